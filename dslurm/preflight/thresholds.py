"""Burn-in thresholds: what a healthy node must reach.

Field names follow `BurninSpec` (the `burnin` section of the site config, dslurm/config/__init__.py);
`Thresholds.from_site(site)` adds what the burn-in takes from the node description (GPU count,
bf16 peak). `None` / 0 means "not judged" for checks whose expectation depends on the hardware.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dslurm.errors import UserError

# Keys of the site's burnin section that are policy for the launcher, not thresholds.
NOT_THRESHOLDS = frozenset({"allow_drain"})


@dataclass(kw_only=True, slots=True)
class Thresholds:
    expected_gpus_per_node: int | None = None
    """GPUs every node must show; None = do not check the count (e.g. CPU nodes)."""
    gpu_peak_tflops: float | None = None
    """Dense bf16 peak of one GPU (datasheet). None = GEMM is measured but not judged."""
    gemm_min_fraction_of_peak: float = 0.6
    """A GPU whose GEMM reaches less than this fraction of peak is slow (fail)."""
    cpu_gemm_min_gflops: float = 0.0
    """Floor of the fp32 CPU smoke-test GEMM in GFLOP/s (CPU sites); 0 = not judged."""
    busbw_intra_min_gbytes_per_s: float = 0.0
    """Minimum all-reduce bus bandwidth inside a node at the largest size (GB/s); 0 = any."""
    busbw_inter_min_gbytes_per_s: float = 0.0
    """Minimum all-reduce bus bandwidth across all nodes at the largest size (GB/s); 0 = any."""
    max_temp_c: float = 85.0
    """GPU core temperature above this fails (it throttles soon)."""
    max_ecc_uncorrected: int = 0
    """Uncorrected ECC errors allowed (volatile or aggregate); more fails."""
    min_pcie_gen: int = 0
    """Lowest acceptable current PCIe generation (0 = not checked). GPUs downshift the link
    when idle, so this is only a warning."""
    min_free_mem_fraction: float = 0.9
    """Free/total GPU memory below this means someone else holds the GPU (warn)."""
    min_power_limit_fraction: float = 0.9
    """Enforced power limit below this fraction of the default means a capped GPU (warn)."""
    slow_link_factor: float = 3.0
    """A node pair slower than this factor times the fastest pair is a slow link. The fastest,
    not the median: in a 3-node ring one slow node makes 2 of 3 pairs slow."""

    def __post_init__(self) -> None:
        if not 0.0 < self.gemm_min_fraction_of_peak <= 1.0:
            raise ValueError(
                f"burnin.gemm_min_fraction_of_peak={self.gemm_min_fraction_of_peak}: "
                "must be in (0, 1]"
            )
        if self.slow_link_factor <= 1.0:
            raise ValueError(f"burnin.slow_link_factor={self.slow_link_factor}: must be > 1")
        if not 0.0 <= self.min_free_mem_fraction <= 1.0:
            raise ValueError(
                f"burnin.min_free_mem_fraction={self.min_free_mem_fraction}: must be in [0, 1]"
            )

    @classmethod
    def from_site(cls, site: Any) -> Thresholds:
        """From a dslurm.config.SiteConfig: its burnin section plus node.gpus and the peak."""
        section = {name: getattr(site.burnin, name) for name in site.burnin.__slots__}
        section["expected_gpus_per_node"] = site.node.gpus or None
        section["gpu_peak_tflops"] = site.node.peak_tflops_bf16 or None
        return cls.from_mapping(section, source="site burnin")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "burnin") -> Thresholds:
        """Build from a config section; unknown keys are errors that list the valid ones."""
        valid = [f.name for f in dataclasses.fields(cls)]
        data = {k: v for k, v in data.items() if k not in NOT_THRESHOLDS}
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise UserError(
                f"{source}: unknown key(s) {unknown}; valid keys are {valid}"
            )
        try:
            return cls(**dict(data))
        except (TypeError, ValueError) as exc:
            raise UserError(f"{source}: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
