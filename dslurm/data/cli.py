"""`dslurm data`: make and inspect HDF5 token files and sharded tokenizations.

    dslurm data synth OUT --tokens N --vocab V [--seed S] [--seq-len L]
    dslurm data tokenize IN OUT [--seq-len L]      (byte level, vocab 256)
    dslurm data tokenize INPUT... --tokenizer T --out DIR [--shards N] [--field F]
                         [--txt-docs blank|file] [--bos TOK] [--eos TOK]
                         [--instruct [--chat-template FILE] --seq-len L]
                         [--slurm --site S [--concurrency K] [--time T] [--wait]]
    dslurm data info FILE|MANIFEST|DIR

Light to import: numpy, h5py and the format module (`dslurm.data.tokenize`, torch-free) are
imported inside the commands.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from dslurm.errors import UserError

if TYPE_CHECKING:
    from dslurm.data import tokenize as tk


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `data` and its subcommands to the dslurm CLI."""
    parser = sub.add_parser("data", help="make and inspect HDF5 token files",
                            description="Make and inspect HDF5 token files for the trainer.")
    def usage(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=usage)
    cmds = parser.add_subparsers(dest="data_command", metavar="ACTION")

    p = cmds.add_parser("synth", help="write a deterministic, learnable synthetic corpus")
    p.add_argument("out", metavar="OUT", help="HDF5 file to write")
    p.add_argument("--tokens", type=int, required=True, help="number of tokens")
    p.add_argument("--vocab", type=int, required=True, help="vocabulary size")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.add_argument("--seq-len", type=int, default=0, help="sequence length hint stored in the file")
    p.set_defaults(func=run)

    p = cmds.add_parser("tokenize", help="tokenize text into token files (docs/data.md)",
                        description="With --tokenizer: INPUT... (.txt/.jsonl[.gz|.zst]/.json/.parquet files or "
                        "folders) into --out DIR: N shards + manifest.json, here or as a Slurm "
                        "job array (--slurm); a re-run redoes only missing or partial shards. "
                        "Without: the byte-level form IN OUT (vocab 256).")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="input files or folders")
    p.add_argument("--tokenizer", help="tokenizer.json, or a folder holding one (never downloaded)")
    p.add_argument("--out", help="output folder: shard-NNNNN.h5, manifest.json, plan.json, logs/")
    p.add_argument("--shards", type=int, default=1, help="shards = array tasks (default 1); each "
                   "holds a contiguous run of the inputs (large .jsonl/.parquet files cut at lines / row groups)")
    p.add_argument("--field", default="text", help="jsonl field / parquet column (default text)")
    p.add_argument("--txt-docs", choices=("blank", "file"), default="blank",
                   help=".txt documents: blank-line separated blocks (default) or one per file")
    p.add_argument("--bos", help="token put before every document (besides the post-processor's)")
    p.add_argument("--eos", help="token put after every document (besides the post-processor's)")
    p.add_argument("--seq-len", type=int, default=0, help="sequence length hint stored in the file (with "
                   "--instruct: the model's seq_len, which the examples are packed for)")
    p.add_argument("--instruct", action="store_true", help="instruction data: prompt/completion or messages "
                   "jsonl, with a loss mask on the completions (docs/data.md)")
    p.add_argument("--chat-template", metavar="FILE", help="with --instruct: a Jinja chat template (default: the "
                   "tokenizer folder's tokenizer_config.json chat_template)")
    p.add_argument("--slurm", action="store_true", help="run the shards as one Slurm job array")
    p.add_argument("--site", help="with --slurm: site config (partition, setup lines, python)")
    p.add_argument("--concurrency", type=int, default=0, help="with --slurm: at most K tasks at once "
                   "(%%K; default 0 = no limit)")
    p.add_argument("--time", help="with --slurm: time limit per task (default: the site's)")
    p.add_argument("--cpus-per-task", type=int, default=1, help="with --slurm: CPUs per task, and as "
                   "many encode threads")
    p.add_argument("--wait", action="store_true", help="with --slurm: wait for the array, then "
                   "check the shards and write the manifest")
    p.set_defaults(func=run)

    p = cmds.add_parser("info", help="print a token file's header, a manifest's summary, or a tokenization's "
                        "progress per task (a folder with plan.json and no manifest yet)")
    p.add_argument("file", metavar="FILE", help="HDF5 token file, manifest.json or its folder")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Dispatch on the action; user mistakes raise UserError (exit 2)."""
    from dslurm.data import tokenize as tk

    if args.data_command == "synth":
        if Path(args.out).is_dir():
            raise UserError(f"OUT {args.out}: is a folder. Fix: name the HDF5 file to write, e.g. "
                            f"{Path(args.out) / 'synth.h5'}")
        if args.tokens < 2:
            raise UserError(f"--tokens {args.tokens}: a corpus needs at least 2 tokens")
        if not 1 <= args.vocab <= 1 << 32:
            raise UserError(f"--vocab {args.vocab}: must be in 1..{1 << 32}")
        if args.seq_len < 0:
            raise UserError(f"--seq-len {args.seq_len}: must be >= 0 (0 = no hint)")
        path = tk.write_synthetic(args.out, args.tokens, args.vocab, args.seed, seq_len=args.seq_len)
    elif args.data_command == "tokenize" and args.tokenizer:
        from dslurm.data.tokenize_cmd import tokenize

        return tokenize(args)
    elif args.data_command == "tokenize":
        if len(args.inputs) != 2 or args.out:
            raise UserError("data tokenize: without --tokenizer it is the byte-level form IN OUT. "
                            "Fix: give --tokenizer tokenizer.json --out DIR for real tokenization")
        if args.seq_len < 0:
            raise UserError(f"--seq-len {args.seq_len}: must be >= 0 (0 = no hint)")
        path = tk.tokenize_text(args.inputs[0], args.inputs[1], seq_len=args.seq_len)
    else:
        path = args.file
        folder = Path(path)
        if folder.is_dir() and not (folder / "manifest.json").is_file() and (folder / "plan.json").is_file():
            print(_progress(Path(path)))  # a tokenization under way: per task, done / running / not started
            return 0
        if Path(path).is_dir() or str(path).endswith(".json"):
            from dslurm.data.manifest import format_manifest, read_manifest

            print(format_manifest(read_manifest(path)))
            return 0
    print(format_info(tk.read_info(path)))
    return 0


def _progress(out: Path) -> str:
    from dslurm.data import progress, shards

    plan = shards.read_plan(out)
    todo = set(shards.missing(out, plan))
    return progress.format_progress(out, plan, [i not in todo for i in range(len(plan["shards"]))])


def format_info(info: tk.TokenFileInfo) -> str:
    """Human-readable header of a `dslurm.data.tokenize.TokenFileInfo`."""
    lines = [
        f"file        {info.path}",
        f"tokens      {info.n_tokens:,} ({info.dtype}, {info.size_bytes / 1e6:.1f} MB on disk)",
        f"vocab_size  {info.vocab_size}",
        f"seq_len     {info.seq_len or 'no hint'}",
        f"source      {info.source}",
        f"created     {info.created}",
    ]
    if info.tokenizer_hash:
        lines.append(f"tokenizer   sha256 {info.tokenizer_hash[:16]}  bos_id {info.bos_id}  "
                     f"eos_id {info.eos_id}")
    if info.packed_seq_len:
        lines.append(f"instruct    examples packed for seq_len {info.packed_seq_len}, with loss_mask and doc_start")
    if info.seq_len:
        lines.append(f"samples     {info.samples(info.seq_len):,} windows of {info.seq_len}+1 tokens")
    return "\n".join(lines)
