"""Per-rank RNG streams as JSON-able state (saved as ranks/rank-NNNNN.json in a generation).

Restored only when the world size is unchanged: per-rank streams have no meaning for a
different set of ranks (dslurm.checkpoint.dcp.RestoreResult.rng_restored).
"""

from __future__ import annotations

import base64
import random
from typing import Any

import torch


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture_rng() -> dict[str, Any]:
    """This rank's RNG streams (Python, numpy, torch CPU, CUDA when initialised), JSON-able."""
    v, state, gauss = random.getstate()
    out: dict[str, Any] = {"python": [v, list(state), gauss], "torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        out["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]  # type: ignore[union-attr]
    except ImportError:
        pass
    return out


def apply_rng(st: dict[str, Any]) -> None:
    v, state, gauss = st["python"]
    random.setstate((v, tuple(state), gauss))
    torch.set_rng_state(_unb64(st["torch"]))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in st["cuda"]])
    if "numpy" in st:
        import numpy as np
        name, keys, pos, has_gauss, cached = st["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
