"""Rank-aware data: a global-batch sampler whose position is training state, and the loader.

Samples. Sample i of a token file is the window of seq_len+1 tokens starting at
i·seq_len (stride seq_len, so consecutive windows share one token and every token
after the first is a target exactly once). inputs = window[:-1], targets = window[1:].

The global sequence. Epoch e visits the samples in a permutation seeded by
(seed, e). The *global batch* of B samples is the unit: step k of the run takes the
next B entries of the endless stream epoch 0, epoch 1, ... and data-parallel rank r
of D gets the contiguous share [r·B/D, (r+1)·B/D) of it. Nothing in the stream
depends on D, so:
  * every parallel layout sees the same global batch as a single-process run
    (the parity tests rely on it);
  * the state (epoch, position), with position counting *global* samples consumed
    in the epoch, can be saved at any step boundary and restored under another D
    without a repeat or a skip.

Tail policy when the epoch's N samples are not a multiple of B:
  * drop: the epoch is cut to N - N % B samples; no sample repeats within an epoch
    (the cut samples differ from epoch to epoch because the permutation does);
  * pad:  the epoch is extended to a multiple of B by repeating its first samples;
    each repeated slot consumed adds one to `padding_repeats` (a global count, the
    same on every rank, carried in the state so restarts keep counting).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from dslurm.data.tokenize import TokenFile, write_synthetic
from dslurm.errors import UserError

log = logging.getLogger(__name__)

Policy = Literal["drop", "pad"]


@dataclass(kw_only=True, slots=True)
class GlobalBatchSampler:
    """Sample ids per step for one data-parallel rank; pure (numpy only), no I/O."""

    num_samples: int
    global_batch: int
    dp_rank: int = 0
    dp_size: int = 1
    seed: int = 0
    policy: Policy = "drop"
    epoch: int = 0
    position: int = 0
    padding_repeats: int = 0
    _order_cache: tuple[int, np.ndarray] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.dp_size < 1 or not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank={self.dp_rank} must be in [0, dp_size={self.dp_size})")
        if self.global_batch < 1 or self.global_batch % self.dp_size:
            raise ValueError(f"global_batch({self.global_batch}) must be a positive multiple of "
                             f"dp_size({self.dp_size})")
        if self.policy not in ("drop", "pad"):
            raise ValueError(f"policy={self.policy!r} must be 'drop' or 'pad'")
        if self.num_samples < 1 or (self.policy == "drop" and self.num_samples < self.global_batch):
            raise ValueError(f"{self.num_samples} samples cannot fill one global batch of "
                             f"{self.global_batch} under policy {self.policy!r}")

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp_size

    @property
    def epoch_length(self) -> int:
        """Global samples in one epoch after the tail policy."""
        n, b = self.num_samples, self.global_batch
        return n - n % b if self.policy == "drop" else -(-n // b) * b

    @property
    def steps_per_epoch(self) -> int:
        return self.epoch_length // self.global_batch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The epoch's sample ids after the tail policy (cached for the current epoch)."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            # np.resize repeats cyclically: the pad slots are the epoch's first samples.
            self._order_cache = (epoch, np.resize(perm, self.epoch_length))
        return self._order_cache[1]

    def next_global(self) -> np.ndarray:
        """The next global batch (B sample ids) and advance the state.

        A batch may straddle an epoch boundary only if global_batch changed on restore.
        """
        out, need = [], self.global_batch
        while need:
            take = min(need, self.epoch_length - self.position)
            start = self.position
            out.append(self.epoch_order(self.epoch)[start:start + take])
            # Slots at or past num_samples are the pad repeats.
            self.padding_repeats += max(0, start + take - max(start, self.num_samples))
            self.position += take
            need -= take
            if self.position >= self.epoch_length:
                self.epoch, self.position = self.epoch + 1, 0
        return np.concatenate(out)

    @property
    def stream_position(self) -> int:
        """Samples consumed since epoch 0 began: where the next global batch starts."""
        return self.epoch * self.epoch_length + self.position

    def local_share(self, global_ids: np.ndarray) -> np.ndarray:
        """This rank's contiguous slice of a global batch."""
        b = self.local_batch
        return global_ids[self.dp_rank * b:(self.dp_rank + 1) * b]

    def next_ids(self) -> np.ndarray:
        """This rank's sample ids for the next step."""
        return self.local_share(self.next_global())

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and strings: safe for json, torch.save and DCP's non-tensor state."""
        return {"epoch": self.epoch, "position": self.position,
                "padding_repeats": self.padding_repeats, "num_samples": self.num_samples,
                "seed": self.seed, "policy": self.policy, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore (epoch, position); dp_rank/dp_size may differ from the saving run.

        A different corpus size, seed or policy makes the position meaningless, so
        they must match; a different global_batch is accepted (position is in samples).
        """
        for key in ("num_samples", "seed", "policy"):
            if key in state and state[key] != getattr(self, key):
                raise UserError(f"data state: {key}={state[key]!r} in the checkpoint but "
                                f"{getattr(self, key)!r} now; the saved position does not apply. "
                                "Fix: restore with the same data file, train.seed and data.policy")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.padding_repeats = int(state.get("padding_repeats", 0))
        if self.position >= self.epoch_length:  # global_batch changed and the tail moved
            self.epoch, self.position = self.epoch + 1, 0


class TokenLoader:
    """`next_batch()` -> (inputs, targets) LongTensors [local_batch, seq_len] for one step.

    One call per optimizer step: the rank's whole share of the global batch. The
    loop splits it into grad_accum (and pipeline) micro-batches, e.g.
    ``inputs.chunk(grad_accum)``; the split does not change which samples a step sees.
    """

    def __init__(self, tokens: TokenFile, sampler: GlobalBatchSampler, seq_len: int, *,
                 device: Any = "cpu") -> None:
        self.tokens, self.sampler, self.seq_len, self.device = tokens, sampler, seq_len, device

    @property
    def local_batch(self) -> int:
        return self.sampler.local_batch

    @property
    def padding_repeats(self) -> int:
        return self.sampler.padding_repeats

    def read(self, ids: np.ndarray) -> np.ndarray:
        """Windows [len(ids), seq_len+1] (int64) for the given sample ids."""
        out = np.empty((len(ids), self.seq_len + 1), dtype=np.int64)
        for row, i in enumerate(ids):
            out[row] = self.tokens.window(int(i) * self.seq_len, self.seq_len + 1)
        return out

    def next_batch(self) -> tuple[Any, Any]:
        import torch  # lazy: the data module is imported by torch-free tools too

        windows = torch.from_numpy(self.read(self.sampler.next_ids()))
        # contiguous before the copy: `.to` keeps a view's strides, and kernels want dense rows
        inputs, targets = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        if str(self.device) != "cpu":
            return inputs.to(self.device), targets.to(self.device)
        return inputs, targets

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


# ------------------------------------------------------------------------- factory


def synthetic_path(run_dir: str | Path, n_tokens: int, vocab_size: int, seed: int) -> Path:
    """Name that encodes what the content depends on, so a restart reuses the file."""
    return Path(run_dir) / "data" / f"synthetic-v{vocab_size}-n{n_tokens}-s{seed}.h5"


def ensure_synthetic(path: Path, n_tokens: int, vocab_size: int, seed: int, *, rank: int,
                     seq_len: int = 0, wait_s: float = 600.0, poll_s: float = 0.2) -> Path:
    """Rank 0 writes the synthetic corpus once; the other ranks wait for the file.

    Chosen over per-process generation in memory so the trainer reads synthetic and
    real data through the same HDF5 path and `dslurm data info` can inspect the file.
    The write is atomic (temp + rename), so "the file exists" means "it is complete";
    the run directory is on shared durable storage, so every node sees it.
    """
    if path.exists():
        return path
    if rank == 0:
        log.info("writing synthetic corpus %s (%d tokens, vocab %d)", path, n_tokens, vocab_size)
        return write_synthetic(path, n_tokens, vocab_size, seed, seq_len=seq_len)
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: {path} did not appear within {wait_s:.0f}s; rank 0 "
                               "writes it. Is the run directory shared by all nodes?")
        time.sleep(poll_s)
    return path


def make_loader(resolved: Any, dp_rank: int, dp_size: int, *, device: Any = "cpu",
                rank: int | None = None, wait_s: float = 600.0) -> TokenLoader:
    """The loader for a `dslurm.config.resolve.Resolved` job on one data-parallel rank.

    `rank` (global; default $RANK, else 0) only decides who writes the synthetic corpus
    when `data.path` is null. A relative `data.path` is relative to the working
    directory (jobs start in the submit directory).
    """
    job, shape = resolved.job, resolved.shape
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    if job.data.path is None:
        path = ensure_synthetic(
            synthetic_path(resolved.run_dir, job.data.synthetic_tokens, shape.vocab_size,
                           job.train.seed),
            job.data.synthetic_tokens, shape.vocab_size, job.train.seed, rank=rank,
            seq_len=shape.seq_len, wait_s=wait_s)
    else:
        path = Path(os.path.expandvars(os.path.expanduser(job.data.path)))
    where = f"{resolved.job_path}: field 'data.path' ({path})"
    tokens = TokenFile(path)
    if tokens.vocab_size > shape.vocab_size:
        raise UserError(f"{where}: vocab_size {tokens.vocab_size} > model vocab_size "
                        f"{shape.vocab_size}. Fix: set model.vocab_size >= {tokens.vocab_size}")
    n = tokens.info.samples(shape.seq_len)
    b = job.train.global_batch
    if n < 1 or (job.data.policy == "drop" and n < b):
        raise UserError(f"{where}: {tokens.n_tokens} tokens make {n} samples of seq_len "
                        f"{shape.seq_len}+1, fewer than train.global_batch {b} under policy "
                        f"{job.data.policy!r}. Fix: more tokens, a smaller batch or seq_len, "
                        "or data.policy: pad")
    sampler = GlobalBatchSampler(num_samples=n, global_batch=b, dp_rank=dp_rank,
                                 dp_size=dp_size, seed=job.train.seed, policy=job.data.policy)
    return TokenLoader(tokens, sampler, shape.seq_len, device=device)
