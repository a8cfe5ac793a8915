"""The simulator: replay a schedule with costs, and report its timeline, bubble and memory.

The replay itself (``replay.py``) takes a schedule object; this is the public entry, which
also takes a name (``"auto"`` included, hence it sits above ``auto.py``).
"""
from __future__ import annotations

from typing import Optional, Union

from seqpipe.schedule.lookup import get_schedule
from seqpipe.schedule.protocol import AnySchedule
from seqpipe.schedule.replay import Cost, Simulation, replay

__all__ = ["Cost", "Simulation", "simulate"]


def simulate(
    schedule: Union[str, AnySchedule],
    num_ranks: int,
    num_microbatches: int,
    *,
    forward_cost: Cost = 1.0,
    backward_cost: Optional[Cost] = None,
    input_cost: Optional[Cost] = None,
    weight_cost: Optional[Cost] = None,
) -> Simulation:
    """Replay a schedule with per-action costs (scalars or one per *stage*).

    ``backward_cost`` (default 2) is a full ``B``; a split backward costs ``input_cost``
    for ``I`` and ``weight_cost`` for ``W`` (default: half of ``backward_cost`` each; give
    both halves to set them, then ``B = I + W``). Validates like
    :func:`~seqpipe.schedule.validate_schedule` (raising ``ScheduleError``) and reports
    when each action runs, the makespan, the bubble and the peak live micro-batches.
    """
    return replay(get_schedule(schedule), num_ranks, num_microbatches,
                  forward_cost=forward_cost, backward_cost=backward_cost,
                  input_cost=input_cost, weight_cost=weight_cost)
