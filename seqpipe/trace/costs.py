"""The costs a recorded step measured, and the simulator's plan for them.

The prediction replays the step's schedule with per-stage median measured costs of each
action (:func:`seqpipe.schedule.simulate`). The simulator models neither the loss nor
recomputation nor communication: the loss is counted in the forward of its micro-batch
and recomputation in its backward (``I`` when split), where they run; communication is
left out, so a measured step longer than its prediction is time lost to messages,
waiting and the engine itself.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from seqpipe.schedule import Simulation, simulate
from seqpipe.trace.events import KIND_OF_PHASE, Event, EventKind, StepRecord

__all__ = ["predict"]

_ATTACHED = {EventKind.LOSS: (EventKind.FORWARD,),
             EventKind.RECOMPUTE: (EventKind.INPUT_GRAD, EventKind.BACKWARD)}
"""Events the simulator has no action for, and the actions whose cost they join."""
_LETTERS = {kind: phase.letter for phase, kind in KIND_OF_PHASE.items()}
"""The letter of each event kind the simulator has an action for."""


def predict(record: StepRecord, events: Sequence[Event]
            ) -> Tuple[Dict[str, List[float]], Optional[Simulation], Optional[str]]:
    """The step's per-stage median costs, their simulation, and why there is none."""
    costs, note = _median_costs(events, record.num_stages)
    if note is None and record.num_microbatches < 1:
        note = f"its step record counts {record.num_microbatches} micro-batches"
    if note is not None:
        return costs, None, note
    split = "I" in costs
    kwargs = {"input_cost": costs["I"], "weight_cost": costs["W"]} if split \
        else {"backward_cost": costs["B"]}
    sim = simulate(record.schedule, record.num_ranks, record.num_microbatches,
                   forward_cost=costs["F"], **kwargs)
    return costs, sim, None


def _median_costs(events: Sequence[Event], num_stages: int
                  ) -> Tuple[Dict[str, List[float]], Optional[str]]:
    """Per action letter, each stage's median cost; a reason if one cannot be measured."""
    samples: Dict[Tuple[EventKind, int], List[float]] = defaultdict(list)
    for e, cost in _action_costs(events):
        samples[(e.kind, e.stage)].append(cost)
    has = {kind for kind, _ in samples}
    split = bool(has & {EventKind.INPUT_GRAD, EventKind.WEIGHT_GRAD})
    forward_only = not has & {EventKind.BACKWARD, EventKind.INPUT_GRAD,
                              EventKind.WEIGHT_GRAD}
    costs: Dict[str, List[float]] = defaultdict(list)
    for stage in range(num_stages):
        med = {_LETTERS[kind]: statistics.median(samples[(kind, stage)])
               for kind in _LETTERS if samples.get((kind, stage))}
        if "F" not in med:
            return dict(costs), f"stage {stage} has no measured forward"
        costs["F"].append(med["F"])
        if forward_only:
            costs["B"].append(0.0)
        elif split:
            halves = (med["I"], med["W"]) if "I" in med and "W" in med \
                else (med["B"] / 2, med["B"] / 2) if "B" in med else None
            if halves is None:
                return dict(costs), f"stage {stage} has no measured backward"
            costs["I"].append(halves[0])
            costs["W"].append(halves[1])
        elif "B" in med:
            costs["B"].append(med["B"])
        else:
            return dict(costs), f"stage {stage} has no measured backward"
    return dict(costs), None


def _action_costs(events: Sequence[Event]) -> Iterable[Tuple[Event, float]]:
    """Every schedule action with its cost: its duration plus the loss or recomputation
    of its (stage, micro-batch) that ran outside it."""
    actions = {(e.kind, e.stage, e.microbatch, e.rank): e for e in events if e.kind in _LETTERS}
    extra: Dict[Event, float] = defaultdict(float)
    for e in events:
        for kind in _ATTACHED.get(e.kind, ()):
            owner = actions.get((kind, e.stage, e.microbatch, e.rank))
            if owner is not None:
                overlap = max(0.0, min(e.end, owner.end) - max(e.start, owner.start))
                extra[owner] += e.duration - overlap
                break
    return [(e, e.duration + extra[e]) for e in actions.values()]
