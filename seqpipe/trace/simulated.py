"""A :class:`~seqpipe.trace.events.Recording` built from a simulated schedule.

The simulator (:func:`seqpipe.schedule.simulate`) says when each action of a schedule
would run; turned into a recording, that plan is drawn and summarised exactly like a
measured step: the SVG writer draws it below the measured timeline, and tests use it as a
realistic recording whose numbers are known.

Each action becomes one event on its stage (``rank`` = the simulated rank). When an
action starts after its rank fell idle and it needs a message from a stage on another
rank (an activation for ``F``, a gradient for ``B``/``I``), the gap becomes a wait for
that message, as the engines record it; the simulator does not model communication, so
there are no sends.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

from seqpipe.schedule import Action, Phase, Simulation
from seqpipe.trace.events import KIND_OF_PHASE, Event, EventKind, Recording, StepRecord, What

__all__ = ["KIND_OF_PHASE", "from_simulation"]


def from_simulation(simulation: Simulation, schedule: Any, *, start: float = 0.0,
                    step: int = 0, waits: bool = True) -> Recording:
    """The simulated timeline as a one-step recording, shifted to begin at ``start``.

    ``schedule`` is what was simulated (kept in the step record, so the recording can be
    summarised and re-simulated). ``waits=False`` leaves the idle gaps empty instead of
    recording them as waits for the message the next action needs.
    """
    events: List[Event] = []
    for rank, row in enumerate(simulation.timeline):
        free = 0.0
        for begin, end, action in row:
            stage = rank if action.stage is None else action.stage
            need = _needs(action, stage, simulation)
            if waits and begin > free and need is not None:
                peer, what = need
                events.append(Event(EventKind.WAIT, stage, start + free, start + begin,
                                    action.microbatch, rank, peer, what, step))
            events.append(Event(KIND_OF_PHASE[action.phase], stage, start + begin,
                                start + end, action.microbatch, rank, step=step))
            free = end
    record = StepRecord(step, start, start + simulation.makespan, schedule,
                        simulation.num_stages, simulation.num_ranks,
                        simulation.num_microbatches)
    recording = Recording(events, [record])
    recording.finish()
    return recording


def _needs(action: Action, stage: int, simulation: Simulation) -> Optional[Tuple[int, str]]:
    """The (stage, message) the action receives from another rank, if any."""
    if action.phase is Phase.FORWARD:
        peer, what = stage - 1, What.ACTIVATION
    elif action.sends_gradient:
        peer, what = stage + 1, What.GRADIENT
    else:
        return None
    placement = simulation.placement
    if not 0 <= peer < placement.num_stages or \
            placement.rank_of(peer) == placement.rank_of(stage):
        return None
    return peer, what
