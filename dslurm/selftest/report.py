"""The self-check's report: parts run in order, each timed; a part that raises records its error
and the others still run; the issue's goals are judged as pass/fail fields. Pure, except that
`Report.run` writes the report after every part (a process killed later still leaves what it
measured) and stops starting parts once the time budget is spent.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "dslurm.selftest/1"
PARTS = ("nvml", "gemm", "trainer_eager", "checkpoint", "trainer_compiled")
"""In the order they run: NVML before this process allocates GPU memory (its free-memory check),
the checkpoint part on the eager trainer's state, the compiled trainer last (the slowest start)."""
GEMM_GOAL = 0.70
"""Issue 20: bf16 GEMM reaches at least 70% of the site's dense peak on an H100/H200."""
MFU_GOAL = 0.40
"""Issue 20: the trainer reaches at least 40% MFU with compile on a model that fills the GPU."""


def goal(value: float | None, target: float) -> dict[str, Any]:
    """One goal: pass is None when nothing was measured against a peak (CPU, a failed part)."""
    return {"goal": target, "value": value, "pass": None if value is None else value >= target}


def _result(parts: dict[str, Any], name: str, key: str) -> Any:
    return ((parts.get(name) or {}).get("result") or {}).get(key)


def judge(parts: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals from the parts' results."""
    return {"gemm_bf16_fraction_of_peak": goal(_result(parts, "gemm", "fraction_of_peak"), GEMM_GOAL),
            "trainer_mfu_compiled": goal(_result(parts, "trainer_compiled", "mfu"), MFU_GOAL)}


def failed(report: dict[str, Any]) -> list[str]:
    """What makes the report a failure: an error before any part, a part not ok, a goal missed."""
    out = [f"error: {report['error']}"] if report.get("error") else []
    out += [f"part {n}: {(report['parts'].get(n) or {}).get('status', 'not run')}"
           for n in PARTS if (report["parts"].get(n) or {}).get("status") != "ok"]
    out += [f"goal {n}: {g['value']:.3f} < {g['goal']}" for n, g in report["goals"].items() if g["pass"] is False]
    return out


def new_report(*, mode: str, chip: str, device: str, site: dict[str, Any], notes: list[str],
               env: dict[str, Any]) -> dict[str, Any]:
    return {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "mode": mode, "chip": chip,
            "device": device, "site": site, "notes": notes, "env": env,
            "parts": {n: {"status": "not run"} for n in PARTS}, "goals": judge({}), "wall_s": 0.0}


@dataclass(slots=True)
class Report:
    """The report being built by the in-job process; `path` is rewritten after each part."""

    data: dict[str, Any]
    path: Path | None
    budget_s: float
    clock: Callable[[], float] = time.perf_counter
    t0: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.t0 = self.clock()

    def run(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """Run part `name`; its result dict, or None when it raised or was skipped."""
        elapsed = self.clock() - self.t0
        part: dict[str, Any]
        if elapsed > self.budget_s:
            part = {"status": "skipped", "error": f"time budget of {self.budget_s:.0f} s spent "
                    f"({elapsed:.0f} s elapsed) before this part started", "wall_s": 0.0}
            result = None
        else:
            t = self.clock()
            try:
                result = fn()
                part = {"status": "ok", "error": None, "result": result}
            except Exception as exc:  # a failed part is a finding; the others still run
                result = None
                part = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:4000],
                        "traceback": traceback.format_exc()[-4000:]}
            part["wall_s"] = round(self.clock() - t, 3)
        part["chip"] = self.data["chip"]
        self.data["parts"][name] = part
        self.save()
        return result

    def save(self) -> None:
        self.data["goals"] = judge(self.data["parts"])
        self.data["wall_s"] = round(self.clock() - self.t0, 3)
        if self.path is not None:
            from dslurm.preflight.gate import write_report

            write_report(self.path, self.data)
