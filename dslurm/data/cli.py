"""`dslurm data`: make and inspect HDF5 token files.

    dslurm data synth OUT --tokens N --vocab V [--seed S] [--seq-len L]
    dslurm data tokenize IN OUT [--seq-len L]      (byte level, vocab 256)
    dslurm data info FILE

Light to import: numpy, h5py and the format module (`dslurm.data.tokenize`, torch-free) are
imported inside the commands.
"""

from __future__ import annotations

import argparse
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

    p = cmds.add_parser("tokenize", help="byte-level tokenization of a text file (vocab 256)")
    p.add_argument("input", metavar="IN", help="text (any bytes) file")
    p.add_argument("out", metavar="OUT", help="HDF5 file to write")
    p.add_argument("--seq-len", type=int, default=0, help="sequence length hint stored in the file")
    p.set_defaults(func=run)

    p = cmds.add_parser("info", help="print a token file's header")
    p.add_argument("file", metavar="FILE", help="HDF5 token file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Dispatch on the action; user mistakes raise UserError (exit 2)."""
    from dslurm.data import tokenize as tk

    if args.data_command == "synth":
        if args.tokens < 2:
            raise UserError(f"--tokens {args.tokens}: a corpus needs at least 2 tokens")
        if not 1 <= args.vocab <= 1 << 32:
            raise UserError(f"--vocab {args.vocab}: must be in 1..{1 << 32}")
        if args.seq_len < 0:
            raise UserError(f"--seq-len {args.seq_len}: must be >= 0 (0 = no hint)")
        path = tk.write_synthetic(args.out, args.tokens, args.vocab, args.seed, seq_len=args.seq_len)
    elif args.data_command == "tokenize":
        if args.seq_len < 0:
            raise UserError(f"--seq-len {args.seq_len}: must be >= 0 (0 = no hint)")
        path = tk.tokenize_text(args.input, args.out, seq_len=args.seq_len)
    else:
        path = args.file
    print(format_info(tk.read_info(path)))
    return 0


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
    if info.seq_len:
        lines.append(f"samples     {info.samples(info.seq_len):,} windows of {info.seq_len}+1 tokens")
    return "\n".join(lines)
