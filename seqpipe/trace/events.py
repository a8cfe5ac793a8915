"""What a recording holds: timed events of real pipeline steps, as plain data.

An :class:`Event` is one interval on one stage's timeline: an action of the schedule
(``F``, ``B``, ``I``, ``W``), a recomputation, the loss, a wait for a message, a send, or a
reduction (data-parallel or tied-weight). A :class:`StepRecord` says which schedule a step
ran, so the measured timeline can be replayed by :func:`seqpipe.schedule.simulate` with the
measured costs. Times are seconds on one clock: ``time.perf_counter()`` of the process
that recorded them, shifted onto the first rank's clock when ranks are merged.

Nothing here depends on how events are captured or drawn: the recorder fills a
:class:`Recording`; the writers (Chrome trace JSON, SVG) and the summary read it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from seqpipe.schedule.action import Phase

__all__ = ["CONTROL", "KIND_OF_PHASE", "WHATS", "Event", "EventKind", "StepRecord", "Recording",
           "What"]


class What:
    """The names an event's ``what`` takes: for waits and sends the message, for
    reductions which one. Both engines and every reader of a recording use these."""

    ACTIVATION = "activation"
    GRADIENT = "gradient"
    SKIP = "skip tensor"
    SKIP_GRAD = "skip gradient"
    STEP = "start of the step"
    DONE = "end of the step"
    LOSS = "loss"
    DATA_PARALLEL = "data parallel"
    TIES = "tied weights"


WHATS = (What.ACTIVATION, What.GRADIENT, What.SKIP, What.SKIP_GRAD, What.STEP, What.DONE,
         What.LOSS, What.DATA_PARALLEL, What.TIES)
"""Every ``What``, in the order that numbers them on the wire (``trace.gather``)."""

CONTROL = frozenset({What.STEP, What.DONE, What.LOSS})
"""Messages that open and close a call: waiting on them means waiting for a whole stage to
finish, which the data waits before it already name."""


class EventKind(str, enum.Enum):
    """What an event's interval was spent on."""

    FORWARD = "F"
    BACKWARD = "B"
    INPUT_GRAD = "I"
    WEIGHT_GRAD = "W"
    RECOMPUTE = "recompute"
    LOSS = "loss"
    WAIT = "wait"        # blocked on a message that had not arrived yet
    SEND = "send"
    REDUCE = "reduce"    # data-parallel or tied-weight gradient reduction

    @property
    def is_compute(self) -> bool:
        """Forward, backward halves, recomputation and loss: the stage's own work."""
        return self in _COMPUTE


KIND_OF_PHASE = {Phase.FORWARD: EventKind.FORWARD, Phase.BACKWARD: EventKind.BACKWARD,
                 Phase.BACKWARD_INPUT: EventKind.INPUT_GRAD,
                 Phase.BACKWARD_WEIGHT: EventKind.WEIGHT_GRAD}
"""The event kind that records each schedule phase."""

_COMPUTE = frozenset({EventKind.FORWARD, EventKind.BACKWARD, EventKind.INPUT_GRAD,
                      EventKind.WEIGHT_GRAD, EventKind.RECOMPUTE, EventKind.LOSS})


@dataclass(frozen=True)
class Event:
    """One timed interval on one stage.

    ``stage``: the pipeline stage the interval belongs to; ``rank``: the process that ran
    it (0 in a local ``Pipe``). ``microbatch``: the micro-batch it served, if any.
    ``peer``: the stage at the other end of a wait or send. ``what``: for waits and sends
    the message, for reductions which one (a :class:`What`). ``step``: the index of the
    recorded step it belongs to.
    """

    kind: EventKind
    stage: int
    start: float
    end: float
    microbatch: Optional[int] = None
    rank: int = 0
    peer: Optional[int] = None
    what: Optional[str] = None
    step: int = 0

    @property
    def duration(self) -> float:
        """Seconds from start to end."""
        return self.end - self.start

    @property
    def name(self) -> str:
        """The label a trace shows: ``F3``, ``I3``, ``recompute 3``,
        ``recv gradient 3 ← stage 2``, ``send activation 3 → stage 1``, ``reduce data parallel``."""
        i = "" if self.microbatch is None else str(self.microbatch)
        if self.kind in (EventKind.FORWARD, EventKind.BACKWARD, EventKind.INPUT_GRAD,
                         EventKind.WEIGHT_GRAD):
            return f"{self.kind.value}{i}"
        if self.kind is EventKind.WAIT:
            return _joined("recv", self.what, i, "←", self.peer)
        if self.kind is EventKind.SEND:
            return _joined("send", self.what, i, "→", self.peer)
        if self.kind is EventKind.REDUCE:
            return _joined("reduce", self.what, "", "", None)
        return _joined(self.kind.value, None, i, "", None)


def _joined(verb: str, what: Optional[str], i: str, arrow: str, peer: Optional[int]) -> str:
    words = [verb] + [w for w in (what, i) if w]
    if peer is not None:
        words += [arrow, f"stage {peer}"]
    return " ".join(words)


@dataclass(frozen=True)
class StepRecord:
    """One recorded step: when it ran and what it was asked to run.

    ``schedule`` is what ``seqpipe.schedule.simulate`` accepts (a name or a schedule
    object); ``num_ranks`` the rows the simulator replays (devices of a local ``Pipe``).
    ``backward``: whether the step ran backward actions too (``False`` for a forward-only
    call, e.g. evaluation, where only the schedule's forwards ran).
    """

    index: int
    start: float
    end: float
    schedule: Any
    num_stages: int
    num_ranks: int
    num_microbatches: int
    backward: bool = True


@dataclass
class Recording:
    """Every event of the recorded steps, in order of start time once ``finish`` ran."""

    events: List[Event] = field(default_factory=list)
    steps: List[StepRecord] = field(default_factory=list)

    def finish(self) -> None:
        """Sort events by (start, stage) so writers and summaries read them in time order."""
        self.events.sort(key=lambda e: (e.start, e.stage, e.end))

    def stages(self) -> List[Tuple[int, int]]:
        """Every (rank, stage) that has an event, in order: one timeline track each."""
        return sorted({(e.rank, e.stage) for e in self.events})
