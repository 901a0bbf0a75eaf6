"""The job's sections that the trainer is built from: the model's shape (`ModelSpec`, a preset or
`model.init_from`'s config.json), the parallel degrees, the optimisation (`TrainSpec`), the data
(`DataSpec`, `SourceSpec`) and the checkpoints (`CheckpointSpec`).

Each section checks its own fields in `__post_init__`; how they fit the site and each other
(world size, layout, batch rule) is `dslurm.config.resolve`'s. `JobSpec` (dslurm/config/job.py)
holds them; every other module imports them from `dslurm.config`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dslurm.config import families
from dslurm.config.families import DEFAULT_SEQ_LEN
from dslurm.config.models import PRESETS, ModelShape, shape_from
from dslurm.config.schema import FieldError, field
from dslurm.errors import UserError


@dataclass(kw_only=True, slots=True)
class ModelSpec:
    preset: str | None = field(None, help=f"named shape: {', '.join(PRESETS)}; default tiny, or with init_from "
                                          "the shape of its config.json")
    dim: int | None = field(None, help="override the preset's hidden size")
    n_layers: int | None = field(None, help="override the number of layers")
    n_heads: int | None = field(None, help="override attention heads")
    n_kv_heads: int | None = field(None, help="override key/value heads (GQA)")
    ffn_dim: int | None = field(None, help="override the SwiGLU hidden size")
    vocab_size: int | None = field(None, help="override the vocabulary size")
    seq_len: int | None = field(None, help="override the sequence length (with init_from and no preset: "
                                           f"default min(max_position_embeddings, {DEFAULT_SEQ_LEN}))")
    init_from: str | None = field(None, help="start a fresh run from these weights: a Hugging Face Llama, Mistral, "
                                             "Qwen2/2.5 or Qwen3 directory (config.json + safetensors; its "
                                             "config.json gives the shape) or a `dslurm ckpt export` output; "
                                             "a run that has a generation resumes from it instead")

    def __post_init__(self) -> None:
        if self.preset is not None and self.preset not in PRESETS:
            raise FieldError("preset", f"{self.preset!r} is unknown", f"choose one of {', '.join(PRESETS)}")

    def stated(self) -> dict[str, Any]:
        """The shape fields this job states: its preset's (when it names one), then its own."""
        base = dataclasses.asdict(PRESETS[self.preset]) if self.preset is not None else {}
        base = {k: base[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                                     "seq_len", "rope_theta", "norm_eps") if k in base}
        own = {k: getattr(self, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                                             "seq_len")}
        return base | {k: v for k, v in own.items() if v is not None}

    def shape(self) -> ModelShape:
        """The model: with init_from and a config.json there, that file's shape (every field the job
        states must agree, else exit 2 naming each); otherwise the preset with the fields set here."""
        if self.init_from is not None:
            path = Path(os.path.expandvars(os.path.expanduser(self.init_from)))
            if (path / families.CONFIG).is_file():
                where = f"model.init_from {path}"
                stated = self.stated()
                have = families.shape_of(families.read_config(path, where), where, stated.get("seq_len"))
                limit = dataclasses.replace(have, seq_len=have.max_positions or have.seq_len)
                if differ := families.differences(limit, stated):
                    raise UserError(families.mismatch_message(where, stated, differ))
                return have
            if self.preset is None and not any(getattr(self, k) is not None for k in ("dim", "n_layers")):
                raise UserError(f"model.init_from {path}: no {families.CONFIG} there, so the model's shape is "
                                "unknown. Fix: copy the model's config.json into the directory, or state the shape "
                                "(model.preset and its fields) for a `dslurm ckpt export` output without --hf")
        return shape_from(self.preset or "tiny", dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                          n_kv_heads=self.n_kv_heads, ffn_dim=self.ffn_dim,
                          vocab_size=self.vocab_size, seq_len=self.seq_len)


@dataclass(kw_only=True, slots=True)
class ParallelSpec:
    dp_replicate: int = field(1, help="HSDP replicas (data-parallel groups that each hold a full shard set)")
    dp_shard: int = field(-1, help="FSDP shard degree; -1 = all ranks left after the others")
    tp: int = field(1, help="tensor (+sequence) parallel degree; stays inside the NVLink domain")
    pp: int = field(1, help="pipeline stages")
    cp: int = field(1, help="context parallel degree: each sequence split over cp ranks "
                         "(2*cp must divide seq_len; the cp ranks join FSDP's sharding)")
    pp_schedule: Literal["GPipe", "1F1B", "Interleaved1F1B"] = field("1F1B", help="pipeline schedule")
    microbatches: int = field(1, help="pipeline microbatches per schedule step (>= stages; unused when pp=1)")
    allow_tp_outside_nvlink: bool = field(False, help="accept tp larger than the NVLink domain")

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "pp", "cp", "microbatches"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"{getattr(self, name)} must be at least 1",
                                 f"set parallel.{name} to 1 (off) or more")
        if self.dp_shard < 1 and self.dp_shard != -1:
            raise FieldError("dp_shard", f"{self.dp_shard} must be -1 (the rest) or at least 1",
                             "set parallel.dp_shard: -1 to shard over all ranks left")


@dataclass(kw_only=True, slots=True)
class TrainSpec:
    steps: int = field(100, help="optimizer steps in total (across restarts)")
    global_batch: int = field(8, help="sequences per optimizer step, all ranks together")
    grad_accum: int = field(1, help="gradient accumulation steps per optimizer step")
    lr: float = field(3e-3, help="peak learning rate (AdamW)")
    min_lr_ratio: float = field(0.1, help="cosine floor as a fraction of lr")
    warmup_steps: int = field(10, help="linear warmup steps")
    weight_decay: float = field(0.1, help="AdamW weight decay")
    grad_clip: float = field(1.0, help="max global grad norm (0 = off)")
    seed: int = field(0, help="seed for init and data order")
    dtype: Literal["fp32", "bf16"] = field("fp32", help="parameter dtype for compute (bf16 needs a GPU)")
    activation_checkpoint: Literal["none", "selective", "full"] = field("none", help="recomputation")
    compile: bool = field(False, help="torch.compile each block")
    log_every: int = field(10, help="steps between log lines and metrics")
    eval_every: int = field(0, help="steps between evaluations on data.val / the held-out fraction (0 = never)")
    eval_batches: int = field(4, help="batches per evaluation (each the size of one global batch)")
    straggler_every: int = field(50, help="steps between gathers of per-rank step times")
    step_sleep_s: float = field(0.0, help="sleep per step (demos and tests that need a long run)")
    nonfinite: Literal["skip", "rollback", "stop", "off"] = field(
        "stop", help="a step whose loss or grad norm is NaN/inf, agreed by all ranks: skip it (no optimizer "
        "step), roll back to the last good generation and skip its data, stop (exit 81), or off (train on)")
    nonfinite_max: int = field(3, help="non-finite steps skipped or rolled back before the run stops (exit 81)")

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "grad_accum", "log_every", "straggler_every", "nonfinite_max"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"{getattr(self, name)} must be at least 1", f"set train.{name} to 1 or more")
        if self.lr <= 0:
            raise FieldError("lr", f"{self.lr} must be above 0", "set train.lr to the peak rate, e.g. 3e-4")
        if self.eval_batches < 1:
            raise FieldError("eval_batches", f"{self.eval_batches} must be at least 1",
                             "set train.eval_batches to 1 or more")
        for name in ("min_lr_ratio", "warmup_steps", "weight_decay", "grad_clip", "step_sleep_s", "eval_every"):
            if getattr(self, name) < 0:
                raise FieldError(name, f"{getattr(self, name)} must not be negative", f"set train.{name} to 0 or more")


@dataclass(kw_only=True, slots=True)
class SourceSpec:
    path: str = field(help="a token file (HDF5), a shard manifest (manifest.json), or a directory holding one")
    weight: float = field(1.0, help="share of the mixture's tokens drawn from this source (relative)")

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise FieldError("weight", f"{self.weight} must be above 0", "give every source a positive weight")


@dataclass(kw_only=True, slots=True)
class DataSpec:
    path: str | None = field(None, help="HDF5 token file, a shard manifest (manifest.json) or a directory holding "
                                        "one; null (and no sources) = a synthetic corpus made in the run dir")
    sources: list[SourceSpec] = field(factory=list, help="a mixture instead of `path`: [{path, weight}, ...]")
    synthetic_tokens: int = field(1 << 20, help="tokens in the synthetic corpus")
    policy: Literal["drop", "pad"] = field("drop", help="uneven tail across data-parallel ranks")
    val: str | None = field(None, help="validation tokens: a token file or manifest (see val_fraction otherwise)")
    val_fraction: float = field(0.0, help="without `val`: this fraction of the training stream is held out for "
                                          "evaluation (never trained on)")
    prefetch: int = field(2, help="batches a background reader per rank keeps ready (pinned on a GPU); 0 = read "
                                  "in the step")
    read_threads: int = field(1, help="threads per rank sharing the background reader's reads (calls in flight "
                                      "together, for a file system whose reads wait: Lustre, NFS, a cold NVMe); "
                                      "page-cached reads are fastest with 1")
    read: Literal["preadv", "mmap"] = field(
        "preadv", help="how windows leave the token files: preadv (a call per window, or per run of adjacent "
        "ones) or mmap (a copy per window from a read-only memory map, a page-cached file of <= 8 GiB mapped "
        "whole at the start: 1.4-1.9x the reader's tokens/s here; its pages count in each rank's RSS, and a "
        "file cut short while mapped is a SIGBUS; docs/data.md)")
    shuffle_block: int = field(1, help="samples shuffled as blocks of this many adjacent windows (1 = every "
                                       "window on its own); a rank's block is then one contiguous read")

    def __post_init__(self) -> None:
        if self.path is not None and self.sources:
            raise FieldError(("path", "sources"), "both are set", "give either data.path or data.sources")
        if not 0.0 <= self.val_fraction < 0.5:
            raise FieldError("val_fraction", f"{self.val_fraction} is outside [0, 0.5)",
                             "hold out a small fraction, e.g. 0.01, or set data.val")
        if self.val is not None and self.val_fraction:
            raise FieldError(("val", "val_fraction"), "both are set", "give either data.val or data.val_fraction")
        if not 1 <= self.shuffle_block <= 4096:
            raise FieldError("shuffle_block", f"{self.shuffle_block} is outside [1, 4096]",
                             "1 shuffles every window; a few (e.g. 4, a rank's windows per step) read each "
                             "block in one call")
        if self.sources and len(self.sources) * self.shuffle_block > 4096:
            raise FieldError(("sources", "shuffle_block"), f"{len(self.sources)} sources in blocks of "
                             f"{self.shuffle_block} exceed a mixture period's 4096 slots",
                             "a smaller data.shuffle_block (or fewer sources)")
        if not 0 <= self.prefetch <= 64:
            raise FieldError("prefetch", f"{self.prefetch} is outside [0, 64]",
                             "keep a few batches ready, e.g. 2 (0 reads in the step)")
        if not 1 <= self.read_threads <= 64:
            raise FieldError("read_threads", f"{self.read_threads} is outside [1, 64]",
                             "1, or a few threads per rank where reads wait on the file system (e.g. 8 on Lustre)")


@dataclass(kw_only=True, slots=True)
class CheckpointSpec:
    run_dir: str | None = field(None, help="run directory; default <site.storage.durable>/<job name>")
    interval: int = field(50, help="steps between saves")
    keep: int = field(2, help="verified generations kept (>= 2)")
    keep_every: int | None = field(None, help="also keep every generation whose step is a multiple")
    async_save: bool = field(False, help="stage to host memory and write in the background")
    on_inflight: Literal["wait", "skip"] = field("wait", help="a save asked while one is in flight")
    on_error: Literal["continue", "stop"] = field("continue", help="a save that fails (disk full)")
    tiers: Literal["durable", "two_tier"] = field(
        "durable", help="durable: every save to the run dir; two_tier: node-local scratch first "
        "(site storage.scratch), then copied to the run dir in the background")
    keep_local: int = field(2, help="two_tier: locally committed generations kept per node (>= 1)")
    on_lag: Literal["wait", "skip_local", "skip_durable"] = field(
        "wait", help="two_tier: a save arriving while the copies (partner, durable) of the previous one still run")
    partner: bool | None = field(
        None, help="two_tier: also copy each node's local commit to the next node's scratch over the job's network, "
        "so a lost node restores at local speed (unset: the site's storage.partner)")
    partner_mbps: float = field(0.0, help="two_tier partner copies: each rank's send rate cap in MB/s (0: none)")
    verify_resume: Literal["fingerprint", "replay"] = field(
        "fingerprint", help="what a restore checks before the first step: fingerprint (each rank's per-tensor crc32s "
        "against what it saved) or replay (that, plus a forward-only probe loss of the saved state on the next "
        "step's batch, recorded at each save and recomputed after the restore: one forward per save and per "
        "restore; not with pipeline parallel)")

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise FieldError("interval", f"{self.interval} must be at least 1",
                             "set checkpoint.interval to the steps between saves")
        if self.keep_local < 1:
            raise FieldError("keep_local", f"{self.keep_local} must be at least 1",
                             "set checkpoint.keep_local: 1 or more")
        if self.partner_mbps < 0:
            raise FieldError("partner_mbps", f"{self.partner_mbps} is negative",
                             "set checkpoint.partner_mbps: 0 (no cap) or a rate in MB/s")
        if self.partner and self.tiers != "two_tier":
            raise FieldError(("partner", "tiers"), f"partner copies need tiers: two_tier, not {self.tiers}",
                             "set checkpoint.tiers: two_tier, or drop checkpoint.partner")
        if self.keep < 2:
            raise FieldError("keep", f"{self.keep} must be at least 2 (the newest may be mid-write)",
                             "set checkpoint.keep: 2 or more")
