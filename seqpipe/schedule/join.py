"""Join a split backward (``I`` ... ``W``) back into one ``B`` where the split buys nothing.

A split pays for itself only where its ``W``, deferred, fills time its rank would otherwise
spend waiting; elsewhere the ``W`` merely delays the rank's next action, and the split's own
work (a graph walk, more engine calls, saved-tensor holders: ``Costs.backward`` below
``I + W``) is lost. On a 2-rank transformer whose last stage is the heavier, that is every
``W`` of the steady state (docs/benchmarks.md, "Session 13: zb3").

:func:`join_splits` takes a split schedule and measured :class:`~seqpipe.schedule.Costs`
and returns :class:`Orders`, the same orders with ``I(i)`` replaced by ``B(i)`` (in ``I``'s
place: the gradient still leaves first) and ``W(i)`` dropped wherever the simulator
predicts that joining does not lengthen the step. It is a pure function of its arguments
(deterministic, no clock), so ranks holding the same costs derive the same orders. A join
never deadlocks a valid schedule: ``B`` sends its gradient from ``I``'s place, and nothing
else waits for a ``W``.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Optional

from seqpipe.schedule.action import Action, Phase
from seqpipe.schedule.checks import collect, encode, walk
from seqpipe.schedule.costs import Costs
from seqpipe.schedule.placement import Placement
from seqpipe.schedule.protocol import AnySchedule, ScheduleError, placement_of, staged_orders
from seqpipe.schedule.replay import Simulation, replay_table

__all__ = ["Orders", "RunsAs", "join_splits", "joined", "simulate_orders"]

RunsAs = Callable[[Sequence[Sequence[Action]], Placement], list[list[Action]]]
"""What an engine runs for given per-rank orders (``DistributedPipe``: ``split_tails``)."""

_MAX_PASSES = 4  # each pass tries every split; a pass that changes none ends the search
_BUDGET = 1_000_000  # simulated actions per start (~1 s of CPU); then the search stops
_TOLERANCE = 1e-9  # relative: steps this close are equal (float sums in another order)


@dataclass(frozen=True)
class Orders:
    """A schedule for one pipeline size and micro-batch count: every rank's actions, fixed
    (each naming its stage). Asked for another size, it raises ``ScheduleError``."""

    name: str
    layout: Placement
    num_microbatches: int
    orders: tuple[tuple[Action, ...], ...]

    def placement(self, num_ranks: int) -> Placement:
        """The placement the orders were made for."""
        self._check(num_ranks, self.num_microbatches)
        return self.layout

    def rank_actions(self, rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
        """The fixed actions of ``rank``."""
        self._check(num_ranks, num_microbatches)
        return list(self.orders[rank])

    def _check(self, num_ranks: int, num_microbatches: int) -> None:
        if (num_ranks, num_microbatches) != (self.layout.num_ranks, self.num_microbatches):
            raise ScheduleError(
                f"{self.name!r} was laid out for {self.layout.num_ranks} ranks and "
                f"{self.num_microbatches} micro-batches, not {num_ranks} and "
                f"{num_microbatches}: derive it again for that size (join_splits)")

    @property
    def splits(self) -> tuple[tuple[int, int], ...]:
        """``(stage, micro-batch)`` of every backward still split, by rank and position."""
        return _splits(self.orders)


def _splits(orders: Sequence[Sequence[Action]]) -> tuple[tuple[int, int], ...]:
    return tuple((a.stage, a.microbatch) for row in orders for a in row  # type: ignore[misc]
                 if a.phase is Phase.BACKWARD_INPUT)


def _join(orders: Sequence[Sequence[Action]],
          keep: Collection[tuple[int, int]]) -> list[list[Action]]:
    """``orders`` with every split not in ``keep`` run as one ``B`` in its ``I``'s place."""
    out = []
    for row in orders:
        new = []
        for a in row:
            if a.phase is Phase.BACKWARD_INPUT and (a.stage, a.microbatch) not in keep:
                new.append(Action(Phase.BACKWARD, a.microbatch, a.stage))
            elif a.phase is not Phase.BACKWARD_WEIGHT or (a.stage, a.microbatch) in keep:
                new.append(a)
        out.append(new)
    return out


def _orders(name: str, placement: Placement, m: int,
            orders: Sequence[Sequence[Action]]) -> Orders:
    return Orders(name, placement, m, tuple(tuple(row) for row in orders))


def joined(schedule: AnySchedule, num_ranks: int, num_microbatches: int,
           keep: Callable[[int, int], bool], name: str) -> Orders:
    """``schedule``'s orders with the split backward of ``(stage, micro-batch)`` kept where
    ``keep(stage, micro-batch)`` and joined into one ``B`` (in ``I``'s place) elsewhere."""
    placement = placement_of(schedule, num_ranks)
    orders = staged_orders(schedule, num_ranks, num_microbatches)
    kept = {split for split in _splits(orders) if keep(*split)}
    return _orders(name, placement, num_microbatches, _join(orders, kept))


def simulate_orders(orders: Orders, costs: Costs,
                    runs_as: Optional[RunsAs] = None) -> Simulation:
    """The simulated step of ``orders`` as the engine runs them (``runs_as``) at ``costs``."""
    ran = orders if runs_as is None else _orders(
        orders.name, orders.layout, orders.num_microbatches,
        runs_as(orders.orders, orders.layout))
    return replay_table(collect(ran, ran.layout.num_ranks, ran.num_microbatches),
                        costs.table())


def join_splits(schedule: AnySchedule, num_ranks: int, num_microbatches: int, costs: Costs,
                *, runs_as: Optional[RunsAs] = None, name: Optional[str] = None) -> Orders:
    """``schedule`` with each split backward joined into one ``B`` wherever the simulated
    step at ``costs`` (``B`` costing ``costs.backward``) is not longer for it.

    A deterministic local search, from two starts: every split joined, and the schedule as
    given. The splits are tried in rank and list order, in passes until one changes
    nothing (at most ``_MAX_PASSES``, and ``_BUDGET`` simulated actions per start): a split
    is joined if the step it predicts is no longer than the best so far (a join that only
    saves the split's own work is taken, one whose ``W`` filled a wait is not), and split
    again if that shortens the step. The better end wins (on a tie, the fewer splits).
    ``runs_as`` maps orders to what the engine really runs (its own splits included: a
    join the engine would split again is not made). The result validates wherever
    ``schedule`` does.
    """
    collect(schedule, num_ranks, num_microbatches)  # checked once: every join is valid
    placement = placement_of(schedule, num_ranks)
    base = staged_orders(schedule, num_ranks, num_microbatches)
    label = name if name is not None else f"joined({getattr(schedule, 'name', schedule)})"
    splits = _splits(base)
    table = costs.table()

    def predict(keep: Collection[tuple[int, int]]) -> tuple[float, set[tuple[int, int]]]:
        orders = _join(base, keep)
        ran = orders if runs_as is None else runs_as(orders, placement)
        plan = encode(ran, placement, num_microbatches)
        starts = walk(plan, table)
        step = max((row[-1] + table[links[-1][0]][links[-1][1] // num_microbatches]
                    for row, links in zip(starts, plan.rows) if row), default=0.0)
        return step, set(_splits(ran))

    trials = max(1, _BUDGET // max(1, sum(map(len, base))))

    def improve(keep: set[tuple[int, int]]) -> tuple[float, set[tuple[int, int]]]:
        best, _ = predict(keep)
        tried = 0
        for _ in range(_MAX_PASSES):
            changed = False
            for split in splits:
                tried += 1
                if tried > trials:  # a long pipeline: keep what the budget reached
                    return best, keep
                trial = keep - {split} if split in keep else keep | {split}
                step, ran = predict(trial)
                if split in keep:  # join: if the engine would not split it again, and
                    better = split not in ran and step <= best * (1 + _TOLERANCE)  # no longer
                else:  # split again: only if it shortens the step
                    better = step < best * (1 - _TOLERANCE)
                if better:
                    keep, best, changed = trial, step, True
            if not changed:
                break
        return best, keep

    # From every split joined (then splitting where that shortens the step) and from the
    # schedule as given (then joining where that does not lengthen it): one join or one
    # split alone can lengthen a step that several together shorten, so one start can stop
    # short of the other's end.
    ends = [improve(set()), improve(set(splits))]
    _, keep = min(ends, key=lambda end: (end[0], len(end[1])))
    return _orders(label, placement, num_microbatches, _join(base, keep))
