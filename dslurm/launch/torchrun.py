"""`python -m dslurm.launch.torchrun ARGS`: torchrun (`torch.distributed.run`), leaving through
`endings.worker_exit.leave` instead of the interpreter's finalization.

torchrun imports torch, and finalizing that took ~0.45 s here after its workers had ended
(a worker's failure -> the process gone: 0.59 s as `-m torch.distributed.run`, 0.14 s through
this module; bench/bench_launch_exit.py): on every job step's end, so on every in-allocation
recovery's path. What torchrun prints
is unchanged (its error summary; an exception it raised is printed as Python would)."""

from __future__ import annotations

import sys
import traceback


def main() -> None:
    from torch.distributed.run import main as torchrun  # in-job: this process is torch's launcher

    from dslurm.endings.worker_exit import leave

    try:
        torchrun()
        code = 0
    except SystemExit as exc:  # argparse's own errors, as `python -m` would exit with them
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # as Python's own exit on an unhandled SIGINT reads to a shell
        traceback.print_exc()
        code = 128 + 2
    except BaseException:  # ChildFailedError, a signal torchrun turned into an exception
        traceback.print_exc()
        code = 1
    leave(code)


if __name__ == "__main__":
    main()
