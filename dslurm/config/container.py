"""The site's container: which runtime the in-job parts (launcher, burn-in, trainer) run in.

Two families, because sites run one or the other:
- Apptainer/Singularity: the per-node launcher is wrapped, `apptainer exec --nv --bind .. IMAGE python ..`.
- Pyxis/enroot: a Slurm SPANK plugin; the flags go on the srun line (`--container-image=..`).

Both runtimes read comma-separated lists and `:`-separated bind specs, so a path holding ',' or ':'
cannot be passed through them at all: it is refused here, with the field, instead of failing on
the cluster. Rendering lives in dslurm/render/container.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from dslurm.config.schema import FieldError, field

APPTAINER_FAMILY = ("apptainer", "singularity")
# One path in a bind spec: no list (',') or spec (':') separator. Pyxis hands its mounts to enroot,
# whose mount entries are fstab lines, so there a blank ends the path too; apptainer takes it whole.
_APPTAINER_PATH = re.compile(r"[^,:\0\n\r]+")
_PYXIS_PATH = re.compile(r"[^\s,:\0]+")
_ALLOWED = {_APPTAINER_PATH: "without ',' or ':'",
            _PYXIS_PATH: "without ',', ':' or blanks (enroot reads mounts as fstab lines)"}


def bindable(runtime: str, path: str) -> str | None:
    """None if `path` can be bound by `runtime` as it is, else what it must be instead."""
    pattern = _PYXIS_PATH if runtime == "pyxis" else _APPTAINER_PATH
    return None if pattern.fullmatch(path) else _ALLOWED[pattern]
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_URI = re.compile(r"[a-z]+://")


@dataclass(kw_only=True, slots=True)
class ContainerSpec:
    runtime: Literal["apptainer", "singularity", "pyxis"] = field(
        help="apptainer or singularity (`exec` around the launcher) or pyxis (srun --container-* flags)")
    image: str = field(help="apptainer/singularity: absolute path of a .sif image (or sandbox directory); "
                       "pyxis: an enroot URI such as nvcr.io#nvidia/pytorch:24.05-py3, or an absolute "
                       ".sqsh path")
    binds: list[str] = field(factory=list, help="apptainer/singularity: extra binds SRC:DST[:ro|rw], absolute "
                             "paths (the submit dir, run dir, data dir and two-tier scratch are bound already)")
    nv: bool | None = field(None, help="apptainer/singularity: --nv, the host's NVIDIA driver and GPUs in the "
                            "container; default true (pyxis: enroot's NVIDIA hook does it)")
    env: dict[str, str] = field(factory=dict, help="apptainer/singularity: environment set only inside the "
                                "container (--env); the site and job env reach it anyway")
    mounts: list[str] = field(factory=list, help="pyxis: extra mounts SRC:DST[:FLAGS] (flags joined with +, "
                              "e.g. ro+rprivate); the submit dir, run dir, data dir and scratch are mounted already")
    workdir: str | None = field(None, help="pyxis: working directory in the container; default: the submit dir")

    def __post_init__(self) -> None:
        if self.runtime in APPTAINER_FAMILY:
            self._check_apptainer()
        else:
            self._check_pyxis()

    def _check_apptainer(self) -> None:
        rt = self.runtime
        if _URI.match(self.image):
            raise FieldError("image", f"{self.image!r} is a registry URI: {rt} would pull and convert it on "
                             "every node at every start",
                             f"pull it once (`{rt} pull /shared/images/NAME.sif {self.image}`) and give that path")
        if not self.image.startswith("/") or not _APPTAINER_PATH.fullmatch(self.image):
            raise FieldError("image", f"{self.image!r} must be an absolute path without ',' or ':' "
                             "(the job runs from the submit dir on every node; a relative path is a guess)",
                             "give the absolute path of the image on the shared filesystem, e.g. "
                             "/shared/images/pytorch.sif")
        for i, spec in enumerate(self.binds):
            _check_spec(f"binds.{i}", spec, _APPTAINER_PATH, _apptainer_opts, "e.g. /datasets:/datasets:ro")
        for key, value in self.env.items():
            if not _ENV_NAME.fullmatch(key):
                raise FieldError("env", f"{key!r} is not a valid environment variable name",
                                 "use letters, digits and '_', not starting with a digit")
            if "," in value:  # --env is a comma-separated list: the value would be cut in two
                raise FieldError("env", f"{key}={value!r}: {rt} --env splits on ','",
                                 "set it in the site's env instead (the container inherits the job's environment)")
        _only("pyxis", "pyxis", mounts=self.mounts, workdir=self.workdir)

    def _check_pyxis(self) -> None:
        if not self.image.strip() or any(c in self.image for c in " \t,\0\n"):
            raise FieldError("image", f"{self.image!r} must be one word without spaces or ','",
                             "give an enroot URI such as nvcr.io#nvidia/pytorch:24.05-py3 or an absolute .sqsh path")
        if self.image.endswith((".sqsh", ".squashfs")) and not self.image.startswith("/"):
            raise FieldError("image", f"{self.image!r} is a relative squashfs path: it is opened on every node, "
                             "from a directory you do not control",
                             "give its absolute path, e.g. /shared/images/pt.sqsh")
        for i, spec in enumerate(self.mounts):
            _check_spec(f"mounts.{i}", spec, _PYXIS_PATH, _pyxis_flags, "e.g. /datasets:/datasets:ro")
        if self.workdir is not None and (not self.workdir.startswith("/") or not _PYXIS_PATH.fullmatch(self.workdir)):
            raise FieldError("workdir", f"{self.workdir!r} must be an absolute path without spaces, ',' or ':'",
                             "give a directory inside the container, or remove it (the submit dir)")
        _only("apptainer or singularity", "apptainer", binds=self.binds, env=self.env, nv=self.nv is not None)


def _apptainer_opts(opts: str) -> bool:
    return opts in ("ro", "rw")


def _pyxis_flags(opts: str) -> bool:
    return all(re.fullmatch(r"[a-z]+", f) for f in opts.split("+"))


def _check_spec(name: str, spec: str, path_ok: re.Pattern[str], opts_ok: Callable[[str], bool],
                example: str) -> None:
    """`SRC:DST[:OPTS]`, both absolute: a bare SRC is refused because which path the job sees
    inside must be said, not left to the runtime's defaults."""
    parts = spec.split(":")
    if len(parts) not in (2, 3):
        raise FieldError(name, f"{spec!r} is not SRC:DST or SRC:DST:OPTIONS",
                         f"write the host path, ':', the path inside the container, {example}")
    for part in parts[:2]:
        if not part.startswith("/") or not path_ok.fullmatch(part):
            raise FieldError(name, f"{spec!r}: {part!r} must be an absolute path {_ALLOWED[path_ok]}",
                             f"write both paths absolute, {example}")
    if len(parts) == 3 and not opts_ok(parts[2]):
        raise FieldError(name, f"{spec!r}: options {parts[2]!r} are not understood",
                         "use ro or rw" if opts_ok is _apptainer_opts else "use flags joined with +, e.g. ro+rprivate")


def _only(runtimes: str, example: str, **fields: object) -> None:
    """Fields of the other runtime are refused, so that a setting never silently does nothing."""
    for name, value in fields.items():
        if value:
            raise FieldError(name, f"{name} is read by runtime {runtimes} only",
                             f"remove container.{name}, or set container.runtime: {example}")
