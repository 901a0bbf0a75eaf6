"""`verify_resume: replay` under torchrun: 2 processes, FSDP2 on a CPU gloo mesh, one launch.

The run saves at 2 and K with a probe loss (a forward of the saved state on the next step's
batch, all-reduced). Then, each on its own copy of the run directory, the same launch restores:

- untouched: the probe comes back bit-equal, the newest generation is used;
- a forged tensor in rank 0's shard with *everything* rewritten to agree (the shard's crc32 in the
  manifest, the tensor's crc32 in rank 0's fingerprint, the pointer): no checksum and no fingerprint
  can tell; without replay the forged state is restored as if sound; with replay the probe differs,
  `restore_rejected` names the copy, the previous generation is restored, no crash;
- the same forgery with a NaN (Megatron-LM #5281: a restore assembled from replicas gave a
  deterministic NaN): the probe is NaN, refused the same way;
- two tiers: rank 0's node-local copy forged the same way (its local record agreeing): every
  rank's local copy of that generation is withdrawn and the sound durable copy restored.

A reshard (the 2-rank save restored in one process, in the test itself) passes within the reshard
tolerance. This file is also the torchrun worker: `torchrun --nproc_per_node=2 THIS_FILE all RUN OUT`.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_checkpoint_dist import K, build  # noqa: E402

pytestmark = pytest.mark.integration


def as_dicts(ledger: Any) -> list[dict[str, Any]]:
    """A RecordingLedger's typed events as the ledger would write them (for the results file)."""
    return [{"event": ev.NAME, **{k: v for k, v in vars(ev).items() if not k.startswith("_")}}
            for ev in ledger.events]


def _batch(index: int, world: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(index)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    n = 8 // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def prober(model: nn.Module) -> Callable[[dict[str, Any]], float]:
    """The probe of dslurm.checkpoint.replay for this toy: the loss of the state held now on the
    batch the saved sampler position reads next, mean over the ranks; no gradients."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

    def probe(extra: dict[str, Any]) -> float:
        x, y = _batch(extra["sampler"]["index"], world, rank)
        with torch.no_grad():
            loss = nn.functional.mse_loss(model(x), y).reshape(1)
        if world > 1:
            dist.all_reduce(loss)
        return float(loss.item()) / world
    return probe


def forge(run: Path, step: int, how: str, local: bool = False) -> str:
    """Rewrite one tensor of rank 0's shard of the generation at `step` (+1e-3, or one NaN), and the
    tensor's crc32 in rank 0's fingerprint, the shard's and rank file's crc32s in the manifest and
    the pointer (`local`: in rank 0's local commit record) to agree. -> the tensor's key."""
    from dslurm import checkpoint as ck
    from dslurm.checkpoint import fingerprint, tiers
    gen = next(g.path for g in ck.list_generations(run) if g.step == step)
    md = pickle.loads((gen / ".metadata").read_bytes())
    key, info = next((k, v) for k, v in md.storage_data.items()
                     if v.relative_path == "__0_0.distcp" and k.fqn.endswith("weight") and v.length > 256)
    raw = bytearray((gen / info.relative_path).read_bytes())
    t = torch.load(io.BytesIO(bytes(raw[info.offset:info.offset + info.length])), weights_only=True)
    new = t + 1e-3
    if how == "nan":
        new = t.clone()
        new.view(-1)[0] = float("nan")
    buf = io.BytesIO()
    torch.save(new, buf)
    assert len(buf.getvalue()) == info.length
    raw[info.offset:info.offset + info.length] = buf.getvalue()
    (gen / info.relative_path).write_bytes(bytes(raw))
    rank_file = gen / ck.RANKS / "rank-00000.json"
    rec = json.loads(rank_file.read_text())
    tensors = rec[fingerprint.KEY]["tensors"]
    (fp_key,) = [k for k, v in tensors.items() if v[0] == fingerprint.tensor_crc(t) and v[1] == list(t.shape)]
    tensors[fp_key][0] = fingerprint.tensor_crc(new)
    rank_file.write_text(json.dumps(rec))
    commit = json.loads(tiers.record_path(gen, 0).read_text()) if local else ck.read_manifest(gen)
    for name in (info.relative_path, f"{ck.RANKS}/rank-00000.json"):
        body = (gen / name).read_bytes()
        commit["files"][name] = {"size": len(body), "crc32": f"{zlib.crc32(body):08x}"}
    if local:
        tiers.record_path(gen, 0).write_text(json.dumps(commit))
        return fp_key
    ck.write_manifest(gen, step, commit["files"])
    ck.write_pointer(run, gen.name, step)
    assert ck.verify_generation(gen) == []  # every checksum agrees
    return fp_key


def train_and_save(mgr: Any, model: nn.Module, opt: Any, sched: Any) -> dict[int, float]:
    """K steps, saves at 2 and K with the loss, grad norm and probe. -> step -> saved probe."""
    from dslurm.checkpoint.dcp import TrainState
    rank, world = dist.get_rank(), dist.get_world_size()
    extra: dict[str, Any] = {"sampler": {"index": 5}}
    probe, saved = prober(model), {}
    state = {"train": TrainState(model, opt, sched)}
    for step in range(1, K + 1):
        x, y = _batch(extra["sampler"]["index"], world, rank)
        extra["sampler"]["index"] += 3
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).full_tensor())
        opt.step()
        sched.step()
        opt.zero_grad()
        if step in (2, K):
            saved[step] = probe(extra)
            mgr.save(step, state, extra, blocking=True, loss=float(loss.item()), grad_norm=norm, probe=saved[step])
    return saved


def worker(run_dir: Path, out: Path) -> None:
    from dslurm.checkpoint.dcp import CheckpointManager, TrainState
    from testkit import RecordingLedger
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = {"dp_shard": world}
    saves = RecordingLedger()
    with CheckpointManager(run_dir, layout=layout, verify_resume="replay", ledger=saves) as mgr:
        saved = train_and_save(mgr, *build(world))
    results: dict[str, Any] = {"saved": saved, "save_events": as_dicts(saves)}
    for case, how, replay in (("good", None, True), ("forged_unchecked", "shift", False),
                              ("forged", "shift", True), ("nan", "nan", True)):
        run = run_dir.parent / case
        if rank == 0:
            shutil.copytree(run_dir, run)
            results[f"{case}_key"] = forge(run, K, how) if how else ""
        dist.barrier()
        model, opt, sched = build(world, seed=1)
        ledger, got = RecordingLedger(), {}
        with CheckpointManager(run, layout=layout, verify_resume="replay" if replay else "fingerprint",
                               ledger=ledger) as mgr:
            res = mgr.restore({"train": TrainState(model, opt, sched)}, got, probe=prober(model))
        assert res is not None
        results[case] = {"step": res.step, "fell_back": res.fell_back, "rejected": [n for n, _ in res.rejected],
                         "reason": res.reason, "phases": res.phases, "last_step": res.last_step,
                         "probe_now": prober(model)(got), "events": as_dicts(ledger)}
    # Two tiers: rank 0's node-local copy of K forged (its local record rewritten to agree); the
    # durable copy of K is sound.
    from dslurm.checkpoint import tiers
    os.environ["SLURMD_NODENAME"] = f"node{rank}"  # one "node" per rank: its own scratch
    run2, scratch = run_dir.parent / "two", run_dir.parent / "scratch"
    kw: dict[str, Any] = {"layout": layout, "scratch": str(scratch / "%n"), "verify_resume": "replay"}
    with CheckpointManager(run2, **kw) as mgr:
        results["two_saved"] = train_and_save(mgr, *build(world))
    if rank == 0:
        results["two_key"] = forge(tiers.local_run_dir(scratch / "node0", run2), K, "shift", local=True)
    dist.barrier()
    model, opt, sched = build(world, seed=1)
    ledger, got = RecordingLedger(), {}
    with CheckpointManager(run2, ledger=ledger, **kw) as mgr:
        res = mgr.restore({"train": TrainState(model, opt, sched)}, got, probe=prober(model))
    results["two"] = {"step": res.step, "tier": res.tier, "probe_now": prober(model)(got), "events": as_dicts(ledger)}
    if rank == 0:
        (out / "results.json").write_text(json.dumps(results, default=str))


def torchrun(run_dir: Path, out: Path) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           __file__, "all", str(run_dir), str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    base = tmp_path_factory.mktemp("replay")
    res = torchrun(base / "run", base / "out")
    assert res.returncode == 0 and (base / "out" / "results.json").is_file(), res.stderr[-4000:]
    return base / "run", json.loads((base / "out" / "results.json").read_text()), res.stderr


def _steps(run: Path) -> dict[int, str]:
    from dslurm import checkpoint as ck
    return {g.step: g.name for g in ck.list_generations(run)}


def test_a_good_restore_passes_replay_bit_equal(launched):
    run, r, _ = launched
    good = r["good"]
    assert good["step"] == K and not good["fell_back"] and good["rejected"] == []
    assert good["probe_now"] == r["saved"][str(K)]  # bit-equal: same ranks, same layout, same bytes
    assert good["phases"]["replay"] > 0
    (restore,) = [e for e in good["events"] if e["event"] == "ckpt_restore"]
    assert restore["replay_s"] > 0 and restore["suspect"] == ""
    assert set(restore["last_step"]) == {"loss", "grad_norm"} and restore["last_step"]["loss"] > 0
    ckpt_saves = [e for e in r["save_events"] if e["event"] == "ckpt_save"]
    assert [e["step"] for e in ckpt_saves] == [2, K]  # the ledger has each save's records too
    assert [e["probe_loss"] for e in ckpt_saves] == [r["saved"]["2"], r["saved"][str(K)]]
    assert ckpt_saves[-1]["last_step"] == restore["last_step"]


def test_a_forged_state_that_every_checksum_vouches_for_is_caught_by_replay(launched):
    run, r, stderr = launched
    unchecked = r["forged_unchecked"]  # fingerprint only: the forgery is restored as if sound
    assert unchecked["step"] == K and not unchecked["fell_back"]
    assert unchecked["probe_now"] != r["saved"][str(K)]
    forged = r["forged"]
    assert forged["step"] == 2 and forged["fell_back"] and forged["rejected"] == [_steps(run)[K]]
    assert forged["probe_now"] == r["saved"]["2"]  # the previous generation, itself checked
    (rej,) = [e for e in forged["events"] if e["event"] == "restore_rejected"]
    assert rej["copy"] == "durable" and rej["reason"].startswith("replay: probe loss")
    assert "bit-equal expected" in rej["reason"]
    assert "REJECTED" in stderr


def test_a_restore_that_gives_nan_is_caught_and_falls_back(launched):
    _, r, _ = launched
    nan = r["nan"]
    assert nan["step"] == 2 and nan["fell_back"]
    (rej,) = [e for e in nan["events"] if e["event"] == "restore_rejected"]
    assert "not finite" in rej["reason"] and "nan" in rej["reason"]
    assert [e["event"] for e in nan["events"]] == ["restore_rejected", "ckpt_fallback"]


def test_two_tiers_a_forged_local_copy_is_caught_by_replay_and_the_durable_copy_used(launched):
    """The local walk (dslurm/checkpoint/local_restore.py) refuses the assembled state: no one rank's
    copy can be blamed, so every rank's local copy of K is withdrawn and the sound durable K used."""
    _, r, _ = launched
    two = r["two"]
    assert (two["step"], two["tier"]) == (K, "durable")
    assert two["probe_now"] == r["two_saved"][str(K)]
    rejected = [e for e in two["events"] if e["event"] == "restore_rejected"]
    assert sorted((e["copy"], e["node"], e["ranks"][0]) for e in rejected) == [("local", "node0", 0),
                                                                               ("local", "node1", 1)]
    assert all(e["reason"].startswith("replay: probe loss") for e in rejected)


def test_a_reshard_passes_replay_within_its_tolerance(launched, tmp_path, caplog):
    """The 2-rank save restored in one process: not bit-equal by rule, within RESHARD_RTOL."""
    run, r, _ = launched
    from dslurm.checkpoint import replay
    from dslurm.checkpoint.dcp import CheckpointManager, TrainState
    model, opt, sched = build(1, seed=1)
    got: dict[str, Any] = {}
    with caplog.at_level("INFO"):
        with CheckpointManager(shutil.copytree(run, tmp_path / "run"), layout={"dp_shard": 1},
                               verify_resume="replay") as mgr:
            res = mgr.restore({"train": TrainState(model, opt, sched)}, got, probe=prober(model))
    assert res.step == K and not res.fell_back and "matches the saved one" in caplog.text
    now = prober(model)(got)
    assert abs(now - r["saved"][str(K)]) <= replay.RESHARD_RTOL * r["saved"][str(K)]


if __name__ == "__main__":
    import logging
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.path.insert(0, str(ROOT / "tests"))  # testkit
    dist.init_process_group("gloo")
    try:
        worker(Path(sys.argv[2]), Path(sys.argv[3]))
    finally:
        dist.destroy_process_group()
    from dslurm.endings.worker_exit import leave
    leave(0)  # not the interpreter's finalization: it can abort a finished gloo worker (see leave)
