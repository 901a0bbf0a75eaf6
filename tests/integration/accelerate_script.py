"""An accelerate loop saved and restored through dslurm.runtime.Checkpoint with the Accelerator's
prepared model, optimizer, scheduler and (stateful) dataloader handed over as they are. One
process: trained STOP steps and saved (final); a fresh build from another seed restored. Prints one
JSON line: which entries went where, and whether every restored state equals the saved one."""

from __future__ import annotations

import json
import sys

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch import nn

import dslurm.runtime as dr

STEPS, STOP = 12, 5


def build(acc: Accelerator, seed: int) -> tuple:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.5)
    x = torch.randn(40, 4, generator=torch.Generator().manual_seed(3))
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    dl = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)  # 10 batches: the run crosses an epoch
    return acc.prepare(model, opt, dl, sched)


def train(acc: Accelerator, parts: tuple, start: int, stop: int, ckpt=None) -> None:  # noqa: ANN001
    model, opt, dl, sched = parts
    step = start
    while step < stop:
        for x, y in dl:
            loss = nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            if step == stop:
                if ckpt is not None:
                    ckpt.save(step, final=True)
                return


def states(parts: tuple, restored: bool) -> list:
    """The four states; the loader's as accelerate saves it (its position, one batch behind its
    prefetching base loader) or, restored, as the base loader holds it until it iterates."""
    model, opt, dl, sched = parts
    data = dl.base_dataloader.state_dict() if restored else dl.state_dict()
    return [model.state_dict(), opt.state_dict(), sched.scheduler.state_dict(), data]


def equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def main() -> None:
    dr.init(run_dir=sys.argv[1])
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    first = build(acc, 0)
    model, opt, dl, sched = first
    ck = dr.Checkpoint(model=model, optim=opt, sched=sched, data=dl)
    assert ck.restore() == 0
    train(acc, first, 0, STOP, ck)
    saved = states(first, restored=False)
    ck.close()
    second = build(acc, 1)  # other weights, a fresh optimizer and loader: the restore must bring all back
    model, opt, dl, sched = second
    ck = dr.Checkpoint(model=model, optim=opt, sched=sched, data=dl)
    start = ck.restore()
    names = ["model", "optim", "sched", "data"]
    same = {n: equal(a, b) for n, a, b in zip(names, saved, states(second, restored=True))}
    print(json.dumps({"start": start, "equal": same, "shared": sorted(ck._shared),
                      "per_rank": [e.name for e in ck._per_rank]}))
    dr.finish(start)


if __name__ == "__main__":
    main()
