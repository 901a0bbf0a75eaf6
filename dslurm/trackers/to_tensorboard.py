"""TensorBoard event files in `<run_dir>/tensorboard/`, one file per start.

Written with the `tensorboard` package alone (no torch, no TensorFlow). Each start's file
begins with a SessionLog START at `purge_from`: TensorBoard then drops the earlier starts'
points from that step on (torch's SummaryWriter(purge_step=...) does the same), so a step
trained again after a crash is plotted once, with the new value. Annotations are text
summaries under `dslurm/events` (the Text tab).
"""

from __future__ import annotations

import time
from typing import Any

from dslurm.trackers import Start

SUBDIR = "tensorboard"


class TensorBoardTracker:
    def __init__(self, ctx: Start) -> None:
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._pb = event_pb2
        logdir = ctx.run_dir / SUBDIR
        ctx.state.setdefault("logdir", SUBDIR)
        # The suffix keeps two starts in the same second (and pid) in two files, in order.
        self.writer = EventFileWriter(str(logdir), filename_suffix=f".start{ctx.start:04d}")
        self._add(event_pb2.Event(step=ctx.purge_from, session_log=event_pb2.SessionLog(
            status=event_pb2.SessionLog.START)))

    def _add(self, ev: Any) -> None:
        ev.wall_time = time.time()
        self.writer.add_event(ev)
        self.writer.flush()  # a node failure loses no logged point (one write, no fsync)

    def log(self, step: int, values: dict[str, float]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        self._add(self._pb.Event(step=step, summary=summary))

    def event(self, text: str, step: int) -> None:
        from tensorboard.plugins.text.summary_v2 import text_pb

        self._add(self._pb.Event(step=step, summary=text_pb("dslurm/events", text)))

    def close(self, ending: str | None) -> None:
        self.writer.close()


def describe(ctx: Start) -> str:
    return f"TensorBoard's event files in {ctx.run_dir / SUBDIR}"


def open_run(ctx: Start) -> TensorBoardTracker:
    return TensorBoardTracker(ctx)
