"""Pipeline schedules: the order in which each rank runs its forwards and backwards.

A schedule is plain data, with no dependency on ``torch``. An :class:`Action` names its
phase (``F`` forward, ``B`` full backward, ``I`` input-gradient backward, ``W``
weight-gradient backward), its micro-batch and, when a rank holds several stages, its stage;
a :class:`Placement` maps every stage to a rank. A schedule is written in one of two forms
(:mod:`~seqpipe.schedule.protocol`): :class:`Schedule`, one stage per rank, lists each
stage's actions; :class:`StagedSchedule` gives a placement and each rank's actions.

:func:`validate_schedule` rejects, before any communication, a schedule that is malformed or
would deadlock; :func:`simulate` replays one with costs. Package layout: ``action.py``,
``placement.py``, ``protocol.py`` (the data); ``fill_drain.py``, ``one_f_one_b.py``,
``zero_bubble.py``, ``dualpipe.py`` (the built-in families); ``registry.py`` (their
names); ``checks.py`` and ``replay.py`` (the validator and the simulator on schedule
objects); ``costs.py`` (measured per-stage costs); ``join.py`` (``join_splits``: a split
backward joined into ``B`` where it fills no wait); ``auto.py`` (``Auto``, which simulates
the built-ins and their joined forms); ``lookup.py``
(``get_schedule``: names, ``"auto"`` included); ``validate.py`` and ``simulate.py`` (the
public entries, taking names too).
"""
from seqpipe.schedule.action import (
    Action,
    B,
    F,
    I,
    Phase,
    W,
    backward,
    backward_input,
    backward_phase,
    backward_weight,
    forward,
    forward_phase,
)
from seqpipe.schedule.auto import Auto, AutoChoice, Prediction
from seqpipe.schedule.costs import Costs
from seqpipe.schedule.dualpipe import DualPipeV
from seqpipe.schedule.fill_drain import FillDrain, LoopedBFS
from seqpipe.schedule.join import Orders, join_splits, joined
from seqpipe.schedule.lookup import get_schedule
from seqpipe.schedule.one_f_one_b import Interleaved1F1B, OneFOneB
from seqpipe.schedule.placement import Placement
from seqpipe.schedule.protocol import (
    AnySchedule,
    Schedule,
    ScheduleError,
    StagedSchedule,
    placement_of,
    rank_orders,
)
from seqpipe.schedule.registry import SCHEDULES
from seqpipe.schedule.simulate import Simulation, simulate
from seqpipe.schedule.validate import validate_schedule
from seqpipe.schedule.zero_bubble import (
    InterleavedZeroBubble,
    ZeroBubbleH1,
    ZeroBubbleH2,
    ZeroBubbleV,
)

__all__ = [
    "SCHEDULES",
    "Action",
    "AnySchedule",
    "Auto",
    "AutoChoice",
    "B",
    "Costs",
    "DualPipeV",
    "F",
    "FillDrain",
    "I",
    "Interleaved1F1B",
    "InterleavedZeroBubble",
    "LoopedBFS",
    "OneFOneB",
    "Orders",
    "Phase",
    "Placement",
    "Prediction",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "StagedSchedule",
    "W",
    "ZeroBubbleH1",
    "ZeroBubbleH2",
    "ZeroBubbleV",
    "backward",
    "backward_input",
    "backward_phase",
    "backward_weight",
    "forward",
    "forward_phase",
    "get_schedule",
    "join_splits",
    "joined",
    "placement_of",
    "rank_orders",
    "simulate",
    "validate_schedule",
]
