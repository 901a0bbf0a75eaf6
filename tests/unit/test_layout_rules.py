"""Package rules of the layout (docs/architecture.md): the torch-free toolkit never imports the
trainer, and no module in `dslurm` imports torch at module level outside the in-job parts."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# In-job modules: they run inside the training processes, where torch is already loaded.
IN_JOB = {"dslurm/checkpoint/dcp.py", "dslurm/checkpoint/io.py", "dslurm/checkpoint/rng.py",
          "dslurm/checkpoint/twotier.py", "dslurm/checkpoint/staging.py", "dslurm/runtime/state.py",
          "dslurm/checkpoint/per_rank.py", "dslurm/checkpoint/init_from.py", "dslurm/checkpoint/compat.py",
          "dslurm/checkpoint/core.py", "dslurm/checkpoint/generation.py", "dslurm/checkpoint/tier.py",
          "dslurm/checkpoint/durable_tier.py", "dslurm/checkpoint/fingerprint.py",
          "dslurm/checkpoint/local_restore.py", "dslurm/checkpoint/partner.py"}


def _top_imports(path: Path) -> set[str]:
    """Modules imported at module level (not inside functions)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_the_toolkit_never_imports_the_trainer():
    offenders = []
    for p in sorted((ROOT / "dslurm").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            offenders += [f"{p.relative_to(ROOT)}: {m}" for m in mods if m == "train" or m.startswith("train.")]
    assert offenders == []


def test_no_torch_at_module_level_in_the_toolkit():
    heavy = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "dslurm").rglob("*.py"))
             if str(p.relative_to(ROOT)) not in IN_JOB and "torch" in _top_imports(p)]
    assert heavy == []
