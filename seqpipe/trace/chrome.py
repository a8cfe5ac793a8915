"""A recording as Chrome trace event JSON, which Perfetto (https://ui.perfetto.dev) and
``chrome://tracing`` open.

Every event is a complete event (``"ph": "X"``) with ``ts`` and ``dur`` in microseconds
from the recording's first instant. Tracks follow the pipeline: the process id is the rank
(``"rank 0"``), the thread id the stage (``"stage 1"``), so each stage of each rank has
its own row. Events carry the schedule's names (``F3``, ``I3``, ``W3``,
``recv gradient 3 ← stage 2``), a category per phase (``cat``) to filter on, and their
micro-batch, stage, step, peer and message in ``args``.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Union

from seqpipe.trace.empty import require_events
from seqpipe.trace.events import Event, EventKind, Recording

__all__ = ["CATEGORIES", "chrome_events", "write_chrome"]

CATEGORIES = {EventKind.FORWARD: "forward", EventKind.BACKWARD: "backward",
              EventKind.INPUT_GRAD: "backward input", EventKind.WEIGHT_GRAD: "backward weight",
              EventKind.RECOMPUTE: "recompute", EventKind.LOSS: "loss",
              EventKind.WAIT: "wait", EventKind.SEND: "send", EventKind.REDUCE: "reduce"}
"""The ``cat`` of each event kind (the phase), also the SVG legend's words."""


def chrome_events(recording: Recording) -> Dict[str, Any]:
    """The JSON object of the trace: ``traceEvents`` (metadata naming every track, then
    the events in time order) and ``displayTimeUnit``.

    Raises ``ValueError`` for a recording without events.
    """
    require_events(recording, "write as a Chrome trace")
    origin = min([e.start for e in recording.events] + [s.start for s in recording.steps])
    events = sorted(recording.events, key=lambda e: (e.start, e.rank, e.stage, e.end))
    return {"traceEvents": _metadata(recording) + [_complete(e, origin) for e in events],
            "displayTimeUnit": "ms"}


def write_chrome(recording: Recording, path: Union[str, os.PathLike]) -> None:
    """Write :func:`chrome_events` to ``path`` as JSON (UTF-8)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chrome_events(recording), f, ensure_ascii=False)


def _metadata(recording: Recording) -> List[Dict[str, Any]]:
    """Names and order of the tracks: one process per rank, one thread per stage."""
    tracks = recording.stages()
    out: List[Dict[str, Any]] = []
    for rank in sorted({rank for rank, _ in tracks}):
        out.append(_meta("process_name", rank, 0, {"name": f"rank {rank}"}))
        out.append(_meta("process_sort_index", rank, 0, {"sort_index": rank}))
    for rank, stage in tracks:
        out.append(_meta("thread_name", rank, stage, {"name": f"stage {stage}"}))
        out.append(_meta("thread_sort_index", rank, stage, {"sort_index": stage}))
    return out


def _meta(name: str, pid: int, tid: int, args: Dict[str, Any]) -> Dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _complete(event: Event, origin: float) -> Dict[str, Any]:
    args: Dict[str, Any] = {"stage": event.stage, "step": event.step}
    for key, value in (("microbatch", event.microbatch), ("peer", event.peer),
                       ("what", event.what)):
        if value is not None:
            args[key] = value
    return {"name": event.name, "cat": CATEGORIES[event.kind], "ph": "X",
            "ts": (event.start - origin) * 1e6, "dur": event.duration * 1e6,
            "pid": event.rank, "tid": event.stage, "args": args}
