"""The validator's checks of a schedule object: is every action there once, on the right
rank, and can every rank finish?

Engines enforce the data dependencies by waiting to receive:

* ``F(s, i)`` needs ``F(s-1, i)`` (the activation from the previous stage);
* ``B(s, i)`` and ``I(s, i)`` need ``F(s, i)`` and the gradient from stage ``s+1``, which
  its ``B(s+1, i)`` or ``I(s+1, i)`` produces;
* ``W(s, i)`` needs ``I(s, i)``.

Each action runs on the rank that holds its stage, in that rank's order. Sends are buffered,
so a rank only ever blocks on a receive (or, when two neighbouring stages share a rank, on
its own earlier action), and a bad order shows up as a hang across processes. Hence
:func:`check` (``validate_schedule`` of a schedule object) checks the lists and replays
the rules *before* any communication; :func:`walk` is the replay, shared with the simulator.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional, Union

from seqpipe.schedule.action import Action, Phase
from seqpipe.schedule.placement import Placement
from seqpipe.schedule.protocol import AnySchedule, ScheduleError, rank_orders

__all__ = ["CheckedOrders", "check", "collect", "encode", "walk"]

# Kinds of action, as small ints for the walk.
FWD, FULL, INPUT, WEIGHT = range(4)
_KIND = {Phase.FORWARD: FWD, Phase.BACKWARD: FULL,
         Phase.BACKWARD_INPUT: INPUT, Phase.BACKWARD_WEIGHT: WEIGHT}
_LETTER = "FBIW"


@dataclass(frozen=True)
class CheckedOrders:
    """A checked schedule: its placement, each rank's actions, and their walk encoding."""

    placement: Placement
    num_microbatches: int
    orders: list[list[Action]]
    """Per rank, the actions as the schedule gave them."""
    rows: list[list[tuple[int, int, int]]]
    """Per rank, ``(kind, stage * M + micro-batch, slot it waits for or -1)`` per action."""
    grad_kind: list[int]
    """Per ``stage * M + micro-batch``: ``FULL`` or ``INPUT``, whichever sends its gradient."""


def _name(kind: int, slot: int, m: int) -> str:
    return f"{_LETTER[kind]}{slot % m} of stage {slot // m}"


def _check_sizes(num_ranks: int, num_microbatches: int) -> None:
    for label, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ScheduleError(f"{label} must be an int, got {value!r}")
        if value < 1:
            raise ScheduleError(f"{label} must be >= 1, got {value}")


def _stage_of(action: Action, rank: int, held: tuple[int, ...], placement: Placement) -> int:
    """The stage ``action`` runs on, checked against the placement (``held``: rank's stages)."""
    stage = action.stage
    if stage is None:
        if len(held) != 1:
            raise ScheduleError(f"rank {rank} holds stages {list(held)}, so its action "
                                f"{action} must name its stage (Action(..., stage=s))")
        return held[0]
    if stage >= placement.num_stages:
        raise ScheduleError(f"rank {rank}: {action} names stage {stage}, but there "
                            f"are only {placement.num_stages} (0..{placement.num_stages - 1})")
    if placement.ranks[stage] != rank:
        raise ScheduleError(
            f"rank {rank} runs {_LETTER[_KIND[action.phase]]}{action.microbatch} of stage "
            f"{stage}, but stage {stage} is placed on rank {placement.ranks[stage]}")
    return stage


class _Positions:
    """Where each ``(kind, stage, micro-batch)`` sits in its rank's list; finds repeats."""

    def __init__(self, num_stages: int, m: int) -> None:
        self.m = m
        self.at = [[-1] * (num_stages * m) for _ in range(4)]

    def put(self, rank: int, kind: int, slot: int, pos: int) -> None:
        seen = self.at[kind][slot]
        if seen >= 0:
            raise ScheduleError(f"rank {rank}, stage {slot // self.m}: "
                                f"{_LETTER[kind]}{slot % self.m} appears more than once "
                                f"(positions {seen} and {pos} of rank {rank})")
        self.at[kind][slot] = pos

    def check_stage(self, rank: int, stage: int) -> None:
        """Every micro-batch once forward and once backward (``B``, or ``I`` then ``W``)."""
        m, (f, b, i, w) = self.m, self.at
        missing, where = [], f"rank {rank}, stage {stage}"
        for mb in range(m):
            slot = stage * m + mb
            if b[slot] >= 0 and (i[slot] >= 0 or w[slot] >= 0):
                raise ScheduleError(f"{where}: micro-batch {mb} has both B{mb} and a split "
                                    f"backward (I{mb}/W{mb}); run either B or I then W")
            if f[slot] < 0:
                missing.append(f"F{mb}")
            if b[slot] < 0 and i[slot] < 0 and w[slot] < 0:
                missing.append(f"B{mb}")
            elif b[slot] < 0:
                missing += [f"{p}{mb}" for p, pos in (("I", i[slot]), ("W", w[slot])) if pos < 0]
        if missing:
            shown = ", ".join(missing[:8]) + (", ..." if len(missing) > 8 else "")
            raise ScheduleError(f"{where}: missing {len(missing)} action(s): {shown}")
        for mb in range(m):
            slot = stage * m + mb
            back = b[slot] if b[slot] >= 0 else i[slot]
            if back < f[slot]:
                kind = "B" if b[slot] >= 0 else "I"
                raise ScheduleError(f"{where}: {kind}{mb} (backward of micro-batch {mb}) "
                                    f"comes before its forward F{mb}")
            if 0 <= w[slot] < i[slot]:
                raise ScheduleError(f"{where}: W{mb} (weight gradient of micro-batch {mb}) "
                                    f"comes before its input gradient I{mb}")


def _allowed(phases: Optional[Iterable[Union[Phase, str]]]) -> Optional[set[Phase]]:
    return None if phases is None else {Phase(p) for p in phases}


def collect(schedule: AnySchedule, num_ranks: int, num_microbatches: int, *,
            phases: Optional[Iterable[Union[Phase, str]]] = None,
            stages_per_rank: Optional[int] = None) -> CheckedOrders:
    """Fetch every rank's list and run the structural checks; see :func:`check`."""
    _check_sizes(num_ranks, num_microbatches)
    placement, orders = rank_orders(schedule, num_ranks, num_microbatches)
    m, allowed = num_microbatches, _allowed(phases)
    if stages_per_rank is not None:
        for rank in range(num_ranks):
            held = placement.stages_of(rank)
            if len(held) != stages_per_rank:
                raise ScheduleError(f"rank {rank} holds {len(held)} stages {list(held)}, but "
                                    f"this engine runs {stages_per_rank} per rank: choose a "
                                    "schedule with that many, e.g. '1f1b' for 1")
    positions = _Positions(placement.num_stages, m)
    rows = []
    for rank, items in enumerate(orders):
        row, held = [], placement.stages_of(rank)
        for pos, action in enumerate(items):
            stage = _stage_of(action, rank, held, placement)
            if action.microbatch >= m:
                raise ScheduleError(f"rank {rank}, stage {stage}: {action} refers to "
                                    f"micro-batch {action.microbatch}, but there are only "
                                    f"{m} (0..{m - 1})")
            if allowed is not None and action.phase not in allowed:
                names = ", ".join(p.letter for p in Phase if p in allowed)
                raise ScheduleError(f"rank {rank}, stage {stage}: {action} is a "
                                    f"{action.phase.value} pass, but this engine runs only "
                                    f"{names}: choose a schedule without the others, e.g. "
                                    "'1f1b'")
            kind, slot = _KIND[action.phase], stage * m + action.microbatch
            positions.put(rank, kind, slot, pos)
            row.append((kind, slot))
        rows.append(row)
    for rank in range(num_ranks):
        for stage in placement.stages_of(rank):
            positions.check_stage(rank, stage)
    grad_kind = [FULL if pos >= 0 else INPUT for pos in positions.at[FULL]]
    links = [_link(row, placement.num_stages, m) for row in rows]
    return CheckedOrders(placement, m, orders, links, grad_kind)


def encode(orders: Sequence[Sequence[Action]], placement: Placement, m: int) -> CheckedOrders:
    """The walk encoding of orders already checked (every action naming its stage): for a
    caller that replays many variants of one checked schedule (``join_splits``), without
    the checks. ``grad_kind`` is left empty: only a deadlock's message reads it."""
    stages = placement.num_stages
    rows = [_link([(_KIND[a.phase], a.stage * m + a.microbatch) for a in row],  # type: ignore
                  stages, m) for row in orders]
    return CheckedOrders(placement, m, [list(row) for row in orders], rows, [])


def _link(row: list[tuple[int, int]], num_stages: int,
          m: int) -> list[tuple[int, int, int]]:
    """Add to each action the slot it receives from: ``F`` from ``s-1``, ``B``/``I`` from ``s+1``.
    """
    last = (num_stages - 1) * m
    out = []
    for kind, slot in row:
        if kind == FWD:
            need = slot - m if slot >= m else -1
        elif kind == WEIGHT:
            need = -1  # its I is earlier on the same rank (checked)
        else:
            need = slot + m if slot < last else -1
        out.append((kind, slot, need))
    return out


def _deadlock(plan: CheckedOrders, blocked: dict[int, tuple[int, int, int]]) -> ScheduleError:
    """Name every rank that can no longer move, and what it waits for."""
    m, parts = plan.num_microbatches, []
    for rank, (kind, slot, need) in sorted(blocked.items()):
        dep_kind = FWD if kind == FWD else plan.grad_kind[need]
        dep_rank = plan.placement.rank_of(need // m)
        parts.append(f"rank {rank} waits at {_name(kind, slot, m)} for "
                     f"{_name(dep_kind, need, m)} (rank {dep_rank})")
    return ScheduleError("deadlock: " + "; ".join(parts))


def walk(plan: CheckedOrders, cost: Sequence[Sequence[float]]) -> list[list[float]]:
    """Run every rank as far as its dependencies allow; return start times or raise on deadlock.

    ``cost[kind][stage]`` is the duration of an action. An action starts when its rank is
    free and the action it receives from (if any) has ended; same-stage dependencies
    (``F`` before ``B``/``I``, ``I`` before ``W``) are already checked as list order.
    """
    k, m = plan.placement.num_ranks, plan.num_microbatches
    num_slots = plan.placement.num_stages * m
    ends: list[list[Optional[float]]] = [[None] * num_slots, [None] * num_slots]  # F, grad
    starts: list[list[float]] = [[] for _ in range(k)]
    pos, free = [0] * k, [0.0] * k
    blocked: dict[int, tuple[int, int, int]] = {}  # rank -> action it is stuck at
    waiting: dict[int, int] = {}  # 2 * slot + table -> the rank stuck on it
    ready = deque(range(k))
    while ready:
        r = ready.popleft()
        row, row_starts = plan.rows[r], starts[r]
        while pos[r] < len(row):
            kind, slot, need = row[pos[r]]
            start = free[r]
            if need >= 0:
                table = 0 if kind == FWD else 1
                dep_end = ends[table][need]
                if dep_end is None:
                    blocked[r] = row[pos[r]]
                    waiting[2 * need + table] = r
                    break
                if dep_end > start:
                    start = dep_end
            row_starts.append(start)
            free[r] = end = start + cost[kind][slot // m]
            pos[r] += 1
            if kind != WEIGHT:
                table = 0 if kind == FWD else 1
                ends[table][slot] = end
                waiter = waiting.pop(2 * slot + table, None) if waiting else None
                if waiter is not None:
                    del blocked[waiter]
                    ready.append(waiter)
    if blocked:
        raise _deadlock(plan, blocked)
    return starts


def check(schedule: AnySchedule, num_ranks: int, num_microbatches: int, *,
          phases: Optional[Iterable[Union[Phase, str]]] = None,
          stages_per_rank: Optional[int] = None) -> None:
    """:func:`~seqpipe.schedule.validate_schedule` of a schedule object."""
    plan = collect(schedule, num_ranks, num_microbatches, phases=phases,
                   stages_per_rank=stages_per_rank)
    zero = [0.0] * plan.placement.num_stages
    walk(plan, [zero, zero, zero, zero])
