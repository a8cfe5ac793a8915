"""The simulator's replay of a schedule object with costs: its timeline, bubble and memory.

The replay is the validator's dependency walk with durations: an action starts when its
rank is free and the data it receives has arrived. Communication time is not modelled.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Optional, Union

from seqpipe.schedule.action import Action, Phase
from seqpipe.schedule.checks import CheckedOrders, collect, walk
from seqpipe.schedule.placement import Placement
from seqpipe.schedule.protocol import AnySchedule

__all__ = ["Cost", "Simulation", "replay", "replay_table"]

Cost = Union[float, Sequence[float]]


@dataclass(frozen=True)
class Simulation:
    """The replayed timeline of a schedule and the numbers derived from it.

    Everything is per *rank* (with one stage per rank, rank ``r`` runs stage ``r``).
    """

    num_stages: int
    num_microbatches: int
    timeline: list[list[tuple[float, float, Action]]]
    """Per rank, ``(start, end, action)`` in execution order, actions as the schedule gave them."""
    makespan: float
    """When the last action on any rank ends."""
    bubble_fraction: float
    """Share of ``num_ranks * makespan`` that ranks spend idle."""
    peak_live_microbatches: list[int]
    """Per rank, the most (stage, micro-batch) pairs alive at once: forward done, and ``B``
    (or ``W``) not yet done. Their activations must stay in memory."""
    busy_time: list[float]
    """Per rank, the total time spent running actions."""
    placement: Placement
    """Which rank holds each stage."""

    @property
    def num_ranks(self) -> int:
        """How many ranks (rows of the timeline) the pipeline has."""
        return self.placement.num_ranks

    @property
    def peak_activation_memory(self) -> list[float]:
        """Per rank, peak live activations in units of one micro-batch through all of the
        rank's layers (stages of a rank assumed equal): ``peak_live_microbatches / V``.

        This is the number to compare across placements: a ZB-V rank holding ``2K`` live
        half-size stages holds as much as a 1F1B rank holding ``K`` micro-batches.
        """
        return [peak / len(self.placement.stages_of(r))
                for r, peak in enumerate(self.peak_live_microbatches)]

    def chart(self, unit: float = 1.0, label: str = "rank") -> str:
        """A text Gantt chart, one row per rank and one column per ``unit`` of time.

        A cell shows the action running at the middle of its column (``F3``, or ``2F3``
        for micro-batch 3 on stage 2 when actions name their stage); ``.`` is idle.
        ``label`` names what a rank is where the chart is shown (``"thread"`` for a local
        ``Pipe``, whose ranks are its worker threads).
        """
        if unit <= 0:
            raise ValueError(f"unit must be > 0, got {unit}")
        columns = math.ceil(self.makespan / unit - 1e-9)
        width = max((len(str(a)) for row in self.timeline for _, _, a in row), default=1)
        rows = []
        for r, row in enumerate(self.timeline):
            starts = [start for start, _, _ in row]
            cells = []
            for c in range(columns):
                t = (c + 0.5) * unit
                idx = bisect_right(starts, t) - 1
                hit = idx >= 0 and row[idx][0] <= t < row[idx][1]
                cells.append(str(row[idx][2]) if hit else ".")
            rows.append(f"{label} {r}: " + " ".join(cell.ljust(width) for cell in cells).rstrip())
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


def _costs(num_stages: int, forward_cost: Cost = 1.0, backward_cost: Optional[Cost] = None,
           input_cost: Optional[Cost] = None,
           weight_cost: Optional[Cost] = None) -> list[list[float]]:
    """Per kind (F, B, I, W), one cost per stage; ``B = I + W``."""
    fwd = _per_stage(forward_cost, num_stages, "forward_cost")
    if (input_cost is None) != (weight_cost is None):
        raise ValueError("give input_cost and weight_cost together (B = I + W), or neither "
                         "(then I = W = backward_cost / 2)")
    if input_cost is None:
        full = _per_stage(2.0 if backward_cost is None else backward_cost, num_stages,
                          "backward_cost")
        return [fwd, full, [b / 2 for b in full], [b / 2 for b in full]]
    inp = _per_stage(input_cost, num_stages, "input_cost")
    wgt = _per_stage(weight_cost, num_stages, "weight_cost")  # type: ignore[arg-type]
    full = [i + w for i, w in zip(inp, wgt)]
    if backward_cost is not None:
        given = _per_stage(backward_cost, num_stages, "backward_cost")
        if any(not math.isclose(g, f) for g, f in zip(given, full)):
            raise ValueError(f"backward_cost {given} differs from input_cost + weight_cost "
                             f"{full}; give either backward_cost or the two halves")
    return [fwd, full, inp, wgt]


def _peak_live(actions: Sequence[Action]) -> int:
    """Most micro-batches between their forward and their ``B`` or ``W`` along one order."""
    live = peak = 0
    for action in actions:
        if action.is_forward:
            live += 1
            peak = max(peak, live)
        elif action.phase is not Phase.BACKWARD_INPUT:
            live -= 1
    return peak


def replay(schedule: AnySchedule, num_ranks: int, num_microbatches: int,
           **costs: Optional[Cost]) -> Simulation:
    """:func:`~seqpipe.schedule.simulate` of a schedule object; ``costs``: its
    ``forward_cost``, ``backward_cost``, ``input_cost`` and ``weight_cost``."""
    plan = collect(schedule, num_ranks, num_microbatches)
    return replay_table(plan, _costs(plan.placement.num_stages, **costs))  # type: ignore


def replay_table(plan: CheckedOrders, cost: Sequence[Sequence[float]]) -> Simulation:
    """The replay of checked orders with a cost table: ``cost[kind][stage]`` per kind
    ``F``, ``B``, ``I``, ``W`` (``Costs.table()``; there ``B`` need not be ``I + W``)."""
    stages, num_microbatches = plan.placement.num_stages, plan.num_microbatches
    num_ranks = plan.placement.num_ranks
    starts = walk(plan, cost)
    m = num_microbatches
    timeline = [
        [(t, t + cost[kind][slot // m], a)
         for t, a, (kind, slot, _) in zip(row, items, links, strict=True)]
        for row, items, links in zip(starts, plan.orders, plan.rows, strict=True)
    ]
    makespan = max((row[-1][1] for row in timeline if row), default=0.0)
    busy = [sum(end - start for start, end, _ in row) for row in timeline]
    bubble = 1.0 - sum(busy) / (num_ranks * makespan) if makespan > 0 else 0.0
    return Simulation(
        num_stages=stages,
        num_microbatches=m,
        timeline=timeline,
        makespan=makespan,
        bubble_fraction=bubble,
        peak_live_microbatches=[_peak_live(a) for a in plan.orders],
        busy_time=busy,
        placement=plan.placement,
    )
