"""`dslurm site discover|check|nodes`: write a site config from what the cluster says, check one
on the cluster for real, and show the site's memory of its nodes (dslurm/site/nodes_cmd.py).
docs/site.md says what each does and how each row is decided."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from dslurm.errors import UserError
from dslurm.site import nodes_cmd

if TYPE_CHECKING:
    from dslurm.site.check import Row


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("site", help="discover a site config from the cluster; check one end to end",
                       description=__doc__)
    ssub = p.add_subparsers(dest="site_command", metavar="ACTION", required=True)
    d = ssub.add_parser("discover", help="read Slurm and probe one node; write a commented site YAML")
    d.add_argument("--partition", help="the partition to describe (default: Slurm's default partition)")
    d.add_argument("-o", "--output", help="write the site here (default: print it)")
    d.add_argument("--no-probe", action="store_true", help="do not srun the probe on a node: Slurm's answers only")
    c = ssub.add_parser("check", help="check a site config's promises on the cluster; exit 0 when all hold")
    c.add_argument("site", metavar="SITE", help="site config YAML")
    c.add_argument("--site-set", action="append", default=[], metavar="KEY=VALUE", help="override a site field")
    c.add_argument("--nodes", type=int, default=2, help="nodes of the whole-node job checked (default 2)")
    c.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for the check jobs (queue wait included); default 600")
    c.add_argument("--work-dir", help="where the check's scripts and logs go (default: under slurm.log_dir)")
    c.add_argument("--json", action="store_true", help="print the rows and the verdict as JSON")
    nodes_cmd.add_parser(ssub)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.site_command == "discover":
        from dslurm.site.discover import discover, validate_and_write

        text, notes = discover(args.partition, probe=not args.no_probe)
        validate_and_write(text, args.output)
        if not args.output:
            sys.stdout.write(text)
        for note in notes:
            print(f"dslurm site discover: note: {note}", file=sys.stderr)
        if args.output:
            print(f"wrote {args.output}; check it with: dslurm site check {args.output}", file=sys.stderr)
        return 0
    if args.site_command == "nodes":
        return nodes_cmd.run(args)
    from dslurm.config import load_site
    from dslurm.site.check import as_json, table, verdict
    from dslurm.site.jobs import run_check

    if args.nodes < 1:
        raise UserError(f"site check --nodes {args.nodes}: must be at least 1 (2 checks the durable path and "
                        "the all-reduce)")
    site = load_site(args.site, args.site_set)
    rows = run_check(site, args.site, args.nodes, args.timeout, args.work_dir)
    code = verdict(rows)
    if args.json:
        print(as_json(rows))
        return code
    print(table(rows))
    print("every promise holds" if code == 0 else "some promises do not hold: see the fixes above")
    _warm_note(rows, args.site)
    return code


def _warm_note(rows: list[Row], site_path: str) -> None:
    """Where the warm row went, and what `recovery.warm: auto` (the default) does with it."""
    from dslurm.site.check import P_WARM
    from dslurm.submission.warm_proof import record_path

    row = next((r for r in rows if r.promise == P_WARM), None)
    if row is None or row.status == "skip":
        return
    then = "start warm" if row.status == "ok" else "start cold"
    print(f"warm restart {'proven' if row.status == 'ok' else 'not proven'}: recorded in {record_path(site_path)}; "
          f"jobs on this site file with spares and recovery.warm: auto (the default) {then} after a failure")
