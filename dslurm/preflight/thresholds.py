"""Burn-in thresholds: what a healthy node must reach.

The thresholds themselves are defined once, in `BurninSpec` (the `burnin` section of the site
config, dslurm/config/site.py: defaults, help, checks). `Thresholds` is that section plus
what the burn-in takes from the node description (GPU count, bf16 peak): `Thresholds.from_site`.
`None` / 0 means "not judged" for checks whose expectation depends on the hardware.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dslurm.config import BurninSpec
from dslurm.config.schema import FieldError
from dslurm.errors import UserError

# Keys of the site's burnin section that are policy for the launcher, not thresholds.
NOT_THRESHOLDS = frozenset({"allow_drain"})


@dataclass(kw_only=True, slots=True)
class Thresholds(BurninSpec):
    expected_gpus_per_node: int | None = None
    """GPUs every node must show; None = do not check the count (e.g. CPU nodes)."""
    gpu_peak_tflops: float | None = None
    """Dense bf16 peak of one GPU (datasheet). None = GEMM is measured but not judged."""

    @classmethod
    def from_site(cls, site: Any) -> Thresholds:
        """From a dslurm.config.SiteConfig: its burnin section plus node.gpus and the peak."""
        section = {f.name: getattr(site.burnin, f.name) for f in dataclasses.fields(BurninSpec)}
        section["expected_gpus_per_node"] = site.node.gpus or None
        section["gpu_peak_tflops"] = site.node.peak_tflops_bf16 or None
        return cls.from_mapping(section, source="site burnin")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "burnin") -> Thresholds:
        """Build from a config section; unknown keys are errors that list the valid ones."""
        valid = [f.name for f in dataclasses.fields(cls) if f.name not in NOT_THRESHOLDS]
        data = {k: v for k, v in data.items() if k not in NOT_THRESHOLDS}
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise UserError(
                f"{source}: unknown key(s) {unknown}; valid keys are {valid}"
            )
        try:
            return cls(**dict(data))
        except FieldError as exc:
            raise UserError(f"{source}: field 'burnin.{exc.fields[0]}': {exc.what}. Fix: {exc.fix}") from None
        except (TypeError, ValueError) as exc:
            raise UserError(f"{source}: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in NOT_THRESHOLDS}
