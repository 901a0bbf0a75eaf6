"""The global-batch samplers' common part, and the single-stream sampler (`GlobalBatchSampler`).

Pure (numpy only, no I/O); train/sources.py has the mixture's sampler, train/data.py the loader.

The global sequence. Epoch e visits the samples in a permutation keyed by (seed, e),
computed per index (train/order.py), never listed: constant memory at any corpus size.
The *global batch* of B samples is the unit: step k of the run takes the next B entries
of the endless stream epoch 0, epoch 1, ... and data-parallel rank r of D gets the
contiguous share [r·B/D, (r+1)·B/D) of it. Nothing in the stream
depends on D, so:
  * every parallel layout sees the same global batch as a single-process run
    (the parity tests rely on it);
  * the state (epoch, position), with position counting *global* samples consumed
    in the epoch, can be saved at any step boundary and restored under another D
    without a repeat or a skip.

Tail policy when the epoch's N samples are not a multiple of B:
  * drop: the epoch is cut to N - N % B samples; no sample repeats within an epoch
    (the cut samples differ from epoch to epoch because the permutation does);
  * pad:  the epoch is extended to a multiple of B by repeating its first samples;
    each repeated slot consumed adds one to `padding_repeats` (a global count, the
    same on every rank, carried in the state so restarts keep counting).

Ids ahead. A rank's ids are a pure function of the stream position, so `DpShare` computes
those of the next `ahead_steps` steps at once (`plan_ids`: one vectorised pass of the
permutations) and hands them out step by step, keyed by the position they belong to; the
background reader takes many steps at once (`take`). The position stays the whole state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from dslurm.config.layout import Layout
from dslurm.errors import UserError
from train.order import ORDER, Order, mix_key, sample_order, warn_order

Policy = Literal["drop", "pad"]


AHEAD_IDS = 4096
"""A rank's ids are computed for about this many samples at once (`DpShare.next_ids`): numpy's
per-call cost, not the hashing, is what a step's few ids would pay one step at a time."""


class DpShare:
    """What both global-batch samplers (train/sources.py's `MixtureSampler`, this module's
    `GlobalBatchSampler`) do alike: data-parallel rank r of D takes the contiguous share
    [r*B/D, (r+1)*B/D) of each global batch of B samples (`Layout.dp_share` checks B and D), and
    a rank's ids are a pure function of the stream position, so the next steps' ids are computed
    together (`plan_ids`) and handed out step by step, keyed by the position they belong to."""

    __slots__ = ()
    global_batch: int
    dp_rank: int
    dp_size: int
    _ahead: dict[int, np.ndarray]
    """stream position -> this rank's ids there, computed ahead (a cache: the state is the position)"""

    def next_global(self) -> np.ndarray:
        raise NotImplementedError

    def plan_ids(self, steps: int) -> np.ndarray:
        """[steps, local_batch]: this rank's ids of the next `steps` steps, without advancing."""
        raise NotImplementedError

    def step(self) -> None:
        """Advance by one global batch."""
        raise NotImplementedError

    def advance(self, steps: int) -> None:
        """Advance by `steps` global batches at once (as `steps` calls of `step`)."""
        raise NotImplementedError

    def take(self, steps: int) -> tuple[list[int], np.ndarray]:
        """The next `steps` steps at once, advancing past them: (the stream position of each,
        [steps, local_batch] ids). What the background reader takes (its own copy of the sampler)."""
        at, plan = self.stream_position, self.plan_ids(steps)
        self.advance(steps)
        return [at + k * self.global_batch for k in range(steps)], plan

    @property
    def stream_position(self) -> int:
        raise NotImplementedError

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp_size

    def ahead_by_ids(self) -> int:
        """Steps of about AHEAD_IDS ids."""
        return max(1, AHEAD_IDS // self.local_batch)

    @property
    def ahead_steps(self) -> int:
        """Steps whose ids are computed at once (about AHEAD_IDS ids)."""
        return self.ahead_by_ids()

    def local_share(self, global_ids: np.ndarray) -> np.ndarray:
        """This rank's contiguous slice of a global batch."""
        b = self.local_batch
        return global_ids[self.dp_rank * b:(self.dp_rank + 1) * b]

    def next_ids(self) -> np.ndarray:
        """This rank's sample ids for the next step (and advance): the B/D entries of its share
        only, from `plan_ids` computed for the next `ahead_steps` steps at once."""
        at = self.stream_position
        ids = self._ahead.pop(at, None)
        if ids is None:
            steps = self.ahead_steps
            plan = self.plan_ids(steps)
            self._ahead.clear()  # what was planned from another position (a skip, a restore)
            self._ahead.update({at + k * self.global_batch: plan[k] for k in range(1, steps)})
            ids = plan[0]
        self.step()
        return ids


def check_block(state: dict[str, Any], block: int) -> None:
    """A saved position is a place in one order: restoring it under another `data.shuffle_block`
    would repeat and skip samples within the epoch, so it is refused (a state from before the
    field was saved under 1)."""
    saved = int(state.get("shuffle_block", 1))
    if saved != block:
        raise UserError(f"data state: saved with data.shuffle_block {saved}, the run now sets {block}; the "
                        "saved position is a place in the other order. Fix: restore with data.shuffle_block: "
                        f"{saved} (change it only for a new run)")


@dataclass(kw_only=True, slots=True)
class GlobalBatchSampler(DpShare):
    """Sample ids per step for one data-parallel rank; pure (numpy only), no I/O."""

    num_samples: int
    global_batch: int
    dp_rank: int = 0
    dp_size: int = 1
    seed: int = 0
    policy: Policy = "drop"
    epoch: int = 0
    position: int = 0
    padding_repeats: int = 0
    shuffle_block: int = 1
    """`data.shuffle_block`: the epoch's order moves blocks of this many adjacent samples"""
    _perm: tuple[int, Order] | None = field(default=None, init=False, repr=False)
    _ahead: dict[int, np.ndarray] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        Layout.dp_share(self.global_batch, self.dp_rank, self.dp_size)
        if self.policy not in ("drop", "pad"):
            raise ValueError(f"policy={self.policy!r} must be 'drop' or 'pad'")
        if self.num_samples < 1 or (self.policy == "drop" and self.num_samples < self.global_batch):
            raise ValueError(f"{self.num_samples} samples cannot fill one global batch of "
                             f"{self.global_batch} under policy {self.policy!r}")

    @property
    def epoch_length(self) -> int:
        """Global samples in one epoch after the tail policy."""
        n, b = self.num_samples, self.global_batch
        return n - n % b if self.policy == "drop" else -(-n // b) * b

    @property
    def steps_per_epoch(self) -> int:
        return self.epoch_length // self.global_batch

    def _permutation(self, epoch: int) -> Order:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, sample_order(self.num_samples, mix_key(self.seed, epoch, 0x6C0B), self.shuffle_block))
        return self._perm[1]

    def order(self, epoch: int, start: int, count: int) -> np.ndarray:
        """Entries [start, start+count) of the epoch's order after the tail policy, computed per
        index (train/order.py: O(count) time, no n-sized array). Pad slots (at or past
        num_samples) repeat the epoch's first samples, in order."""
        return self._permutation(epoch)[np.arange(start, start + count, dtype=np.int64) % self.num_samples]

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The whole epoch's order, listed (tests and small corpora: epoch_length int64)."""
        return self.order(epoch, 0, self.epoch_length)

    def _advance(self) -> list[tuple[int, int, int]]:
        """Advance the state by one global batch; its (epoch, start, count) pieces of epoch order.

        A batch may straddle an epoch boundary only if global_batch changed on restore.
        """
        pieces, need = [], self.global_batch
        while need:
            take = min(need, self.epoch_length - self.position)
            start = self.position
            pieces.append((self.epoch, start, take))
            # Slots at or past num_samples are the pad repeats.
            self.padding_repeats += max(0, start + take - max(start, self.num_samples))
            self.position += take
            need -= take
            if self.position >= self.epoch_length:
                self.epoch, self.position = self.epoch + 1, 0
        return pieces

    def next_global(self) -> np.ndarray:
        """The next global batch (B sample ids) and advance the state."""
        return np.concatenate([self.order(e, s, n) for e, s, n in self._advance()])

    def plan_ids(self, steps: int) -> np.ndarray:
        """[steps, local_batch]: this rank's share of each of the next `steps` global batches, in
        one vectorised pass and without advancing. The stream is the epochs end to end, each
        epoch_length long, so entry j of step k is stream index q = stream_position + k*B +
        dp_rank*B/D + j, i.e. entry q % epoch_length of epoch q // epoch_length."""
        lb, length = self.local_batch, self.epoch_length
        q = (self.stream_position + self.dp_rank * lb + np.arange(steps, dtype=np.int64)[:, None] * self.global_batch
             + np.arange(lb, dtype=np.int64)[None, :])
        epoch, pos = np.divmod(q, length)
        out = np.empty_like(q)
        for e in range(int(epoch[0, 0]), int(epoch[-1, -1]) + 1):
            sel = epoch == e
            out[sel] = self._permutation(e)[pos[sel] % self.num_samples]
        return out

    @property
    def stream_position(self) -> int:
        """Samples consumed since epoch 0 began: where the next global batch starts."""
        return self.epoch * self.epoch_length + self.position

    @property
    def ahead_steps(self) -> int:
        """As `DpShare.ahead_steps`, within one epoch's steps: a tiny corpus's plan would cover
        many epochs, a permutation each (numpy's per-call cost again)."""
        return max(1, min(self.ahead_by_ids(), self.steps_per_epoch))

    def step(self) -> None:
        """Advance by one global batch (what `next_global` and `next_ids` do besides their ids)."""
        self._advance()

    def advance(self, steps: int) -> None:
        """`steps` global batches at once, in closed form: the stream moves steps*B on, and the pad
        repeats consumed are the stream indices passed whose epoch position is >= num_samples."""
        length, n = self.epoch_length, self.num_samples

        def pads(q: int) -> int:  # pad slots in stream indices [0, q)
            return q // length * (length - n) + max(0, q % length - n) if length > n else 0

        at = self.stream_position
        end = at + steps * self.global_batch
        self.padding_repeats += pads(end) - pads(at)
        self.epoch, self.position = divmod(end, length)

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and strings: safe for json, torch.save and DCP's non-tensor state."""
        return {"epoch": self.epoch, "position": self.position,
                "padding_repeats": self.padding_repeats, "num_samples": self.num_samples,
                "seed": self.seed, "policy": self.policy, "global_batch": self.global_batch, "order": ORDER,
                "shuffle_block": self.shuffle_block}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore (epoch, position); dp_rank/dp_size may differ from the saving run.

        A different corpus size, seed or policy makes the position meaningless, so
        they must match; a different global_batch is accepted (position is in samples).
        """
        if state.get("kind") == "mixture":
            raise UserError("data state: the checkpoint holds a mixture position (data.sources) but the run "
                            "now reads one stream. Fix: restore with the data section the run was saved with")
        for key in ("num_samples", "seed", "policy"):
            if key in state and state[key] != getattr(self, key):
                raise UserError(f"data state: {key}={state[key]!r} in the checkpoint but "
                                f"{getattr(self, key)!r} now; the saved position does not apply. "
                                "Fix: restore with the same data file, train.seed and data.policy")
        check_block(state, self.shuffle_block)
        warn_order(state)
        self._ahead.clear()
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.padding_repeats = int(state.get("padding_repeats", 0))
        if self.position >= self.epoch_length:  # global_batch changed and the tail moved
            self.epoch, self.position = self.epoch + 1, 0
