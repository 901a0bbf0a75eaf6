"""Parallel degrees of one run and the DeviceMesh built from them, once.

`ParallelDims` mirrors torchtitan's: built from the resolved `Layout` (dp_shard already
resolved by `dslurm.config.resolve`), validated on creation, `*_enabled` properties, and a lazily
built world mesh with dims (pp, dp_replicate, dp_shard, cp, tp), tp fastest, matching
`Layout.coords` so a rank's mesh coordinates equal the pure ones. Size-1 dims are kept in
the mesh so every name is always valid (FSDP on a 1-process mesh is how the benchmark
measures wrapper overhead); "dp" is the flattened (dp_replicate, dp_shard) pair.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dslurm.config.resolve import Layout
from dslurm.errors import UserError

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLAT_NAMES = {"dp": ("dp_replicate", "dp_shard")}


@dataclass(kw_only=True, slots=True)
class ParallelDims:
    """Degrees of each parallelism; the product must equal the world size."""

    pp: int
    """pipeline stages (one per rank along this dim)"""
    dp_replicate: int
    """HSDP replicas: each holds a full set of FSDP shards"""
    dp_shard: int
    """FSDP shard degree"""
    cp: int
    """context parallel degree (GPU only)"""
    tp: int
    """tensor + sequence parallel degree"""
    world_size: int
    """processes in the job"""
    device_type: str = "cpu"
    """'cpu' (gloo) or 'cuda' (nccl)"""
    _mesh: Any = field(default=None, repr=False)
    _flat: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for name in DIM_NAMES:
            if getattr(self, name) < 1:
                raise UserError(f"parallel.{name}={getattr(self, name)} must be at least 1")
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise UserError(
                f"pp({self.pp})*dp_replicate({self.dp_replicate})*dp_shard({self.dp_shard})*cp({self.cp})"
                f"*tp({self.tp})={product} != world_size({self.world_size}). Fix: make the product equal "
                f"the number of processes, or set parallel.dp_shard: -1")
        if self.cp > 1 and self.device_type == "cpu":
            # No sharding rule for the CPU flash-attention op (reproduced on torch 2.13 CPU).
            raise UserError(f"parallel.cp={self.cp}: context parallel needs GPUs (the CPU attention op has "
                            "no DTensor sharding rule). Fix: set parallel.cp: 1 on CPU")

    @classmethod
    def from_layout(cls, layout: Layout, world_size: int, device_type: str = "cpu") -> ParallelDims:
        return cls(pp=layout.pp, dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard,
                   cp=layout.cp, tp=layout.tp, world_size=world_size, device_type=device_type)

    @property
    def dp(self) -> int:
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
        """FSDP/HSDP is applied whenever there is data parallelism to shard or replicate over."""
        return self.dp > 1

    @property
    def loss_parallel_enabled(self) -> bool:
        return self.tp_enabled

    @property
    def mesh(self) -> Any:
        """The world DeviceMesh, built on first use (needs an initialised process group)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(self.device_type, tuple(getattr(self, n) for n in DIM_NAMES),
                                    mesh_dim_names=DIM_NAMES)
            # Keep the flattened meshes ourselves: slicing a flattened dim from the root mesh
            # is deprecated (UserWarning in torch 2.13).
            self._flat = {flat: mesh[parts]._flatten(flat) for flat, parts in FLAT_NAMES.items()}
            self._mesh = mesh
        return self._mesh

    def get_mesh(self, names: str | tuple[str, ...] | list[str]) -> Any:
        """The sub-mesh over `names`; a wrong name lists the valid ones."""
        names = (names,) if isinstance(names, str) else tuple(names)
        valid = DIM_NAMES + tuple(FLAT_NAMES)
        bad = [n for n in names if n not in valid]
        if bad:
            raise ValueError(f"unknown mesh dim(s) {bad}; valid names: {', '.join(valid)}")
        mesh = self.mesh
        flat = [n for n in names if n in FLAT_NAMES]
        if flat:
            if len(names) > 1:
                raise ValueError(f"flattened dim {flat[0]!r} cannot be combined with others in {names}; "
                                 f"ask for its parts {FLAT_NAMES[flat[0]]} instead")
            return self._flat[flat[0]]
        return mesh[names if len(names) > 1 else names[0]]
