"""TensorBoard event files in `<run_dir>/tensorboard/`, one file per start.

Written with the `tensorboard` package alone (no torch, no TensorFlow). Each start's file
begins with a SessionLog START at `purge_from`: TensorBoard then drops the earlier starts'
points from that step on (torch's SummaryWriter(purge_step=...) does the same), so a step
trained again after a crash is plotted once, with the new value. Annotations are text
summaries under `dslurm/events` (the Text tab). What the run holds (`held`) is read from the
event files (TensorBoard's own reader, purges applied). `dslurm trackers sync` writes its own
file, `.sync<n>`, with no purge, and only when it has something to write.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dslurm.trackers import Start
from dslurm.trackers.backlog import NOTES, Held

PACKAGE = "tensorboard.summary.writer.event_file_writer"
SUBDIR = "tensorboard"


class TensorBoardTracker:
    def __init__(self, ctx: Start) -> None:
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._pb = event_pb2
        self.logdir = ctx.run_dir / SUBDIR
        ctx.state.setdefault("logdir", SUBDIR)
        self._held = read_held(self.logdir)
        self.writer: Any = None
        if ctx.sync:  # a file of its own, made when there is something to write
            n = 1 + len(list(self.logdir.glob("events.out.tfevents.*.sync*")))
            self._new: Callable[[], Any] = lambda: EventFileWriter(str(self.logdir), filename_suffix=f".sync{n:04d}")
            return
        self._held.below(ctx.purge_from)
        # The suffix keeps two starts in the same second (and pid) in two files, in order.
        self.writer = EventFileWriter(str(self.logdir), filename_suffix=f".start{ctx.start:04d}")
        self._add(event_pb2.Event(step=ctx.purge_from, session_log=event_pb2.SessionLog(
            status=event_pb2.SessionLog.START)))

    def held(self) -> Held:
        return self._held

    def _add(self, ev: Any) -> None:
        if self.writer is None:
            self.writer = self._new()
        ev.wall_time = time.time()
        self.writer.add_event(ev)
        self.writer.flush()  # a node failure loses no logged point (one write, no fsync)

    def log(self, step: int, values: dict[str, float], t: float = 0.0) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        self._add(self._pb.Event(step=step, summary=summary))

    def event(self, text: str, step: int) -> None:
        from tensorboard.plugins.text.summary_v2 import text_pb

        self._add(self._pb.Event(step=step, summary=text_pb("dslurm/events", text)))

    def close(self, ending: str | None) -> None:
        if self.writer is not None:
            self.writer.close()


def read_held(logdir: Path) -> Held:
    """What the event files under `logdir` hold (TensorBoard's reader: later starts' purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, TENSORS, EventAccumulator

    held = Held()
    if not logdir.is_dir():
        return held
    acc = EventAccumulator(str(logdir), size_guidance={SCALARS: 0, TENSORS: 0})
    acc.Reload()
    tags = acc.Tags()
    for tag in tags.get("scalars", []):
        held.last[tag] = max(s.step for s in acc.Scalars(tag))
    if NOTES in tags.get("tensors", []):
        for t in acc.Tensors(NOTES):
            held.took_note(t.step, t.tensor_proto.string_val[0].decode())
    return held


def remote(spec: object, run_dir: Path) -> bool:
    return False


def describe(ctx: Start) -> str:
    return f"TensorBoard's event files in {ctx.run_dir / SUBDIR}"


def open_run(ctx: Start) -> TensorBoardTracker:
    return TensorBoardTracker(ctx)
