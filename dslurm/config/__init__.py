"""The one validated config tree: a site (the cluster) and a job (what to run on it).

`load_site` / `load_job` read YAML and return frozen-in-spirit dataclasses; `resolve`
checks the two together and computes the numbers every later link uses (nodes,
processes per node, world size, the parallel layout), once.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dslurm.config import families
from dslurm.config.container import ContainerSpec
from dslurm.config.families import DEFAULT_SEQ_LEN
from dslurm.config.models import PRESETS, ModelShape, shape_from
from dslurm.config.schema import FieldError, Where, apply_overrides, build, field, load_yaml
from dslurm.errors import UserError

# ----------------------------------------------------------------------------- site


@dataclass(kw_only=True, slots=True)
class SlurmSpec:
    partition: str = field(help="partition (queue) to submit to")
    account: str | None = field(None, help="account to charge (--account)")
    qos: str | None = field(None, help="quality of service (--qos)")
    gpu_directive: Literal["gpus-per-node", "gres", "none"] = field(
        "gpus-per-node", help="how this site asks for GPUs: --gpus-per-node=N, --gres=NAME:N, or not at all")
    gres_name: str = field("gpu", help="gres name for gpu_directive=gres, e.g. gpu or gpu:h100")
    constraint: str | None = field(None, help="node feature constraint (--constraint)")
    default_time: str = field("01:00:00", help="time limit when the job gives none (Slurm format)")
    log_dir: str = field("logs", help="where --output/--error files go (relative to the submit dir)")


@dataclass(kw_only=True, slots=True)
class NodeSpec:
    gpus: int = field(help="GPUs per node (0 for CPU-only nodes)")
    cpus: int = field(help="CPU cores per node")
    mem_gb: int = field(help="memory per node in GB (informational: jobs ask for --mem=0, all of it)")
    procs_per_node: int | None = field(None, help="training processes per node; default: one per GPU")
    gpu_model: str | None = field(None, help="GPU model, e.g. H100-SXM5-80GB")
    gpu_mem_gb: float = field(0.0, help="memory per GPU in GB")
    peak_tflops_bf16: float = field(0.0, help="dense bf16 peak TFLOP/s per GPU (for MFU); 0 = unknown")
    nvlink_domain: int = field(1, help="GPUs that share one NVLink/NVSwitch domain (TP stays inside it)")

    def __post_init__(self) -> None:
        for name in ("gpus", "cpus", "mem_gb", "nvlink_domain"):
            low = 0 if name == "gpus" else 1
            if getattr(self, name) < low:
                raise FieldError(name, f"{getattr(self, name)} must be at least {low}",
                                 f"set node.{name} to what one node has ({low} or more)")
        if self.procs_per_node is not None and self.procs_per_node < 1:
            raise FieldError("procs_per_node", f"{self.procs_per_node} must be at least 1",
                             "set node.procs_per_node to 1 or more, or remove it (one per GPU)")
        if self.gpus == 0 and self.procs_per_node is None:
            raise FieldError(("gpus", "procs_per_node"), "gpus: 0 leaves the processes per node unknown",
                             "add node.procs_per_node: N (CPU processes per node)")


@dataclass(kw_only=True, slots=True)
class NetworkSpec:
    backend: Literal["nccl", "gloo"] = field("nccl", help="torch.distributed backend")
    intra_node_gbytes_per_s: float = field(0.0, help="per-GPU bandwidth inside a node (NVLink), GB/s")
    inter_node_gbytes_per_s: float = field(0.0, help="per-node bandwidth between nodes, GB/s")


@dataclass(kw_only=True, slots=True)
class SiteRequeueSpec:
    enabled: bool = field(True, help="ask Slurm to requeue jobs on preemption/time limit")
    signal_lead_s: int = field(120, help="seconds before the time limit that USR2 is sent")
    max_restarts: int = field(5, help="restart budget per job")
    no_progress_limit: int = field(3, help="stop after this many starts without the pointer advancing")
    max_stray_stops: int = field(3, help="requeues per job after a stray stop (a TERM that reached the job step "
                                         "but not the batch shell while Slurm still ran the job)")


@dataclass(kw_only=True, slots=True)
class SiteRecoverySpec:
    warm: bool | Literal["auto"] = field(
        "auto", help="warm restarts inside the allocation (jobs with spares) on this site: true = they work here, "
        "false = never, auto = where `dslurm site check` proved one (its record beside this file; docs/site.md)")


@dataclass(kw_only=True, slots=True)
class StorageSpec:
    durable: str = field("checkpoints", help="root of run directories (checkpoints, ledger); shared by all nodes")
    scratch: str | None = field(None, help="node-local fast storage, if any; %n is the node name "
                                "(SLURMD_NODENAME); used by checkpoint.tiers: two_tier")


@dataclass(kw_only=True, slots=True)
class BurninSpec:
    """The burn-in's thresholds: what a healthy node must reach (docs/burnin.md). The one
    definition: `dslurm.preflight.thresholds.Thresholds` is this plus what it takes from the
    node description (GPU count, bf16 peak)."""

    gemm_min_fraction_of_peak: float = field(0.6, help="a GPU whose bf16 GEMM reaches less than this fraction of "
                                             "node.peak_tflops_bf16 fails (no peak: measured, not judged)")
    cpu_gemm_min_gflops: float = field(0.5, help="floor of the fp32 CPU smoke-test GEMM in GFLOP/s (CPU sites); "
                                       "0 = not judged")
    busbw_intra_min_gbytes_per_s: float = field(0.0, help="all-reduce bus bandwidth floor inside a node at the "
                                                "largest size, GB/s; 0 = any")
    busbw_inter_min_gbytes_per_s: float = field(0.0, help="all-reduce bus bandwidth floor across all nodes at the "
                                                "largest size, GB/s; 0 = any")
    slow_link_factor: float = field(3.0, help="a node pair slower than this x the fastest pair is a slow link (the "
                                    "fastest, not the median: in a 3-node ring one slow node makes 2 of 3 pairs slow)")
    max_temp_c: float = field(85.0, help="GPU core temperature ceiling, C: above it fails (it throttles soon)")
    max_ecc_uncorrected: int = field(0, help="uncorrected ECC errors tolerated (volatile or aggregate); more fails")
    min_pcie_gen: int = field(0, help="lowest acceptable current PCIe generation, a warning only (idle GPUs "
                              "downshift the link); 0 = not checked")
    min_free_mem_fraction: float = field(0.9, help="free/total GPU memory below this means someone else holds "
                                         "the GPU (warn)")
    min_power_limit_fraction: float = field(0.9, help="an enforced power limit below this fraction of the default "
                                            "means a capped GPU (warn)")
    allow_drain: bool = field(False, help="may a job drain bad nodes (needs Slurm operator rights); launcher "
                              "policy, not a threshold")

    def __post_init__(self) -> None:
        if not 0.0 < self.gemm_min_fraction_of_peak <= 1.0:
            raise FieldError("gemm_min_fraction_of_peak", f"{self.gemm_min_fraction_of_peak} must be in (0, 1]",
                             "give the fraction of peak a healthy GPU reaches, e.g. 0.6")
        if self.slow_link_factor <= 1.0:
            raise FieldError("slow_link_factor", f"{self.slow_link_factor} must be > 1",
                             "give how many times slower than the fastest pair is slow, e.g. 3")
        for name in ("min_free_mem_fraction", "min_power_limit_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise FieldError(name, f"{getattr(self, name)} must be in [0, 1]", "give a fraction, e.g. 0.9")


@dataclass(kw_only=True, slots=True)
class RemoteSpec:
    workdir: str | None = field(None, help="with `login`: absolute directory on the cluster that relative run "
                                "directories (storage.durable, checkpoint.run_dir) resolve against there")
    dslurm: str = field("dslurm", help="with `login`: the command that runs dslurm on the login host, after the "
                        "site's setup lines, split like a shell: /opt/venv/bin/dslurm or python3 -m dslurm")
    ssh_config: str | None = field(None, help="with `login`: an ssh config file to use instead of ~/.ssh/config "
                                   "(ssh -F)")


@dataclass(kw_only=True, slots=True)
class SiteConfig:
    name: str = field(help="short name of the cluster")
    description: str = field("", help="free text")
    slurm: SlurmSpec = field(help="scheduler settings")
    node: NodeSpec = field(help="what one node has")
    network: NetworkSpec = field(factory=NetworkSpec, help="interconnect")
    env: dict[str, str] = field(factory=dict, help="environment exported in every job (NCCL_* etc.)")
    setup: list[str] = field(factory=list, help="shell lines run before launch (modules, venv, container)")
    python: str = field("python3", help="Python interpreter inside the job (after setup), with any "
                        "arguments, split like a shell: python3 -X dev")
    requeue: SiteRequeueSpec = field(factory=SiteRequeueSpec, help="requeue policy")
    recovery: SiteRecoverySpec = field(factory=SiteRecoverySpec, help="recovery inside the allocation")
    storage: StorageSpec = field(factory=StorageSpec, help="where run state lives")
    burnin: BurninSpec = field(factory=BurninSpec, help="pre-flight thresholds")
    container: ContainerSpec | None = field(None, help="run the launcher, burn-in and training in a container "
                                            "(apptainer, singularity or pyxis); docs/containers.md")
    login: str | None = field(None, help="drive this cluster from another machine: the ssh host alias of its "
                              "login node (your ssh config and agent are used); docs/remote.md")
    remote: RemoteSpec = field(factory=RemoteSpec, help="with `login`: where runs live on the cluster and how "
                               "dslurm runs there")

    @property
    def procs_per_node(self) -> int:
        return self.node.procs_per_node or self.node.gpus

    @property
    def python_argv(self) -> list[str]:
        """`python` as words: an interpreter may come with arguments (`python3 -X dev`,
        `apptainer exec img.sif python3`); each word is quoted on its own when rendered."""
        return shlex.split(self.python)


# ------------------------------------------------------------------------------ job


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
    cp: int = field(1, help="context parallel degree (GPU only)")
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

    def __post_init__(self) -> None:
        if self.path is not None and self.sources:
            raise FieldError(("path", "sources"), "both are set", "give either data.path or data.sources")
        if not 0.0 <= self.val_fraction < 0.5:
            raise FieldError("val_fraction", f"{self.val_fraction} is outside [0, 0.5)",
                             "hold out a small fraction, e.g. 0.01, or set data.val")
        if self.val is not None and self.val_fraction:
            raise FieldError(("val", "val_fraction"), "both are set", "give either data.val or data.val_fraction")
        if not 0 <= self.prefetch <= 64:
            raise FieldError("prefetch", f"{self.prefetch} is outside [0, 64]",
                             "keep a few batches ready, e.g. 2 (0 reads in the step)")


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
        "wait", help="two_tier: a save arriving while the durable copy of the previous one still runs")

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise FieldError("interval", f"{self.interval} must be at least 1",
                             "set checkpoint.interval to the steps between saves")
        if self.keep_local < 1:
            raise FieldError("keep_local", f"{self.keep_local} must be at least 1",
                             "set checkpoint.keep_local: 1 or more")
        if self.keep < 2:
            raise FieldError("keep", f"{self.keep} must be at least 2 (the newest may be mid-write)",
                             "set checkpoint.keep: 2 or more")


@dataclass(kw_only=True, slots=True)
class HealthSpec:
    watchdog: bool = field(True, help="hang watchdog in every training process (dslurm/health.py)")
    hang_k: float = field(10.0, help="a step without progress for hang_k x the median step time is a hang")
    hang_floor_s: float = field(120.0, help="the hang bound is never below this (seconds)")
    hang_ceiling_s: float = field(1800.0, help="the hang bound before step times are known and during saves; "
                                  "the process-group timeout is this + 60 s")
    sdc_every: int = field(50, help="steps between silent-data-corruption checks of the HSDP replicas "
                           "(also before every save); 0 = off; needs parallel.dp_replicate > 1")
    sdc_max: int = field(2, help="corruptions rolled back per start; the next one ends the start as a crash "
                         "(the requeue then excludes the blocklisted node)")
    device_poll_every: int = field(50, help="steps between NVML polls (temperature, throttling, new ECC/Xid); "
                                   "0 = off; a no-op without NVML")
    profile_at: int = field(0, help="profile steps profile_at..profile_at+profile_steps-1 (1-based) of each start "
                            "with torch.profiler on every rank (train/profile.py); 0 = off")
    profile_steps: int = field(3, help="steps per profile (also what `dslurm ctl RUN profile` takes without --steps)")

    def __post_init__(self) -> None:
        if self.profile_steps < 1:
            raise FieldError("profile_steps", f"{self.profile_steps} must be at least 1",
                             "set health.profile_steps to e.g. 3")
        for name in ("sdc_every", "sdc_max", "device_poll_every", "profile_at"):
            if getattr(self, name) < 0:
                raise FieldError(name, f"{getattr(self, name)} must not be negative",
                                 f"set health.{name} to 0 (off) or more")
        if self.hang_k < 1:
            raise FieldError("hang_k", f"{self.hang_k} must be at least 1", "set health.hang_k to e.g. 10")
        if not 0 < self.hang_floor_s <= self.hang_ceiling_s:
            raise FieldError(("hang_floor_s", "hang_ceiling_s"),
                             f"need 0 < hang_floor_s({self.hang_floor_s}) <= hang_ceiling_s({self.hang_ceiling_s})",
                             "set health.hang_floor_s below health.hang_ceiling_s")


@dataclass(kw_only=True, slots=True)
class PreflightSpec:
    enabled: bool = field(True, help="run the burn-in before training")


@dataclass(kw_only=True, slots=True)
class RecoverySpec:
    warm: bool | Literal["auto"] = field(
        "auto", help="with spares: keep a preloaded worker pool on every allocated node, so an attempt after a "
        "failure forks its workers instead of importing torch again (docs/recovery.md); auto = where the site "
        "proved it (its recovery.warm, or a passed `dslurm site check` warm row), true = always, false = every "
        "attempt starts cold")


@dataclass(kw_only=True, slots=True)
class RequeueSpec:
    enabled: bool | None = field(None, help="requeue on preemption/time limit; null = the site's policy")
    signal_lead: int | Literal["auto"] | None = field(
        None, help="seconds of warning before the time limit, or 'auto'; null = the site's")
    max_restarts: int | None = field(None, help="restart budget; null = the site's")
    no_progress_limit: int | None = field(None, help="starts without progress before giving up")
    max_stray_stops: int | None = field(None, help="requeues after stray stops (a TERM that reached only the "
                                                   "job step); null = the site's")


@dataclass(kw_only=True, slots=True)
class MetricsSpec:
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = field(
        factory=list, help="experiment trackers rank 0 writes from the ledger's numbers (docs/trackers.md)")
    mlflow_uri: str | None = field(None, help="MLflow tracking URI; null = a file store in the run directory "
                                   "(or MLFLOW_TRACKING_URI from your environment)")
    wandb_project: str | None = field(None, help="W&B project; null = the job's name")
    wandb_mode: Literal["offline", "online"] | None = field(
        None, help="W&B mode; null = WANDB_MODE from your environment, else offline")
    tracker_timeout_s: float = field(
        30.0, help="seconds a tracker's open, log or annotation may go unanswered; then it is a tracker_failed "
        "and off for the rest of the start (training never waits for it)")
    tracker_close_s: float = field(
        10.0, help="seconds the end of a start waits for the trackers to send what is queued and close "
        "(keep it inside the site's KillWait)")

    def __post_init__(self) -> None:
        for name in ("tracker_timeout_s", "tracker_close_s"):
            if not 0 < getattr(self, name) <= 3600:
                raise FieldError(name, f"{getattr(self, name)} is not in (0, 3600] seconds", "give a positive bound")
        if len(set(self.trackers)) != len(self.trackers):
            raise FieldError("trackers", f"{self.trackers} names a tracker twice", "list each tracker once")
        if self.mlflow_uri is not None and not self.mlflow_uri.strip():
            raise FieldError("mlflow_uri", "is empty", "remove it (a file store in the run directory) or give a URI")


_DEPENDENCY = r"[a-z]+(:[0-9_+]+)+([,?][a-z]+(:[0-9_+]+)+)*|singleton"  # e.g. afterany:12:13,afterok:14


@dataclass(kw_only=True, slots=True)
class JobSpec:
    name: str = field(help="job name (letters, digits, - _ . only)")
    nodes: int = field(help="whole nodes to allocate")
    time: str | None = field(None, help="time limit, Slurm format (MM, HH:MM:SS, D-HH:MM...)")
    procs_per_node: int | None = field(None, help="override the site's processes per node")
    launch: Literal["torchrun", "srun"] = field(
        "torchrun", help="torchrun: one task per node; srun: one task per process")
    entry: str | list[str] = field(
        "train", help="what every training process runs. A module name (train, dslurm.launch.probe): "
        "python -m ENTRY --site S --job J. Your own script with its arguments: [my_train.py, --lr, '3e-4'] "
        "(or [-m, my.module, ...]), run as given, without dslurm's arguments; dslurm.runtime finds the "
        "frozen config through DSLURM_RUN_DIR")
    model: ModelSpec = field(factory=ModelSpec, help="model shape")
    parallel: ParallelSpec = field(factory=ParallelSpec, help="parallel degrees")
    train: TrainSpec = field(factory=TrainSpec, help="optimisation")
    data: DataSpec = field(factory=DataSpec, help="data")
    checkpoint: CheckpointSpec = field(factory=CheckpointSpec, help="checkpoints")
    preflight: PreflightSpec = field(factory=PreflightSpec, help="pre-flight burn-in")
    health: HealthSpec = field(factory=HealthSpec, help="health during the run: hang watchdog, SDC check, device poll")
    requeue: RequeueSpec = field(factory=RequeueSpec, help="requeue")
    recovery: RecoverySpec = field(factory=RecoverySpec, help="recovery inside the allocation (jobs with spares)")
    metrics: MetricsSpec = field(factory=MetricsSpec, help="experiment trackers (TensorBoard, W&B, MLflow)")
    dependency: str | None = field(None, help="Slurm dependency, e.g. afterany:1234")
    env: dict[str, str] = field(factory=dict, help="extra environment for this job")
    spares: int = field(0, help="spare whole nodes allocated beyond `nodes` (with --no-kill): a failed "
                        "node is swapped for one inside the allocation, without the queue (docs/recovery.md)")
    on_spares_exhausted: Literal["requeue", "shrink"] = field(
        "requeue", help="a node fails and no spare is left: requeue without the bad node, or shrink: go on "
        "with fewer nodes, a smaller data-parallel degree and the same global batch (gradient accumulation)")

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", self.name):
            raise FieldError("name", f"{self.name!r} may only hold letters, digits, '-', '_' and '.' (max 64, "
                             "no spaces, quotes or newlines) because it names files and Slurm jobs",
                             "rename the job, e.g. llama8b-run1")
        if self.nodes < 1:
            raise FieldError("nodes", f"nodes={self.nodes} must be at least 1", "set nodes: 1 or more")
        if self.spares < 0:
            raise FieldError("spares", f"spares={self.spares} must not be negative",
                             "set spares: 0 (no spare nodes) or more")
        _check_entry(self.entry)
        if self.launch == "srun" and not self.builtin_entry and self.preflight.enabled:
            raise FieldError(("entry", "launch", "preflight"), "a script entry gets its burn-in from a torchrun "
                             "wrapper (dslurm.launch.gate), which srun mode does not have",
                             "use launch: torchrun, or set preflight.enabled: false")
        if self.procs_per_node is not None and self.procs_per_node < 1:
            raise FieldError("procs_per_node", f"{self.procs_per_node} must be at least 1",
                             "set procs_per_node: 1 or more, or remove it (the site's)")
        if self.dependency is not None and not re.fullmatch(_DEPENDENCY, self.dependency):
            raise FieldError("dependency", f"{self.dependency!r} is not a Slurm dependency",
                             "write it as Slurm does, e.g. afterany:1234 or afterok:12:13")
        for key in self.env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise FieldError("env", f"{key!r} is not a valid environment variable name",
                                 "use letters, digits and '_', not starting with a digit")

    @property
    def builtin_entry(self) -> bool:
        """A module given as a string: a dslurm entry, which takes --site/--job."""
        return isinstance(self.entry, str) and not self.entry.endswith(".py")

    @property
    def entry_argv(self) -> list[str]:
        """What follows the interpreter: `-m MODULE`, or the script entry's words as given."""
        if isinstance(self.entry, str):
            return [self.entry] if self.entry.endswith(".py") else ["-m", self.entry]
        return list(self.entry)


_MODULE = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"


def _check_entry(entry: str | list[str]) -> None:
    """A module name, a script path ending in .py, or a list: [SCRIPT.py, ARGS...] or
    [-m, MODULE, ARGS...]. Every word one line (it is quoted into the script). Pure."""
    words = [entry] if isinstance(entry, str) else entry
    for i, w in enumerate(words):
        if any(c in w for c in "\n\r\0"):
            raise FieldError("entry", f"item {i} {w!r} holds a newline or NUL", "write each argument on one line")
    if isinstance(entry, str):
        if entry.endswith(".py") or re.fullmatch(_MODULE, entry):
            return
        raise FieldError("entry", f"{entry!r} is neither a Python module name nor a script path ending in .py",
                         "name a module like train, or give your script: entry: [my_train.py, --lr, '3e-4']")
    if not entry:
        raise FieldError("entry", "the list is empty", "give the script and its arguments: [my_train.py, --lr, '3e-4']")
    head = entry[0]
    if head == "-m":
        if len(entry) < 2 or not re.fullmatch(_MODULE, entry[1]):
            raise FieldError("entry", f"{entry[1:2]!r} after -m is not a Python module name",
                             "write [-m, my.module, ARGS...]")
    elif not head.endswith(".py") or head.startswith("-"):
        raise FieldError("entry", f"the first item {head!r} is not a script path ending in .py",
                         "start the list with your script, e.g. [my_train.py, --lr, '3e-4'], or with -m MODULE")


# ------------------------------------------------------------------------ loading


def _check_site_values(site: SiteConfig, where: Where) -> None:
    """Values that land in #SBATCH lines or `export` lines must be single-line and sane."""
    directive_values = {
        "slurm.partition": site.slurm.partition, "slurm.account": site.slurm.account,
        "slurm.qos": site.slurm.qos, "slurm.gres_name": site.slurm.gres_name,
        "slurm.constraint": site.slurm.constraint, "slurm.log_dir": site.slurm.log_dir,
    }
    for name, value in directive_values.items():
        if value is not None and (not value.strip() or any(c in value for c in "\n\r\t\0 ")):
            raise _at(where, name).fail(f"{value!r} must be one non-empty word without spaces or newlines",
                                        "use the name Slurm shows for it")
    for key in site.env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise where.child("env").fail(f"{key!r} is not a valid environment variable name",
                                          "use letters, digits and '_', not starting with a digit")
    for i, line in enumerate(site.setup):
        if "\0" in line or "\n" in line:
            raise _at(where, f"setup.{i}").fail("one shell line per list item, no newlines",
                                                "split it into several list items")
    try:
        words = site.python_argv
    except ValueError as exc:  # shlex: unbalanced quotes
        raise where.child("python").fail(f"{site.python!r} is not a command line ({exc})",
                                         "write the interpreter and its arguments as you would in a shell, "
                                         "e.g. python3 -X dev") from None
    if not words or any(c in site.python for c in "\n\r\0"):
        raise where.child("python").fail(f"{site.python!r} names no interpreter",
                                         "give the interpreter, e.g. python3 or /opt/venv/bin/python -X dev")
    parse_time(site.slurm.default_time, _at(where, "slurm.default_time").label())
    _check_remote(site, where)


def _check_remote(site: SiteConfig, where: Where) -> None:
    """`login` becomes an ssh argument and `remote.*` words of a remote shell line: one safe word each."""
    rem = site.remote
    if site.login is None:
        return
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.@:%+-]*", site.login):
        raise where.child("login").fail(f"{site.login!r} is not an ssh host alias",
                                        "give the Host name of your ssh config, e.g. mycluster or me@login1")
    if rem.workdir is None or not rem.workdir.startswith("/") or any(c in rem.workdir for c in "\n\r\0"):
        raise _at(where, "remote.workdir").fail(
            f"{'is not set' if rem.workdir is None else repr(rem.workdir) + ' is not absolute'}; with `login` "
            "it must be an absolute path on the cluster",
            "add remote.workdir: the directory on the cluster that holds your runs, e.g. /scratch/me/runs")
    try:
        words = shlex.split(rem.dslurm)
    except ValueError as exc:
        words = []
        why = str(exc)
    else:
        why = "names no command"
    if not words or any(c in rem.dslurm for c in "\n\r\0"):
        raise _at(where, "remote.dslurm").fail(f"{rem.dslurm!r} {why}",
                                               "give the command, e.g. dslurm or /opt/venv/bin/dslurm")


def _at(where: Where, dotted: str) -> Where:
    for part in dotted.split("."):
        where = where.child(part)
    return where


def load_site(path: str | Path | None = None, overrides: list[str] | None = None,
              data: dict[str, Any] | None = None) -> SiteConfig:
    """Read and validate a site config from a YAML file (or a dict), with `--site-set` overrides."""
    source = str(path) if path is not None else "site"
    raw = load_yaml(path) if path is not None else dict(data or {})
    data, origins = apply_overrides(raw, overrides or [], "--site-set")
    where = Where(source, origins=origins)
    site = build(SiteConfig, data, where)
    _check_site_values(site, where)
    return site


def load_job(path: str | Path | None = None, overrides: list[str] | None = None,
             data: dict[str, Any] | None = None) -> JobSpec:
    """Read and validate a job spec from a YAML file (or a dict), with `--set` overrides."""
    source = str(path) if path is not None else "job"
    raw = load_yaml(path) if path is not None else dict(data or {})
    raw, origins = apply_overrides(raw, overrides or [])
    where = Where(source, origins=origins)
    job = build(JobSpec, raw, where)
    if job.time is not None:
        parse_time(job.time, where.child("time").label())
    try:
        shape = job.model.shape()  # with model.init_from: its config.json
    except UserError as exc:
        raise UserError(f"{source}: {exc}") from None
    problems = shape.problems()
    if problems:
        raise where.child("model").fail(
            f"{'; '.join(problems)} (preset {job.model.preset!r} with the fields set here)",
            "choose model fields that divide as stated, or remove the overrides to keep the preset's shape")
    return job


_TIME_FORMS = re.compile(
    r"(?:(?P<d>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?)"  # D-H[:M[:S]]
    r"|(?P<h>\d+):(?P<hm>\d+):(?P<hs>\d+)"  # H:M:S
    r"|(?P<m>\d+)(?::(?P<ms>\d+))?"  # M[:S]
)


def parse_time(value: str, where: str = "time") -> int:
    """Slurm time limit -> seconds. Accepts M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    m = _TIME_FORMS.fullmatch(value.strip()) if isinstance(value, str) else None
    if not m:
        raise UserError(f"{where}: {value!r} is not a Slurm time. Fix: use MM, HH:MM:SS or D-HH:MM:SS, "
                        "e.g. 00:30:00")
    g = {k: int(v) if v else 0 for k, v in m.groupdict().items()}
    seconds = (g["d"] * 86400 + g["dh"] * 3600 + g["dm"] * 60 + g["ds"]
               + g["h"] * 3600 + g["hm"] * 60 + g["hs"] + g["m"] * 60 + g["ms"])
    if seconds <= 0:
        raise UserError(f"{where}: {value!r} is zero. Fix: give a positive time limit")
    return seconds


def format_time(seconds: int) -> str:
    """Seconds -> Slurm's D-HH:MM:SS (rounded up to whole minutes: Slurm's granularity)."""
    minutes = math.ceil(seconds / 60)
    d, rem = divmod(minutes, 1440)
    h, mi = divmod(rem, 60)
    return f"{d}-{h:02d}:{mi:02d}:00" if d else f"{h:02d}:{mi:02d}:00"
