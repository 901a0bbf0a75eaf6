"""The DeviceMesh of one run, built once from the shared `Layout`.

The degrees, their order and every rule about them live in `dslurm.config.layout.Layout`
(torch-free; built and checked by `dslurm.config.resolve`). `ParallelDims` adds only what
needs torch, as torchtitan's does: a lazily built world mesh with dims `DIM_NAMES`
(pp, dp_replicate, dp_shard, cp, tp), tp fastest, matching `Layout.coords` so a rank's mesh
coordinates equal the pure ones. Size-1 dims are kept in the mesh so every name is always
valid (FSDP on a 1-process mesh is how the benchmark measures wrapper overhead); "dp" is the
flattened (dp_replicate, dp_shard) pair and "dp_shard_cp" the flattened (dp_shard, cp) pair: the
cp ranks join FSDP's sharding (as torchtitan's dp_shard_cp), `fsdp_mesh` says which mesh FSDP gets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dslurm.config.layout import DIM_NAMES, Layout

if TYPE_CHECKING:  # torch is imported when the mesh is first built
    from torch.distributed.device_mesh import DeviceMesh

FLAT_NAMES = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp")}


@dataclass(kw_only=True, slots=True)
class ParallelDims:
    """A checked `Layout` on this run's device, and its mesh."""

    layout: Layout
    """the degrees (read `dims.layout.tp`, `dims.layout.pp_enabled`, ...)"""
    device_type: str = "cpu"
    """'cpu' (gloo) or 'cuda' (nccl)"""
    _mesh: DeviceMesh | None = field(default=None, repr=False)
    _flat: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)
    _hsdp_cp: DeviceMesh | None = field(default=None, repr=False)

    @classmethod
    def from_layout(cls, layout: Layout, world_size: int, device_type: str = "cpu") -> ParallelDims:
        """The layout checked against the launcher's world and the device."""
        layout.check_world(world_size)
        return cls(layout=layout, device_type=device_type)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def mesh(self) -> DeviceMesh:
        """The world DeviceMesh, built on first use (needs an initialised process group)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(self.device_type, tuple(d for _, d in self.layout.dims()),
                                    mesh_dim_names=DIM_NAMES)
            # Keep the flattened meshes ourselves: slicing a flattened dim from the root mesh
            # is deprecated (UserWarning in torch 2.13).
            self._flat = {flat: mesh[parts]._flatten(flat) for flat, parts in FLAT_NAMES.items()}
            self._mesh = mesh
        return self._mesh

    def get_mesh(self, names: str | tuple[str, ...] | list[str]) -> DeviceMesh:
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

    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over: dp_shard, joined by cp when context parallel is on (a cp rank
        holds other tokens of the same sequences, so it shards parameters and averages gradients
        like a data-parallel rank), and with HSDP the 2-D (dp_replicate, that) mesh."""
        lay = self.layout
        if not lay.cp_enabled:
            return self.get_mesh(("dp_replicate", "dp_shard") if lay.dp_replicate_enabled else "dp_shard")
        if not lay.dp_replicate_enabled:
            return self.get_mesh("dp_shard_cp")
        if self._hsdp_cp is None:
            # (dp_replicate, dp_shard*cp): the three adjacent dims flattened, then cut in two
            # (slicing a flattened dim from the root mesh is deprecated, see above).
            flat = self.mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
            self._hsdp_cp = flat._unflatten(0, (lay.dp_replicate, lay.dp_shard * lay.cp),
                                            ("dp_replicate", "dp_shard_cp"))
        return self._hsdp_cp
