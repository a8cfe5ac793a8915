"""Pipeline schedules: the order in which each stage runs its forwards and backwards.

A schedule is plain data. For every stage it lists the forward (``F``) and backward (``B``)
passes of the micro-batches in the order that stage executes them. The same schedule object
drives the local engine (one thread per stage) and the distributed engine (one process per
stage), so it lives here with no dependency on ``torch`` or ``torch.distributed``.

Engines enforce the data dependencies by waiting to receive:

* ``F(s, i)`` needs ``F(s - 1, i)`` (the activation from the previous stage);
* ``B(s, i)`` needs ``F(s, i)`` on the same stage and ``B(s + 1, i)`` (the gradient from the
  next stage).

Sends are buffered, so a stage only ever blocks on a receive. A bad order therefore shows up
as a hang across processes, which is why :func:`validate_schedule` replays the schedule
against those rules *before* any communication and names the stages that would block.
:func:`simulate` replays the same rules with costs to report the timeline, the bubble and
the peak number of live micro-batches per stage.
"""
from __future__ import annotations

import enum
import math
from bisect import bisect_right
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import ClassVar, Protocol, runtime_checkable

__all__ = [
    "Action",
    "B",
    "F",
    "FillDrain",
    "OneFOneB",
    "Phase",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "backward",
    "backward_phase",
    "forward",
    "forward_phase",
    "get_schedule",
    "simulate",
    "validate_schedule",
]


class Phase(str, enum.Enum):
    """Which pass an action runs."""

    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True)
class Action:
    """One pass of one micro-batch on a stage, e.g. ``F3`` or ``B3``."""

    phase: Phase
    microbatch: int

    def __post_init__(self) -> None:
        if not isinstance(self.phase, Phase):
            try:
                object.__setattr__(self, "phase", Phase(self.phase))
            except ValueError:
                raise TypeError(f"phase must be a Phase, got {self.phase!r}") from None
        if isinstance(self.microbatch, bool) or not isinstance(self.microbatch, int):
            raise TypeError(f"microbatch must be an int, got {self.microbatch!r}")
        if self.microbatch < 0:
            raise ValueError(f"microbatch must be >= 0, got {self.microbatch}")

    @classmethod
    def forward(cls, microbatch: int) -> Action:
        """The forward pass of ``microbatch``."""
        return cls(Phase.FORWARD, microbatch)

    @classmethod
    def backward(cls, microbatch: int) -> Action:
        """The backward pass of ``microbatch``."""
        return cls(Phase.BACKWARD, microbatch)

    @property
    def is_forward(self) -> bool:
        """True for a forward pass."""
        return self.phase is Phase.FORWARD

    def __str__(self) -> str:
        return f"{'F' if self.is_forward else 'B'}{self.microbatch}"

    def __repr__(self) -> str:
        return f"{'F' if self.is_forward else 'B'}({self.microbatch})"


def forward(microbatch: int) -> Action:
    """The forward pass of ``microbatch`` (short for ``Action.forward``)."""
    return Action.forward(microbatch)


def backward(microbatch: int) -> Action:
    """The backward pass of ``microbatch`` (short for ``Action.backward``)."""
    return Action.backward(microbatch)


F = forward
B = backward


def forward_phase(actions: Iterable[Action]) -> list[Action]:
    """The forwards of a stage's action list, in schedule order."""
    return [a for a in actions if a.phase is Phase.FORWARD]


def backward_phase(actions: Iterable[Action]) -> list[Action]:
    """The backwards of a stage's action list, in schedule order."""
    return [a for a in actions if a.phase is Phase.BACKWARD]


class ScheduleError(ValueError):
    """A schedule is malformed or would deadlock."""


@runtime_checkable
class Schedule(Protocol):
    """Anything that can list, per stage, the actions that stage runs in order."""

    def actions(self, stage: int, num_stages: int, num_microbatches: int) -> Sequence[Action]:
        """The ordered actions of ``stage`` in a ``num_stages``-stage pipeline."""
        ...


def _check_stage_args(stage: int, num_stages: int, num_microbatches: int) -> None:
    """Reject arguments the built-in schedules cannot lay out."""
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(
            f"need num_stages >= 1 and num_microbatches >= 1, got {num_stages}, {num_microbatches}"
        )
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in 0..{num_stages - 1}, got {stage}")


@dataclass(frozen=True)
class FillDrain:
    """GPipe: every forward, then every backward in reverse micro-batch order.

    Simple, but each stage holds the activations of all ``M`` micro-batches at once.
    """

    name: ClassVar[str] = "fill_drain"

    def actions(self, stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
        """``F0 .. F(M-1)`` then ``B(M-1) .. B0``."""
        _check_stage_args(stage, num_stages, num_microbatches)
        m = num_microbatches
        return [forward(i) for i in range(m)] + [backward(i) for i in reversed(range(m))]


@dataclass(frozen=True)
class OneFOneB:
    """1F1B (PipeDream-flush): warm up, then alternate one forward and one backward.

    Stage ``s`` runs ``K - s - 1`` warm-up forwards, so it never holds more than
    ``min(K - s, M)`` micro-batches' activations, with the same bubble as fill-drain.
    """

    name: ClassVar[str] = "1f1b"

    def actions(self, stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
        """Warm-up forwards, steady ``F(w+j), B(j)`` pairs, then the remaining backwards."""
        _check_stage_args(stage, num_stages, num_microbatches)
        m = num_microbatches
        warmup = min(num_stages - stage - 1, m)
        order = [forward(i) for i in range(warmup)]
        for j in range(m - warmup):
            order += [forward(warmup + j), backward(j)]
        order += [backward(j) for j in range(m - warmup, m)]
        return order


_BUILTINS: dict[str, type] = {"fill_drain": FillDrain, "gpipe": FillDrain, "1f1b": OneFOneB}


def get_schedule(name_or_schedule: str | Schedule) -> Schedule:
    """Resolve a schedule name (``"fill_drain"``, ``"gpipe"``, ``"1f1b"``) or pass one through."""
    if isinstance(name_or_schedule, str):
        key = name_or_schedule.strip().lower().replace("-", "_")
        if key not in _BUILTINS:
            valid = ", ".join(repr(n) for n in _BUILTINS)
            raise ValueError(f"unknown schedule {name_or_schedule!r}; valid names: {valid}")
        return _BUILTINS[key]()
    if isinstance(name_or_schedule, type):
        raise TypeError(
            f"expected a schedule instance, got the class {name_or_schedule.__name__}; "
            f"use {name_or_schedule.__name__}()"
        )
    if not callable(getattr(name_or_schedule, "actions", None)):
        raise TypeError(
            "expected a schedule name or an object with "
            "actions(stage, num_stages, num_microbatches), "
            f"got {type(name_or_schedule).__name__}"
        )
    return name_or_schedule


# --- Structural checks -------------------------------------------------------------------
#
# Internally an action is an int code, ``2 * microbatch + (1 if backward else 0)``, so the
# checks and the walk index flat lists instead of hashing Action objects.


def _code(action: Action) -> int:
    return 2 * action.microbatch + (0 if action.is_forward else 1)


def _decode(code: int) -> Action:
    return Action(Phase.BACKWARD if code & 1 else Phase.FORWARD, code >> 1)


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    """Reject a pipeline shape that is not a positive integer pair."""
    for label, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ScheduleError(f"{label} must be an int, got {value!r}")
        if value < 1:
            raise ScheduleError(f"{label} must be >= 1, got {value}")


def _stage_actions(schedule: Schedule, stage: int, num_stages: int, m: int) -> list[Action]:
    """Fetch one stage's list and check its items are Actions of existing micro-batches."""
    raw = schedule.actions(stage, num_stages, m)
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Iterable):
        raise ScheduleError(
            f"stage {stage}: actions() returned {type(raw).__name__}, "
            "expected a sequence of Action"
        )
    items = list(raw)
    for pos, item in enumerate(items):
        if not isinstance(item, Action):
            raise ScheduleError(
                f"stage {stage}: item {pos} is {item!r} ({type(item).__name__}), "
                "expected an Action"
            )
        if item.microbatch >= m:
            raise ScheduleError(
                f"stage {stage}: {item} refers to micro-batch {item.microbatch}, "
                f"but there are only {m} (0..{m - 1})"
            )
    return items


def _check_stage_order(stage: int, codes: list[int], m: int) -> None:
    """Each F(i) and B(i) exactly once, and B(i) after F(i)."""
    where = [-1] * (2 * m)
    for pos, code in enumerate(codes):
        if where[code] >= 0:
            raise ScheduleError(
                f"stage {stage}: {_decode(code)} appears more than once "
                f"(positions {where[code]} and {pos})"
            )
        where[code] = pos
    missing = [str(_decode(code)) for code, pos in enumerate(where) if pos < 0]
    if missing:
        shown = ", ".join(missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise ScheduleError(f"stage {stage}: missing {len(missing)} action(s): {shown}")
    for i in range(m):
        if where[2 * i + 1] < where[2 * i]:
            raise ScheduleError(
                f"stage {stage}: backward of micro-batch {i} comes before its forward"
            )


def _collect(
    schedule: str | Schedule, num_stages: int, num_microbatches: int
) -> tuple[list[list[Action]], list[list[int]]]:
    """Every stage's action list and its codes, after the per-stage structural checks."""
    schedule = get_schedule(schedule)
    _check_sizes(num_stages, num_microbatches)
    lists, codes = [], []
    for stage in range(num_stages):
        items = _stage_actions(schedule, stage, num_stages, num_microbatches)
        stage_codes = [_code(a) for a in items]
        _check_stage_order(stage, stage_codes, num_microbatches)
        lists.append(items)
        codes.append(stage_codes)
    return lists, codes


# --- Dependency walk (shared by the validator and the simulator) ---------------------------


def _source(stage: int, code: int, num_stages: int) -> int:
    """The stage ``code`` receives its input from, or -1 if it receives nothing."""
    src = stage + 1 if code & 1 else stage - 1
    return src if 0 <= src < num_stages else -1


def _deadlock(blocked: dict[int, int], num_stages: int) -> ScheduleError:
    """Name every stage that can no longer move, and what it waits for."""
    parts = []
    for s, code in sorted(blocked.items()):
        action = _decode(code)
        parts.append(f"stage {s} waits at {action} for {action} from stage "
                     f"{_source(s, code, num_stages)}")
    return ScheduleError("deadlock: " + "; ".join(parts))


def _walk(
    codes: list[list[int]], fwd_cost: list[float], bwd_cost: list[float]
) -> list[list[float]]:
    """Run every stage as far as its dependencies allow; return start times or raise on deadlock.

    Each stage runs its list in order; an action starts when its stage is free and the action
    it receives from (if any) has ended. Orders are already checked, so the same-stage forward
    of a backward has always ended before it.
    """
    k = len(codes)
    ends: list[list[float | None]] = [[None] * len(c) for c in codes]
    starts: list[list[float]] = [[] for _ in range(k)]
    pos, free = [0] * k, [0.0] * k
    blocked: dict[int, int] = {}  # stage -> code it is stuck at
    ready = deque(range(k))
    while ready:
        s = ready.popleft()
        row, row_ends, row_starts = codes[s], ends[s], starts[s]
        while pos[s] < len(row):
            code = row[pos[s]]
            src = s + 1 if code & 1 else s - 1  # see _source; inlined, this loop is hot
            start = free[s]
            if 0 <= src < k:
                dep_end = ends[src][code]
                if dep_end is None:
                    blocked[s] = code
                    break
                start = max(start, dep_end)
            row_starts.append(start)
            free[s] = row_ends[code] = start + (bwd_cost[s] if code & 1 else fwd_cost[s])
            pos[s] += 1
            dst = s - 1 if code & 1 else s + 1  # the only stage that can wait for this
            if blocked.get(dst) == code:
                del blocked[dst]
                ready.append(dst)
    if blocked:
        raise _deadlock(blocked, k)
    return starts


def validate_schedule(
    schedule: str | Schedule, num_stages: int, num_microbatches: int
) -> None:
    """Raise :class:`ScheduleError` unless every stage can run its whole list.

    Checks each stage's list holds every ``F(i)``/``B(i)`` once with ``B(i)`` after ``F(i)``,
    then replays the dependency rules and names each stage that would block forever.
    """
    _, codes = _collect(schedule, num_stages, num_microbatches)
    _walk(codes, [0.0] * num_stages, [0.0] * num_stages)


# --- Simulation ----------------------------------------------------------------------------

Cost = float | Sequence[float]


@dataclass(frozen=True)
class Simulation:
    """The replayed timeline of a schedule and the numbers derived from it."""

    num_stages: int
    num_microbatches: int
    timeline: list[list[tuple[float, float, Action]]]
    """Per stage, ``(start, end, action)`` in execution order."""
    makespan: float
    """When the last action on any stage ends."""
    bubble_fraction: float
    """Share of ``num_stages * makespan`` that stages spend idle."""
    peak_live_microbatches: list[int]
    """Per stage, the most micro-batches with forward done and backward not yet done."""
    busy_time: list[float]
    """Per stage, the total time spent running actions."""

    def chart(self, unit: float = 1.0) -> str:
        """A text Gantt chart, one row per stage and one column per ``unit`` of time."""
        if unit <= 0:
            raise ValueError(f"unit must be > 0, got {unit}")
        columns = math.ceil(self.makespan / unit - 1e-9)
        width = len(f"B{self.num_microbatches - 1}")
        rows = []
        for s, row in enumerate(self.timeline):
            starts = [start for start, _, _ in row]
            cells = []
            for c in range(columns):
                t = (c + 0.5) * unit
                idx = bisect_right(starts, t) - 1
                hit = idx >= 0 and row[idx][0] <= t < row[idx][1]
                cells.append(str(row[idx][2]) if hit else ".")
            rows.append(f"stage {s}: " + " ".join(cell.ljust(width) for cell in cells).rstrip())
        return "\n".join(rows)


def _per_stage(cost: Cost, num_stages: int, label: str) -> list[float]:
    """Expand a scalar or per-stage cost into one non-negative float per stage."""
    values = [cost] * num_stages if isinstance(cost, Real) else list(cost)  # type: ignore[arg-type]
    if len(values) != num_stages:
        raise ValueError(f"{label} needs {num_stages} per-stage values, got {len(values)}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, Real):
            raise TypeError(f"{label} must be a number or a sequence of numbers, got {v!r}")
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{label} must be finite and >= 0, got {v!r}")
    return [float(v) for v in values]


def _peak_live(actions: Sequence[Action]) -> int:
    """Most micro-batches between their forward and backward along one stage's order."""
    live = peak = 0
    for action in actions:
        live += 1 if action.is_forward else -1
        peak = max(peak, live)
    return peak


def simulate(
    schedule: str | Schedule,
    num_stages: int,
    num_microbatches: int,
    *,
    forward_cost: Cost = 1.0,
    backward_cost: Cost = 2.0,
) -> Simulation:
    """Replay a schedule with per-action costs (scalars or one per stage).

    Validates like :func:`validate_schedule` (raising :class:`ScheduleError`) and reports
    when each action runs, the makespan, the bubble and the peak live micro-batches.
    """
    lists, codes = _collect(schedule, num_stages, num_microbatches)
    fwd = _per_stage(forward_cost, num_stages, "forward_cost")
    bwd = _per_stage(backward_cost, num_stages, "backward_cost")
    starts = _walk(codes, fwd, bwd)
    timeline = [
        [(t, t + (fwd[s] if a.is_forward else bwd[s]), a) for t, a in zip(row, items, strict=True)]
        for s, (row, items) in enumerate(zip(starts, lists, strict=True))
    ]
    makespan = max(row[-1][1] for row in timeline)
    busy = [sum(end - start for start, end, _ in row) for row in timeline]
    bubble = 1.0 - sum(busy) / (num_stages * makespan) if makespan > 0 else 0.0
    return Simulation(
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        timeline=timeline,
        makespan=makespan,
        bubble_fraction=bubble,
        peak_live_microbatches=[_peak_live(a) for a in lists],
        busy_time=busy,
    )
