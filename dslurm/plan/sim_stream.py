"""`plan simulate` over any number of trials in bounded memory: the trials are drawn in chunks
of at most `CELLS` failure draws from one generator (so a run of few trials is one chunk, drawn
exactly as `draw_failures` draws it), and each scenario keeps running statistics
(`simulate.Accumulator`). Spares are sized in a first pass over the same chunks (the generator is
seeded again), from a count of trials per "most nodes under repair at once".

Why: every draw kept at once grew with `--trials` (100M trials took 21 GB in seconds on a login
node before the OOM killer came); and past `MAX_TRIALS` the answer no longer moves while the
run takes hours, so more is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from dslurm.errors import UserError
from dslurm.plan.recovery_sim import Draws, max_in_repair
from dslurm.plan.simulate import Accumulator, SimConfig, SimResult, SparesSizing, draw_failures, segments_per_trial

CELLS = 1_000_000  # failure draws held at once (8 MB of float64; the timeline holds a few such arrays)
MAX_TRIALS = 100_000  # the goodput's standard error at 1000 trials is already ~0.1 %


def check_trials(trials: int) -> int:
    if trials > MAX_TRIALS:
        raise UserError(f"--trials {trials}: more than {MAX_TRIALS} trials per interval is refused (its memory "
                        f"is bounded, its time is not: about {trials // 1000} times a 1000-trial run, for an "
                        f"answer that stops moving well before); fix: give --trials {MAX_TRIALS} or fewer")
    return trials


def chunk_trials(cfg: SimConfig) -> int:
    """Trials per chunk: as many as fit `CELLS` draws (at least 1)."""
    return max(1, CELLS // segments_per_trial(cfg)[1])


def chunks(cfg: SimConfig) -> Iterator[Draws]:
    """cfg.trials trials of failure draws, in chunks from one generator seeded with cfg.seed."""
    import numpy as np

    rng = np.random.default_rng(cfg.seed)
    left, size = cfg.trials, chunk_trials(cfg)
    while left > 0:
        k = min(size, left)
        yield draw_failures(replace(cfg, trials=k), rng)
        left -= k


def size_spares_streamed(cfg: SimConfig, probability: float) -> SparesSizing:
    """simulate.size_spares over the chunks: the same answer, from counts instead of a sorted array."""
    import numpy as np

    if not 0.0 < probability < 1.0:
        raise UserError(f"probability={probability} must be between 0 and 1 (exclusive), e.g. 0.99")
    counts = np.zeros(1, dtype=np.int64)
    for draws in chunks(cfg):
        got = np.bincount(max_in_repair(draws, cfg.costs()))
        if len(got) > len(counts):
            counts = np.pad(counts, (0, len(got) - len(counts)))
        counts[: len(got)] += got
    n = int(counts.sum())
    index = min(n - 1, max(0, int(np.ceil(probability * n)) - 1))
    spares = int(np.argmax(np.cumsum(counts) > index))
    return SparesSizing(probability=probability, spares=spares,
                        mean_most_in_repair=float((np.arange(len(counts)) * counts).sum() / n))


def score_streamed(base: SimConfig, scenarios: list[SimConfig], intervals_s: list[float] | None) -> list[SimResult]:
    """Every scenario scored on the same chunks of draws (common random numbers, as `score`)."""
    accs: list[Any] = [Accumulator(s, intervals_s) for s in scenarios]
    for draws in chunks(base):
        for acc in accs:
            acc.add(draws)
    return [acc.result() for acc in accs]
