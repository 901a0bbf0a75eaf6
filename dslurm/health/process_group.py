"""One process-group initialisation for every in-job entry point (trainer, burn-in, probe).

In-job only (imports torch when called). The device is chosen and set before the group
exists, because NCCL object collectives use the current device; a world of one started
without torchrun (no MASTER_ADDR) gets an in-memory store, so it needs no port.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from typing import Any

from dslurm.errors import UserError


def init_process_group(backend: str | None = None, *, require_cuda: bool = False, cpu_only: bool = False,
                       where: str = "", timeout_s: float | None = None, store_prefix: str | None = None) -> Any:
    """Initialise torch.distributed from torchrun's (or srun's) environment; return the device.
    `require_cuda`: the site has GPUs, so a missing CUDA device is a user error naming `where`;
    `cpu_only`: the site has none, so stay on the CPU even where CUDA exists; `timeout_s`: how
    long a collective may block (the trainer passes `dslurm.health.pg_timeout_s`, just above its
    hang watchdog's ceiling; None: torch's default, 10 min NCCL / 30 min gloo); `store_prefix`: keep
    this group's keys apart in torchrun's store, so a later group of the same processes (the
    script after the burn-in wrapper, dslurm/launch/gate.py) never meets them."""
    import datetime

    from dslurm import health

    health.enable_flight_recorder(os.environ)  # before any group: c10d reads it once (dslurm/runtime/flight.py)
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available() and not cpu_only:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    elif require_cuda:
        raise UserError(f"{where}: the site has GPUs but torch sees no CUDA device here. "
                        "Fix: run on a GPU node or use a CPU site")
    else:
        device = torch.device("cpu")
    if dist.is_initialized():
        # A library made it first (accelerate under HF's TrainingArguments, dslurm.integrations):
        # one group per process, so it is adopted as it is.
        return device
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
    await_store(os.environ)
    if store_prefix is not None:
        store, rank, world = next(dist.rendezvous("env://"))
        dist.init_process_group(backend, store=dist.PrefixStore(store_prefix, store), rank=rank,
                                world_size=world, timeout=timeout)
    elif world == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None, timeout=timeout)
    return device


def await_store(env: Mapping[str, str], timeout_s: float = 60.0, poll_s: float = 0.01) -> bool:
    """A worker that is not rank 0, whose store rank 0 hosts (a warm attempt's workers: no
    torchrun agent holds it), waits here until the store's port accepts. torch's client, started
    before rank 0 listened, backs off (a server 50 ms late: connected after 0.40 s, 0.085 s with
    this wait first; bench/bench_launch_exit.py), a third of a warm restart. A plain connection,
    closed at once, costs the store nothing. The name is resolved once and the polls back off to
    0.1 s (thousands of ranks poll one host).
    False: nothing to wait for, or `timeout_s` passed (init_process_group then says what is wrong)."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or env.get("RANK", "0") == "0":
        return False
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT", "")
    if not addr or not port.isdigit():
        return False
    deadline = time.monotonic() + timeout_s
    where: tuple[Any, ...] | None = None
    while time.monotonic() < deadline:
        try:
            if where is None:
                family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, int(port), type=socket.SOCK_STREAM)[0]
                where = (family, kind, proto, sockaddr)
            with socket.socket(*where[:3]) as sock:
                sock.settimeout(1.0)
                sock.connect(where[3])
                return True
        except OSError:
            time.sleep(poll_s)
            poll_s = min(poll_s * 1.5, 0.1)
    return False
