"""`model.init_from` through the real trainer (torchrun, gloo, CPU): a Hugging Face Llama directory
made here by `transformers` (random weights, sharded safetensors with an index) starts a fresh run.

- the trainer's first-step logits equal transformers' within 1e-5 under FSDP x TP 2x2 (4 processes)
  and under PP 2 (2 processes): every rank read only its own box of each tensor, q/k rows put back
  in the trainer's order;
- export -> init_from -> export is bit-identical (and the first export holds exactly transformers'
  tensors, so the round trip loses nothing either way);
- the peak resident memory each rank gained while loading stays below 1.5x the bytes of its own
  shard plus ALLOWANCE; the model (vocab 32768) is large enough that a rank reading the whole of it
  would not fit that bound;
- once a generation exists, resume wins: the ledger's init_from event says "resumed".

Each worker runs the real entry (`python -m train`) through a wrapper that, before the first
optimizer step, writes the logits of fixed tokens and saves a generation of step 0 (the weights
init_from gave), and measures the load's peak RSS (VmHWM reset through /proc/self/clear_refs).
Cost: 4 + 2 + 1 + 1 worker processes of 1-2 steps each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dslurm import checkpoint as ck
from dslurm.cli import main
from dslurm.observe import events
from train_helpers import run_train, write_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
TOL = 1e-5
VOCAB = 32768  # tiny preset otherwise: dim 64, 4 layers, 4 heads, 2 kv heads, seq 64
ALLOWANCE = 4 << 20  # bytes: what a load costs beyond the shard (Python objects, one read block)
SHARD = "2MB"  # transformers' and our exports' shard size: several files, one index

WORKER = r"""
import json, os, re, runpy, sys
import torch
import torch.distributed as dist
from dslurm.checkpoint import init_from
from train.loop import Trainer

OUT, RANK = sys.argv[1], int(os.environ.get("RANK", "0"))


def status(key):
    return int(re.search(key + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024


load = init_from.load


def measured(path, shape, parts):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS now: the peak of the load alone (the CPU build held the full model)
    before = status("VmRSS")
    got = load(path, shape, parts)
    rec = {"rank": RANK, "rss_before": before, "peak": status("VmHWM"), "shard_bytes": got.shard_bytes,
           "bytes_read": got.bytes_read}
    open(os.path.join(OUT, f"rss-{RANK}.json"), "w").write(json.dumps(rec))
    return got


init_from.load = measured


def logits(trainer):
    shape, b = trainer.resolved.shape, trainer.built
    tokens = torch.randint(0, shape.vocab_size, (2, shape.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        if b.schedule is None:
            out = b.parts[0](tokens)
        elif b.has_first_stage:  # pp 2, one stage per rank: hidden states from rank 0 to rank 1
            dist.send(b.parts[0](tokens).contiguous(), dst=1)
            return None
        else:
            h = torch.empty(2, shape.seq_len, shape.dim)
            dist.recv(h, src=0)
            out = b.parts[0](h)
    return out.full_tensor() if hasattr(out, "full_tensor") else out


step = Trainer.train_step


def first_step(self):
    if self.step == 0:
        out = logits(self)
        if out is not None and (RANK == 0 or self.built.schedule is not None):
            torch.save(out, os.path.join(OUT, "logits.pt"))
        self._save(blocking=True)  # a generation of step 0: the weights init_from gave
    return step(self)


Trainer.train_step = first_step
sys.argv = ["train", *sys.argv[2:]]
runpy.run_module("train", run_name="__main__", alter_sys=True)
"""


def make_hf_dir(out: Path) -> Path:
    """A random Llama of the job's shape saved by transformers itself, in shards with an index."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms away from 1 and q sharpened: a wrong row order or norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif "q_proj" in name:
                p.mul_(10)
    model.save_pretrained(out, max_shard_size=SHARD)
    assert (out / "model.safetensors.index.json").is_file()
    return out


def start(tmp: Path, name: str, nproc: int | None, init: Path, *sets: str, steps: int = 1,
          wrapped: bool = True) -> tuple[Path, Path]:
    """One start of the trainer with init_from; (its run dir, the wrapper's output dir)."""
    out = tmp / f"{name}-out"
    out.mkdir(exist_ok=True)
    wrapper = tmp / "worker.py"
    wrapper.write_text(WORKER)
    entry = (str(wrapper), str(out)) if wrapped else ("-m", "train")
    proc = run_train(nproc, write_job(tmp, name, steps=steps), f"model.vocab_size={VOCAB}",
                     f"model.init_from={init}", *sets, entry=entry, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp / name, out


def gen_at(run_dir: Path, step: int) -> str:
    (g,) = [g.name for g in ck.list_generations(run_dir) if g.step == step]
    return g


def export(run_dir: Path, generation: str, out: Path) -> Path:
    assert main(["ckpt", "export", str(run_dir), "-g", generation, "--format", "safetensors", "--hf-llama",
                 "--max-shard-size", SHARD, "-o", str(out)]) == 0
    return out


def tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name != "export.json"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("init_from")
    hf = make_hf_dir(tmp / "hf")
    fsdp_tp = start(tmp, "fsdp2xtp2", 4, hf, "parallel.tp=2")
    pp = start(tmp, "pp2", 2, hf, "parallel.pp=2", "parallel.microbatches=2")
    e1 = export(fsdp_tp[0], gen_at(fsdp_tp[0], 0), tmp / "e1")
    again = start(tmp, "again", None, e1)  # one process, from the export of the 2x2 run
    return {"tmp": tmp, "hf": hf, "fsdp2xtp2": fsdp_tp, "pp2": pp, "e1": e1, "again": again}


def hf_logits(hf: Path) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(hf, local_files_only=True, output_loading_info=True)
    assert not any(info.values()), info
    tokens = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model.eval()(tokens).logits


def test_first_step_logits_equal_transformers_under_fsdp_x_tp_and_pp(runs, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    want = hf_logits(runs["hf"])
    for name in ("fsdp2xtp2", "pp2"):
        got = torch.load(runs[name][1] / "logits.pt")
        delta = (got - want).abs().max().item()
        print(f"\n{name}: trainer vs transformers first-step logits max |delta| {delta:.1e} "
              f"(logits up to {want.abs().max().item():.1f})")
        assert delta < TOL
    (ev,) = events.of(events.read(runs["fsdp2xtp2"][0]), events.InitFrom)
    assert ev.action == "loaded" and ev.tensors == 4 * 9 + 3 and ev.path == str(runs["hf"])


def test_export_init_from_export_is_bit_identical(runs):
    e1 = runs["e1"]
    assert tensors(e1).keys() == tensors(runs["hf"]).keys()
    assert all(torch.equal(v, tensors(runs["hf"])[k]) for k, v in tensors(e1).items())  # transformers' own
    assert len(list(e1.glob("*.safetensors"))) > 1
    for name in ("pp2", "again"):
        run = runs[name][0]
        back = export(run, gen_at(run, 0), runs["tmp"] / f"{name}-export")
        assert files(back) == files(e1), name  # every shard, the index and config.json, byte for byte


def test_peak_rss_while_loading_stays_near_the_ranks_own_shard(runs):
    model_bytes = sum(v.numel() * v.element_size() for v in tensors(runs["hf"]).values())
    for name, nproc in (("fsdp2xtp2", 4), ("pp2", 2), ("again", 1)):
        for r in range(nproc):
            rec = json.loads((runs[name][1] / f"rss-{r}.json").read_text())
            grew, shard = rec["peak"] - rec["rss_before"], rec["shard_bytes"]
            bound = 1.5 * shard + ALLOWANCE
            print(f"\n{name} rank {r}: peak RSS grew {grew / 2**20:.2f} MiB while loading; own shard "
                  f"{shard / 2**20:.2f} MiB, read {rec['bytes_read'] / 2**20:.2f} MiB; bound {bound / 2**20:.2f} "
                  f"MiB; whole model {model_bytes / 2**20:.2f} MiB")
            assert rec["bytes_read"] == shard
            assert grew < bound
            if nproc == 4:
                assert bound < model_bytes  # the bound would catch a rank that read the whole model


def test_resume_wins_over_init_from_once_a_generation_exists(runs):
    run, _ = start(runs["tmp"], "again", None, runs["e1"], steps=2, wrapped=False)
    evs = list(events.of(events.read(run), events.InitFrom))
    assert [e.action for e in evs] == ["loaded", "resumed"]
    assert evs[1].generation == gen_at(run, 1) and evs[1].step == 1
    starts = list(events.of(events.read(run), events.TrainStart))
    assert starts[-1].step == 1 and starts[-1].generation == evs[1].generation


def test_a_directory_that_does_not_fit_the_job_exits_2_naming_each_field(runs):
    proc = run_train(None, write_job(runs["tmp"], "mismatch", steps=1), f"model.vocab_size={VOCAB}",
                     "model.n_layers=2", "model.ffn_dim=128", f"model.init_from={runs['hf']}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for part in ("model.n_layers: the job has 2, config.json has num_hidden_layers=4",
                 "model.ffn_dim: the job has 128, config.json has intermediate_size=192",
                 "set in the job's model: n_layers: 4, ffn_dim: 192"):
        assert part in proc.stderr, proc.stderr[-3000:]
    assert not ck.list_generations(runs["tmp"] / "mismatch")  # nothing trained, nothing saved
