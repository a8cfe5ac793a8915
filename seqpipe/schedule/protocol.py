"""The two ways to write a schedule, and how either becomes per-rank orders.

* :class:`Schedule` (one stage per rank): ``actions(stage, num_stages, num_microbatches)``
  lists the actions of one stage, whose actions need not name their stage. This is the
  protocol the engines run today, with ``F`` and ``B`` actions.
* :class:`StagedSchedule` (any placement): ``placement(num_ranks)`` says which rank holds
  each stage, and ``rank_actions(rank, num_ranks, num_microbatches)`` lists a rank's actions
  in order, each naming its stage.

:func:`rank_orders` turns either into one action list per rank, which is what the validator
and the simulator walk.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, Union, runtime_checkable

from seqpipe.schedule.action import Action
from seqpipe.schedule.placement import Placement

__all__ = ["AnySchedule", "Schedule", "ScheduleError", "StagedSchedule", "is_staged",
           "placement_of", "rank_orders", "stage_named", "staged_orders"]


class ScheduleError(ValueError):
    """A schedule is malformed or would deadlock."""


@runtime_checkable
class Schedule(Protocol):
    """One stage per rank: lists, per stage, the actions that stage runs in order."""

    def actions(self, stage: int, num_stages: int, num_microbatches: int) -> Sequence[Action]:
        """The ordered actions of ``stage`` in a ``num_stages``-stage pipeline."""
        ...


@runtime_checkable
class StagedSchedule(Protocol):
    """Any placement: which rank holds which stage, and each rank's ordered actions."""

    def placement(self, num_ranks: int) -> Placement:
        """Which rank holds each stage when the pipeline has ``num_ranks`` ranks."""
        ...

    def rank_actions(self, rank: int, num_ranks: int,
                     num_microbatches: int) -> Sequence[Action]:
        """The ordered actions of ``rank``; each names its stage."""
        ...


AnySchedule = Union[Schedule, StagedSchedule]


def is_staged(schedule: object) -> bool:
    """True if ``schedule`` implements :class:`StagedSchedule` (checked before ``actions``)."""
    return callable(getattr(schedule, "rank_actions", None)) and \
        callable(getattr(schedule, "placement", None))


def placement_of(schedule: AnySchedule, num_ranks: int) -> Placement:
    """The schedule's placement; one stage per rank for a :class:`Schedule`."""
    if not is_staged(schedule):
        return Placement.one_per_rank(num_ranks)
    placement = schedule.placement(num_ranks)  # type: ignore[union-attr]
    if not isinstance(placement, Placement):
        raise ScheduleError(f"placement() returned {type(placement).__name__}, "
                            "expected a seqpipe.schedule.Placement")
    if placement.num_ranks != num_ranks:
        raise ScheduleError(f"placement() is for {placement.num_ranks} ranks, "
                            f"but the pipeline has {num_ranks}")
    return placement


def _as_list(raw: object, rank: int) -> list[Action]:
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Iterable):
        raise ScheduleError(f"rank {rank}: the schedule returned {type(raw).__name__}, "
                            "expected a sequence of Action")
    items = list(raw)
    for pos, item in enumerate(items):
        if not isinstance(item, Action):
            raise ScheduleError(f"rank {rank}: item {pos} is {item!r} "
                                f"({type(item).__name__}), expected an Action")
    return items


def rank_orders(schedule: AnySchedule, num_ranks: int,
                num_microbatches: int) -> tuple[Placement, list[list[Action]]]:
    """The placement and every rank's action list, as the schedule gives them.

    Only the types are checked here; :func:`seqpipe.schedule.validate_schedule` checks the
    contents. For a :class:`Schedule`, rank ``r`` runs the list of stage ``r``.
    """
    placement = placement_of(schedule, num_ranks)
    if is_staged(schedule):
        def fetch(rank: int) -> object:
            return schedule.rank_actions(rank, num_ranks, num_microbatches)  # type: ignore
    else:
        def fetch(rank: int) -> object:
            return schedule.actions(rank, num_ranks, num_microbatches)  # type: ignore
    return placement, [_as_list(fetch(rank), rank) for rank in range(num_ranks)]


def stage_named(actions: Sequence[Action], rank: int) -> list[Action]:
    """``actions`` of ``rank``, each naming its stage (``rank`` where it names none)."""
    return [a if a.stage is not None else Action(a.phase, a.microbatch, rank) for a in actions]


def staged_orders(schedule: AnySchedule, num_ranks: int,
                  num_microbatches: int) -> list[list[Action]]:
    """Every rank's action list, as :func:`rank_orders` gives it, each naming its stage."""
    _, orders = rank_orders(schedule, num_ranks, num_microbatches)
    return [stage_named(order, rank) for rank, order in enumerate(orders)]
