"""`dslurm ckpt ls|verify|gc RUN_DIR`: inspect and prune a run's checkpoints without torch."""

from __future__ import annotations

import argparse
import datetime as _dt
from pathlib import Path

from dslurm import checkpoint as ck
from dslurm.errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ckpt", help="list, verify and prune a run's checkpoint generations",
                       description="Checkpoints of one run directory (see docs/checkpoint.md).")
    acts = p.add_subparsers(dest="ckpt_action", metavar="ACTION", required=True)
    ls = acts.add_parser("ls", help="generations: step, time, size, verified, pointer")
    ls.add_argument("run_dir", type=Path)
    ls.add_argument("--full", action="store_true",
                    help="checksum every file (default: manifest and sizes only, which is instant)")
    v = acts.add_parser("verify", help="exit 0 only if the generation is sound; else name the bad file")
    v.add_argument("run_dir", type=Path)
    v.add_argument("--generation", "-g", help="name (or unique prefix); default: the pointer's target")
    g = acts.add_parser("gc", help="remove old and orphaned partial generations")
    g.add_argument("run_dir", type=Path)
    g.add_argument("--keep", type=int, default=2, help="last K committed generations to keep (>= 2)")
    g.add_argument("--keep-every", type=int, default=None, metavar="M", help="also keep every M-th step")
    g.add_argument("--dry-run", action="store_true", help="print what would be removed")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.run_dir.is_dir():
        raise UserError(f"{args.run_dir}: no such run directory (give the directory holding {ck.POINTER} "
                        f"and {ck.GENERATIONS}/)")
    return {"ls": _ls, "verify": _verify, "gc": _gc}[args.ckpt_action](args)


def _console():  # rich only when a person is going to read something
    from rich.console import Console
    return Console()


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)


def _ls(args: argparse.Namespace) -> int:
    from rich.table import Table
    try:
        ptr, note = ck.read_pointer(args.run_dir), ""
    except ck.CheckpointError as exc:
        ptr, note = None, f"[red]{exc}[/red]"
    table = Table(title=str(args.run_dir), caption=note or None)
    for col in ("generation", "step", "time (UTC)", "size", "verified", "pointer"):
        table.add_column(col, justify="right" if col in ("step", "size") else "left",
                         no_wrap=col in ("generation", "time (UTC)"))
    for g in ck.list_generations(args.run_dir):
        size = sum(p.stat().st_size for p in g.path.rglob("*") if p.is_file())
        when = _dt.datetime.strptime(g.name.split("-")[2], "%Y%m%dT%H%M%SZ")
        if not g.committed:
            status = "[yellow]partial[/yellow]"
        else:
            problems = ck.verify_generation(g.path, full=args.full)
            status = f"[red]BAD: {problems[0]}[/red]" if problems else (
                "[green]yes[/green]" if args.full else "[green]sizes[/green]")
        mark = f"◀ {ck.POINTER}" if ptr and ptr.generation == g.name else ""
        table.add_row(g.name, str(g.step), when.strftime("%Y-%m-%d %H:%M:%S"), _human(size), status, mark)
    if ptr and not (args.run_dir / ck.GENERATIONS / ptr.generation).is_dir():
        table.add_row(ptr.generation, str(ptr.step), "", "", "[red]missing[/red]", f"◀ {ck.POINTER}")
    _console().print(table)
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
