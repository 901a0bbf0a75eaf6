"""Instruction data in the trainer: the loss mask and the documents of a packed sequence.

A token file written by `dslurm data tokenize --instruct` (dslurm/data/instruct.py) holds, beside
its tokens, `loss_mask` (1: a completion token, trained as a target) and `doc_start` (1: the first
token of an example, or of a pad run), and was packed for one seq_len (`packed_seq_len`): no
example crosses a window of seq_len+1 tokens. Here a window's arrays become
  - targets with IGNORE where the mask is 0 (cross_entropy skips them: completion-only loss), and
  - `docs`, the example id of every input position (a running count of doc_start), from which
    each attention layer keeps every query to its own example (train/model.py `attention_mask`).
The sample order, its state and its resume are the pre-training ones (train/data.py): the mask
and the documents are read from the same windows, so a resumed run reads the same batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from dslurm.data.instruct import DOC_START, MASK
from dslurm.errors import UserError

if TYPE_CHECKING:  # torch is imported lazily here (see to_tensors)
    import torch
    from torch import nn

    from train.model import Transformer

IGNORE = -100  # F.cross_entropy's ignore_index


FIELDS = (MASK, DOC_START)  # read beside the tokens, over the same windows (train/reader.py)


@dataclass(slots=True)
class Windows:
    """The windows [n, seq_len+1] of a batch: tokens, loss mask, document starts (int64)."""

    tokens: np.ndarray
    mask: np.ndarray
    start: np.ndarray


def detect(sources: list[Any], seq_len: int) -> bool:
    """Whether the streams are instruction data; refuses a mix, or a seq_len they were not packed for."""
    packed = {s.where: {f.info.packed_seq_len for f in s.files} for s in sources}
    kinds = set().union(*packed.values())
    if kinds == {0}:
        return False
    if 0 in kinds:
        where = ", ".join(w for w, k in packed.items() if 0 in k)
        raise UserError(f"{where}: pre-training tokens mixed with instruction data (--instruct). Fix: train on one "
                        "kind: tokenize every source with --instruct, or none")
    for where, k in packed.items():
        if k != {seq_len}:
            raise UserError(f"{where}: packed for seq_len {sorted(k)}, the model's seq_len is {seq_len}. Fix: re-run "
                            f"`dslurm data tokenize --instruct --seq-len {seq_len}`, or set model.seq_len: {min(k)}")
    return True


def to_tensors(w: Windows | dict[str, Any], device: Any) -> tuple[Any, Any, Any]:
    """(inputs, targets with IGNORE off the completions, docs of the inputs), int64 on `device`,
    from a batch's windows: a `Windows`, or the loader's fields (numpy arrays, or tensors in
    pinned host memory for a GPU: moved first, widened there)."""
    import torch  # lazy, as train/data.py: torch-free tools import the data modules

    if isinstance(w, Windows):
        w = {"tokens": w.tokens, MASK: w.mask, DOC_START: w.start}
    moved = []
    for name in ("tokens", MASK, DOC_START):
        t = torch.from_numpy(w[name]) if isinstance(w[name], np.ndarray) else w[name]
        if str(device) != "cpu":
            t = t.to(device, non_blocking=t.is_pinned())
        moved.append(t)
    windows, mask, start = moved
    inputs = windows[:, :-1].long().contiguous()
    targets = torch.where(mask[:, 1:] > 0, windows[:, 1:].long(), IGNORE).contiguous()
    docs = torch.cumsum(start.long(), dim=1)[:, :-1].contiguous()
    return inputs, targets, docs


def masked_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed loss of the trained (not IGNORE) targets (0 for a micro-batch of prompts only).
    The trainer divides by the global batch's trained targets (`Trainer.weigh_tokens`), so the
    gradient is the same token mean whatever the layout cuts into micro-batches and ranks. Works
    on DTensor logits under `loss_parallel()`."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), ignore_index=IGNORE,
                           reduction="sum")


def queue_docs(parts: Sequence[nn.Module], docs: torch.Tensor | None, microbatches: int) -> None:
    """Hand a pipeline's stages the documents of the microbatches of one `schedule.step`: the
    schedule splits its inputs along dim 0 with tensor_split, and each stage's forward of microbatch
    i takes entry i (train/model.py `Transformer.chunk_docs`, train/parallel/pp.py)."""
    chunks = list(docs.tensor_split(microbatches)) if docs is not None else None
    for part in parts:
        cast("Transformer", part).chunk_docs = chunks
