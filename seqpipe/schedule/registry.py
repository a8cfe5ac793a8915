"""Built-in schedules by name (``"auto"``, which picks among them, is added by
``lookup.get_schedule``, above ``auto.py``, which needs these names)."""
from __future__ import annotations

from typing import Callable, Union

from seqpipe.schedule.dualpipe import DualPipeV
from seqpipe.schedule.fill_drain import FillDrain, LoopedBFS
from seqpipe.schedule.one_f_one_b import Interleaved1F1B, OneFOneB
from seqpipe.schedule.protocol import AnySchedule, is_staged
from seqpipe.schedule.zero_bubble import (
    InterleavedZeroBubble,
    ZeroBubbleH1,
    ZeroBubbleH2,
    ZeroBubbleV,
)

__all__ = ["SCHEDULES", "builtin_or_object", "normalized"]

SCHEDULES: dict[str, Callable[[], AnySchedule]] = {
    "fill_drain": FillDrain,
    "gpipe": FillDrain,
    "1f1b": OneFOneB,
    "zb_h1": ZeroBubbleH1,
    "zb_h2": ZeroBubbleH2,
    "interleaved_1f1b": Interleaved1F1B,
    "looped_bfs": LoopedBFS,
    "interleaved_zb": InterleavedZeroBubble,
    "zbv": ZeroBubbleV,
    "dualpipev": DualPipeV,
}
"""Name -> class of every built-in (several-stages-per-rank ones with ``V = 2``)."""


def normalized(name: str) -> str:
    """A schedule name as looked up: case-insensitive, ``-`` read as ``_``."""
    return name.strip().lower().replace("-", "_")


def builtin_or_object(name_or_schedule: Union[str, AnySchedule]) -> AnySchedule:
    """``get_schedule`` for everything but ``"auto"``: a built-in by name, or a schedule
    object passed through after checking its type."""
    if isinstance(name_or_schedule, str):
        key = normalized(name_or_schedule)
        if key not in SCHEDULES:
            valid = ", ".join(repr(n) for n in [*SCHEDULES, "auto"])
            raise ValueError(f"unknown schedule {name_or_schedule!r}; valid names: {valid}")
        return SCHEDULES[key]()
    if isinstance(name_or_schedule, type):
        raise TypeError(
            f"expected a schedule instance, got the class {name_or_schedule.__name__}; "
            f"use {name_or_schedule.__name__}()"
        )
    if not callable(getattr(name_or_schedule, "actions", None)) and \
            not is_staged(name_or_schedule):
        raise TypeError(
            "expected a schedule name or an object with "
            "actions(stage, num_stages, num_microbatches) (one stage per rank), or with "
            "placement(num_ranks) and rank_actions(rank, num_ranks, num_microbatches), "
            f"got {type(name_or_schedule).__name__}"
        )
    return name_or_schedule
