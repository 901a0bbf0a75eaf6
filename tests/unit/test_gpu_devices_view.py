"""dslurm.launch.devices: the device files a process can open, each open's answer read as the
devices cgroup's (EPERM: denied) or as having reached the device (ENXIO: no driver behind it, as
for the local cluster's placeholders). The kernel's EPERM is not producible here without a cgroup:
that case is faked at os.open (the cluster test tests/cluster/test_gpu_devices.py has the real one)."""

from __future__ import annotations

import errno
import os

from dslurm.launch import devices as D
from dslurm.launch.warm import preload


def test_the_device_glob_expands_the_given_environment(tmp_path):
    for node in ("node1", "node2"):
        (tmp_path / node).mkdir()
        for i in range(2):
            (tmp_path / node / f"gpu{i}").write_text("")
    env = {D.DEVICES_ENV: f"{tmp_path}/$SLURMD_NODENAME/gpu*", "SLURMD_NODENAME": "node2"}
    assert D.device_files(env) == [f"{tmp_path}/node2/gpu0", f"{tmp_path}/node2/gpu1"]
    assert D.device_files({D.DEVICES_ENV: f"{tmp_path}/none*"}) == []


def test_each_open_is_read_as_the_cgroup_would_answer(tmp_path, monkeypatch):
    ok = tmp_path / "gpu0"
    ok.write_text("")
    assert D.can_open(str(ok)) == "reachable"
    assert D.can_open(str(tmp_path / "missing")) == "ENOENT"
    answers = {"nodriver": errno.ENXIO, "denied": errno.EPERM}
    real = os.open

    def fake_open(path, flags, *a):
        name = os.path.basename(path)
        if name in answers:
            raise OSError(answers[name], os.strerror(answers[name]))
        return real(path, flags, *a)

    monkeypatch.setattr(os, "open", fake_open)
    assert D.can_open("/x/nodriver") == "reachable" and D.can_open("/x/denied") == "denied"


def test_same_devices_compares_what_is_reachable_and_what_is_promised():
    a = {"reachable": ["/d/gpu0", "/d/gpu1"], "gpu_env": {"CUDA_VISIBLE_DEVICES": "0,1"}, "cgroup": "/a"}
    assert D.same_devices(a, {**a, "cgroup": "/b"})  # another cgroup holding the same devices
    assert not D.same_devices(a, {**a, "reachable": ["/d/gpu0"]})
    assert not D.same_devices(a, {**a, "gpu_env": {"CUDA_VISIBLE_DEVICES": "0"}})


def test_a_plain_module_entry_is_preloaded_as_itself():
    """`python -m dslurm.launch.probe` (a module, not a package): the pool imports it without running it."""
    assert preload("dslurm.launch.probe", base=()) == []
    import sys

    assert "dslurm.launch.probe" in sys.modules
