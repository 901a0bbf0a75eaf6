"""Rank-aware data: the token streams, the loader, and the factories that build them for a job.

Samples. Sample i of a token file is the window of seq_len+1 tokens starting at
i·seq_len (stride seq_len, so consecutive windows share one token and every token
after the first is a target exactly once). inputs = window[:-1], targets = window[1:].

The global sequence, its tail policies and the samplers' state: train/sampler.py.

Many shards, many sources (train/sources.py has the pure rules). `data.path` may name a
token file, a manifest.json or a folder holding one (dslurm/data/manifest.py): a
manifest's shards are read as ONE concatenated stream (`TokenSource`), sample i being the
window at i·seq_len of that stream, so a window may straddle two shards -- the sample
count is that of a single file holding the same tokens. `data.sources` mixes several
such streams by weight (`MixtureSampler`). `data.val_fraction` holds samples out by a
fixed hash of their id; `data.val` names a separate stream. `make_eval_data` gives the
fixed evaluation batches (train/evaluate.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dslurm.config.resolve import Resolved
from dslurm.data.tokenize import DATASET, TokenFile, write_synthetic
from dslurm.errors import UserError
from dslurm.run import RunDir
from train import packing
from train.reader import Alloc, Planned, Prefetcher, ReadPool, plan_reads, read_group, read_planned, staging_dtype
from train.sampler import GlobalBatchSampler
from train.sources import MixtureSampler, SampleSpace, eval_indices, held_out_split

log = logging.getLogger(__name__)

class TokenSource:
    """One token stream: a token file, or a manifest's shards read end to end (one stream).

    `window` may straddle a shard boundary: the stream is the shards' concatenation, in the
    manifest's order. `where` (file and field of the job) prefixes the errors it raises.
    """

    def __init__(self, path: str | Path, *, where: str) -> None:
        from dslurm.data.manifest import token_sources

        self.path, self.where = Path(path), where
        try:
            # a manifest is checked here: every shard present, its token count as stated
            self.files = [TokenFile(sh.path) for sh in token_sources(self.path)]
        except UserError as exc:
            raise UserError(f"{where}: {exc}") from exc
        if not self.files:
            raise UserError(f"{where}: {self.path} names no shard. Fix: point it at a manifest with shards")
        self.starts = np.cumsum([0] + [f.n_tokens for f in self.files]).astype(np.int64)
        self._dtypes: dict[str, np.dtype] = {}
        self.vocab_size = max(f.vocab_size for f in self.files)

    @property
    def n_tokens(self) -> int:
        return int(self.starts[-1])

    def samples(self, seq_len: int) -> int:
        """Windows of seq_len+1 tokens with stride seq_len (as `TokenFileInfo.samples`)."""
        return max(0, (self.n_tokens - 1) // seq_len)

    def dtype_of(self, name: str = DATASET) -> np.dtype:
        """The on-disk dtype of per-token dataset `name` (the widest over the shards)."""
        if name not in self._dtypes:
            self._dtypes[name] = np.result_type(*[f.dtype_of(name) for f in self.files])
        return self._dtypes[name]

    def read_into(self, start: int, out: np.ndarray, name: str = DATASET) -> None:
        """Elements [start, start+len(out)) of the concatenated stream's dataset `name` into `out`."""
        end = start + len(out)
        if len(self.files) == 1:
            self.files[0].read_into(start, out, name)
            return
        if start < 0 or end > self.n_tokens:
            raise IndexError(f"window [{start}, {end}) outside {self.n_tokens} tokens")
        pos = start
        f = int(np.searchsorted(self.starts, start, side="right")) - 1
        while pos < end:
            take = min(end, int(self.starts[f + 1])) - pos
            if take > 0:
                self.files[f].read_into(pos - int(self.starts[f]), out[pos - start:pos - start + take], name)
            pos += take
            f += 1

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) of the concatenated stream, as int64."""
        buf = np.empty(length, dtype=self.dtype_of())
        self.read_into(start, buf)
        return buf.astype(np.int64)

    def check_vocab(self, model_vocab: int) -> None:
        """The model must embed every token id: refuse a file whose vocabulary is larger."""
        for f in self.files:
            if f.vocab_size > model_vocab:
                raise UserError(f"{self.where}: {f.path} has vocab_size {f.vocab_size} > model vocab_size "
                                f"{model_vocab}. Fix: set model.vocab_size >= {f.vocab_size}, or give tokens "
                                "made with the model's tokenizer")


class TokenLoader:
    """`next_batch()` -> (inputs, targets) LongTensors [local_batch, seq_len] for one step.

    One call per optimizer step: the rank's whole share of the global batch. The
    loop splits it into grad_accum (and pipeline) micro-batches, e.g.
    ``inputs.chunk(grad_accum)``; the split does not change which samples a step sees.
    `tokens` is one stream (a `TokenFile` or `TokenSource`) whose sample ids the sampler
    gives; or, with `space`, a list of streams and the sampler gives `space` indices.

    With `prefetch` = k > 0 a background reader (train/reader.py) keeps k batches ready (in
    pinned host memory on a GPU), so the step's `data` time is a wait on a ready batch; the
    sampler here stays the step's own and its state is what a checkpoint saves. `fields`
    names the per-token arrays a batch reads ({dataset name: dtype}; default the tokens in
    `staging_dtype`, widened to int64 in `to_tensors` after the move to the device):
    `read_arrays` returns them all, row for row over the same windows. `read_threads` > 1 shares
    the reads of a group of batches among that many threads (train/reader.py `ReadPool`); `read`
    "mmap" copies the windows from the files' memory maps instead of a call each (`data.read`).
    """

    def __init__(self, tokens: Any, sampler: Any, seq_len: int, *, device: Any = "cpu",
                 space: SampleSpace | None = None, prefetch: int = 0,
                 fields: dict[str, Any] | None = None, read_threads: int = 1, read: str = "preadv") -> None:
        self.sources = list(tokens) if isinstance(tokens, (list, tuple)) else [tokens]
        self.tokens, self.sampler, self.seq_len, self.device = self.sources[0], sampler, seq_len, device
        self.space = space
        self.prefetch = prefetch
        self.mapped = read == "mmap"
        self.fields = {k: np.dtype(v) for k, v in (fields or {DATASET: staging_dtype(self.sources)}).items()}
        self._pre: Prefetcher | None = None
        self._pool = ReadPool(read_threads) if read_threads > 1 else None
        if self._pool is not None:  # its idle threads leave with the loader
            weakref.finalize(self, self._pool.close)
        self._step_plans: dict[int, tuple[Planned, np.ndarray, int]] = {}
        """stream position -> (a plan, that batch's ids, its row block): the step's own reads ahead"""
        # instruction data: batches carry a loss mask and documents (train/packing.py), read as
        # fields over the same windows as the tokens
        self.instruct = packing.detect(self.sources, seq_len) if hasattr(self.sources[0], "files") else False
        if self.instruct:
            self.fields.update({name: np.result_type(*[s.dtype_of(name) for s in self.sources])
                                for name in packing.FIELDS})

    @property
    def local_batch(self) -> int:
        return int(self.sampler.local_batch)

    @property
    def padding_repeats(self) -> int:
        return int(self.sampler.padding_repeats)

    def plan(self, ids: np.ndarray) -> Planned:
        """The reads of the windows of these sample ids (space indices with `space`), worked out at once."""
        if self.space is None:
            src, sample = np.zeros(len(ids), dtype=np.int64), np.asarray(ids, dtype=np.int64)
        else:
            src, sample = self.space.locate(ids)
        return plan_reads(self.sources, src, sample, self.seq_len, self.fields, self.mapped)

    def read_arrays(self, ids: np.ndarray, alloc: Alloc | None = None) -> dict[str, np.ndarray]:
        """{field: [len(ids), seq_len+1]} for the given sample ids (space indices with `space`)."""
        return read_planned(self.plan(ids), self.sources, 0, len(ids), alloc, self._pool)

    def read(self, ids: np.ndarray) -> np.ndarray:
        """Token windows [len(ids), seq_len+1] (int64) for the given ids."""
        return self.read_arrays(ids)[DATASET].astype(np.int64, copy=False)

    def _staged(self, plan: Planned, lo: int, hi: int) -> dict[str, Any]:
        """Rows [lo, hi) of a plan, {field: [n, seq_len+1]}: numpy arrays for a CPU step, else
        tensors in pinned host memory, read straight into them (no copy to pin)."""
        if str(self.device) == "cpu":
            return read_planned(plan, self.sources, lo, hi, pool=self._pool)
        import torch

        pinned: dict[str, Any] = {}

        def alloc(name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
            t = torch.empty(shape, dtype=getattr(torch, dtype.name), pin_memory=True)  # torch names numpy's
            pinned[name] = t  # the tensor owns the pinned block; the array is a view of it
            return np.asarray(t.numpy())

        read_planned(plan, self.sources, lo, hi, alloc, self._pool)
        return pinned

    def batches(self, sampler: Any) -> Iterator[tuple[int, np.ndarray, dict[str, Any]]]:
        """The background reader's work (train/reader.py `Prefetcher`): the sampler's next batches,
        read, as (stream position, ids, batch), advancing `sampler` (a private copy). The ids of
        `ahead_steps` batches (about AHEAD_IDS windows) are located and their reads worked out
        together, in numpy; the batches are then read a group at a time (`read_group`: about
        READ_GROUP_BYTES, one `os.preadv` per window or run of adjacent windows, into one block)
        and handed out as views of it, so what is read ahead is the prefetcher's bounded queue
        plus the group being handed out."""
        while True:
            positions, ids = sampler.take(int(sampler.ahead_steps))
            plan, lb = self.plan(ids.reshape(-1)), ids.shape[1]
            group = read_group(lb * sum(dt.itemsize for dt in self.fields.values()) * (self.seq_len + 1))
            for g in range(0, len(positions), group):
                staged = self._staged(plan, g * lb, min(len(positions), g + group) * lb)
                for k in range(g, min(len(positions), g + group)):
                    a = (k - g) * lb
                    yield positions[k], ids[k], {name: rows[a:a + lb] for name, rows in staged.items()}

    def to_tensors(self, batch: Any) -> tuple[Any, ...]:
        """(inputs, targets) int64 [n, seq_len] from a batch's windows [n, seq_len+1] of any integer
        dtype (an array, or `read_arrays`' fields); instruction data adds its docs (train/packing.py)."""
        import torch  # lazy: the data module is imported by torch-free tools too

        if isinstance(batch, dict):
            if self.instruct:
                return packing.to_tensors(batch, self.device)
            batch = batch[DATASET]
        windows = torch.from_numpy(batch) if isinstance(batch, np.ndarray) else batch
        if str(self.device) != "cpu":  # one copy of the compact windows (from pinned memory: async)
            windows = windows.to(self.device, non_blocking=windows.is_pinned())
        # widened while cut: one pass each, dense rows (kernels want them)
        return windows[:, :-1].long().contiguous(), windows[:, 1:].long().contiguous()

    def next_batch(self) -> tuple[Any, ...]:
        if self.prefetch and self._pre is None:
            self._pre = Prefetcher(self.batches, dataclasses.replace(self.sampler), self.prefetch)
        position = int(self.sampler.stream_position)
        ids = self.sampler.next_ids()
        staged = None
        if self._pre is not None:
            try:
                staged = self._pre.take(position, ids)
            finally:
                if staged is None:  # it read another way (or failed): restart it from here
                    self.close()
            if staged is None:
                self._pre = Prefetcher(self.batches, dataclasses.replace(self.sampler), self.prefetch)
        batch = staged if staged is not None else self._read_in_step(position, ids)
        return self.to_tensors(batch)

    def _read_in_step(self, position: int, ids: np.ndarray) -> dict[str, Any]:
        """The step's own read (prefetch 0, or the reader went another way): rows of the reads
        worked out for this and the next `ahead_steps` - 1 batches at once (a copy of the sampler,
        already past this batch, walks them), as the background reader does."""
        got = self._step_plans.get(position)
        if got is None or not np.array_equal(got[1], ids):
            walk = dataclasses.replace(self.sampler)
            steps = int(walk.ahead_steps) - 1
            positions, ahead = walk.take(steps) if steps else ([], ids[None, :0])
            every = np.concatenate([ids[None, :], ahead]) if steps else ids[None, :]
            plan = self.plan(every.reshape(-1))
            self._step_plans = {p: (plan, every[k], k) for k, p in enumerate([position, *positions])}
            got = self._step_plans[position]
        plan, _, k = got
        return self._staged(plan, k * len(ids), (k + 1) * len(ids))

    def close(self) -> None:
        """Stop the background reader (if any); the next batch starts it again."""
        if self._pre is not None:
            self._pre.close()
            self._pre = None

    def state_dict(self) -> dict[str, Any]:
        return dict(self.sampler.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.close()  # what it read ahead follows the old position
        self._step_plans = {}
        self.sampler.load_state_dict(state)


@dataclass(slots=True)
class EvalData:
    """The evaluation batches: always the same `batches` global batches, this rank's share of each."""

    loader: TokenLoader
    """reads the eval stream (its sampler is unused)"""
    ids: np.ndarray
    """[batches, global_batch] indices of the eval stream"""
    dp_rank: int
    dp_size: int
    label: str
    """'val' (data.val) or 'held_out' (data.val_fraction)"""

    @property
    def batches(self) -> int:
        return int(self.ids.shape[0])

    def batch(self, b: int) -> tuple[Any, ...]:
        """(inputs, targets) of this rank's share of eval batch b."""
        per = self.ids.shape[1] // self.dp_size
        return self.loader.to_tensors(self.loader.read_arrays(self.ids[b, self.dp_rank * per:(self.dp_rank + 1) * per]))


# ------------------------------------------------------------------------- factory


def synthetic_path(run_dir: str | Path, n_tokens: int, vocab_size: int, seed: int) -> Path:
    """Name that encodes what the content depends on, so a restart reuses the file."""
    return RunDir(run_dir).data / f"synthetic-v{vocab_size}-n{n_tokens}-s{seed}.h5"


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


def _expand(path: str) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(path)))


@dataclass(slots=True)
class _Streams:
    """The training streams of a job, opened and checked, with their held-out split."""

    sources: list[TokenSource]
    weights: list[float] | None
    """None: one stream (`data.path`); else the mixture's weights"""
    sizes: list[int]
    """samples of each source"""
    train: SampleSpace
    held: SampleSpace


def _streams(resolved: Resolved, rank: int, wait_s: float) -> _Streams:
    job, shape = resolved.job, resolved.shape
    if job.data.sources:
        paths = [(_expand(s.path), f"data.sources[{i}].path") for i, s in enumerate(job.data.sources)]
        weights: list[float] | None = [float(s.weight) for s in job.data.sources]
    elif job.data.path is None:
        paths = [(ensure_synthetic(
            synthetic_path(resolved.run_dir, job.data.synthetic_tokens, shape.vocab_size, job.train.seed),
            job.data.synthetic_tokens, shape.vocab_size, job.train.seed, rank=rank,
            seq_len=shape.seq_len, wait_s=wait_s), "data.path")]
        weights = None
    else:
        paths, weights = [(_expand(job.data.path), "data.path")], None
    sources = [TokenSource(p, where=f"{resolved.job_path}: field '{field}' ({p})") for p, field in paths]
    for src in sources:
        src.check_vocab(shape.vocab_size)
    sizes = [src.samples(shape.seq_len) for src in sources]
    splits = [held_out_split(n, job.data.val_fraction) for n in sizes]
    train = SampleSpace.of([k for k, _ in splits], sizes)
    held = SampleSpace([h for _, h in splits], [len(h) for _, h in splits])
    return _Streams(sources, weights, sizes, train, held)


def make_loader(resolved: Resolved, dp_rank: int, dp_size: int, *, device: Any = "cpu",
                rank: int | None = None, wait_s: float = 600.0) -> TokenLoader:
    """The loader for a `dslurm.config.resolve.Resolved` job on one data-parallel rank.

    `rank` (global; default $RANK, else 0) only decides who writes the synthetic corpus
    when `data.path` is null. A relative path is relative to the working directory (jobs
    start in the submit directory).
    """
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    return _loader(resolved, _streams(resolved, rank, wait_s), dp_rank, dp_size, device)


def _loader(resolved: Resolved, st: _Streams, dp_rank: int, dp_size: int, device: Any) -> TokenLoader:
    job, shape = resolved.job, resolved.shape
    b = job.train.global_batch
    held = f" (after data.val_fraction {job.data.val_fraction} held some out)" if job.data.val_fraction else ""
    for i, (src, n) in enumerate(zip(st.sources, st.train.counts)):
        short = n < 1 or (st.weights is None and job.data.policy == "drop" and n < b)
        if short:
            field_ = "data.path" if st.weights is None else f"data.sources[{i}].path"
            raise UserError(f"{resolved.job_path}: field '{field_}' ({src.path}): {src.n_tokens} tokens make "
                            f"{n} samples of seq_len {shape.seq_len}+1{held}, fewer than "
                            f"train.global_batch {b} under policy {job.data.policy!r}. Fix: more tokens, "
                            "a smaller batch or seq_len, or data.policy: pad")
    if job.data.shuffle_block > 1 and job.data.val_fraction:
        log.warning("data.shuffle_block %d with data.val_fraction %g: the held-out split scatters the kept "
                    "samples within each 1024 ids, so a block's windows are not adjacent and are read one "
                    "call each (the order is still a block shuffle; use data.val for a held-out set and "
                    "contiguous blocks)", job.data.shuffle_block, job.data.val_fraction)
    if st.weights is not None:
        mix = MixtureSampler(space=st.train, weights=st.weights, global_batch=b, dp_rank=dp_rank,
                             dp_size=dp_size, seed=job.train.seed, shuffle_block=job.data.shuffle_block)
        return TokenLoader(st.sources, mix, shape.seq_len, device=device, space=st.train,
                           prefetch=job.data.prefetch, read_threads=job.data.read_threads, read=job.data.read)
    sampler = GlobalBatchSampler(num_samples=st.train.total, global_batch=b, dp_rank=dp_rank,
                                 dp_size=dp_size, seed=job.train.seed, policy=job.data.policy,
                                 shuffle_block=job.data.shuffle_block)
    space = st.train if st.train.ids[0] is not None else None
    return TokenLoader(st.sources, sampler, shape.seq_len, device=device, space=space, prefetch=job.data.prefetch,
                       read_threads=job.data.read_threads, read=job.data.read)


def make_data(resolved: Resolved, dp_rank: int, dp_size: int, *, device: Any = "cpu",
              rank: int | None = None, wait_s: float = 600.0) -> tuple[TokenLoader, EvalData | None]:
    """The training loader and, when `train.eval_every` > 0, the evaluation batches."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    st = _streams(resolved, rank, wait_s)
    loader = _loader(resolved, st, dp_rank, dp_size, device)
    job, shape = resolved.job, resolved.shape
    if not job.train.eval_every:
        return loader, None
    b, n = job.train.global_batch, job.train.eval_batches * job.train.global_batch
    if job.data.val is not None:
        val = TokenSource(_expand(job.data.val), where=f"{resolved.job_path}: field 'data.val' ({job.data.val})")
        val.check_vocab(shape.vocab_size)
        size = val.samples(shape.seq_len)
        if size < 1:
            raise UserError(f"{val.where}: {val.n_tokens} tokens make no sample of seq_len {shape.seq_len}+1. "
                            "Fix: give a longer validation file")
        ids = eval_indices(SampleSpace([None], [size]), n, None, job.train.seed)
        ev_loader, label = TokenLoader(val, None, shape.seq_len, device=device), "val"
    elif job.data.val_fraction:
        empty = [i for i, c in enumerate(st.held.counts) if c < 1]
        if empty:
            raise UserError(f"{resolved.job_path}: field 'data.val_fraction' ({job.data.val_fraction}) holds out "
                            f"no sample of source(s) {empty}. Fix: raise data.val_fraction or set data.val")
        ids = eval_indices(st.held, n, st.weights, job.train.seed)
        ev_loader, label = TokenLoader(st.sources, None, shape.seq_len, device=device, space=st.held), "held_out"
    else:
        raise UserError(f"{resolved.job_path}: field 'train.eval_every' ({job.train.eval_every}) asks for "
                        "evaluation but there is no evaluation data. Fix: set data.val (a token file or "
                        "manifest) or data.val_fraction (e.g. 0.01), or train.eval_every: 0")
    return loader, EvalData(ev_loader, ids.reshape(job.train.eval_batches, b), dp_rank, dp_size, label)
