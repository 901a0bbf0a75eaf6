"""What a generation records about the step that made it, and the replay check of a restore
(torch-free: `ckpt ls` shows it; docs/recovery.md, "A resume that proves itself").

Two records go into a generation's meta.json beside its per-tensor fingerprints
(dslurm.checkpoint.fingerprint):

- `last_step`: the loss and grad norm of the saved step, as the trainer logged them. They say what
  state the run was in: a non-finite one marks the generation *suspect* in `ckpt ls` and on
  restore. It is not refused for it: the state itself was checked finite before the commit (a
  non-finite state is never committed), so a non-finite loss there means the step was skipped
  (`train.nonfinite: skip`) and the saved state is the one before it.
- `replay` (with `checkpoint.verify_resume: replay`): a *probe loss*, a forward-only loss of the
  saved state on a batch fixed by the saved data position (the next step's batch), all-reduced
  over the ranks. The saved state is after step s's update, so step s's own loss cannot be
  recomputed from it; the probe can, from the same parameters and the same batch, after the
  restore and before the first step. A restore whose probe differs, or is not finite (a state
  assembled wrongly, Megatron-LM #5281: a deterministic NaN after a restore from replicas), is
  refused like a corrupt copy: the next copy, then the previous generation.

The comparison: bit-equal with the same world size and layout (the same ranks run the same
forward on the same bytes; CPU/gloo is deterministic); after a reshard the reductions run in
another order and shapes, so within RESHARD_RTOL. Pure.
"""

from __future__ import annotations

import math
from typing import Any

MODES = ("fingerprint", "replay")
"""checkpoint.verify_resume: fingerprint (per-tensor crc32s, always on), replay (that + the probe)"""

RESHARD_RTOL = 5e-3
"""Relative tolerance of a probe after a reshard (other world size or layout): the forward runs on
other shapes and reduces in another order. bf16 rounds at 2^-8 = 3.9e-3 relative; fp32 reshards
here differ by ~1e-7. A NaN or inf is never within it."""


def last_step(loss: float | None, grad_norm: float | None) -> dict[str, float | None]:
    """The `last_step` record (None when the caller gave none). Floats, NaN/inf as strings:
    meta.json is strict JSON."""
    return {"loss": _num(loss), "grad_norm": _num(grad_norm)}


def _num(x: float | None) -> Any:
    if x is None:
        return None
    return float(x) if math.isfinite(x) else str(float(x))


def _val(x: Any) -> float | None:
    return None if x is None else float(x)


def suspect(meta: dict[str, Any]) -> str:
    """Why a generation's recorded last step is suspect ("" when it is not, or nothing was
    recorded: an older generation)."""
    rec = meta.get("last_step") or {}
    bad = [f"{k} {rec[k]}" for k in ("loss", "grad_norm") if rec.get(k) is not None
           and not math.isfinite(float(rec[k]))]
    return f"the saved step's {' and '.join(bad)} (the state was checked finite: that step was skipped)" if bad else ""


def probe_record(loss: float) -> dict[str, Any]:
    """The `replay` record of a save."""
    return {"probe_loss": _num(loss), "batch": "next"}


def bad_probe(meta: dict[str, Any]) -> str:
    """Why a save's recorded probe refuses its commit ("" when none was recorded or it is finite):
    finite tensors that compute a non-finite loss would be refused by every restore."""
    probe = _val((meta.get("replay") or {}).get("probe_loss"))
    if probe is None or math.isfinite(probe):
        return ""
    return f"the state's probe loss is {probe} (verify_resume: replay): finite tensors that compute a non-finite loss"


def verdict(saved: dict[str, Any] | None, now: float, *, same_layout: bool) -> str:
    """The problem with a restored state's probe loss `now` against the saved record ("" when it
    passes). A non-finite probe fails even when nothing was recorded."""
    if not math.isfinite(now):
        return f"replay: probe loss {now} on the restored state is not finite"
    want = _val((saved or {}).get("probe_loss"))
    if want is None:
        return ""
    if same_layout:
        if now != want:
            return f"replay: probe loss {now!r} != saved {want!r} (bit-equal expected: same world and layout)"
        return ""
    if not math.isfinite(want) or abs(now - want) > RESHARD_RTOL * max(abs(want), 1e-12):
        return (f"replay: probe loss {now!r} != saved {want!r} beyond the reshard tolerance "
                f"(relative {RESHARD_RTOL})")
    return ""


def describe(meta: dict[str, Any]) -> str:
    """`loss L, grad norm G[, probe P]` for `ckpt ls` ("" when nothing was recorded)."""
    rec = meta.get("last_step") or {}
    parts = []
    if rec.get("loss") is not None:
        parts.append(f"loss {_short(rec['loss'])}")
    if rec.get("grad_norm") is not None:
        parts.append(f"grad norm {_short(rec['grad_norm'])}")
    probe = (meta.get("replay") or {}).get("probe_loss")
    if probe is not None:
        parts.append(f"probe {_short(probe)}")
    return ", ".join(parts)


def _short(x: Any) -> str:
    v = float(x)
    return f"{v:.4g}" if math.isfinite(v) else str(v)
