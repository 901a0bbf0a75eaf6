"""The one way dslurm talks to a login host: the `ssh` client, as the user runs it.

Thin on purpose: the user's ssh config (Host aliases, ProxyJump, ControlMaster) and agent do
the work. dslurm adds BatchMode (never a password prompt a script would hang on), a connect
timeout, and keep-alives. Every remote command is one bash script handed over as a single
quoted word (`bash -c SCRIPT`): the remote login shell, whatever it is, only unquotes it.
`script` builds those scripts (pure); `run` runs one and turns ssh's own failures (exit 255:
the host was not reached) and a missing remote dslurm (the script's own check, exit MISSING)
into errors with their fix. An exit 127 of anything else (a command the remote dslurm or a
setup line runs that is not there) is that command's, reported as such, not "dslurm missing".
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from dslurm.errors import UserError

OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=15", "-o", "ServerAliveInterval=15",
           "-o", "ServerAliveCountMax=4")
UNREACHABLE = 255  # ssh's own exit code: the connection or the authentication failed
NOT_FOUND = 127  # the shell's: some command does not exist (not necessarily dslurm)
MISSING = 96  # the script's check: the site's dslurm command is not there (a code neither dslurm nor the shell uses)


@dataclass(frozen=True, slots=True)
class Login:
    host: str
    """an ssh host alias (validated by dslurm.config: no leading '-')"""
    config: str | None = None
    """an ssh config file (ssh -F); None: ~/.ssh/config"""
    dslurm: tuple[str, ...] = ("dslurm",)
    """the words that run dslurm there"""
    setup: tuple[str, ...] = ()
    """the site's setup lines, run before dslurm (module load, venv activate)"""

    def argv(self, script_text: str) -> list[str]:
        cfg = ["-F", self.config] if self.config else []
        return ["ssh", *OPTIONS, *cfg, self.host, "bash -c " + shlex.quote(script_text)]


def quote_words(words: Sequence[str]) -> str:
    return " ".join(shlex.quote(w) for w in words)


# What body lines write to run dslurm there: the words of the site's command, kept in a bash
# array that `script` defines once. A textual substitution would also rewrite the word inside
# values the body already quoted (a run dir, a --set value, passthrough argv named DSLURM...).
DSLURM = '"${dslurm_cmd[@]}"'


def script(login: Login, body: Sequence[str]) -> str:
    """The site's setup lines, the command that runs dslurm (the bash array `dslurm_cmd`, used
    as `DSLURM` in body lines), a check that it is there, then `body` unchanged. Setup lines
    may fail on a login node (a module only compute nodes have): their messages reach stderr
    and the script goes on. Pure."""
    define = f"dslurm_cmd=({quote_words(login.dslurm)})"  # after setup: no setup line can change it
    check = f'command -v "${{dslurm_cmd[0]}}" >/dev/null 2>&1 || exit {MISSING}'
    return "\n".join([*login.setup, define, check, *body, ""])


def unreachable(login: Login, stderr: str) -> UserError:
    said = stderr.strip().splitlines()[-1] if stderr.strip() else "no message"
    how = f"ssh -F {login.config} {login.host} true" if login.config else f"ssh {login.host} true"
    return UserError(f"login host {login.host!r} (site field 'login') cannot be reached over ssh ({said}); "
                     f"nothing was done on the cluster. Fix: make `{how}` work from this shell without a "
                     "prompt (a Host entry in your ssh config or remote.ssh_config, your key in ssh-agent); "
                     "dslurm runs ssh with BatchMode=yes, so it never asks for a password")


def missing_dslurm(login: Login) -> UserError:
    return UserError(f"login host {login.host!r}: `{quote_words(login.dslurm)}` is not a command there (after the "
                     "site's setup lines); nothing was submitted. Fix: set remote.dslurm in the site to the "
                     "command that runs dslurm on the cluster (e.g. /path/to/venv/bin/dslurm), or make the "
                     "site's setup lines put it on PATH")


def run(login: Login, script_text: str, *, input: bytes | None = None, capture: bool = True,
        timeout: float | None = None) -> subprocess.CompletedProcess[bytes]:
    """Run one remote script. capture=False streams its output to ours (watch, status)."""
    try:
        res = subprocess.run(login.argv(script_text), input=input, timeout=timeout,
                             stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)
    except FileNotFoundError:
        raise UserError("`ssh` is not installed here. Fix: install the OpenSSH client") from None
    except subprocess.TimeoutExpired:
        raise UserError(f"login host {login.host!r}: no answer within {timeout:.0f} s. Fix: check the "
                        "connection, then run the command again") from None
    if res.returncode == UNREACHABLE:
        raise unreachable(login, (res.stderr or b"").decode(errors="replace"))
    if res.returncode == MISSING:
        raise missing_dslurm(login)
    return res
