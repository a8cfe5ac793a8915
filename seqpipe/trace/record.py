"""``seqpipe.trace.record()``: measure what real pipeline steps did.

Inside ``with seqpipe.trace.record() as rec:`` every step of a ``Pipe`` or a
``DistributedPipe`` is recorded, per stage: forwards, backwards (``I`` and ``W`` where the
schedule splits them), recomputations, waits for messages, sends, data-parallel and
tied-weight reductions and the loss, each with its start and end on this process's clock
(``time.perf_counter``). The engines report through ``seqpipe.trace.hooks``; while no
recording is open (and no profiler runs) they skip every hook without allocating.

For a ``DistributedPipe`` every rank records its own events; at the end of the block
(collective: every rank of the pipeline must leave it, without an exception) they are
gathered to the pipeline's first rank over the pipe's group, shifted onto that rank's
clock (see ``seqpipe.trace.gather``), and its ``rec.recording`` holds all of them; the
other ranks keep their own.
"""
from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

import torch.distributed as dist

from seqpipe.trace import hooks
from seqpipe.trace.events import Event, EventKind, Recording, StepRecord

__all__ = ["Recorder", "record"]

Row = Tuple[EventKind, int, float, float, Optional[int], Optional[int], Optional[str], int]


def record(*, gather: bool = True, clock: Callable[[], float] = time.perf_counter) -> "Recorder":
    """Record the pipeline steps run inside ``with seqpipe.trace.record() as rec:``.

    ``gather``: at the end of the block, gather the events of a ``DistributedPipe``'s
    ranks to its first rank (a collective over the pipe's group; with ``False``, call
    ``rec.gather(pipe)`` on every rank yourself). ``clock``: seconds, monotonic
    (``time.perf_counter``; another clock is for tests of the offset estimation).
    """
    return Recorder(clock=clock, gather=gather)


class Recorder:
    """An open (or finished) recording; see ``record``.

    ``recording``: the events and steps (a ``seqpipe.trace.Recording``); ``summary()``,
    ``to_chrome(path)`` and ``to_svg(path)`` read it.
    """

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter,
                 gather: bool = True) -> None:
        self.clock = clock
        self.rank = 0
        self._gather_at_exit = gather
        self._rows: List[Row] = []
        self._lock = threading.Lock()
        self._open: Dict[int, Dict[str, Any]] = {}
        self._steps: List[StepRecord] = []
        self._count = 0
        self._step = 0
        self._pipes: Dict[int, Tuple[Any, Any]] = {}  # id(group) -> (group, device)
        self._merged: Optional[Recording] = None

    # -- the block ---------------------------------------------------------------------
    def __enter__(self) -> "Recorder":
        if hooks.active is not None:
            raise RuntimeError("a seqpipe.trace.record() block is already open; recordings "
                               "do not nest: record the steps in the outer block")
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        hooks.active = self
        return self

    def __exit__(self, kind: Optional[Type[BaseException]], error: Optional[BaseException],
                 traceback: Optional[TracebackType]) -> None:
        hooks.active = None
        pipes, self._pipes = list(self._pipes.values()), {}
        if kind is not None or not self._gather_at_exit or not pipes:
            return
        if len(pipes) > 1:
            raise RuntimeError("DistributedPipes on several process groups ran in this "
                               "record() block; gather each yourself: record(gather=False), "
                               "then rec.gather(pipe) on every rank")
        self._gather(*pipes[0])

    # -- what the engines report (seqpipe.trace.hooks) ---------------------------------
    def add(self, kind: EventKind, stage: int, start: float, end: float,
            microbatch: Optional[int], peer: Optional[int], what: Optional[str]) -> None:
        """One event of the current step (any thread)."""
        row = (kind, stage, start, end, microbatch, peer, what, self._step)
        with self._lock:
            self._rows.append(row)

    def begin_step(self, **fields: Any) -> int:
        """A step starts: its index; ``fields`` are ``StepRecord``'s, completed at its end."""
        with self._lock:
            index, self._count = self._count, self._count + 1
            self._open[index] = dict(fields, start=self.clock())
            self._step = index
        return index

    def resume_step(self, index: int) -> None:
        """Events from now on belong to step ``index``."""
        self._step = index

    def end_step(self, index: int, group: Any = None, device: Any = None,
                 **fields: Any) -> None:
        """Step ``index`` ended; a distributed one names its ``group`` and ``device``."""
        end = self.clock()
        with self._lock:
            opened = self._open.pop(index, None)
            if opened is None:  # begun before this recording
                return
            opened.update(fields)
            self._steps.append(StepRecord(index=index, end=end, **opened))
            if device is not None:
                self._pipes.setdefault(id(group), (group, device))

    # -- reading -----------------------------------------------------------------------
    @property
    def recording(self) -> Recording:
        """The recorded events and steps, in time order (all ranks' on the first rank of a
        distributed pipeline, once gathered)."""
        if self._merged is not None:
            return self._merged
        return self._local()

    def _local(self) -> Recording:
        with self._lock:
            rows, steps, unfinished = list(self._rows), list(self._steps), dict(self._open)
        events = [Event(kind, stage, start, end, mb, self.rank, peer, what, step)
                  for kind, stage, start, end, mb, peer, what, step in rows]
        for index, fields in unfinished.items():  # a forward whose backward never ran
            ends = [e.end for e in events if e.step == index]
            steps.append(StepRecord(index=index, end=max(ends, default=fields["start"]),
                                    **fields))
        recording = Recording(events, sorted(steps, key=lambda s: s.index))
        recording.finish()
        return recording

    def gather(self, pipe: Any) -> None:
        """Gather every rank's events of ``pipe`` (a ``DistributedPipe``) to its first rank,
        on that rank's clock. Collective over the pipe's group: call it on every rank."""
        self._gather(pipe.group, pipe.device)

    def _gather(self, group: Any, device: Any) -> None:
        from seqpipe.trace.gather import gather_recording

        self._merged = gather_recording(self._local(), group, device, self.clock)

    def summary(self) -> Any:
        """Per-stage busy, waiting and idle time and the bubble, against the simulator's
        prediction for the same schedule and costs (``seqpipe.trace.summary``)."""
        from seqpipe.trace.summary import summarize

        return summarize(self.recording)

    def to_chrome(self, path: Any) -> None:
        """Write a Chrome trace event JSON file (Perfetto, chrome://tracing)."""
        from seqpipe.trace.chrome import write_chrome

        write_chrome(self.recording, path)

    def to_svg(self, path: Any) -> None:
        """Draw the measured Gantt chart, next to the simulated one, as an SVG file."""
        from seqpipe.trace.svg import write_svg

        write_svg(self.recording, path)
