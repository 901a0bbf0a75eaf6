"""`dslurm ckpt ls|verify|gc RUN_DIR`: inspect and prune a run's checkpoints without torch;
`dslurm ckpt export`: take the weights out (imports torch when it runs)."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
from pathlib import Path
from typing import Any

from dslurm import checkpoint as ck
from dslurm.checkpoint import replay, unpickle
from dslurm.errors import UserError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("ckpt", help="list, verify, prune and export a run's checkpoint generations",
                       description="Checkpoints of one run directory (see docs/checkpoint.md).")
    acts = p.add_subparsers(dest="ckpt_action", metavar="ACTION", required=True)
    ls = acts.add_parser("ls", help="generations: step, size, check, pointer, name (with its UTC time)",
                         description="One line per generation, oldest first: STEP SIZE CHECK POINTER GENERATION. "
                         "No field holds a space, so the output is the same (without colour) in a pipe; "
                         "problems go to stderr. CHECK: sizes (manifest and sizes match), crc32 (--full: "
                         "every checksum matches), BAD, partial (no commit marker), rejected (a restore "
                         "refused it), missing (the pointer names a generation that is gone).")
    ls.add_argument("run_dir", type=Path)
    ls.add_argument("--full", action="store_true",
                    help="checksum every file (default: manifest and sizes only, which is instant)")
    ls.add_argument("--json", action="store_true", help="print the generations and the pointer as JSON")
    v = acts.add_parser("verify", help="exit 0 only if the generation is sound; else name the bad file")
    v.add_argument("run_dir", type=Path)
    v.add_argument("--generation", "-g", help="name (or unique prefix); default: the pointer's target")
    g = acts.add_parser("gc", help="remove old and orphaned partial generations")
    g.add_argument("run_dir", type=Path)
    g.add_argument("--keep", type=int, default=2, help="last K committed generations to keep (>= 2)")
    g.add_argument("--keep-every", type=int, default=None, metavar="M", help="also keep every M-th step")
    g.add_argument("--dry-run", action="store_true", help="print what would be removed")
    _register_export(acts)
    p.set_defaults(func=run)


def _register_export(acts: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from dslurm.checkpoint.export import DTYPES, FORMATS
    e = acts.add_parser("export", help="a generation's model weights as one file or size-sharded files",
                        description="Write the model weights of one verified generation (any layout it was "
                        "saved in) as plain torch or safetensors files, loadable without dslurm; optimizer "
                        "state is left out. See docs/checkpoint.md, 'Taking the weights out'.")
    e.add_argument("run_dir", type=Path)
    e.add_argument("--generation", "-g", help="name (or unique prefix); default: the pointer's target")
    e.add_argument("--format", choices=FORMATS, help="file format of the weights (required, except with --hf: "
                   "safetensors)")
    e.add_argument("--dtype", choices=list(DTYPES), help="cast floating tensors (default: as saved; with --hf "
                   "the dtype of the config.json the run started from, when it had one)")
    e.add_argument("--max-shard-size", metavar="SIZE",
                   help="split into files of at most SIZE (5GB, 500MB, 2GiB), with an index json; default: one file")
    e.add_argument("--hf", "--hf-llama", dest="hf", action="store_true",
                   help="the Hugging Face layout of the model's family (Llama, Mistral, Qwen2, Qwen3), with a "
                   "config.json that transformers' matching class loads; --hf-llama is the old name")
    e.add_argument("--key", default="model", help="the state entry holding the model (default: model)")
    e.add_argument("-o", "--output", type=Path, required=True,
                   help="new (or empty) directory to create; it appears only once complete")


def run(args: argparse.Namespace) -> int:
    if not args.run_dir.is_dir():
        raise UserError(f"{args.run_dir}: no such run directory (give the directory holding {ck.POINTER} "
                        f"and {ck.GENERATIONS}/)")
    return {"ls": _ls, "verify": _verify, "gc": _gc, "export": _export}[args.ckpt_action](args)


def _console() -> Any:  # rich only when a person is going to read something
    from dslurm.observe.table import console
    return console()


def _human(n: int) -> str:
    """A size without a space (4.4MB), so a piped listing splits on whitespace."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)


def ls_rows(run_dir: Path, full: bool) -> tuple[list[dict[str, Any]], dict[str, Any] | None, str | None]:
    """(one row per generation, oldest first, plus one for a pointer target that is gone;
    the pointer; why the pointer could not be read)."""
    try:
        ptr, ptr_error = ck.read_pointer(run_dir), None
    except ck.CheckpointError as exc:
        ptr, ptr_error = None, str(exc)
    rows = []
    for g in ck.list_generations(run_dir):
        stamp = g.name.split("-")[2]
        saved = _dt.datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").strftime("%Y-%m-%dT%H:%M:%SZ")
        problems: list[str] = []
        if (g.path / ck.REJECTED).exists():
            check = "rejected"
        elif not g.committed:
            check = "partial"
        else:
            problems = ck.verify_generation(g.path, full=full)
            check = "BAD" if problems else ("crc32" if full else "sizes")
        meta = _meta(g.path)
        rows.append({"generation": g.name, "step": g.step, "saved_utc": saved,
                     "bytes": sum(p.stat().st_size for p in g.path.rglob("*") if p.is_file()),
                     "check": check, "problems": problems, "pointer": bool(ptr and ptr.generation == g.name),
                     "last_step": meta.get("last_step"), "replay": meta.get("replay"),
                     "recorded": replay.describe(meta), "suspect": replay.suspect(meta)})
    if ptr and not (run_dir / ck.GENERATIONS / ptr.generation).is_dir():
        rows.append({"generation": ptr.generation, "step": ptr.step, "saved_utc": None, "bytes": None,
                     "check": "missing", "problems": [f"{run_dir / ck.POINTER} names it, but it is gone"],
                     "pointer": True})
    pointer = {"generation": ptr.generation, "step": ptr.step} if ptr else None
    return rows, pointer, ptr_error


def _meta(gen: Path) -> dict[str, Any]:
    """A generation's meta.json for its records ({} when unreadable: its check says why)."""
    try:
        meta = json.loads((gen / ck.META).read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


_COLOUR = {"sizes": "green", "crc32": "green", "BAD": "red", "missing": "red", "partial": "yellow",
           "rejected": "yellow"}


def format_ls(rows: list[dict[str, Any]], colour: bool = False) -> list[str]:
    """The listing as lines: STEP SIZE CHECK POINTER GENERATION, aligned, no field with a space.
    The generation name comes last and whole (it holds the step and the UTC save time); a row is
    about 75 characters, so it fits 80 columns."""
    head = ("STEP", "SIZE", "CHECK", "POINTER", "GENERATION")
    cells = [(str(r["step"]), "-" if r["bytes"] is None else _human(r["bytes"]), r["check"],
              ck.POINTER if r["pointer"] else "-", r["generation"]) for r in rows]
    w = [max(len(c[i]) for c in [head, *cells]) for i in range(4)]
    out = []
    for i, c in enumerate([head, *cells]):
        check = c[2].ljust(w[2])
        if colour and i and c[2] in _COLOUR:
            check = f"[{_COLOUR[c[2]]}]{check}[/{_COLOUR[c[2]]}]"
        out.append(f"{c[0].rjust(w[0])}  {c[1].rjust(w[1])}  {check}  {c[3].ljust(w[3])}  {c[4]}")
    return out


def _ls(args: argparse.Namespace) -> int:
    import sys

    rows, pointer, ptr_error = ls_rows(args.run_dir, args.full)
    if args.json:
        print(json.dumps({"run_dir": str(args.run_dir), "pointer": pointer, "pointer_error": ptr_error,
                          "generations": rows}, indent=2))
        return 0
    con = _console()
    for line in format_ls(rows, colour=con.is_terminal):
        if con.is_terminal:
            con.print(line, highlight=False, soft_wrap=True)
        else:
            print(line)
    # Problems apart, on stderr: stdout stays one row per generation.
    notes = [f"{r['generation']}: {r['check']}: {p}" for r in rows for p in r["problems"]]
    notes += [f"{r['generation']}: suspect: {r['suspect']}" for r in rows if r.get("suspect")]
    notes += [f"{args.run_dir / ck.POINTER}: {ptr_error}"] if ptr_error else []
    notes += [f"no generations in {ck.generations_dir(args.run_dir)}"] if not rows else []
    for note in notes:
        print(f"ckpt ls: {note}", file=sys.stderr)
    return 0


def _resolve(run_dir: Path, wanted: str | None) -> tuple[str, str | None]:
    """(generation name, manifest crc the pointer recorded, when it is the pointer's target)."""
    if wanted is None:
        ptr = ck.read_pointer(run_dir)  # garbage pointer: CheckpointError, exit 1 naming the file
        if ptr is None:
            raise ck.CheckpointError(f"{run_dir / ck.POINTER}: missing; nothing is committed here "
                                     "(name one with --generation to check it anyway)")
        return ptr.generation, ptr.manifest_crc32
    names = [g.name for g in ck.list_generations(run_dir)]
    hits = [n for n in names if n == wanted] or [n for n in names if n.startswith(wanted)]
    if len(hits) != 1:
        raise UserError(f"--generation {wanted!r}: {'ambiguous' if hits else 'no such generation'} "
                        f"in {run_dir / ck.GENERATIONS} (have: {', '.join(names) or 'none'})")
    return hits[0], None


def _verify(args: argparse.Namespace) -> int:
    name, crc = _resolve(args.run_dir, args.generation)
    unpickle.refuse_unsafe(ck.generations_dir(args.run_dir) / name / ".metadata")  # exit 2, the class named
    problems = ck.verify_generation(ck.generations_dir(args.run_dir) / name, full=True, pointer_crc=crc)
    con = _console()
    if problems:
        for p in problems:
            con.print(f"[red]BAD[/red] {p}", soft_wrap=True)
        return 1
    con.print(f"[green]OK[/green] {name}: every file matches {ck.MANIFEST}", soft_wrap=True)
    return 0


def _gc(args: argparse.Namespace) -> int:
    # The lock refuses while a job writes this run: its in-flight generation has no manifest yet
    # and would look exactly like an orphaned partial.
    with ck.RunDirLock(args.run_dir):
        doomed = ck.collect_garbage(args.run_dir, args.keep, args.keep_every, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    _console().print(f"{verb} {len(doomed)} generation(s)" + "".join(f"\n  {n}" for n in doomed))
    return 0


def _export(args: argparse.Namespace) -> int:
    from dslurm.checkpoint.export import export, parse_size
    limit = parse_size(args.max_shard_size) if args.max_shard_size is not None else None
    if args.format is None and not args.hf:
        raise UserError("ckpt export: --format is required (torch or safetensors; with --hf it defaults to "
                        "safetensors)")
    name, crc = _resolve(args.run_dir, args.generation)
    con = _console()
    res = export(ck.generations_dir(args.run_dir) / name, args.output, fmt=args.format or "safetensors",
                 dtype=args.dtype, max_shard_bytes=limit, hf=args.hf, key=args.key, pointer_crc=crc,
                 progress=lambda msg: con.print(f"ckpt export: {msg}", highlight=False, soft_wrap=True))
    con.print(f"[green]OK[/green] {res.generation} (step {res.step}): {res.tensors} tensors, "
              f"{_human(res.total_bytes)} in {len(res.files)} file(s) -> {res.out}", soft_wrap=True)
    return 0
