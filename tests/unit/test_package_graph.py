"""dslurm's packages depend one way (docs/architecture.md, "The package graph"): the import graph
between its packages and top-level modules, computed from the source with every import counted
(function-level ones too; only `if TYPE_CHECKING:` imports are left out), has no cycle; the ground
floor imports nothing above it; no module reaches into a command module for a helper; and the
doc shows the graph as it is. Pure: ast only, nothing imported."""

from __future__ import annotations

import ast

import package_graph as pg

FAKE = pg.PKG / "observe" / "made_up.py"  # never written: its source is passed in


def test_the_packages_have_no_cycle():
    es = pg.edges()
    assert pg.cycles(es) == [], "packages that import each other (move the shared piece down):\n" + pg.explain(es)


def test_the_ground_floor_imports_nothing_above_it():
    g = pg.graph()
    above = {v: sorted(g[v] - set(pg.GROUND)) for v in pg.GROUND}
    assert above == {v: [] for v in pg.GROUND}, pg.explain_edges([e for e in pg.edges() if e.src in pg.GROUND])


def test_no_module_imports_a_command_module():
    """`dslurm submit`'s module, `dslurm render`'s and each package's `cli` are commands: a helper in
    one of them belongs in a library module (cli/__init__.py, the command table, imports them by name)."""
    commands = {"dslurm.cli.submit", "dslurm.cli.render"} | {
        ".".join(pg._module_of(p)) for p in pg.PKG.glob("*/cli.py")}
    offenders = []
    for p in sorted(pg.PKG.rglob("*.py")):
        me = ".".join(pg._module_of(p))
        for imp in pg._imports(pg._parsed(p)):
            names = ([a.name for a in imp.names] if isinstance(imp, ast.Import)
                     else [imp.module or "", *(f"{imp.module}.{a.name}" for a in imp.names)])
            hit = [n for n in names if n in commands and n.rpartition(".")[0] != me.rpartition(".")[0]]
            offenders += [f"{p.relative_to(pg.ROOT)}:{imp.lineno} imports {n}" for n in hit]
    assert offenders == []


def test_docs_architecture_shows_the_graph_as_computed():
    shown = pg.doc_section(pg.DOC.read_text())
    assert shown is not None, f"{pg.DOC}: the generated package graph section is missing"
    assert shown == pg.render(pg.graph()), "stale: run `python tests/package_graph.py --write`"


# ------------------------------------------------------------- the detector on made-up files


def _edges(source: str) -> list[tuple[str, str]]:
    return [(e.src, e.dst) for e in pg.file_edges(FAKE, source)]


def test_every_import_counts_function_level_ones_too():
    src = ("import dslurm.slurm\nfrom dslurm.config import load_job\n"
           "def f():\n    from dslurm.requeue import decide\n    import dslurm.launch.warm as w\n")
    assert _edges(src) == [("observe", "slurm"), ("observe", "config"), ("observe", "requeue"),
                           ("observe", "launch")]


def test_type_checking_imports_are_left_out_but_their_else_is_not():
    src = ("from typing import TYPE_CHECKING\nimport typing\nif TYPE_CHECKING:\n    from dslurm.cli.submit import x\n"
           "if typing.TYPE_CHECKING:\n    import dslurm.api\nelse:\n    import dslurm.sweep\n")
    assert _edges(src) == [("observe", "sweep")]


def test_relative_and_package_imports_resolve_to_their_node():
    src = "from . import events\nfrom ..requeue import cancel\nfrom dslurm import faults, __version__\n"
    assert _edges(src) == [("observe", "observe"), ("observe", "requeue"), ("observe", "faults"),
                           ("observe", "dslurm")]


def test_a_cycle_is_found_and_named_with_its_lines():
    es = [pg.Edge("a", "b", "dslurm/a/x.py:3"), pg.Edge("b", "c", "dslurm/b/y.py:7"),
          pg.Edge("c", "a", "dslurm/c/z.py:9"), pg.Edge("c", "d", "dslurm/c/z.py:10")]
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert pg.components(g) == [["a", "b", "c"], ["d"]]
    assert ["a", "b", "c"] in pg.cycles(es)
    text = pg.explain_edges(es, {"a", "b", "c"})
    assert "a -> b   dslurm/a/x.py:3" in text and "c -> a   dslurm/c/z.py:9" in text and "-> d" not in text
