"""Exit codes that carry meaning between the trainer, the launcher and the batch script."""

OK = 0
USER_ERROR = 2  # a mistake in the input: retrying cannot help
REQUEUE = 75  # EX_TEMPFAIL: saved on a signal, run me again
NO_PROGRESS = 76  # the pointer did not advance across N starts: stop
BUDGET = 77  # the restart budget is spent: stop
PREFLIGHT_FAILED = 78  # burn-in found bad nodes: requeue without them
TERMINATED = 143  # SIGTERM (scancel, preemption): saved if there was time, do not requeue ourselves

NAMES = {OK: "completed", USER_ERROR: "user_error", REQUEUE: "requeue", NO_PROGRESS: "no_progress",
         BUDGET: "budget", PREFLIGHT_FAILED: "preflight_failed", TERMINATED: "terminated"}
