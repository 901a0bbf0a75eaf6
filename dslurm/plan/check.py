"""`dslurm plan check --site S --job J [--ranks LIST]`: the job's real layout, built at its full world
size on a fake process group, against the planner, rank by rank.

Each checked rank runs in its own CPU process, `python -m train.plan_check` (torch lives there; this
module stays torch-free so the CLI starts at once): the trainer's own build (train/parallel/) on a
fake backend with fake tensors, no GPU and no real memory. It reports what the rank holds and
sends; `dslurm.plan.rank` says what the planner expects of that rank. Gated terms (more than
`TOLERANCE` apart: exit 1, naming the rank, the term and both numbers): the parameter, gradient and
optimizer bytes, and the bytes of every collective kind per mesh dimension of one micro-batch's
forward and backward. The activation peak of that micro-batch is shown beside the planner's figure
but not gated: on a CPU the fake run takes the CPU's kernels (attention and the loss keep
intermediates a GPU's fused kernels do not), so it bounds the GPU's from above. See docs/plan.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from dslurm.errors import UserError

TOLERANCE = 0.10
PARALLEL = 2
"""ranks measured at once (the machine this was written for has 2 cores)"""
GATED = ("params", "grads", "optimizer")


class MeasureFailed(UserError):
    """A rank's measuring process failed (its stderr is in the message): exit 1, no traceback."""

    exit_code = 1


@dataclass(frozen=True, slots=True)
class Row:
    rank: int
    term: str
    """params, grads, optimizer, activations, or `<dim> <op>` for a collective"""
    measured: float
    predicted: float
    gated: bool

    @property
    def apart(self) -> float:
        """|measured - predicted| / predicted (inf when only one of them is zero)."""
        if self.predicted == 0:
            return 0.0 if self.measured == 0 else float("inf")
        return abs(self.measured - self.predicted) / self.predicted

    @property
    def bad(self) -> bool:
        return self.gated and self.apart > TOLERANCE


def parse_ranks(text: str | None, world: int) -> list[int] | None:
    """`--ranks 0,7,511` -> [0, 7, 511]; None when not given; UserError naming a bad entry."""
    if text is None:
        return None
    out = []
    for part in text.split(","):
        if not part.strip().isdigit() or not 0 <= int(part) < world:
            raise UserError(f"--ranks {text!r}: {part.strip()!r} is not a rank of the job's world of {world}. "
                            f"Fix: comma-separated ranks in 0..{world - 1}")
        out.append(int(part))
    return sorted(set(out))


def compare(rank: int, measured: dict[str, Any], predicted: Any) -> list[Row]:
    """The rows of one rank: memory terms, then every collective either side names."""
    rows = [Row(rank, t, float(measured[t]), predicted.bytes[t], t in GATED)
            for t in (*GATED, "activations")]
    got = {(c["dim"], c["op"]): float(c["bytes"]) for c in measured["collectives"]}
    for key in sorted(set(got) | set(predicted.collectives)):
        rows.append(Row(rank, f"{key[0]} {key[1]}", got.get(key, 0.0), predicted.collectives.get(key, 0.0), True))
    return rows


def measure(site: str, job: str, rank: int, overrides: list[str], site_overrides: list[str]) -> dict[str, Any]:
    """One rank's measurement from its own process (train/plan_check.py)."""
    cmd = [sys.executable, "-m", "train.plan_check", "--site", site, "--job", job, "--rank", str(rank)]
    cmd += [x for o in overrides for x in ("--set", o)] + [x for o in site_overrides for x in ("--site-set", o)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0 or not proc.stdout.strip():
        raise MeasureFailed(f"plan check: rank {rank}: `{' '.join(cmd)}` exited {proc.returncode}:\n"
                            f"{proc.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def _fmt(x: float) -> str:
    return f"{x / 1e9:.3f} GB" if x >= 1e7 else f"{x / 1e6:.3f} MB"


def render(rows: list[Row], header: str) -> str:
    lines = [header, f"{'rank':>6}  {'term':<26} {'measured':>13} {'planner':>13} {'apart':>8}  verdict"]
    for r in rows:
        verdict = "FAIL" if r.bad else "ok" if r.gated else "shown (not gated)"
        apart = "inf" if r.apart == float("inf") else f"{100 * r.apart:.1f}%"
        lines.append(f"{r.rank:>6}  {r.term:<26} {_fmt(r.measured):>13} {_fmt(r.predicted):>13} {apart:>8}  {verdict}")
    return "\n".join(lines)


def run_check(site: str, job: str, overrides: list[str], site_overrides: list[str], ranks_text: str | None,
              as_json: bool = False) -> int:
    """The command: 0 when every gated term is within TOLERANCE on every checked rank, else 1."""
    from dslurm.plan.inputs import from_files
    from dslurm.plan.rank import default_ranks, rank_figures

    base = from_files(site, job, overrides, site_overrides)
    lay, work = base.layout, base.work
    ranks = parse_ranks(ranks_text, lay.world_size) or default_ranks(lay)
    recompute = work.recompute or "none"
    rows: list[Row] = []
    records = []
    # one process per rank, two at a time: each is one busy CPU thread (OMP_NUM_THREADS=1 below)
    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        measured = list(pool.map(lambda r: measure(site, job, r, overrides, site_overrides), ranks))
    for rank, got in zip(ranks, measured, strict=True):
        want = rank_figures(base.model, lay, work, base.cluster, recompute, rank)
        rows += compare(rank, got, want)
        records.append({"rank": rank, "measured": got, "stages": want.stages, "layers": want.layers})
    bad = [r for r in rows if r.bad]
    if as_json:
        print(json.dumps({"layout": lay.describe(), "ranks": records,
                          "rows": [{"rank": r.rank, "term": r.term, "measured": r.measured, "predicted": r.predicted,
                                    "apart": r.apart, "gated": r.gated, "ok": not r.bad} for r in rows],
                          "ok": not bad}))
    else:
        print(render(rows, f"plan check: {job} on {site}, world {lay.world_size} ({lay.describe()}), "
                           f"ranks {', '.join(map(str, ranks))}; one micro-batch of {work.micro_batch}"))
    for r in bad:
        print(f"plan check: rank {r.rank} {r.term}: measured {_fmt(r.measured)}, the planner says "
              f"{_fmt(r.predicted)} ({100 * r.apart:.1f}% apart > {100 * TOLERANCE:.0f}%)", file=sys.stderr)
    return 1 if bad else 0
