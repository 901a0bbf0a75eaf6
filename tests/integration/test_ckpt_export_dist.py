"""`dslurm ckpt export` of a generation the real trainer saved sharded FSDP x TP (torchrun, 4
processes on gloo: dp_shard 2 x tp 2), read in one process without a process group.

- The torch and safetensors files load with plain `torch.load` / the `safetensors` package into a
  single-process model whose parameters are bit-identical to the trainer's own resume path
  (CheckpointManager.restore into one process, which tests/integration/test_reshard_resume.py
  checks against an uninterrupted run) and within 1e-5 of an uninterrupted single-process run
  of the same steps (the single-process reference; FSDP x TP reduces in another order).
- --hf-llama: transformers' LlamaForCausalLM, built from the exported config.json with no download,
  loads every tensor (nothing missing or unexpected) and gives the built-in model's logits; the
  same weights without the q/k row reordering give other logits, so the check can fail.

Cost: one 4-process and one 1-process training run of 2 steps (~35 CPU-s), then exports in-process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dslurm import checkpoint as ck
from dslurm.checkpoint import hf_layout
from dslurm.checkpoint.dcp import CheckpointManager
from dslurm.cli import main
from dslurm.config.models import ModelShape
from dslurm.runtime.state import train_state
from train.model import build_model
from train_helpers import run_train, write_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
STEPS = 2
TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Run dirs of the same 2 steps: FSDP x TP on 4 processes, and one plain process."""
    tmp = tmp_path_factory.mktemp("export")
    out = {}
    for name, nproc, sets in (("fsdp2xtp2", 4, ("parallel.tp=2",)), ("ref", None, ())):
        proc = run_train(nproc, write_job(tmp, name, steps=STEPS), *sets, f"checkpoint.interval={STEPS}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = tmp / name
    meta = json.loads((generation(out["fsdp2xtp2"]) / ck.META).read_text())
    assert meta["layout"]["tp"] == 2 and meta["layout"]["dp_shard"] == 2 and meta["step"] == STEPS
    return out


def generation(run_dir: Path) -> Path:
    return ck.generations_dir(run_dir) / ck.read_pointer(run_dir).generation


def shape_of(run_dir: Path) -> ModelShape:
    return ModelShape(**json.loads((generation(run_dir) / ck.META).read_text())["model_shape"])


def export(run_dir: Path, out: Path, *flags: str) -> Path:
    assert main(["ckpt", "export", str(run_dir), *flags, "-o", str(out)]) == 0
    return out


def restored(run_dir: Path) -> dict[str, torch.Tensor]:
    """The generation as the trainer's resume path loads it into one process."""
    model = build_model(shape_of(run_dir), seed=123)  # other init: everything must come from the file
    opt = torch.optim.AdamW(model.parameters())
    with CheckpointManager(run_dir) as mgr:
        assert mgr.restore(train_state([model], [opt])) is not None
    return model.state_dict()


def test_export_of_fsdp_x_tp_generation_is_the_trained_model(runs, tmp_path):
    run = runs["fsdp2xtp2"]
    want = restored(run)
    from_torch = torch.load(export(run, tmp_path / "pt", "--format", "torch") / "pytorch_model.bin",
                            weights_only=True)
    out = export(run, tmp_path / "st", "--format", "safetensors", "--max-shard-size", "200KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    from_st: dict[str, torch.Tensor] = {}
    for f in sorted(set(index["weight_map"].values())):
        from_st.update(load_file(out / f))
    assert len(set(index["weight_map"].values())) > 1
    for got in (from_torch, from_st):
        model = build_model(shape_of(run), seed=7)
        model.load_state_dict(got)  # strict: exactly the model's keys, no optimizer state
        assert all(torch.equal(p, want[k]) for k, p in model.state_dict().items())
    # The single-process reference: the same 2 steps trained in one process, not a resharded load.
    ref = load_file(export(runs["ref"], tmp_path / "ref", "--format", "safetensors") / "model.safetensors")
    init = build_model(shape_of(run), seed=0).state_dict()
    worst = max((from_st[k] - ref[k]).abs().max().item() for k in ref)
    moved = max((ref[k] - init[k]).abs().max().item() for k in ref)
    print(f"\nexport vs single-process run: max |delta| {worst:.1e}; training moved weights by {moved:.1e}")
    assert worst < TOL < moved


def test_hf_layout_export_gives_the_same_logits_in_transformers(runs, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a local directory: nothing may be fetched
    from transformers import LlamaForCausalLM

    run = runs["fsdp2xtp2"]
    shape = shape_of(run)
    out = export(run, tmp_path / "hf", "--format", "safetensors", "--hf-llama")
    hf, info = LlamaForCausalLM.from_pretrained(out, local_files_only=True, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    hf.eval()
    exported, want = load_file(out / "model.safetensors"), restored(run)
    unpermuted = {k: undo_half_split(v, shape.n_heads if "q_proj" in k else shape.n_kv_heads)
                  if k.endswith(("q_proj.weight", "k_proj.weight")) else v for k, v in exported.items()}
    tokens = torch.randint(0, shape.vocab_size, (2, shape.seq_len), generator=torch.Generator().manual_seed(1))
    # As trained (loaded by from_pretrained), and with every query projection x10 in both models:
    # sharper attention, where the position rotation moves the logits more (the negative control's margin).
    for scale in (1.0, 10.0):
        ours = build_model(shape, seed=7).eval()
        ours.load_state_dict({k: v * scale if k.endswith("wq.weight") else v for k, v in want.items()})
        with torch.no_grad():
            ref = ours(tokens)
            if scale != 1.0:
                hf.load_state_dict(sharpen(exported, scale))
            delta = (hf(tokens).logits - ref).abs().max().item()
            hf.load_state_dict(sharpen(unpermuted, scale))  # negative control: q/k rows not reordered
            wrong = (hf(tokens).logits - ref).abs().max().item()
            hf.load_state_dict(sharpen(exported, 1.0))
        print(f"\nq x{scale:g}: HF vs built-in logits max |delta| {delta:.1e}; without the q/k reordering {wrong:.1e}")
        assert delta < TOL and wrong > 100 * TOL * scale / 10


def sharpen(sd: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    return {k: v * scale if k.endswith("q_proj.weight") else v for k, v in sd.items()}


def undo_half_split(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows, cols = w.shape
    out = w.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)
    assert torch.equal(hf_layout.to_half_split(out, heads), w)
    return out
