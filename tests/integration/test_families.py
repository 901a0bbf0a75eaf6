"""The model families (dslurm/config/families.py) against transformers itself, in one torchrun of 4
processes (gloo, CPU) shared by every family: a tiny random model of each, saved by transformers
(sharded safetensors + index), is read by `model.init_from`'s loader into the parallelised parts
of two layouts, FSDP2 x TP (2x2) and PP x TP (2x2), whose first-step logits must equal
transformers' within 1e-5 (fp32). The FSDP x TP parts are then saved as a generation, and
`dslurm ckpt export RUN --hf` must give transformers' own tensors back bit for bit, with a
config.json that the family's class loads (and gives the same logits with).

The families and what each exercises: Llama 3.1-style scaled RoPE (rope_type llama3), Llama 3.2
with tied embeddings (FSDP x TP only: a tie across pipeline stages is refused), Qwen2 q/k/v biases,
Qwen3 q/k norms and a head_dim apart from hidden_size, Mistral's sliding window (8 keys of a
32-token sequence). Weights are randomised (biases, norms) so that a wrong row order shows.
Cost: one 4-process torchrun; transformers is imported in the test process only.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dslurm.cli import main
from dslurm.config import families
from dslurm.config.models import ModelShape
from train_helpers import run_procs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
TOL = 1e-5
SEQ = 32
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ, rms_norm_eps=1e-5, rope_theta=10000.0,
            tie_word_embeddings=False)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # wavelengths 6..1e5: all 3 bands
MODELS = {  # name: (transformers class names, config fields, layouts)
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE}, ("fsdp_tp", "pp_tp")),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}, ("fsdp_tp",)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, ("fsdp_tp", "pp_tp")),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}, ("fsdp_tp", "pp_tp")),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}, ("fsdp_tp", "pp_tp")),
}

WORKER = r"""
import json, os, sys
from pathlib import Path
import torch
import torch.distributed as dist
from dslurm.checkpoint import init_from
from dslurm.checkpoint.dcp import CheckpointManager
from dslurm.config import ModelSpec, load_job
from dslurm.config.layout import Layout
from dslurm.runtime.state import ModelState
from train.model import cross_entropy
from train.parallel.build import build_parts
from train.parallel.dims import ParallelDims

root, spec = Path(sys.argv[1]), json.loads(sys.argv[2])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
LAYOUTS = {"fsdp_tp": dict(dp_shard=2, tp=2), "pp_tp": dict(pp=2, tp=2, microbatches=2)}
tokens = torch.randint(0, 256, (2, %(seq)d), generator=torch.Generator().manual_seed(1))
for name, layouts in spec.items():
    shape = ModelSpec(init_from=str(root / name / "hf")).shape()  # the shape comes from config.json
    for lay_name in layouts:
        kw = LAYOUTS[lay_name]
        job = load_job(data={"name": "t", "nodes": 1, "parallel": dict(kw)})
        lay = Layout.for_world(world, **kw)
        dims = ParallelDims.from_layout(lay, world, "cpu")
        b = build_parts(shape, job, dims, torch.device("cpu"), loss_fn=cross_entropy)
        init_from.load(root / name / "hf", shape, b.parts)
        with torch.no_grad():
            if b.schedule is None:
                out = b.parts[0](tokens)
            else:  # one stage per pp rank: hidden states (this tp rank's sequence shard) to the next
                pp = dims.get_mesh("pp")
                peer = dist.get_global_rank(pp.get_group(), 1 - pp.get_local_rank())
                if b.has_first_stage:
                    dist.send(b.parts[0](tokens).contiguous(), dst=peer)
                    out = None
                else:
                    h = torch.empty(2, %(seq)d // 2, shape.dim)
                    dist.recv(h, src=peer)
                    out = b.parts[0](h)
        if out is not None:
            out = out.full_tensor() if hasattr(out, "full_tensor") else out
            if rank == world - 1:
                torch.save(out, root / name / f"logits-{lay_name}.pt")
        if lay_name == "fsdp_tp":
            with CheckpointManager(root / name / "run", model_shape=shape.record()) as mgr:
                assert mgr.save(0, {"model": ModelState(b.parts)})
        dist.barrier()
dist.destroy_process_group()
""" % {"seq": SEQ}


def make_hf(name: str, out: Path) -> Path:
    import transformers

    cfg_cls, model_cls, extra, _ = MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**{**BASE, **extra}))
    with torch.no_grad():  # norms and biases away from 1 and 0, q sharpened: a wrong order would show
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif pname.endswith("bias"):
                p.normal_(0, 0.5)
            elif "q_proj" in pname:
                p.mul_(10)
    model.save_pretrained(out, max_shard_size="100KB")
    assert (out / "model.safetensors.index.json").is_file()
    return out


def tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def hf_logits(name: str, d: Path) -> torch.Tensor:
    import transformers

    model, info = getattr(transformers, MODELS[name][1]).from_pretrained(d, local_files_only=True,
                                                                          output_loading_info=True)
    assert not any(info.values()), info
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model.eval()(tokens).logits


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    os.environ["HF_HUB_OFFLINE"] = "1"
    root = tmp_path_factory.mktemp("families")
    for name in MODELS:
        make_hf(name, root / name / "hf")
    script = root / "worker.py"
    script.write_text(WORKER)
    spec = json.dumps({n: m[3] for n, m in MODELS.items()})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(script),
           str(root), spec]
    proc = run_procs(cmd, 4, 200)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return root


@pytest.mark.parametrize("name", list(MODELS))
def test_first_step_logits_equal_transformers_under_fsdp_x_tp_and_pp(runs, name):
    want = hf_logits(name, runs / name / "hf")
    for lay in MODELS[name][3]:
        got = torch.load(runs / name / f"logits-{lay}.pt")
        delta = (got - want).abs().max().item()
        print(f"\n{name} {lay}: logits max |delta| vs transformers {delta:.1e} (logits up to "
              f"{want.abs().max().item():.1f})")
        assert delta < TOL, (name, lay, delta)


@pytest.mark.parametrize("name", list(MODELS))
def test_init_from_then_export_gives_the_original_tensors_and_a_config_transformers_loads(runs, name, tmp_path):
    out = tmp_path / "export"
    assert main(["ckpt", "export", str(runs / name / "run"), "--hf", "--max-shard-size", "100KB",
                 "-o", str(out)]) == 0
    orig, back = tensors(runs / name / "hf"), tensors(out)
    assert back.keys() == orig.keys()
    assert all(back[k].dtype == orig[k].dtype and torch.equal(back[k], orig[k]) for k in orig), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [MODELS[name][1]]
    shape = families.shape_of(cfg, "export", SEQ)
    assert shape == families.shape_of(json.loads((runs / name / "hf" / "config.json").read_text()), "hf", SEQ)
    assert isinstance(shape, ModelShape)
    assert torch.equal(hf_logits(name, out), hf_logits(name, runs / name / "hf"))
