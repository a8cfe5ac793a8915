"""The traced spans of a distributed call's messages: which stage waits for (or sends)
what, from (or to) which stage. See ``seqpipe.trace``; free while tracing is off."""
from __future__ import annotations

from typing import Any, Container, ContextManager, Optional, Protocol, Tuple

from seqpipe.distributed.wire import Kind
from seqpipe.schedule import Placement
from seqpipe.skip.layout import SkipLayout
from seqpipe.trace import hooks
from seqpipe.trace.events import EventKind, What

__all__ = ["WHAT", "TracedCall", "end_step", "receiving", "sending"]

WHAT = {Kind.ACTIVATION: What.ACTIVATION, Kind.GRAD: What.GRADIENT, Kind.SKIP: What.SKIP,
        Kind.SKIP_GRAD: What.SKIP_GRAD, Kind.STEP: What.STEP, Kind.DONE: What.DONE,
        Kind.LOSS: What.LOSS}


class TracedCall(Protocol):
    """What the spans read of a call (``distributed.step.Call``, which imports this
    module): who this rank is, where stages live, what arrived."""

    @property
    def rank(self) -> int: ...

    @property
    def num_stages(self) -> int: ...

    @property
    def layout(self) -> SkipLayout: ...

    @property
    def placement(self) -> Placement: ...

    @property
    def inbox(self) -> Container[Tuple[Kind, int, int, int]]: ...

    @property
    def microbatches(self) -> int: ...

    @property
    def grad(self) -> bool: ...


def _ends(call: TracedCall, rank: int, kind: Kind, key: int, origin: int,
          incoming: bool) -> Tuple[int, int]:
    """(sending stage, receiving stage) of a message from (``incoming``) or to ``rank``."""
    if kind is Kind.ACTIVATION:
        return origin, origin + 1
    if kind is Kind.GRAD:
        return origin, origin - 1
    if kind in (Kind.SKIP, Kind.SKIP_GRAD):
        skip = list(call.layout)[key]
        return origin, skip.pop_partition if kind is Kind.SKIP else skip.stash_partition
    # a control message: the loss comes from the last stage, else a rank's first stage
    # stands for it
    sender, receiver = (rank, call.rank) if incoming else (call.rank, rank)
    first = call.placement.stages_of
    return (call.num_stages - 1 if kind is Kind.LOSS else first(sender)[0]), first(receiver)[0]


def receiving(call: TracedCall, src: int,
              wanted: Tuple[Kind, int, int, int]) -> ContextManager[Any]:
    """The wait for message ``wanted`` (kind, micro-batch, key, origin) from rank ``src``;
    ``OFF`` if it already arrived."""
    if not hooks.enabled() or wanted in call.inbox:
        return hooks.OFF
    kind, microbatch, key, origin = wanted
    peer, stage = _ends(call, src, kind, key, origin, incoming=True)
    return hooks.span(EventKind.WAIT, stage, None if microbatch < 0 else microbatch,
                      peer=peer, what=WHAT[kind])


def sending(call: TracedCall, dst: int, kind: Kind, microbatch: int, key: int = -1,
            origin: int = -1) -> ContextManager[Any]:
    """Handing one message to rank ``dst`` to the transport (the send itself is
    asynchronous)."""
    if not hooks.enabled():
        return hooks.OFF
    stage, peer = _ends(call, dst, kind, key, origin, incoming=False)
    return hooks.span(EventKind.SEND, stage, None if microbatch < 0 else microbatch,
                      peer=peer, what=WHAT[kind])


def end_step(index: Optional[int], pipe: Any, call: TracedCall) -> None:
    """Complete step ``index``'s record with what ``pipe`` ran in ``call``."""
    hooks.end_step(index, pipe.group, pipe.device, schedule=pipe.schedule,
                   num_stages=pipe.num_stages, num_ranks=pipe.num_ranks,
                   num_microbatches=call.microbatches, backward=call.grad)
