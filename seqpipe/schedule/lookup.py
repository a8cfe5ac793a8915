"""The one place that turns a schedule name into a schedule: the built-ins and ``"auto"``."""
from __future__ import annotations

from typing import Union

from seqpipe.schedule.auto import Auto
from seqpipe.schedule.protocol import AnySchedule
from seqpipe.schedule.registry import builtin_or_object, normalized

__all__ = ["get_schedule"]


def get_schedule(name_or_schedule: Union[str, AnySchedule]) -> AnySchedule:
    """Resolve a built-in name (see :data:`SCHEDULES`) or pass a schedule object through.

    ``"auto"`` gives ``Auto()``, which picks among the one-stage-per-rank built-ins by
    measured costs. Names are case-insensitive and ``-`` reads as ``_``. An unknown name raises
    ``ValueError`` listing the valid ones; an object with neither ``actions(...)`` nor
    ``placement(...)`` and ``rank_actions(...)`` raises ``TypeError``.
    """
    if isinstance(name_or_schedule, str) and normalized(name_or_schedule) == "auto":
        return Auto()  # not a built-in: it picks one (seqpipe.schedule.auto)
    return builtin_or_object(name_or_schedule)
