"""The validator: is every action there once, on the right rank, and can every rank finish?

The checks themselves (``checks.py``) take a schedule object; this is the public entry,
which also takes a name (``"auto"`` included, hence it sits above ``auto.py``).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Optional, Union

from seqpipe.schedule.action import Phase
from seqpipe.schedule.checks import check
from seqpipe.schedule.lookup import get_schedule
from seqpipe.schedule.protocol import AnySchedule

__all__ = ["validate_schedule"]


def validate_schedule(schedule: Union[str, AnySchedule], num_ranks: int,
                      num_microbatches: int, *,
                      phases: Optional[Iterable[Union[Phase, str]]] = None,
                      stages_per_rank: Optional[int] = None) -> None:
    """Raise :class:`ScheduleError` unless every rank can run its whole list.

    ``num_ranks`` is the pipeline size ``K`` (for a one-stage-per-rank schedule, the number
    of stages). Checks that every action names an existing micro-batch and a stage its rank
    holds; that each stage runs every ``F(i)`` once and its backward once, as ``B(i)`` or as
    ``I(i)`` then ``W(i)``, after ``F(i)``; then replays the dependency rules and names each
    rank that would block forever. ``phases`` (e.g. ``"FB"``) and ``stages_per_rank``
    restrict what is accepted, for an engine that runs only part of what schedules express.
    """
    check(get_schedule(schedule), num_ranks, num_microbatches, phases=phases,
          stages_per_rank=stages_per_rank)
