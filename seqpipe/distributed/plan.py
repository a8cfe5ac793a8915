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

Messages travel between *ranks*; a rank may hold several stages (interleaved and V-shaped
schedules, see ``seqpipe.schedule.Placement``), so a message also names the stage whose
action sends it (``origin``), and what one stage hands another on the same rank never goes
on the wire. The list mirrors what ``Call`` does: ``STEP`` from the rank of stage 0 when a
call opens (first on each of its channels, though sent to a rank its first action does not
feed only after that action); for each forward ``F(s, i)``, the outgoing skips (in layout
order, to the ranks of the stages that pop them) and then the activation (to the rank of
stage ``s+1``); for each ``B(s, i)`` or ``I(s, i)`` (a ``W`` sends nothing), the input
gradient (to the rank of stage ``s-1``) and then the skip gradients (in layout order); and
at the close, the loss from the rank of the last stage and ``DONE`` from the rank that
finishes last.

The pairs of ranks that exchange messages at all (``channels``) are the only ones a
pipeline ever talks over: it opens their communicators when it is built (NCCL creates one
per pair on first use, and that blocks until both ends arrive), and a failure is relayed
along them rather than sent to every stage (see ``Transport.abort``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

from seqpipe.distributed.wire import Kind
from seqpipe.schedule import (
    Action,
    AnySchedule,
    Phase,
    Placement,
    forward_phase,
    placement_of,
)
from seqpipe.schedule.protocol import stage_named as _staged
from seqpipe.schedule.protocol import staged_orders
from seqpipe.skip.layout import SkipLayout
from seqpipe.skip.tracker import SkipKey

__all__ = ["Planned", "OPENING", "Route", "call_actions", "split_tails", "messages", "closer",
           "channels", "pipeline_channels", "routes"]


@dataclass(frozen=True)
class Planned:
    """One message of a call: what it is, and when its sender and receiver handle it.

    ``sent_at`` and ``taken_at`` index the sender's and the receiver's actions in this call
    (-1: at the opening, ``len(actions)``: at the close). ``origin``: the stage whose action
    sends it (-1 for the messages of the opening and the close).
    """

    kind: Kind
    microbatch: int
    key: int
    sent_at: int
    taken_at: int
    origin: int = -1
    # (kind, micro-batch, key, origin): how both ends name the message; made once, as
    # the transport looks it up for every message of every call
    identity: Tuple[Kind, int, int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "identity",
                           (self.kind, self.microbatch, self.key, self.origin))


OPENING = Planned(Kind.STEP, -1, -1, -1, -1)  # rank of stage 0 -> every other rank, first

# a skip crossing to or from a stage: its key, the other end's rank, its index in the
# layout (how messages name it), the other end's stage
SkipRoute = Tuple[SkipKey, int, int, int]


@dataclass(frozen=True)
class Route:
    """Where one stage's messages come from and go to, made once per pipeline (every
    action asks): the ranks of the stages before and after it (-1: none), the skips it
    pops (each from its stashing stage) and those it stashes (each to its popping stage),
    in layout order."""

    before: int
    after: int
    popped: Tuple[SkipRoute, ...]
    stashed: Tuple[SkipRoute, ...]


def routes(layout: SkipLayout, placement: Placement) -> Dict[int, Route]:
    """The ``Route`` of every stage of ``placement``."""
    rank, last = placement.rank_of, placement.num_stages - 1
    index = {skip.key: n for n, skip in enumerate(layout)}
    return {s: Route(rank(s - 1) if s > 0 else -1, rank(s + 1) if s < last else -1,
                     tuple((k.key, rank(k.stash_partition), index[k.key], k.stash_partition)
                           for k in layout.skips_popped_by(s)),
                     tuple((k.key, rank(k.pop_partition), index[k.key], k.pop_partition)
                           for k in layout.skips_stashed_by(s)))
            for s in range(placement.num_stages)}


def closer(num_stages: int, grad: bool) -> int:
    """The stage that finishes a call last; its rank releases the others with ``DONE``."""
    return 0 if grad else num_stages - 1


def call_actions(schedule: AnySchedule, num_ranks: int, m: int,
                 grad: bool) -> List[List[Action]]:
    """What every rank runs in a call of ``m`` micro-batches (forwards only without grad),
    each action naming its stage (stage ``r`` on rank ``r`` for a one-stage schedule), with
    each stage's last backward split where another rank waits on it (``split_tails``)."""
    actions = staged_orders(schedule, num_ranks, m)
    if not grad:
        return [forward_phase(a) for a in actions]
    return split_tails(actions, placement_of(schedule, num_ranks))


_SENDS_GRADIENT = (Phase.BACKWARD, Phase.BACKWARD_INPUT)


def split_tails(actions: Sequence[Sequence[Action]], placement: Placement) -> List[List[Action]]:
    """``actions`` with the last backward of each stage whose upstream stage is on another
    rank, where it is a ``B``, run as ``I`` then ``W`` (the same gradients, and the same
    hooks, as the whole backward: ``seqpipe.core.split_backward``). A stage whose last
    backward is split already (``I`` ... ``W``) is left as it is: splitting an earlier
    ``B`` would take nothing off the end of the step.

    Why: at the end of a step the upstream rank waits for that backward's input gradients,
    and then runs its own last backward, which the rank after it waits for in turn. The
    weight gradients (``W``, about half a backward) are wanted by nobody before the step
    ends, so sending the input gradients first takes them off that chain: a 2-stage
    1F1B step ends a ``W`` sooner. Only the last ``B`` is split, as earlier ones overlap
    with other work and a split costs a little (saved tensors recorded, two engine calls).
    Every rank derives the same orders from the schedule, so the messages they plan agree.
    """
    out: List[List[Action]] = []
    for rank, order in enumerate(actions):
        last: Dict[int, int] = {}  # stage -> index of its last backward (B or I)
        for n, action in enumerate(order):
            s = action.stage
            assert s is not None
            if action.phase in _SENDS_GRADIENT and s > 0 and placement.rank_of(s - 1) != rank:
                last[s] = n
        split = list(order)
        for n in sorted((n for n in last.values() if order[n].phase is Phase.BACKWARD),
                        reverse=True):
            i, s = split[n].microbatch, split[n].stage
            split[n:n + 1] = [Action(Phase.BACKWARD_INPUT, i, s),
                              Action(Phase.BACKWARD_WEIGHT, i, s)]
        out.append(split)
    return out


def _positions(actions: Sequence[Action]) -> Dict[Tuple[Phase, int, Optional[int]], int]:
    return {(a.phase, a.microbatch, a.stage): n for n, a in enumerate(actions)}


def _gradient_taken(at: Dict[Tuple[Phase, int, Optional[int]], int], stage: int, i: int) -> int:
    """Where the receiver uses a gradient for ``stage``'s micro-batch ``i``: its B or I."""
    found = at.get((Phase.BACKWARD, i, stage))
    return found if found is not None else at[(Phase.BACKWARD_INPUT, i, stage)]


def messages(src: int, dst: int, actions: Sequence[Sequence[Action]], layout: SkipLayout,
             grad: bool, placement: Optional[Placement] = None) -> List[Planned]:
    """Every message rank ``src`` sends rank ``dst`` in one call, in sending order.

    ``actions[r]`` is what rank ``r`` runs in the call (only forwards without ``grad``), as
    ``call_actions`` gives it; ``placement``: which rank holds each stage (default: stage
    ``r`` on rank ``r``).
    """
    where = placement if placement is not None else Placement.one_per_rank(len(actions))
    last = where.num_stages - 1
    if src == dst or len(actions) < 2:
        return []
    rank = where.rank_of
    at = _positions(_staged(actions[dst], dst))
    keys = [skip.key for skip in layout]
    out = [OPENING] if src == rank(0) else []
    for n, action in enumerate(_staged(actions[src], src)):
        i, s = action.microbatch, action.stage
        assert s is not None
        if action.phase is Phase.FORWARD:
            out += [Planned(Kind.SKIP, i, keys.index(skip.key), n,
                            at[(Phase.FORWARD, i, skip.pop_partition)], s)
                    for skip in layout.skips_stashed_by(s) if rank(skip.pop_partition) == dst]
            if s < last and rank(s + 1) == dst:
                out.append(Planned(Kind.ACTIVATION, i, -1, n, at[(Phase.FORWARD, i, s + 1)], s))
        elif action.sends_gradient:
            if s > 0 and rank(s - 1) == dst:
                out.append(Planned(Kind.GRAD, i, -1, n, _gradient_taken(at, s - 1, i), s))
            out += [Planned(Kind.SKIP_GRAD, i, keys.index(skip.key), n,
                            _gradient_taken(at, skip.stash_partition, i), s)
                    for skip in layout.skips_popped_by(s) if rank(skip.stash_partition) == dst]
    sent_at, taken_at = len(actions[src]), len(actions[dst])
    finisher = rank(closer(where.num_stages, grad))
    if grad and src == rank(last):
        out.append(Planned(Kind.LOSS, -1, -1, sent_at, taken_at))
    elif grad and dst == finisher != src and quiet_tail(_staged(actions[src], src), where,
                                                        layout):
        out.append(Planned(Kind.DONE, -1, -1, sent_at, taken_at))  # "done here too"
    if src == finisher:
        out.append(Planned(Kind.DONE, -1, -1, sent_at, taken_at))
    return out


def _sends(action: Action, src: int, placement: Placement, layout: SkipLayout) -> bool:
    """Whether ``action`` (of rank ``src``) sends a message to another rank."""
    s, rank = action.stage, placement.rank_of
    assert s is not None
    if action.phase is Phase.FORWARD:
        return (s < placement.num_stages - 1 and rank(s + 1) != src) or any(
            rank(skip.pop_partition) != src for skip in layout.skips_stashed_by(s))
    if action.sends_gradient:
        return (s > 0 and rank(s - 1) != src) or any(
            rank(skip.stash_partition) != src for skip in layout.skips_popped_by(s))
    return False


def quiet_tail(actions: Sequence[Action], placement: Placement, layout: SkipLayout) -> bool:
    """Whether a rank runs actions after its last message to another rank (weight
    gradients at the end of a zero-bubble schedule): nobody would wait on it there, so
    it tells the finishing rank it is done, and a failure there still reaches everyone."""
    src = placement.rank_of(actions[0].stage) if actions else 0  # type: ignore[arg-type]
    sending = [n for n, a in enumerate(actions) if _sends(a, src, placement, layout)]
    return not sending or sending[-1] < len(actions) - 1


def channels(actions: Sequence[Sequence[Action]], layout: SkipLayout, grad: bool,
             placement: Optional[Placement] = None) -> Set[Tuple[int, int]]:
    """Every ``(sender, receiver)`` pair of ranks with a message in one call.

    The same for any number of micro-batches: each kind of message is sent for every
    micro-batch or once per call.
    """
    k = len(actions)
    return {(src, dst) for src in range(k) for dst in range(k)
            if messages(src, dst, actions, layout, grad, placement)}


def pipeline_channels(schedule: AnySchedule, num_ranks: int, chunks: int,
                      layout: SkipLayout) -> Set[Tuple[int, int]]:
    """The pairs of ``channels`` that any call of a pipeline uses, training or not."""
    placement = placement_of(schedule, num_ranks)
    return set().union(*(channels(call_actions(schedule, num_ranks, chunks, grad), layout,
                                  grad, placement) for grad in (True, False)))
