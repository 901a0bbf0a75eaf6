"""Every file a doc names exists (issue 54: four docs named files that had gone). Pure: the
README and docs/*.md are read, and each repository path or `dslurm.` dotted name they give in
backticks is looked up in the checkout. Milliseconds."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
TOP = ("dslurm/", "train/", "tests/", "docs/", "bench/", "scripts/", "examples/", "site-configs/", "sbatch/")
# Backticked names under those folders that are not files: tracker series and tags
# (docs/trackers.md), and what `dslurm site check` writes beside a site file (docs/site.md).
NOT_FILES = {"train/loss", "train/grad_norm", "train/lr", "dslurm/events", "dslurm/event",
             "site-configs/h100-ib.warm-check.json"}
TICKED = re.compile(r"`([^`\n]+)`")
PLACEHOLDER = re.compile(r"[*{}<>$\[\]|]|/[A-Z]+(?:\b|$)")  # globs, templates, bench/NAME
DOTTED = re.compile(r"(?<![\w./])dslurm(?:\.[A-Za-z_]\w*)+(?![\w*/.<{])")  # not a schema, glob, template


def ticked(text: str) -> list[tuple[int, str]]:
    """(line number, backticked text) of a markdown file."""
    return [(n, m.group(1)) for n, line in enumerate(text.splitlines(), 1) for m in TICKED.finditer(line)]


def repo_paths(code: str) -> list[str]:
    """The repository paths in one backticked text: tokens under a top folder, `:line` and
    `(name)` cut off; placeholders skipped."""
    out = []
    for tok in code.split():
        tok = re.split(r"[:(]", tok.strip("(),;:'\""))[0].rstrip(".,")
        if tok.startswith(TOP) and not PLACEHOLDER.search(tok) and tok not in NOT_FILES:
            out.append(tok)
    return out


def path_exists(tok: str) -> bool:
    """A file or folder, or a module written as a path (`train/__main__`)."""
    return (ROOT / tok).exists() or (ROOT / f"{tok}.py").is_file()


@cache
def top_names(module_file: Path) -> frozenset[str]:
    """Names a module defines or imports at its top level (functions, classes, assignments)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(module_file.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return frozenset(names)


def dotted_resolves(name: str) -> bool:
    """`dslurm.a.b[.attr[.member]]`: the longest prefix that is a module, then a name defined in
    it (a class's member is not looked into)."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:k])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            rest = parts[k:]
            return not rest or (len(rest) <= 2 and rest[0] in top_names(module))
    return False


def test_every_repository_path_a_doc_names_exists():
    missing = [f"{doc.relative_to(ROOT)}:{n}: `{tok}`" for doc in DOCS for n, code in ticked(doc.read_text())
               for tok in repo_paths(code) if not path_exists(tok)]
    assert not missing, "docs name files that do not exist:\n" + "\n".join(missing)


def test_every_dslurm_name_a_doc_gives_resolves():
    wrong = [f"{doc.relative_to(ROOT)}:{n}: `{name}`" for doc in DOCS for n, code in ticked(doc.read_text())
             for name in DOTTED.findall(code) if not dotted_resolves(name)]
    assert not wrong, "docs name modules or functions that do not exist:\n" + "\n".join(wrong)


def test_no_doc_gives_a_path_of_one_machine():
    """A command in a doc runs from the checkout (`.venv/bin/python`), not from someone's disk."""
    local = re.compile(r"(?<![\w.])/(?:work|home/\w+|root)/")
    found = [f"{doc.relative_to(ROOT)}:{n}" for doc in DOCS for n, line in enumerate(doc.read_text().splitlines(), 1)
             if local.search(line)]
    assert not found, found


def test_the_checks_catch_what_they_are_for():
    """The scanners find a missing path and a missing function (a check that cannot fail is
    what issue 54 removed)."""
    assert repo_paths("see dslurm/checkpoint/hf_llama.py:12 and bench/NAME") == ["dslurm/checkpoint/hf_llama.py"]
    assert not path_exists("dslurm/checkpoint/hf_llama.py") and path_exists("train/__main__")
    assert dotted_resolves("dslurm.runtime.checkpoint.manager_for") and dotted_resolves("dslurm.preflight")
    assert not dotted_resolves("dslurm.runtime.manager_for") and not dotted_resolves("dslurm.nowhere.x")
    assert DOTTED.findall('schema: "dslurm.burnin/1", dslurm.preflight.EXIT_*, dslurm.event.s<start>') == []
