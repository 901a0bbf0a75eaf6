"""`dslurm site nodes --site S`: the site's memory of its nodes (dslurm/observe/nodes.py), per
node: its evidence and age, its recent weight, and a suggested action with the admin's command.
`--record RUN_DIR` feeds a run's ledger into the store by hand (requeue-me does it at the end of
every start of a submitted run)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from dslurm.errors import UserError
from dslurm.observe import nodes
from dslurm.run import LEDGER, RunDir


def add_parser(ssub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    n = ssub.add_parser("nodes", help="the evidence runs found against the site's nodes, with suggested actions")
    n.add_argument("--site", required=True, metavar="SITE", help="site config YAML (its storage.durable holds "
                                                                 "the store)")
    n.add_argument("--site-set", action="append", default=[], metavar="KEY=VALUE", help="override a site field")
    n.add_argument("--record", type=Path, metavar="RUN_DIR", help="first feed this run's ledger into the store")
    n.add_argument("--json", action="store_true", help="print the nodes as JSON")


def run(args: argparse.Namespace) -> int:
    from dslurm.config import load_site

    site = load_site(args.site, args.site_set)
    durable, policy = site.storage.durable, site.nodes
    if args.record is not None:
        if not RunDir(args.record).ledger.is_file():
            raise UserError(f"site nodes --record {args.record}: no {LEDGER} there; give a run directory")
        print(f"recorded {nodes.record_run(durable, args.record)} new piece(s) of evidence from {args.record}")
    store, now = nodes.read(durable), time.time()
    excluded = nodes.excluded(store, exclude_after=policy.exclude_after, half_life_h=policy.half_life_h,
                                    now=now)
    rows: list[dict[str, Any]] = []
    for node, items in sorted(store.items()):
        w = nodes.weight(items, now, policy.half_life_h)
        action, command = nodes.suggestion(node, items, w, policy.exclude_after)
        rows.append({"node": node, "weight": round(w, 1), "excluded": node in excluded, "action": action,
                     "command": command, "evidence": [
                         {"kind": x.kind, "age_s": round(now - x.t), "run": x.run, "what": x.what,
                          "numbers": x.numbers} for x in reversed(items)]})
    if args.json:
        print(json.dumps({"store": str(nodes.store_dir(durable)), "nodes": rows}, indent=1))
        return 0
    print(f"{nodes.store_dir(durable)}: {len(rows)} node(s) with evidence; new jobs leave out a node whose recent "
          f"evidence weighs >= {policy.exclude_after} (halved every {policy.half_life_h:g} h; "
          f"site.nodes){'' if policy.exclude_after else ' -- exclusion is off'}")
    for r in rows:
        print(f"\n{r['node']}  weight {r['weight']}{'  EXCLUDED from new jobs' if r['excluded'] else ''}")
        for e in r["evidence"][:8]:
            print(f"  {e['kind']:<9} {nodes.age(e['age_s']):>8} ago  {e['what']}  ({e['run']})")
        print(f"  action: {r['action']}")
        if r["command"]:
            print(f"  admin:  {r['command']}")
    return 0
