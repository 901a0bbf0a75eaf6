"""One array task of a sharded tokenization: `python -m dslurm.data.task OUT TASK [OFFSET]`.

Run by the script `dslurm.data.array` renders, with TASK = $SLURM_ARRAY_TASK_ID and OFFSET the
first shard of its array (arrays split at MaxArraySize): it tokenizes shard OFFSET + TASK. A
user mistake prints its message and exits 2, like the CLI.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from dslurm.data.shards import run_task
from dslurm.errors import UserError


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if len(argv) not in (2, 3):
        print("usage: python -m dslurm.data.task OUT_DIR TASK [OFFSET]", file=sys.stderr)
        return 2
    try:
        path = run_task(Path(argv[0]), int(argv[1]) + (int(argv[2]) if len(argv) == 3 else 0))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
