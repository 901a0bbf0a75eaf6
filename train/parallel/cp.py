"""Context parallel: each sequence split over the cp group, attention over the gathered K/V.

Load balance. A causal query at position p attends to p+1 keys, so cutting the sequence into cp
contiguous pieces would give the last rank cp times the first one's attention work. The
sequence is cut into 2*cp chunks instead and cp rank i holds chunks i and 2*cp-1-i (an early
and a late one: the same work on every rank), as Llama 3 and torchtitan do.

Attention. Queries stay local; each layer all-gathers the keys and values of the whole sequence
over the cp group (Llama 3's choice over a ring: K/V are small under GQA) with an autograd
all-gather whose backward reduce-scatters (sums) the K/V gradients back to their owners
(`torch.distributed._functional_collectives.all_gather_single_autograd`). The gathered keys
are kept in rank order, not sequence order: attention does not care in which order it sees the
keys as long as the mask is right, and the mask (train/model.py `attention_mask`) is built from
the global position of every query and key, so the causal rule, Mistral's sliding window and
the documents of packed instruction data are exact for any chunk offsets. RoPE rotates each
token by its global position (`positions`).

Everything else is per token: the loss of a rank is over its own tokens, and the cp ranks join
FSDP's data-parallel group (dp_shard x cp, as torchtitan), whose gradient mean over dp x cp
ranks of equal token counts is the mean over the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from train.model import Transformer


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two of 2*cp chunks cp rank `rank` holds."""
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} outside a cp group of {cp}")
    return rank, 2 * cp - 1 - rank


def positions(local_len: int, rank: int, cp: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global positions of the `local_len` tokens cp rank `rank` holds (its two chunks, in order)."""
    if local_len % 2:
        raise ValueError(f"a cp shard holds two equal chunks; local length {local_len} is odd")
    c = local_len // 2
    a, b = chunk_ids(rank, cp)
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device),
                      torch.arange(b * c, (b + 1) * c, device=device)])


def shard(t: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's part of `t` along `dim` (the sequence): chunks i and 2*cp-1-i of 2*cp."""
    n = t.shape[dim]
    if n % (2 * cp):
        raise ValueError(f"sequence length {n} is not divisible by 2*cp={2 * cp}")
    chunks = t.chunk(2 * cp, dim=dim)
    a, b = chunk_ids(rank, cp)
    return torch.cat([chunks[a], chunks[b]], dim=dim).contiguous()


@dataclass(frozen=True, slots=True)
class ContextShard:
    """One rank's place in its cp group: what `train.model.Attention` needs to attend over the
    whole sequence from its shard (`train.model.SeqShard`)."""

    group: dist.ProcessGroup
    rank: int
    size: int

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        return positions(local_len, self.rank, self.size, device)

    def key_positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Global positions of the gathered keys: every rank's shard, in rank order."""
        return torch.cat([positions(local_len, r, self.size, device) for r in range(self.size)])

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """(batch, local_len, ...) -> (batch, cp*local_len, ...): every rank's shard in rank order.
        Backward reduce-scatters the gradient, so each rank gets the sum over the group of the
        gradients of its own keys and values."""
        out: torch.Tensor = funcol.all_gather_single_autograd(t.contiguous(), gather_dim=1, group=self.group)
        return out


def apply_cp(model: Transformer, group: dist.ProcessGroup, rank: int, size: int) -> None:
    """Give every attention layer of `model` its cp shard (in place, before any wrapper)."""
    shard_of = ContextShard(group=group, rank=rank, size=size)
    for block in model.layers.values():
        block.attention.cp = shard_of  # type: ignore[union-attr]
