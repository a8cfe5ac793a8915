"""What a recording says in numbers: where each stage's time went, the measured bubble,
the simulator's plan for the same schedule with the measured costs, and the biggest wait.

Per stage (one track per rank and stage), a step's span splits into four parts that add up
to it: *busy* (its own work: forward, backward halves, recomputation, loss), *comm*
(sending and gradient reductions, when not busy), *waiting* (blocked on a message that had
not arrived, when neither) and *idle* (the rest: nothing to do, or time the engine spends
outside the actions). The *bubble* is the share of the devices' time not busy, as the
simulator defines it: ``1 - busy / (devices * span)``, a device being the rank (or, in a
local ``Pipe``, the device) that holds the stages.

The prediction is ``seqpipe.trace.costs``'s: the step's schedule replayed with its
measured per-stage median costs.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from seqpipe.schedule import SCHEDULES, Simulation, get_schedule, placement_of
from seqpipe.trace.costs import predict
from seqpipe.trace.empty import require_events
from seqpipe.trace.events import CONTROL, Event, EventKind, Recording, StepRecord, What

__all__ = ["StageTime", "StepSummary", "Summary", "describe_wait", "summarize"]

_COMM = frozenset({EventKind.SEND, EventKind.REDUCE})
_PLURAL = {What.ACTIVATION: "activations", What.GRADIENT: "gradients", What.SKIP: "skip tensors",
           What.SKIP_GRAD: "skip gradients", What.STEP: "the start of the step",
           What.DONE: "the end of the step", What.LOSS: "the loss"}
"""How a wait's message reads after "waited ... for" (others read as they are)."""


@dataclass(frozen=True)
class StageTime:
    """Seconds one stage (on one rank) spent busy, communicating, waiting and idle."""

    rank: int
    stage: int
    busy: float
    comm: float
    waiting: float
    idle: float

    @property
    def span(self) -> float:
        """The four parts together: the step's span."""
        return self.busy + self.comm + self.waiting + self.idle

    def __add__(self, other: StageTime) -> StageTime:
        return StageTime(self.rank, self.stage, self.busy + other.busy,
                         self.comm + other.comm, self.waiting + other.waiting,
                         self.idle + other.idle)


@dataclass(frozen=True)
class StepSummary:
    """One recorded step: its span, per-stage times, bubble, costs and prediction.

    ``span``: seconds from the step's start (or its first event, if earlier) to its end
    (or its last event). ``stages``: per (rank, stage) track, in order. ``devices``: how
    many devices (ranks, or a local ``Pipe``'s devices) ran its stages, ``device_busy``
    their busy seconds together. ``costs`` maps ``"F"``, ``"B"``, ``"I"``, ``"W"`` to the
    per-stage median seconds fed to the simulator; ``predicted`` is its replay (``None``
    with the reason in ``note`` when a stage has no measurement to replay).
    ``multi_rank_stages``: some stage ran on several ranks (data parallel), so waits name
    their rank.
    """

    index: int
    schedule: str
    num_microbatches: int
    span: float
    stages: List[StageTime]
    devices: int
    device_busy: float
    costs: Dict[str, List[float]]
    predicted: Optional[Simulation]
    note: Optional[str]
    biggest_wait: Optional[Event]
    multi_rank_stages: bool = False

    @property
    def bubble(self) -> float:
        """Share of the devices' time (``devices * span``) not busy."""
        return 1 - _ratio(self.device_busy, self.devices * self.span)

    def __str__(self) -> str:
        chunks = format_count(self.num_microbatches, "micro-batch")
        lines = [f"step {self.index} ({self.schedule}, {chunks}): "
                 f"{_vs_plan(self.span, self.bubble, self.predicted)}"]
        lines += _table(self.stages)
        lines += _cost_lines(self.costs)
        if self.note:
            lines.append(f"no simulation: {self.note}")
        if self.biggest_wait is not None:
            lines.append("biggest wait: "
                         + describe_wait(self.biggest_wait, self.multi_rank_stages))
        return "\n".join(lines)


@dataclass(frozen=True)
class Summary:
    """Every recorded step's summary (``steps``, in order) and their totals (``stages``:
    per (rank, stage) sums over the steps)."""

    steps: List[StepSummary]
    stages: List[StageTime]

    @property
    def span(self) -> float:
        """Seconds of all recorded steps together."""
        return sum(s.span for s in self.steps)

    @property
    def bubble(self) -> float:
        """The measured bubble over all steps (device time weighted)."""
        busy = sum(s.device_busy for s in self.steps)
        return 1 - _ratio(busy, sum(s.devices * s.span for s in self.steps))

    @property
    def predicted_span(self) -> Optional[float]:
        """The simulated makespans summed; ``None`` if a step has no prediction."""
        if any(s.predicted is None for s in self.steps):
            return None
        return sum(s.predicted.makespan for s in self.steps)  # type: ignore[union-attr]

    @property
    def predicted_bubble(self) -> Optional[float]:
        """The simulated bubble over all steps; ``None`` if a step has no prediction."""
        sims = [s.predicted for s in self.steps]
        if any(sim is None for sim in sims):
            return None
        busy = sum(sum(sim.busy_time) for sim in sims)  # type: ignore[union-attr]
        total = sum(sim.num_ranks * sim.makespan for sim in sims)  # type: ignore[union-attr]
        return 1 - _ratio(busy, total)

    @property
    def biggest_wait(self) -> Optional[Event]:
        """The longest wait of any step."""
        waits = [s.biggest_wait for s in self.steps if s.biggest_wait is not None]
        return max(waits, key=lambda e: e.duration, default=None)

    def oneline(self) -> str:
        """One line: time per step, bubble against the plan, and the biggest wait."""
        n = len(self.steps)
        text = (f"trace: {format_count(n, 'step')}, "
                f"{_vs_plan(self.span / n, self.bubble, None, self._plan_per_step())}")
        wait = self.biggest_wait
        if wait is not None:
            text += "; biggest wait: " + describe_wait(wait, self._multi_rank())
        return text

    def _plan_per_step(self) -> Optional[Tuple[float, float]]:
        predicted = self.predicted_span
        if predicted is None:
            return None
        return predicted / len(self.steps), self.predicted_bubble  # type: ignore[return-value]

    def _multi_rank(self) -> bool:
        return any(s.multi_rank_stages for s in self.steps)

    def __str__(self) -> str:
        n = len(self.steps)
        if n == 1:
            return str(self.steps[0])
        schedules = ", ".join(sorted({s.schedule for s in self.steps}))
        lines = [f"{n} steps recorded ({schedules}); "
                 f"per step {_vs_plan(self.span / n, self.bubble, None, self._plan_per_step())}",
                 "all steps:"]
        lines += _table(self.stages)
        wait = self.biggest_wait
        if wait is not None:
            lines.append(f"biggest wait: {describe_wait(wait, self._multi_rank())} "
                         f"(step {wait.step})")
        for step in self.steps:
            lines += ["", str(step)]
        return "\n".join(lines)


def summarize(recording: Recording) -> Summary:
    """Summarise every recorded step (those with events) and their totals.

    Raises ``ValueError`` for a recording without events, or with events of a step it
    has no :class:`~seqpipe.trace.events.StepRecord` for.
    """
    require_events(recording, "summarise")
    by_step = _events_by_step(recording)
    steps = [_summarize_step(record, by_step[record.index])
             for record in sorted(recording.steps, key=lambda r: r.index)
             if by_step.get(record.index)]
    totals: Dict[Tuple[int, int], StageTime] = {}
    for step in steps:
        for t in step.stages:
            key = (t.rank, t.stage)
            totals[key] = totals[key] + t if key in totals else t
    return Summary(steps, [totals[k] for k in sorted(totals)])


def describe_wait(event: Event, with_rank: bool = False) -> str:
    """``stage 1 waited 38.0 ms for gradients of micro-batch 0 from stage 2``."""
    who = f"stage {event.stage}" + (f" on rank {event.rank}" if with_rank else "")
    text = f"{who} waited {format_time(event.duration)}"
    if event.what:
        text += f" for {_PLURAL.get(event.what, event.what)}"
    if event.microbatch is not None:
        text += f" {'of' if event.what else 'for'} micro-batch {event.microbatch}"
    if event.peer is not None:
        text += f" from stage {event.peer}"
    return text


def _biggest(waits: Sequence[Event]) -> Optional[Event]:
    """The longest wait for data (activations, gradients, skips); the longest wait of any
    kind only when no data wait was recorded."""
    data = [e for e in waits if e.what not in CONTROL]
    return max(data or waits, key=lambda e: e.duration, default=None)


def _events_by_step(recording: Recording) -> Dict[int, List[Event]]:
    known = {r.index for r in recording.steps}
    by_step: Dict[int, List[Event]] = defaultdict(list)
    for e in recording.events:
        if e.step not in known:
            raise ValueError(f"event {e.name!r} on stage {e.stage} belongs to step {e.step}, "
                             f"but the recording has no step record for it (steps: "
                             f"{sorted(known)}); add a StepRecord for every step")
        by_step[e.step].append(e)
    return by_step


def _summarize_step(record: StepRecord, events: List[Event]) -> StepSummary:
    lo = min([record.start] + [e.start for e in events])
    hi = max([record.end] + [e.end for e in events])
    tracks: Dict[Tuple[int, int], List[Event]] = defaultdict(list)
    for e in events:
        tracks[(e.rank, e.stage)].append(e)
    stages = [StageTime(rank, stage, *_account(tracks[(rank, stage)], lo, hi))
              for rank, stage in sorted(tracks)]
    devices = _device_busy(record, tracks, lo, hi)
    costs, sim, note = predict(record, events)
    waits = [e for e in events if e.kind is EventKind.WAIT]
    ranks_per_stage = defaultdict(set)
    for rank, stage in tracks:
        ranks_per_stage[stage].add(rank)
    return StepSummary(
        index=record.index, schedule=_schedule_name(record.schedule),
        num_microbatches=record.num_microbatches, span=hi - lo, stages=stages,
        devices=len(devices), device_busy=sum(devices.values()), costs=costs,
        predicted=sim, note=note,
        biggest_wait=_biggest(waits),
        multi_rank_stages=any(len(r) > 1 for r in ranks_per_stage.values()))


def _account(events: Iterable[Event], lo: float, hi: float) -> Tuple[float, float, float,
                                                                     float]:
    """Busy, comm, waiting and idle seconds of one track in ``[lo, hi]``.

    Where intervals overlap, the time counts once, for the first of busy > comm > waiting.
    """
    edges: List[Tuple[float, int, int]] = []
    for e in events:
        level = 0 if e.kind.is_compute else 1 if e.kind in _COMM else 2
        start, end = max(e.start, lo), min(e.end, hi)
        if end > start:
            edges += [(start, 1, level), (end, -1, level)]
    edges.sort()
    active = [0, 0, 0]
    parts = [0.0, 0.0, 0.0, 0.0]
    now = lo
    for t, delta, level in edges:
        parts[_top(active)] += t - now
        active[level] += delta
        now = t
    parts[3] += hi - now
    return parts[0], parts[1], parts[2], parts[3]


def _top(active: List[int]) -> int:
    """The highest-priority part with an open interval; 3 (idle) when none is."""
    return next((level for level, n in enumerate(active) if n > 0), 3)


def _device_busy(record: StepRecord, tracks: Dict[Tuple[int, int], List[Event]],
                 lo: float, hi: float) -> Dict[Tuple[int, int], float]:
    """Busy seconds per device: a process rank and the simulated rank of its stages."""
    placement = placement_of(get_schedule(record.schedule), record.num_ranks)
    grouped: Dict[Tuple[int, int], List[Event]] = defaultdict(list)
    for (rank, stage), events in tracks.items():
        sim_rank = placement.rank_of(stage) if stage < placement.num_stages else stage
        grouped[(rank, sim_rank)] += [e for e in events if e.kind.is_compute]
    return {device: _account(events, lo, hi)[0] for device, events in grouped.items()}


def _schedule_name(schedule: Any) -> str:
    """A built-in's registry name (``"1f1b"``), else the schedule's repr or class name."""
    if isinstance(schedule, str):
        return schedule
    for name, make in SCHEDULES.items():
        if type(schedule) is make and schedule == make():
            return name
    text = repr(schedule)
    return type(schedule).__name__ if text.startswith("<") else text


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def format_time(seconds: float) -> str:
    """Seconds as milliseconds with three significant digits (seconds from 10 s on)."""
    if seconds >= 10:
        return f"{seconds:.1f} s"
    v = seconds * 1e3
    for digits, below in ((2, 9.995), (1, 99.95)):
        if v < below:
            return f"{v:.{digits}f} ms"
    return f"{v:.0f} ms"


def format_count(n: int, noun: str) -> str:
    """``1 step``, ``2 steps``, ``4 micro-batches``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}es" if noun.endswith("ch") else f"{n} {noun}s"


def format_share(fraction: float) -> str:
    """A fraction as a percentage: ``23.1 %``."""
    return f"{100 * fraction:.1f} %"


def _vs_plan(span: float, bubble: float, sim: Optional[Simulation],
             plan: Optional[Tuple[float, float]] = None) -> str:
    """``120 ms, bubble 23.1 % (simulated: 110 ms, bubble 15.0 %)``."""
    if sim is not None:
        plan = (sim.makespan, sim.bubble_fraction)
    text = f"{format_time(span)}, bubble {format_share(bubble)}"
    if plan is not None:
        text += (f" (simulated with the measured costs: {format_time(plan[0])}, "
                 f"bubble {format_share(plan[1])})")
    return text


def _table(stages: Sequence[StageTime]) -> List[str]:
    """Per stage busy / comm / waiting / idle in ms and as shares of the span."""
    multi = len({t.rank for t in stages}) > 1 and any(t.rank != t.stage for t in stages)
    heads = "".join(f"{h:>10}{'':6}" for h in ("busy", "comm", "waiting", "idle"))
    rows = [("  " + " " * 16 + heads).rstrip()]
    for t in stages:
        label = f"rank {t.rank} stage {t.stage}" if multi else f"stage {t.stage}"
        cells = "".join(f"{format_time(v):>10} {_share(v, t.span):>5}"
                        for v in (t.busy, t.comm, t.waiting, t.idle))
        rows.append(f"  {label:<16}{cells}")
    return rows


def _share(value: float, span: float) -> str:
    return f"{100 * _ratio(value, span):.0f}%"


def _cost_lines(costs: Dict[str, List[float]]) -> List[str]:
    if not costs:
        return []
    parts = [f"{letter} " + " / ".join(format_time(c) for c in values)
             for letter, values in costs.items() if values]
    return ["median cost per action, stage 0 / 1 / ...: " + "; ".join(parts)]
