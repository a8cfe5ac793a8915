"""The messages one call of a distributed pipeline sends between two stages, in order.

Every rank holds the schedule and the skip layout, so every rank can list, before the call
runs, which messages any stage sends any other and in what order. Two things are built on
that list:

* a receiver posts the receives of a peer's *next* message before the peer sends it
  (sized from what the same message carried in the previous call), so the data is written
  straight into place instead of waiting for a round trip (see ``Transport``);
* a sender knows when a message it sent has certainly been taken (the receiver has since
  sent something it only sends after the action that needs it), so it can let go of the
  tensor then instead of at the end of the step.

The list mirrors what ``Call`` does: ``STEP`` from stage 0 when a call opens; for each
forward, the outgoing skips (in layout order) and then the activation; for each backward,
the input gradient and then the skip gradients (in layout order); and at the close, the
loss from the last stage and ``DONE`` from the stage that finishes last.

The pairs of stages that exchange messages at all (``channels``) are the only ones a
pipeline ever talks over: it opens their communicators when it is built (NCCL creates one
per pair on first use, and that blocks until both ends arrive), and a failure is relayed
along them rather than sent to every stage (see ``Transport.abort``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Set, Tuple

from seqpipe.distributed.wire import Kind
from seqpipe.schedule import Action, Phase, Schedule, forward_phase
from seqpipe.skip.layout import SkipLayout

__all__ = ["Planned", "OPENING", "call_actions", "messages", "closer", "channels",
           "pipeline_channels"]


@dataclass(frozen=True)
class Planned:
    """One message of a call: what it is, and when its sender and receiver handle it.

    ``sent_at`` and ``taken_at`` index the sender's and the receiver's actions in this call
    (-1: at the opening, ``len(actions)``: at the close).
    """

    kind: Kind
    microbatch: int
    key: int
    sent_at: int
    taken_at: int

    @property
    def identity(self) -> Tuple[Kind, int, int]:
        return (self.kind, self.microbatch, self.key)


OPENING = Planned(Kind.STEP, -1, -1, -1, -1)  # stage 0 -> every other stage, first of all


def closer(num_stages: int, grad: bool) -> int:
    """The stage that finishes a call last and releases the others with ``DONE``."""
    return 0 if grad else num_stages - 1


def call_actions(schedule: Schedule, num_stages: int, m: int,
                 grad: bool) -> List[List[Action]]:
    """What every stage runs in a call of ``m`` micro-batches (forwards only without grad)."""
    actions = [list(schedule.actions(s, num_stages, m)) for s in range(num_stages)]
    return actions if grad else [forward_phase(a) for a in actions]


def _positions(actions: Sequence[Action]) -> Dict[Action, int]:
    return {action: n for n, action in enumerate(actions)}


def messages(src: int, dst: int, actions: Sequence[Sequence[Action]], layout: SkipLayout,
             grad: bool) -> List[Planned]:
    """Every message stage ``src`` sends stage ``dst`` in one call, in sending order.

    ``actions[s]`` is what stage ``s`` runs in the call (only forwards without ``grad``).
    """
    num_stages = len(actions)
    if src == dst or num_stages < 2:
        return []
    at = _positions(actions[dst])
    keys = [skip.key for skip in layout]
    out = [OPENING] if src == 0 else []
    for n, action in enumerate(actions[src]):
        i = action.microbatch
        if action.phase is Phase.FORWARD:
            taken = at[Action(Phase.FORWARD, i)]
            out += [Planned(Kind.SKIP, i, keys.index(skip.key), n, taken)
                    for skip in layout.skips_stashed_by(src) if skip.pop_partition == dst]
            if dst == src + 1:
                out.append(Planned(Kind.ACTIVATION, i, -1, n, taken))
        elif action.sends_gradient:
            taken = at.get(Action(Phase.BACKWARD, i), at.get(Action(Phase.BACKWARD_INPUT, i)))
            if dst == src - 1:
                out.append(Planned(Kind.GRAD, i, -1, n, taken))
            out += [Planned(Kind.SKIP_GRAD, i, keys.index(skip.key), n, taken)
                    for skip in layout.skips_popped_by(src) if skip.stash_partition == dst]
    sent_at, taken_at = len(actions[src]), len(actions[dst])
    if grad and src == num_stages - 1:
        out.append(Planned(Kind.LOSS, -1, -1, sent_at, taken_at))
    if src == closer(num_stages, grad):
        out.append(Planned(Kind.DONE, -1, -1, sent_at, taken_at))
    return out


def channels(actions: Sequence[Sequence[Action]], layout: SkipLayout,
             grad: bool) -> Set[Tuple[int, int]]:
    """Every ``(sender, receiver)`` pair of stages with a message in one call.

    The same for any number of micro-batches: each kind of message is sent for every
    micro-batch or once per call.
    """
    k = len(actions)
    return {(src, dst) for src in range(k) for dst in range(k)
            if messages(src, dst, actions, layout, grad)}


def pipeline_channels(schedule: Schedule, num_stages: int, chunks: int,
                      layout: SkipLayout) -> Set[Tuple[int, int]]:
    """The pairs of ``channels`` that any call of a pipeline uses, training or not."""
    return set().union(*(channels(call_actions(schedule, num_stages, chunks, grad), layout, grad)
                         for grad in (True, False)))
