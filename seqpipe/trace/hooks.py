"""What the engines call to be traced: one flag, timed spans, step boundaries.

Off by default, and then free: every hook first reads ``active`` (the recorder of an open
``seqpipe.trace.record()`` block, else ``None``) and the profiler's process-wide flag, and
returns the shared no-op ``OFF`` without allocating anything. On, a span times its body
with the recorder's clock, and, while a ``torch.profiler`` (or ``torch.autograd.profiler``)
run is active, also opens a ``torch.profiler.record_function`` range named like the
event (``F3``, ``recv gradient 3 ← stage 2``), so a user's own profile shows the pipeline.

Spans may be entered on any thread (a local ``Pipe`` runs a thread per stage, autograd
runs recomputation on its own): the recorder takes events from all of them.
"""
from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Optional, Protocol, Tuple

import torch.autograd.profiler as _profiler

from seqpipe.trace.events import Event, EventKind

__all__ = ["OFF", "Listener", "active", "begin_step", "current_label", "enabled", "end_step",
           "resume_step", "span"]


class Listener(Protocol):
    """What the hooks report to: the open recording (``trace.record.Recorder``, which
    imports this module to install itself)."""

    clock: Callable[[], float]

    def add(self, kind: EventKind, stage: int, start: float, end: float,
            microbatch: Optional[int], peer: Optional[int], what: Optional[str]) -> None: ...

    def begin_step(self, **fields: Any) -> int: ...

    def resume_step(self, index: int) -> None: ...

    def end_step(self, index: int, group: Any = None, device: Any = None,
                 **fields: Any) -> None: ...


active: Optional[Listener] = None  # the open recording, if any (set by record())
OFF: ContextManager[None] = nullcontext()  # what every hook returns when tracing is off

Label = Tuple[int, Optional[int]]  # (stage, micro-batch)
_local = threading.local()  # the forward running on this thread, for its recomputation


def enabled() -> bool:
    """Whether anything wants spans: a recording, or an active profiler."""
    return active is not None or _profiler._is_profiler_enabled


def span(kind: EventKind, stage: int, microbatch: Optional[int] = None, *,
         peer: Optional[int] = None, what: Optional[str] = None) -> ContextManager[Any]:
    """A context that times its body as one event of ``stage`` (``OFF`` when tracing is
    off)."""
    if active is None and not _profiler._is_profiler_enabled:
        return OFF
    return _Span(kind, stage, microbatch, peer, what)


def current_label() -> Optional[Label]:
    """The (stage, micro-batch) of the forward running on this thread, while tracing; a
    checkpoint keeps it to name its recomputation, which may run on another thread."""
    if not enabled():
        return None
    return getattr(_local, "label", None)


def begin_step(schedule: Any, num_stages: int, num_ranks: int, num_microbatches: int = 0,
               backward: bool = True) -> Optional[int]:
    """A step starts; its index (events from now on belong to it), or ``None`` when not
    recording."""
    recorder = active
    if recorder is None:
        return None
    return recorder.begin_step(schedule=schedule, num_stages=num_stages, num_ranks=num_ranks,
                               num_microbatches=num_microbatches, backward=backward)


def resume_step(index: Optional[int]) -> None:
    """Events from now on belong to step ``index`` again (a local ``Pipe``'s backward)."""
    recorder = active
    if recorder is not None and index is not None:
        recorder.resume_step(index)


def end_step(index: Optional[int], group: Any = None, device: Any = None,
             **fields: Any) -> None:
    """Step ``index`` ended; ``fields`` complete its ``StepRecord``. ``group`` and
    ``device``: the process group a distributed step ran on, to gather ranks' events over."""
    recorder = active
    if recorder is not None and index is not None:
        recorder.end_step(index, group, device, **fields)


class _Span:
    """One timed interval; see ``span``."""

    __slots__ = ("kind", "stage", "microbatch", "peer", "what", "start", "_range", "_outer",
                 "_recorder")

    def __init__(self, kind: EventKind, stage: int, microbatch: Optional[int],
                 peer: Optional[int], what: Optional[str]) -> None:
        self.kind, self.stage, self.microbatch = kind, stage, microbatch
        self.peer, self.what = peer, what
        self._range: Any = None
        self._outer: Optional[Label] = None

    def __enter__(self) -> None:
        if _profiler._is_profiler_enabled:
            name = Event(self.kind, self.stage, 0.0, 0.0, self.microbatch, peer=self.peer,
                         what=self.what).name
            self._range = _profiler.record_function(name)
            self._range.__enter__()
        if self.kind is EventKind.FORWARD:
            self._outer = getattr(_local, "label", None)
            _local.label = (self.stage, self.microbatch)
        self._recorder = recorder = active
        self.start = recorder.clock() if recorder is not None else 0.0

    def __exit__(self, *exc: object) -> None:
        recorder = self._recorder
        if recorder is not None and recorder is active:  # still the same recording
            recorder.add(self.kind, self.stage, self.start, recorder.clock(), self.microbatch,
                         self.peer, self.what)
        if self.kind is EventKind.FORWARD:
            _local.label = self._outer
        if self._range is not None:
            self._range.__exit__(None, None, None)
