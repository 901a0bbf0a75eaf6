"""`dslurm data tokenize INPUT... --tokenizer T --out DIR`: plan, skip what is done, run the rest.

Here (one shard after another in this process) or, with `--slurm --site S`, as one job array
of the shards still to do. Prints what it skipped, what it runs, and the manifest at the end.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dslurm.data import hf, shards, sources
from dslurm.errors import UserError


def _check_args(args: argparse.Namespace) -> None:
    if not args.out:
        raise UserError("data tokenize --tokenizer: give --out DIR (shards and manifest.json go there)")
    if args.seq_len < 0:
        raise UserError(f"--seq-len {args.seq_len}: must be >= 0 (0 = no hint)")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise UserError(f"--out {args.out}: is a file, not a folder. Fix: give a new folder (or one an earlier "
                        "`dslurm data tokenize` made): shards, manifest.json and plan.json go there")
    if args.slurm and not args.site:
        raise UserError("data tokenize --slurm: give --site FILE (partition, setup lines, python)")
    if not args.slurm and (args.site or args.wait):
        raise UserError("data tokenize: --site/--wait go with --slurm. Fix: add --slurm, or drop them")
    if args.concurrency < 0 or args.cpus_per_task < 1:
        raise UserError(f"--concurrency {args.concurrency} must be >= 0 and --cpus-per-task "
                        f"{args.cpus_per_task} >= 1")


def _instruct(args: argparse.Namespace, tokenizer: Path) -> dict[str, Any] | None:
    """The instruction options frozen into the plan: the chat template's text (or None) and the
    tokenizer_config.json specials it renders with (dslurm/data/instruct.py)."""
    if not args.instruct:
        if args.chat_template:
            raise UserError("data tokenize: --chat-template goes with --instruct. Fix: add --instruct")
        return None
    if args.seq_len <= 0:
        raise UserError("data tokenize --instruct: give --seq-len L, the model's seq_len: examples are packed "
                        "whole into its windows")
    from dslurm.data import instruct

    template, cfg = instruct.find_template(args.chat_template, tokenizer)
    specials = {k: instruct._special_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return {"template": template, "specials": specials}


def tokenize(args: argparse.Namespace) -> int:
    from dslurm.data.manifest import format_manifest, read_manifest

    _check_args(args)
    out = Path(args.out).resolve()
    inputs = sources.find_inputs(args.inputs)
    _, info = hf.load(args.tokenizer, bos=args.bos, eos=args.eos)
    opts = shards.Options(field=args.field, txt_docs=args.txt_docs, seq_len=args.seq_len,
                          instruct=_instruct(args, hf.tokenizer_file(args.tokenizer)))
    plan = shards.make_plan(inputs, info, args.shards, opts)
    shards.write_plan(out, plan)
    todo = shards.missing(out, plan)
    done = [i for i in range(len(plan["shards"])) if i not in todo]
    if done:
        print(f"{len(done)} of {len(plan['shards'])} shards already done, skipped: {_ids(done)}")
    shards.remove_temps(out, plan, todo)
    if todo and args.slurm:
        rc = _run_slurm(args, out, todo)
        if rc is not None:
            return rc
    elif todo:
        print(f"tokenizing shards {_ids(todo)} here")
        shards.run_local(out, todo)
    left = shards.missing(out, plan)
    if left:
        print(f"dslurm data tokenize: shards {_ids(left)} are not done (logs in {out}/logs). "
              f"Re-run the same command: it redoes only those", file=sys.stderr)
        return 1
    shards.finish(out, plan)
    print(format_manifest(read_manifest(out)))
    return 0


def _run_slurm(args: argparse.Namespace, out: Path, todo: list[int]) -> int | None:
    """Submit the array; None when waited for (the caller checks the shards), else 0."""
    from dslurm.config import load_site
    from dslurm.data.array import ArraySpec, submit_array

    site = load_site(args.site)
    spec = ArraySpec(out=out, tasks=todo, concurrency=args.concurrency,
                     time=args.time or site.slurm.default_time, cpus_per_task=args.cpus_per_task)
    print(f"submitting shards {_ids(todo)} as one job array ({out}/tokenize.sbatch)", flush=True)
    job_ids, _ = submit_array(site, spec, wait=args.wait)
    arrays = ", ".join(map(str, job_ids))
    if len(job_ids) > 1:
        print(f"split at MaxArraySize into {len(job_ids)} arrays ({arrays}), each after the one before")
    if not args.wait:
        print(f"submitted job array {arrays}; the last task writes {out}/manifest.json. "
              f"Check with: dslurm data info {out} (progress per task)")
        return 0
    print(f"job array {arrays} ended")
    return None


def _ids(ids: list[int]) -> str:
    return ",".join(map(str, ids))
