"""Run under torchrun (gloo, CPU): context parallel against the whole model in one process.

argv: out.json, then a JSON list of cases {"shape": name, "layout": {...}, "docs": bool}. Every rank
builds the reference model (the seed's weights, then norms, biases and q made to matter) and runs
it on the whole batch; the same weights go into the parallelised parts (`build_parts`, the trainer's
path), which see this rank's dp rows and cp chunks. Rank 0 writes, per case, the largest difference
of every rank's logits (its chunks), of the loss (the cp group's mean) and of every gradient.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from dslurm.config import families, load_job
from dslurm.config.layout import Layout
from dslurm.config.models import PRESETS
from train.model import build_model, cross_entropy
from train.parallel.build import build_parts
from train.parallel.cp import shard
from train.parallel.dims import ParallelDims

SEQ, BATCH = 32, 2
# An init_from directory's config.json (Mistral with a sliding window of 8 of 32 keys; Qwen2's
# q/k/v biases): the shape `model.init_from` builds from it (dslurm.config.families).
HF = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": SEQ, "rms_norm_eps": 1e-5,
      "rope_theta": 10000.0, "tie_word_embeddings": False}
SHAPES = {
    "tiny": PRESETS["tiny"],
    "mistral": families.shape_of({**HF, "model_type": "mistral", "architectures": ["MistralForCausalLM"],
                                  "sliding_window": 8}, "mistral"),
    "qwen2": families.shape_of({**HF, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, "qwen2"),
}


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.full_tensor() if isinstance(t, DTensor) else t


def reference(name: str) -> torch.nn.Module:
    model = build_model(SHAPES[name], seed=0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # away from 1 and 0, q sharpened: a wrong key or position would show
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif pname.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif pname.endswith("wq.weight"):
                p.mul_(20)
    return model


def run_case(case: dict, rank: int, world: int) -> dict[str, float]:
    shape = SHAPES[case["shape"]]
    seq = shape.seq_len
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape.vocab_size, (BATCH, seq + 1), generator=g)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    # documents of packed instruction data: runs of 3..17 positions, crossing the cp chunks
    docs = torch.cumsum((torch.rand(BATCH, seq, generator=g) < 0.15).long(), dim=1) if case["docs"] else None

    ref = reference(case["shape"])
    ref_loss = cross_entropy(ref(inputs, docs), targets)
    ref_logits = ref(inputs, docs).detach()
    ref_loss.backward()

    kw = case["layout"]
    lay = Layout.for_world(world, **kw)
    job = load_job(data={"name": "t", "nodes": 1, "parallel": dict(kw)})
    dims = ParallelDims.from_layout(lay, world, "cpu")
    part = build_parts(shape, job, dims, torch.device("cpu"), loss_fn=cross_entropy).parts[0]
    set_model_state_dict(part, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
    c = lay.coords(rank)
    dp_rank = c["dp_replicate"] * lay.dp_shard + c["dp_shard"]
    rows = slice(dp_rank * BATCH // lay.dp, (dp_rank + 1) * BATCH // lay.dp)
    x, y = shard(inputs[rows], c["cp"], lay.cp), shard(targets[rows], c["cp"], lay.cp)
    ctx = torch.distributed.tensor.parallel.loss_parallel() if lay.tp > 1 else torch.enable_grad()
    with ctx:
        out = part(x, docs[rows] if docs is not None else None)
        loss = cross_entropy(out, y)
        loss.backward()
    loss = _full(loss).detach()
    dist.all_reduce(loss)  # every rank's mean of equal token counts: the world's mean over tp copies
    loss = loss / world
    want = shard(ref_logits[rows], c["cp"], lay.cp)
    d_grad = 0.0
    grads = dict(part.named_parameters())
    for pname, p in ref.named_parameters():
        got = _full(grads[pname].grad)
        assert got is not None, pname
        d_grad = max(d_grad, (got - p.grad).abs().max().item())
    return {"logits": (_full(out).detach() - want).abs().max().item(), "loss": abs(loss.item() - ref_loss.item()),
            "grad": d_grad, "grad_scale": max(p.grad.abs().max().item() for p in ref.parameters())}


def main() -> None:
    out, cases = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for case in cases:
        r = run_case(case, rank, world)
        vec = torch.tensor([r["logits"], r["loss"], r["grad"]])
        dist.all_reduce(vec, op=dist.ReduceOp.MAX)
        results.append({**case, "logits": vec[0].item(), "loss": vec[1].item(), "grad": vec[2].item(),
                        "grad_scale": r["grad_scale"]})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
