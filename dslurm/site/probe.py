"""What one compute node really has, as one JSON line: run there by `dslurm site discover|check`.

    srun -N1 -n1 bash -c 'SETUP; python -m dslurm.site.probe [--scratch S --durable D --token T --role R]'

Facts: usable CPUs, memory, GPUs (NVML when pynvml and a driver are there, else the Slurm GPU
variables of this step), network interfaces with their IPv4 addresses and which are InfiniBand
or RoCE, candidate node-local scratch with free space and filesystem type, Python/torch/CUDA
versions. With --scratch/--durable (the site check) it also writes, reads or removes its
markers: scratch writable here, the durable path shared with another node. Standard library
only, except the optional torch and pynvml imports: a failing import is a fact, not a crash.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import platform
import socket
import struct
import sys
from pathlib import Path
from typing import Any

TAG = "DSLURM-SITE-PROBE "  # the line the submitter looks for in srun's or the job's output
SCRATCH_CANDIDATES = ("$TMPDIR", "/local/scratch", "/scratch/local", "/local", "/scratch", "/lscratch", "/tmp")
MARKER = ".dslurm-site-check-"
_SIOCGIFADDR = 0x8915


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def ipv4_of(name: str) -> str | None:
    """The interface's IPv4 address (the SIOCGIFADDR ioctl: no `ip` binary needed)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        return socket.inet_ntoa(raw[20:24])
    return None


def interfaces(sys_net: str = "/sys/class/net", sys_ib: str = "/sys/class/infiniband") -> list[dict[str, Any]]:
    """Every interface: name, IPv4, operstate, kind (loopback, infiniband = IPoIB, roce = an
    Ethernet port of an RDMA device, ethernet) and the RDMA device behind it (mlx5_0)."""
    rdma: dict[str, str] = {}  # netdev -> RDMA device, from /sys/class/infiniband/<dev>/device/net/<netdev>
    for dev in sorted(Path(sys_ib).glob("*")):
        for net in (dev / "device" / "net").glob("*"):
            rdma[net.name] = dev.name
    out = []
    for p in sorted(Path(sys_net).glob("*")):
        kind_code = _read(p / "type")
        name = p.name
        if name == "lo" or kind_code == "772":
            kind = "loopback"
        elif kind_code == "32":
            kind = "infiniband"
        elif name in rdma:
            kind = "roce"
        else:
            kind = "ethernet"
        out.append({"name": name, "ipv4": ipv4_of(name), "state": _read(p / "operstate") or "unknown",
                    "kind": kind, "rdma_device": rdma.get(name), "speed_mbps": _int(_read(p / "speed"))})
    return out


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def fs_type(path: str, mounts: str = "/proc/mounts") -> str:
    """Filesystem type of the mount holding `path` (the longest mount point that prefixes it)."""
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    for line in _read(mounts).splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, parts[2]
    return kind


def scratch_candidates() -> list[dict[str, Any]]:
    out, seen = [], set()
    for raw in SCRATCH_CANDIDATES:
        path = os.path.expandvars(raw)
        if "$" in path or path in seen or not os.path.isdir(path):
            continue
        seen.add(path)
        st = os.statvfs(path)
        out.append({"path": path, "from": raw, "free_gb": round(st.f_bavail * st.f_frsize / 1e9, 1),
                    "fs": fs_type(path), "writable": os.access(path, os.W_OK)})
    return out


def gpus() -> dict[str, Any]:
    """NVML's view when it answers; the Slurm step's GPU variables either way."""
    env = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS",
                                          "SLURM_STEP_GPUS")}
    visible = env["CUDA_VISIBLE_DEVICES"]
    out: dict[str, Any] = {"env": env, "visible": len([v for v in (visible or "").split(",") if v.strip()]),
                           "nvml": None}
    try:
        import pynvml as nv  # type: ignore[import-not-found, unused-ignore]

        nv.nvmlInit()
        try:
            devs = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
            names = [nv.nvmlDeviceGetName(h) for h in devs]
            out["nvml"] = {"count": len(devs),
                           "models": [n.decode() if isinstance(n, bytes) else str(n) for n in names],
                           "mem_gb": [round(nv.nvmlDeviceGetMemoryInfo(h).total / 2**30, 1) for h in devs],
                           "driver": str(nv.nvmlSystemGetDriverVersion())}
        finally:
            nv.nvmlShutdown()
    except Exception as exc:  # no pynvml, no driver, no GPU: NVML has nothing to say
        out["nvml_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return out


def software() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable}
    try:
        import dslurm

        out["dslurm"] = dslurm.__version__
    except Exception as exc:  # pragma: no cover - we are running inside dslurm
        out["dslurm_error"] = str(exc)
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda
        out["cuda_available"] = bool(torch.cuda.is_available())
    except Exception as exc:
        out["torch"] = None
        out["torch_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def expand(pattern: str, node: str) -> str:
    """%n is the node name (storage.scratch's one placeholder); ~ and $VARS as the shell would."""
    return os.path.expanduser(os.path.expandvars(pattern.replace("%n", node)))


def scratch_write(pattern: str, node: str, token: str, keep: bool) -> dict[str, Any]:
    """Create the scratch dir, write, fsync and read back a marker; keep it for the peer to look for."""
    path = expand(pattern, node)
    out: dict[str, Any] = {"path": path, "writable": False}
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        marker = Path(path) / f"{MARKER}{token}"
        with open(marker, "w") as f:
            f.write(node)
            f.flush()
            os.fsync(f.fileno())
        out["writable"] = marker.read_text() == node
        if not keep:
            marker.unlink()
        st = os.statvfs(path)
        out.update(free_gb=round(st.f_bavail * st.f_frsize / 1e9, 1), fs=fs_type(path))
    except OSError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def durable_write(path: str, node: str, token: str) -> dict[str, Any]:
    marker = Path(expand(path, node)) / f"{MARKER}{token}"
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(node)
        return {"path": str(marker.parent), "written": True, "fs": fs_type(str(marker.parent))}
    except OSError as exc:
        return {"path": str(marker.parent), "written": False, "error": f"{type(exc).__name__}: {exc}"}


def durable_read(path: str, node: str, token: str) -> dict[str, Any]:
    marker = Path(expand(path, node)) / f"{MARKER}{token}"
    seen = _read(marker)
    marker.unlink(missing_ok=True)
    return {"path": str(marker.parent), "seen_from": seen or None, "fs": fs_type(str(marker.parent))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m dslurm.site.probe", description=__doc__)
    ap.add_argument("--scratch", help="storage.scratch to test (%%n = this node)")
    ap.add_argument("--durable", help="storage.durable to test")
    ap.add_argument("--token", default="probe", help="names this check's markers")
    ap.add_argument("--role", choices=("write", "read", "cleanup"), default="write",
                    help="write markers (first node), read the peer's (second node), or remove them")
    args = ap.parse_args(argv)
    node = node_name()
    if args.role == "cleanup":
        if args.scratch:
            Path(expand(args.scratch, node), f"{MARKER}{args.token}").unlink(missing_ok=True)
        return 0
    record: dict[str, Any] = {
        "node": node, "role": args.role, "cpus": len(os.sched_getaffinity(0)), "cpus_online": os.cpu_count(),
        "mem_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "gpus": gpus(), "interfaces": interfaces(), "scratch_candidates": scratch_candidates(),
        "software": software(),
    }
    if args.scratch:
        if args.role == "write":
            record["scratch"] = scratch_write(args.scratch, node, args.token, keep="%n" not in args.scratch)
        else:  # the peer's marker must not be here: a scratch dir two nodes share is not node-local
            record["scratch"] = scratch_write(args.scratch, node, args.token + "-2", keep=False)
            record["scratch"]["peer_marker_seen"] = ("%n" not in args.scratch
                                                     and (Path(expand(args.scratch, node)) / f"{MARKER}{args.token}")
                                                     .exists())
    if args.durable:
        record["durable"] = (durable_write if args.role == "write" else durable_read)(args.durable, node, args.token)
    print(TAG + json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
