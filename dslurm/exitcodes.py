"""Exit codes that carry meaning between the trainer, the launcher and the batch script.

They are a summary for Slurm and the user; decisions read the recorded facts
(dslurm/endings/facts.py, dslurm/endings/__init__.py), because srun and torchrun fold endings together.
"""

OK = 0
USER_ERROR = 2  # a mistake in the input: retrying cannot help
SAVE_FAILED = 74  # EX_IOERR: a checkpoint save failed (disk full, non-finite state): not durable
REQUEUE = 75  # EX_TEMPFAIL: saved on a signal, run me again
NO_PROGRESS = 76  # the pointer did not advance across N starts: stop
BUDGET = 77  # the restart budget is spent: stop
PREFLIGHT_FAILED = 78  # burn-in found bad nodes: requeue without them
REFUSED = 79  # another job holds the run directory's lock: not started, not retried
HANG = 80  # the hang watchdog fired: no step progress within the bound (a crash: retried)
NONFINITE = 81  # the loss diverged (NaN/inf) and train.nonfinite said stop: not retried
OOM = 82  # requeue-me's stop after an out-of-memory ending: the same layout would fail again
TERMINATED = 143  # SIGTERM (scancel, preemption): saved if there was time, do not requeue ourselves

# The standalone burn-in (`python -m dslurm.preflight.run`, `dslurm burnin`); inside a training
# job the gate exits PREFLIGHT_FAILED instead.
BURNIN_BAD_NODES = 3  # at least one node failed; the report's verdict names them and why
BURNIN_UNLOCALIZED = 4  # a cluster-wide threshold failed but no single node was to blame
BURNIN_NO_REPORT = 5  # `dslurm burnin`: the runner crashed before writing its report

# `dslurm selftest --gpu`: the report is written either way; this says it holds a failure.
SELFTEST_FAILED = 6  # a part raised, did not run, or a goal of issue 20 was missed

NAMES = {OK: "completed", USER_ERROR: "user_error", SAVE_FAILED: "save_failed", REQUEUE: "requeue",
         NO_PROGRESS: "no_progress", BUDGET: "budget", PREFLIGHT_FAILED: "preflight_failed",
         REFUSED: "refused", HANG: "hang", NONFINITE: "nonfinite", OOM: "oom", TERMINATED: "terminated"}

# How a training process describes its own exit code in its report (dslurm/endings/facts.py).
KIND_OF_CODE = {OK: "completed", REQUEUE: "stop_saved", TERMINATED: "terminated_saved",
                USER_ERROR: "user_error", PREFLIGHT_FAILED: "burnin_rejected", SAVE_FAILED: "save_failed",
                REFUSED: "refused", HANG: "crash", NONFINITE: "diverged"}
