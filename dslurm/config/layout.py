"""The parallel layout of one run: its degrees, their order, and every rule about them, once.

`Layout` is torch-free. `dslurm.config.resolve` builds it from the job (with the file and
field in each message), the planner proposes and checks it, the trainer's
`train.parallel.dims.ParallelDims` builds the DeviceMesh from it, and the data loader reads
each rank's data-parallel slot from it. Ranks form a grid in `DIM_NAMES` order with tp
fastest, so a TP group is consecutive ranks (inside one node), as in picotron's
`arange(world).view(dp, pp, cp, tp)`.

The batch rule. One optimizer step of `global_batch` sequences is split over the dp
data-parallel ranks; each rank runs `grad_accum` accumulation passes, and with a pipeline
(pp > 1) each pass is one schedule step of `microbatches` pipeline microbatches. So

    global_batch = dp x grad_accum x microbatches x micro_batch     (microbatches = 1 when pp = 1)

with a whole micro_batch. The trainer chunks the per-rank batch exactly that way and scales
each micro-batch's loss by 1 / (grad_accum x microbatches); that is the mean of the step
only when every micro-batch has the same size, so the product must divide global_batch.
(The planner used to read the job as dp x microbatches under pp > 1, leaving grad_accum
out, and so planned micro-batches grad_accum times too large.)
"""

from __future__ import annotations

from dataclasses import dataclass

from dslurm.config.models import ModelShape
from dslurm.errors import UserError

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Mesh dimensions, outermost first; tp is fastest (consecutive ranks)."""

def stages_per_rank(schedule: str) -> int:
    """Virtual pipeline stages per pipeline rank: 2 for the interleaved schedule, else 1."""
    return 2 if schedule == "Interleaved1F1B" else 1


def stage_ids(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """Pipeline stages held by `pp_rank` (loop-style placement: r, r+pp, ...)."""
    return [pp_rank + i * pp for i in range(stages_per_rank(schedule))]


def layer_split(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous layer ranges per stage, the first stages taking one extra when uneven (what
    train/parallel/pp.py builds and the planner counts)."""
    if n_stages > n_layers:
        raise ValueError(f"n_layers({n_layers}) < pipeline stages({n_stages})")
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def _at_least_one(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"parallel.{name}={value!r} must be a whole number, at least 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """Parallel degrees with dp_shard resolved; their product is the world size."""

    pp: int = 1
    """pipeline stages (one per rank along this dim)"""
    dp_replicate: int = 1
    """HSDP replicas, each holding a full set of FSDP shards (DDP when dp_shard is 1)"""
    dp_shard: int = 1
    """FSDP shard degree (1: replicated state)"""
    cp: int = 1
    """context parallel degree: each sequence split over cp ranks (train/parallel/cp.py)"""
    tp: int = 1
    """tensor + sequence parallel degree"""
    microbatches: int = 1
    """pipeline microbatches per schedule step; 1 without a pipeline (grad_accum splits then)"""

    def __post_init__(self) -> None:
        for name in (*DIM_NAMES, "microbatches"):
            _at_least_one(name, getattr(self, name))
        if self.pp == 1 and self.microbatches != 1:
            raise UserError(f"parallel.microbatches={self.microbatches} without a pipeline (pp=1): the batch "
                            "is split by train.grad_accum then. Fix: microbatches 1, or pp > 1")

    @classmethod
    def for_world(cls, world_size: int, *, pp: int = 1, dp_replicate: int = 1, dp_shard: int = -1, cp: int = 1,
                  tp: int = 1, microbatches: int = 1, where: str = "", fix: str = "") -> Layout:
        """The layout over `world_size` ranks; dp_shard=-1 takes the ranks the other degrees leave.
        `microbatches` is kept only with a pipeline. `where` prefixes messages (file and field),
        `fix` replaces the generic fix of a wrong product."""
        fixed = pp * dp_replicate * cp * tp
        if dp_shard == -1:
            if world_size % fixed:
                raise UserError(
                    f"{where}pp({pp})*dp_replicate({dp_replicate})*cp({cp})*tp({tp})={fixed} does not divide "
                    f"world_size({world_size}). Fix: choose degrees whose product divides {world_size}")
            dp_shard = world_size // fixed
        layout = cls(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp,
                     microbatches=microbatches if pp > 1 else 1)
        layout.check_world(world_size, where=where, fix=fix)
        return layout

    # ------------------------------------------------------------------ derived values

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: the flattened (dp_replicate, dp_shard) pair."""
        return self.dp_replicate * self.dp_shard

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP/HSDP is applied whenever there is data parallelism to shard or replicate over; the cp
        ranks join the sharding (dp_shard x cp), as torchtitan's."""
        return self.dp * self.cp > 1

    @property
    def fsdp_shard(self) -> int:
        """Ranks one FSDP group shards the parameters over: dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def loss_parallel_enabled(self) -> bool:
        return self.tp_enabled

    def dims(self) -> list[tuple[str, int]]:
        """(name, degree) in mesh order."""
        return [(name, getattr(self, name)) for name in DIM_NAMES]

    def degrees(self) -> dict[str, int]:
        """The degrees alone (what checkpoints and the ledger record; their product is the world)."""
        return dict(self.dims())

    def product(self) -> str:
        """`pp(2)*dp_replicate(1)*dp_shard(4)*cp(1)*tp(2)=16`, for messages."""
        return "*".join(f"{n}({d})" for n, d in self.dims()) + f"={self.world_size}"

    def describe(self) -> str:
        kind = "DDP" if self.dp_shard == 1 else "FSDP" if self.dp_replicate == 1 else "HSDP"
        return " ".join(f"{n}={d}" for n, d in self.dims()) + f" ({kind}), microbatches={self.microbatches}"

    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> mesh coordinates; pure, the inverse of `rank_of`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        out = {}
        for name, size in reversed(self.dims()):
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name in DIM_NAMES}

    def rank_of(self, **coords: int) -> int:
        rank = 0
        for name, size in self.dims():
            rank = rank * size + coords.get(name, 0)
        return rank

    def dp_coords(self, rank: int) -> tuple[int, int]:
        """Global rank -> (dp_rank, dp): the data-parallel slot combines the HSDP replica and the
        FSDP shard coordinate; TP, CP and PP peers share it, hence the same batch."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"], self.dp

    # ------------------------------------------------------------------ rules

    def check_world(self, world_size: int, *, where: str = "", detail: str = "", fix: str = "") -> None:
        """The product of the degrees must equal the world size."""
        if self.world_size != world_size:
            fix = fix or "make the product equal the number of processes, or set parallel.dp_shard: -1"
            raise UserError(f"{where}{self.product()} != world_size({world_size}){detail}. Fix: {fix}")

    @staticmethod
    def dp_share(global_batch: int, dp_rank: int, dp_size: int) -> int:
        """The samples data-parallel rank `dp_rank` of `dp_size` takes of each global batch, B/D:
        the rule every global-batch sampler (train/data.py, train/sources.py) is built on. A
        ValueError, not a UserError: a job reaches the samplers only after `micro_batch` (its
        stronger form, with grad_accum and microbatches) has told its user; this guards callers."""
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if global_batch < 1 or global_batch % dp_size:
            raise ValueError(f"global_batch({global_batch}) must be a positive multiple of dp_size({dp_size})")
        return global_batch // dp_size

    def micro_batch(self, global_batch: int, grad_accum: int = 1, *, where: str = "") -> int:
        """Sequences per forward pass under the batch rule (module docstring); UserError naming
        every factor when `global_batch` does not split evenly."""
        per_step = self.dp * grad_accum * self.microbatches
        if global_batch < 1 or global_batch % per_step:
            pipe = f" x microbatches({self.microbatches})" if self.pp_enabled else ""
            raise UserError(
                f"{where}{global_batch} is not divisible by dp({self.dp}) x grad_accum({grad_accum}){pipe} = "
                f"{per_step}: every micro-batch must hold the same number of sequences. Fix: use a multiple "
                f"of {per_step}, or change train.grad_accum" + (" or parallel.microbatches" if pipe else ""))
        return global_batch // per_step

    def grad_accum_for(self, global_batch: int, micro_batch: int, *, where: str = "") -> int:
        """The batch rule solved for grad_accum: the accumulation that keeps `global_batch` and
        `micro_batch` on this layout (a shrink to fewer data-parallel ranks accumulates more).
        UserError with the numbers when no whole number does."""
        per_pass = self.dp * self.microbatches * micro_batch
        if micro_batch < 1 or global_batch % per_pass:
            raise UserError(f"{where}global_batch({global_batch}) is not a multiple of dp({self.dp}) x "
                            f"microbatches({self.microbatches}) x micro_batch({micro_batch}) = {per_pass}: no "
                            f"gradient accumulation keeps the global batch on this layout. Fix: a global batch "
                            f"that the smaller data-parallel degree divides, or on_spares_exhausted: requeue")
        return global_batch // per_pass

    def shape_problems(self, shape: ModelShape, stages_per_rank: int = 1) -> list[str]:
        """What the model's shape forbids: tp must split the heads, the FFN and (sequence
        parallel) the sequence; every pipeline stage needs a layer. Empty when all is well."""
        out = []
        if shape.n_heads % self.tp or shape.n_kv_heads % self.tp:
            out.append(f"tp({self.tp}) must divide n_heads({shape.n_heads}) and n_kv_heads({shape.n_kv_heads})")
        if shape.ffn_dim % self.tp:
            out.append(f"tp({self.tp}) must divide ffn_dim({shape.ffn_dim})")
        if self.cp > 1 and shape.seq_len % (2 * self.cp):
            out.append(f"2*cp({2 * self.cp}) must divide seq_len({shape.seq_len}): context parallel gives each cp "
                       "rank two equal chunks of the sequence (load-balanced causal split)")
        elif self.tp > 1 and (shape.seq_len // self.cp) % self.tp:
            local = f"seq_len({shape.seq_len})" if self.cp == 1 else f"seq_len/cp({shape.seq_len // self.cp})"
            out.append(f"tp({self.tp}) must divide {local} for sequence parallel")
        stages = self.pp * stages_per_rank
        if self.pp > 1 and shape.n_layers < stages:
            out.append(f"n_layers({shape.n_layers}) < pipeline stages({stages})")
        if self.pp > 1 and shape.tie_embeddings:
            out.append(f"pp({self.pp}) with tie_word_embeddings: the input embedding and the output projection are "
                       "one matrix, which a pipeline puts on its first and last stages; use pp 1 for this model")
        return out

    def schedule_problem(self, stages_per_rank: int = 1) -> str | None:
        """Pipeline schedules need at least one microbatch per stage."""
        stages = self.pp * stages_per_rank
        if self.pp > 1 and self.microbatches < stages:
            return (f"microbatches({self.microbatches}) < pipeline stages({stages}); "
                    f"set parallel.microbatches >= {stages}")
        return None
