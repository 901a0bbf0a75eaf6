"""Render a whole-node sbatch script from a resolved site + job. Pure: no I/O.

The script allocates whole nodes (`--exclusive`, `--mem=0`, one task per node),
forwards the time-limit/preemption signal from the batch shell to the job step, and
runs `dslurm launch` once per node (or once per process in srun mode). Every value
that lands in the script goes through `shlex.quote`.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field

from dslurm import __version__
from dslurm.config.resolve import Resolved, raw_run_dir
from dslurm.errors import UserError
from dslurm.render import container
from dslurm.run import STARTS


@dataclass(frozen=True, kw_only=True)
class RenderRefs:
    """How the script refers to the config (paths as the job will see them)."""

    site: str
    job: str
    overrides: tuple[str, ...] = ()
    site_overrides: tuple[str, ...] = ()
    log_dir: str | None = None  # default: the site's slurm.log_dir
    extra_env: dict[str, str] = field(default_factory=dict)
    code_dir: str | None = None  # a code snapshot (dslurm.remote.snapshot) every start runs; None: the submit dir
    frozen: bool = False  # site/job are copies frozen into the run directory (submit); False: `render`'s live files


def _one_line(value: object) -> str:
    text = str(value)
    if "\n" in text or "\r" in text or "\0" in text:
        raise UserError(f"value {text!r} contains a newline or NUL and cannot go into a shell script safely. "
                        "Fix: remove it")
    return text


def q(value: object) -> str:
    """One literal word for the script body. `shlex.quote`, except for a value holding `$` or a
    backtick: that goes in double quotes with backslash, `$`, backtick and `"` escaped (the same
    word once bash reads it), because shellcheck's SC2016 takes a single-quoted `$x` for a
    forgotten expansion and the rendered scripts are kept shellcheck-clean."""
    text = _one_line(value)
    if "$" not in text and "`" not in text:
        return shlex.quote(text)
    return '"' + re.sub(r'([\\$`"])', r"\\\1", text) + '"'


def words(argv: list[str]) -> str:
    """Command words for the script, each quoted; the submit-dir marker becomes "$PWD"."""
    return " ".join('"$PWD"'.join(q(p) if p else "" for p in w.split(container.PWD)) for w in argv)


def _directive_value(value: object) -> str:
    """#SBATCH lines are read by sbatch (not bash, not shellcheck): POSIX single quotes."""
    return shlex.quote(_one_line(value))


def tasks_per_node(r: Resolved) -> int:
    """srun tasks per node: one launcher per node (torchrun), or one per process (srun mode)."""
    return r.procs_per_node if r.job.launch == "srun" else 1


def cpus_per_task(r: Resolved) -> int:
    return max(1, r.site.node.cpus // tasks_per_node(r))


def gpu_request(r: Resolved) -> tuple[str, str] | None:
    """The site's GPU request for one node's GPUs as (flag, value), or None (no GPUs, or
    gpu_directive none): the job's #SBATCH line and every job step dslurm supervise starts (the
    training steps and the warm pools') ask for the same."""
    site = r.site
    if site.node.gpus and site.slurm.gpu_directive == "gpus-per-node":
        return ("gpus-per-node", str(site.node.gpus))
    if site.node.gpus and site.slurm.gpu_directive == "gres":
        return ("gres", f"{site.slurm.gres_name}:{site.node.gpus}")
    return None


def step_gpu_flags(r: Resolved) -> list[str]:
    """A job step's srun flags for its node's GPUs: the job's own request, explicitly. A step that
    names none gets the job's GRES by Slurm's default (seen with 22.05 here), but not where
    SLURM_STEP_GRES or a site's srun defaults say otherwise; and under ConstrainDevices the devices
    cgroup of the step is what its processes can open: a warm pool's forked workers live in the
    pool step's, so it must hold exactly the training step's GPUs (docs/recovery.md)."""
    req = gpu_request(r)
    return [] if req is None else [f"--{req[0]}={req[1]}"]


def supervised(r: Resolved) -> bool:
    """`dslurm supervise` runs the job steps (spares, or replica groups) instead of one srun."""
    return bool(r.spares) or r.job.recovery.replicas


def directives(r: Resolved, log_dir: str) -> list[tuple[str, str | None]]:
    """The #SBATCH flags, in a fixed order (deterministic output for golden files)."""
    site, job = r.site, r.job
    flags: list[tuple[str, str | None]] = [
        ("job-name", job.name),
        ("nodes", str(r.alloc_nodes)),  # the training nodes plus the spares
        ("ntasks-per-node", str(tasks_per_node(r))),
        ("exclusive", None),
    ]
    if supervised(r):
        # a failed node must not end the allocation: the spares take over, or the other replica groups train on
        flags.append(("no-kill", None))
    gpus = gpu_request(r)
    if gpus is not None:
        flags.append(gpus)
    flags += [
        ("cpus-per-task", str(cpus_per_task(r))),
        ("mem", "0"),
        ("time", r.time_str),
    ]
    for name in ("partition", "account", "qos", "constraint"):
        value = getattr(site.slurm, name)
        if value:
            flags.append((name, value))
    if r.policy.enabled:
        flags += [("signal", f"B:USR2@{r.policy.lead_s}"), ("requeue", None)]
    else:
        flags.append(("no-requeue", None))
    flags += [
        ("open-mode", "append"),
        ("output", f"{log_dir}/%x-%j.out"),
        ("error", f"{log_dir}/%x-%j.err"),
    ]
    if job.dependency:
        flags.append(("dependency", job.dependency))
    return flags


def _directive_lines(flags: list[tuple[str, str | None]]) -> list[str]:
    return [f"#SBATCH --{k}" if v is None else f"#SBATCH --{k}={_directive_value(v)}" for k, v in flags]


def job_env(r: Resolved, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every job exports: site env, job env, then dslurm's own. The
    rendered script and the submitit path (dslurm/api/job.py) both take it from here."""
    env = {**r.site.env, **r.job.env, **(extra or {})}
    env["DSLURM_RUN_DIR"] = str(r.run_dir)  # the requeue policy is read from the frozen config there
    return env


def _env_lines(r: Resolved, refs: RenderRefs) -> list[str]:
    lines = [f"export {k}={q(v)}" for k, v in job_env(r, refs.extra_env).items()]
    shell = None if refs.frozen else shell_path(raw_run_dir(r.site, r.job))
    return [f"export DSLURM_RUN_DIR={shell}" if shell and ln.startswith("export DSLURM_RUN_DIR=") else ln
            for ln in lines]


def shell_path(raw: str) -> str | None:
    """A run directory written with `~` as shell words that expand on the node, not on the machine
    that renders (a laptop's home is not the cluster's): `~/runs/x` -> "$HOME"'/runs/x' (the rest
    expanded as `resolve` does, then single-quoted). None without a leading `~` (`submit` renders
    where the job runs, and `resolve` expanded it already)."""
    if not (raw.startswith("~") and raw[1:2] in ("", "/")):
        return None
    return '"$HOME"' + (q(os.path.expandvars(raw[1:])) if raw[1:] else "")


def trainer_args(r: Resolved, refs: RenderRefs) -> list[str]:
    """`PYTHON -m ENTRY --site S --job J [--site-set ..] [--set ..]` as the job runs it; a script
    entry runs with its own arguments only (dslurm.runtime reads the frozen config through
    DSLURM_RUN_DIR), behind the burn-in wrapper when the job has one (dslurm/launch/gate.py)."""
    if not r.job.builtin_entry:
        gate = ["-m", "dslurm.launch.gate"] if r.job.preflight.enabled else []
        return [*r.site.python_argv, *gate, *r.job.entry_argv]
    args = [*r.site.python_argv, *r.job.entry_argv, "--site", refs.site, "--job", refs.job]
    for o in refs.site_overrides:
        args += ["--site-set", o]
    for o in refs.overrides:
        args += ["--set", o]
    return args


LAUNCHER_WRAP = """sh -c 'trap "" USR2; exec "$@"' dslurm-launch"""
"""The words before each node's launcher: it starts with USR2 ignored (a disposition exec keeps).
Slurm's warning forwarded to a launcher whose interpreter has not yet set its handler killed it
(exit 140: no facts, read as a crash that spent a restart; `dslurm selftest chaos` seed 4444).
Ignored instead, and not lost where it was recorded: the launcher takes the stops in its step's
batch.signals (the batch shell's trap and supervise write them before forwarding) once its
handlers are set (dslurm.launch `_Forwarder.take_recorded`)."""


def _live_note(refs: RenderRefs, log_dir: str) -> list[str]:
    """What a script from `dslurm render` (not `submit`) depends on, said where sbatch users read."""
    return [f"# Every start (a requeue too) reads {refs.site} and {refs.job} as they are then (a relative",
            "# path: from where sbatch runs); `dslurm submit` runs copies frozen into the run directory instead.",
            f"# Slurm writes the logs into {log_dir}/, which must exist there (`dslurm render -o` creates it)."]


def render_sbatch(r: Resolved, refs: RenderRefs) -> str:
    """The whole sbatch script as text."""
    log_dir = refs.log_dir or r.site.slurm.log_dir
    py = " ".join(q(w) for w in r.site.python_argv)  # `python3 -X dev`: one quoted word each
    launch_mode = r.job.launch
    preflight = ["--preflight", "--site", q(refs.site)] if r.job.preflight.enabled else []
    trainer = " ".join(q(a) for a in trainer_args(r, refs))
    prefix = container.launcher_prefix(r)  # apptainer/singularity exec IMAGE: the launcher runs inside
    launch = ((_one_per_line(prefix) + " \\\n  " if prefix else "") + LAUNCHER_WRAP + " "
              + f'{py} -m dslurm launch --mode {launch_mode} --nproc-per-node "$NPROC_PER_NODE" '
              + " ".join(preflight) + (" " if preflight else ""))
    lines = [
        "#!/bin/bash",
        f"# Generated by dslurm {__version__} from {r.site_path} and {r.job_path}. Do not edit: re-render.",
        *([] if refs.frozen else _live_note(refs, log_dir)),
        "# shellcheck disable=SC1090,SC1091  # site setup sources files that exist only on the cluster",
        *_directive_lines(directives(r, log_dir)),
        "",
        "# Site setup lines (module load, venv activate) often read unset variables: -u after them.",
        "set -eo pipefail",
        "",
        "# Computed once by dslurm; everything below uses these.",
        *([f"# {r.nnodes} training node(s) + {r.spares} spare(s): dslurm supervise picks each step's nodes."]
          if supervised(r) else [f"NNODES={r.nnodes}"]),
        f"NPROC_PER_NODE={r.procs_per_node}",
        *([] if supervised(r) else [f"CPUS_PER_TASK={cpus_per_task(r)}"]),
        "",
        "# Site setup (from the site config).",
        *(r.site.setup or [":"]),
        "set -u",
        "",
        "# Environment (site, then job).",
        *_env_lines(r, refs),
        "",
        *_code_lines(refs.code_dir),
        "# This start's facts (dslurm/endings/facts.py): how it ended is decided from them, not from rc.",
        f'export DSLURM_FACTS_DIR="$DSLURM_RUN_DIR/{STARTS}/${{SLURM_JOB_ID}}.${{SLURM_RESTART_COUNT:-0}}"',
        'mkdir -p "$DSLURM_FACTS_DIR" || true',
        "",
        "# Slurm signals only this batch shell (--signal=B:...). Record it, then forward it to the",
        "# job step, whose launcher forwards to the training processes; they save and exit.",
        "step_pid=''",
        "got_signal=0",
        "# shellcheck disable=SC2317,SC2329  # invoked by the traps below",
        "forward() {",
        '  got_signal=1',
        '  echo "$1 $EPOCHREALTIME" >> "$DSLURM_FACTS_DIR/batch.signals" 2>/dev/null || true',
        '  echo "dslurm: batch shell got SIG$1; forwarding to the job step" >&2',
        '  if [ -n "$step_pid" ]; then kill -s "$1" "$step_pid" 2>/dev/null || true; fi',
        "}",
        "trap 'forward USR2' USR2",
        "trap 'forward TERM' TERM",
        "",
        *_container_note(r),
        *_lighthouse(r, py),
        *(_supervised_step(py, launch, trainer, replicas=r.job.recovery.replicas) if supervised(r)
          else _plain_step(py, launch_mode, launch, trainer, container.srun_container_flags(r))),
        "",
    ]
    return "\n".join(lines)


def _code_lines(code_dir: str | None) -> list[str]:
    """Run the snapshot taken at submit, on this start and every requeued one: a requeue re-runs
    this script, so it must not pick up an edit made to the working copy since (docs/remote.md)."""
    if code_dir is None:
        return []
    return [
        "# The code snapshot taken at submit: relative paths, `python -m` and imports resolve there first.",
        f"cd {q(code_dir)}",
        f'export PYTHONPATH={q(code_dir)}"${{PYTHONPATH:+:$PYTHONPATH}}"',
        "",
    ]


_WAIT = [
    'step_pid=$!',
    "# `wait` returns early when a trapped signal arrives; keep waiting for the step.",
    "while :; do",
    "  got_signal=0",
    '  set +e; wait "$step_pid"; rc=$?; set -e',
    '  if [ "$got_signal" -eq 0 ] || [ "$rc" -le 128 ]; then break; fi',
    "done",
]


def _one_per_line(prefix: list[str]) -> str:
    """`apptainer exec ...`: each --bind/--env and the image on a line of its own, for a reader."""
    out = words(prefix[:1])
    for i, w in enumerate(prefix[1:], 1):
        out += (" \\\n    " if w in ("--bind", "--env") or i == len(prefix) - 1 else " ") + words([w])
    return out


def _container_note(r: Resolved) -> list[str]:
    """Why the container wraps the launcher and not this shell (dslurm/render/container.py)."""
    c = r.site.container
    if c is None:
        return []
    how = "srun's --container-* flags start" if c.runtime == "pyxis" else f"`{c.runtime} exec` wraps"
    end = "supervise" if supervised(r) else "requeue-me"
    return [
        f"# Container: {how} the launcher in the image on every node, and with it",
        "# the burn-in and the training processes (all that needs torch). This shell, its setup and",
        f"# {end} stay outside: they call scontrol/sacct/srun, which need the host's Slurm and munge.",
    ]


def _plain_step(py: str, launch_mode: str, launch: str, trainer: str, srun_container: list[str]) -> list[str]:
    """One job step on every node; then requeue-me decides what comes next. `srun_container`:
    pyxis's flags, on this srun only (the batch shell itself stays outside the container)."""
    srun_tasks = '"$NPROC_PER_NODE"' if launch_mode == "srun" else "1"
    return [
        'echo "dslurm: job ${SLURM_JOB_ID} start ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST}" >&2',
        f'srun --kill-on-bad-exit=1 --nodes="$NNODES" --ntasks-per-node={srun_tasks} \\',
        '  --cpus-per-task="$CPUS_PER_TASK" \\',
        *[f"  {words([flag])} \\" for flag in srun_container],
        f"  {launch}\\",
        f"  -- {trainer} &",
        *_WAIT,
        "",
        "# Requeue, stop or finish: dslurm classifies the ending from the recorded facts, then",
        "# decides from the class, the restart budget, the ledger and the checkpoint pointer",
        "# (dslurm/endings/__init__.py, dslurm/requeue/__init__.py), and names the reason.",
        "set +e",
        f'{py} -m dslurm requeue-me --rc "$rc"',
        'exit $?',
    ]


def _lighthouse(r: Resolved, py: str) -> list[str]:
    """recovery.replicas: torchft's Lighthouse beside this shell, on the job's first node, for as
    long as the script runs (dslurm/recover/lighthouse.py); USR2 is this shell's to forward, not its."""
    if not r.job.recovery.replicas:
        return []
    return [
        f"# Replica groups: torchft's Lighthouse (the quorum of the {r.job.parallel.dp_replicate} groups) runs here",
        "# until supervise returns; supervise gives every group its address.",
        f"( trap '' USR2; exec {py} -m dslurm.recover.lighthouse "
        f"--heartbeat-timeout-s {q(r.job.recovery.replica_timeout_s)} ) &",
        "lighthouse_pid=$!",
        "",
    ]


def _supervised_step(py: str, launch: str, trainer: str, *, replicas: bool = False) -> list[str]:
    """Spares: `dslurm supervise` runs the job steps on the training nodes and recovers inside
    the allocation (dslurm/recover/supervise.py); it decides the end itself, as requeue-me would.
    Replica groups: one step per group, a lost group's step started again (dslurm/recover/replicas.py)."""
    stop = ['kill "$lighthouse_pid" 2>/dev/null || true'] if replicas else []
    what = "replica groups" if replicas else "spares"
    return [
        'echo "dslurm: job ${SLURM_JOB_ID} start ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST}'
        f' (with {what}; recovery inside the allocation)" >&2',
        "# USR2 ignored across exec until supervise installs its handler (a USR2 before that would kill",
        "# it and end the job); it reads what came meanwhile from batch.signals, recorded above.",
        f"( trap '' USR2; exec {py} -m dslurm supervise -- {launch}\\",
        f"  -- {trainer} ) &",
        *_WAIT,
        "",
        "# supervise classified every step's ending from the facts, recovered what it could inside the",
        "# allocation, and took the last decision (requeue, stop or end) like requeue-me: its code is ours.",
        *stop,
        'exit "$rc"',
    ]
