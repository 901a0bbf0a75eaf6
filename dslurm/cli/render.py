"""`dslurm render`: site + job -> sbatch script on stdout or in a file.

`dslurm render --examples --check|--write` keeps the scripts in sbatch/ equal to what
the generator produces for the shipped example jobs (the golden files).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dslurm.errors import UserError, check_output_file

if TYPE_CHECKING:
    from dslurm.config.resolve import Resolved

# The shipped examples: (site config, job spec) -> sbatch/<job>.<site>.sbatch
EXAMPLES = (
    ("site-configs/local.yaml", "examples/jobs/tiny-2node.yaml"),
    ("site-configs/local.yaml", "examples/jobs/tiny-spares.yaml"),
    ("site-configs/local.yaml", "examples/jobs/own-safe.yaml"),
    ("site-configs/local.yaml", "examples/jobs/own-plain.yaml"),
    ("site-configs/local.yaml", "examples/jobs/finetune-tiny.yaml"),
    ("site-configs/h100-ib.yaml", "examples/jobs/llama8b-h100.yaml"),
    ("site-configs/h100-ib.yaml", "examples/jobs/finetune-llama32-instruct.yaml"),  # run locally: tests/cluster
    ("site-configs/h100-ib.yaml", "examples/jobs/llama70b-h100.yaml"),
    ("site-configs/h100-ib.yaml", "examples/jobs/llama405b-h100.yaml"),
    ("site-configs/a100-eth.yaml", "examples/jobs/llama1b-a100-srun.yaml"),
    ("site-configs/h100-ib-pyxis.yaml", "examples/jobs/llama8b-h100.yaml"),  # containers: docs/containers.md
    ("site-configs/a100-apptainer.yaml", "examples/jobs/llama1b-a100-srun.yaml"),
)


def render_files(site_path: str, job_path: str, overrides: list[str] | None = None,
                 site_overrides: list[str] | None = None) -> str:
    return render_resolved(site_path, job_path, overrides, site_overrides)[1]


def render_resolved(site_path: str, job_path: str, overrides: list[str] | None = None,
                    site_overrides: list[str] | None = None) -> tuple[Resolved, str]:
    """(the resolved job, its script as `dslurm render` writes it)."""
    from dslurm.config.resolve import warnings
    from dslurm.observe.lead import load
    from dslurm.render import RenderRefs, render_sbatch

    r = load(site_path, job_path, overrides, site_overrides)
    for line in warnings(r):
        print(line, file=sys.stderr)
    refs = RenderRefs(site=site_path, job=job_path, overrides=tuple(overrides or ()),
                      site_overrides=tuple(site_overrides or ()))
    return r, render_sbatch(r, refs)


def golden_path(site_path: str, job_path: str, root: Path) -> Path:
    return root / "sbatch" / f"{Path(job_path).stem}.{Path(site_path).stem}.sbatch"


def examples(root: Path, write: bool) -> list[str]:
    """Render every shipped example; return the golden files that differ (or are missing).
    With write=True, rewrite them instead (the explicit refresh)."""
    stale = []
    cwd = os.getcwd()
    os.chdir(root)  # examples are rendered with repo-relative paths, as users run them
    try:
        for site_path, job_path in EXAMPLES:
            text = render_files(site_path, job_path)
            path = golden_path(site_path, job_path, root)
            if write:
                write_atomic(path, text)
            elif not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(root)))
    finally:
        os.chdir(cwd)
    return stale


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    from dslurm.durable import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text, mode)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("render", help="render a whole-node sbatch script from a site config and a job spec")
    p.add_argument("--site", help="site config YAML (site-configs/*.yaml)")
    p.add_argument("--job", help="job spec YAML")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a job field, e.g. --set train.steps=200 (repeatable)")
    p.add_argument("--site-set", dest="site_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a site field (repeatable)")
    p.add_argument("-o", "--output", help="write the script here instead of stdout")
    p.add_argument("--sweep", metavar="SWEEP.yaml", default=None,
                   help="render a sweep's job array script(s) (docs/sweeps.md); nothing is written but -o")
    p.add_argument("--examples", choices=("check", "write"),
                   help="check or rewrite the golden scripts in sbatch/ for the shipped examples")
    p.set_defaults(func=run, configure_logging=False)  # nothing on this path logs: skip `import logging`


def run(args: argparse.Namespace) -> int:
    if args.examples:
        root = Path(__file__).resolve().parents[2]  # the repository: dslurm/cli/render.py -> ../../..
        stale = examples(root, write=args.examples == "write")
        if stale:
            print("stale golden files (run `dslurm render --examples write`):\n  " + "\n  ".join(stale),
                  file=sys.stderr)
            return 1
        return 0
    if args.sweep:
        from dslurm.sweep.submit import run_render

        return run_render(args)
    if not args.site or not args.job:
        raise UserError("render needs --site FILE and --job FILE (or --examples check|write)")
    if args.output:
        check_output_file(Path(args.output), "-o")
    r, text = render_resolved(args.site, args.job, args.overrides, args.site_overrides)
    if args.output:
        write_atomic(Path(args.output), text, 0o755)
        logs = Path(r.site.slurm.log_dir)  # relative: to where sbatch runs, taken to be here
        logs.mkdir(parents=True, exist_ok=True)  # Slurm does not create it, and a job without it fails unseen
        print(f"wrote {args.output} (logs go to {logs}/; sbatch it from {os.getcwd()})", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
