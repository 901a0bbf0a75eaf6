"""The run directory's one owner (dslurm/run.py): every file name there, the frozen config read
back, the blocklist. Pure: tmp files, no Slurm, no torch."""

from __future__ import annotations

import ast
from pathlib import Path

from dslurm import run as run_mod
from dslurm.config.resolve import load
from dslurm.endings import facts
from dslurm.observe import events as ev
from dslurm.observe.ledger import FILENAME, Ledger
from dslurm.preflight.in_job import report_path
from dslurm.run import FROZEN, RunDir, add_to_blocklist, read_blocklist
from dslurm.submission import freeze_and_render

ROOT = Path(__file__).resolve().parents[2]


def test_the_frozen_config_reads_back_as_the_resolved_job(tmp_path):
    run = RunDir(tmp_path / "run")
    assert not run.is_run() and run.frozen() is None
    r = load(ROOT / "site-configs/local.yaml", ROOT / "examples/jobs/tiny-2node.yaml",
             overrides=[f"checkpoint.run_dir={run.path}", "train.steps=7"])
    script = freeze_and_render(r)
    assert script == run.script and sorted(p.name for p in run.path.iterdir()) == sorted([*FROZEN, "logs"])
    assert run.is_run() and run.logs.is_dir()
    site, job = run.frozen() or (None, None)
    assert site == r.site and job is not None and job.train.steps == 7 and job.checkpoint.run_dir == str(run.path)
    back = run.resolved()
    assert (back.nnodes, back.procs_per_node, back.layout, back.time_s, back.policy, back.run_dir) == (
        r.nnodes, r.procs_per_node, r.layout, r.time_s, r.policy, r.run_dir)
    assert run.resolved(["train.steps=9"]).job.train.steps == 9


def test_the_names_other_links_use_are_the_run_dirs(tmp_path):
    run = RunDir(str(tmp_path))  # a str is taken too
    assert run.path == tmp_path
    Ledger(tmp_path).append(ev.Steps(step_time_s=1.0))
    assert run.ledger == tmp_path / FILENAME and run.ledger.is_file()
    assert run.starts == tmp_path / facts.STARTS
    assert run.burnin_report("12", 3) == report_path(tmp_path, "12", 3) == tmp_path / "preflight/burnin-12-r3.json"
    assert run.code_current == run.code / "CURRENT"


def test_the_blocklist_merges_sorted_and_atomically(tmp_path):
    run = RunDir(tmp_path / "new")
    assert run.read_blocklist() == []
    assert add_to_blocklist(run.path, ["node3", "node1"]) == ["node1", "node3"]  # creates the directory
    assert run.add_to_blocklist(["node2", "node1"]) == ["node1", "node2", "node3"]
    assert read_blocklist(run.path) == ["node1", "node2", "node3"]
    assert run.blocklist.read_text() == "node1\nnode2\nnode3\n"
    assert sorted(p.name for p in run.path.iterdir()) == ["blocklist.txt"]  # no temp file left


def _string_parts(tree: ast.AST) -> list[ast.Constant]:
    """Every string constant of a module (f-strings' literal parts too), docstrings aside: a docstring
    may name a file; code that builds a path or a message from the name must take it from dslurm/run.py."""
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs]


def test_every_run_file_name_is_spelled_in_dslurm_run_only():
    names = [v for k, v in vars(run_mod).items() if k.isupper() and isinstance(v, str) and "." in v]
    assert {"site.yaml", "job.yaml", "job.sbatch", "ledger.jsonl", "trackers.json"} <= set(names)
    spelled: dict[str, set[str]] = {n: set() for n in names}
    for f in sorted([*(ROOT / "dslurm").rglob("*.py"), *(ROOT / "train").rglob("*.py")]):
        for c in _string_parts(ast.parse(f.read_text(), str(f))):
            for n in names:
                if n in c.value:
                    spelled[n].add(str(f.relative_to(ROOT)))
    assert {n: sorted(m) for n, m in spelled.items() if m != {"dslurm/run.py"}} == {}
