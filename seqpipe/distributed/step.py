"""One call of a distributed pipeline on one rank: its stages' actions, in schedule order.

A rank holds one stage, or several (interleaved and V-shaped schedules); ``Call.run``
dispatches each action by its phase (``F``, ``B``, ``I``, ``W``) to the stage it names, so
no schedule has code of its own here. Data comes in through ``Transport`` messages
(between two stages of one rank, in memory); whatever arrives before it is needed waits
in an inbox. The rank of stage 0 opens every call by telling the others how many
micro-batches it has cut; the rank of the last stage closes it by sending the loss, and the
rank that finishes last sends "done" to every other rank, so a failure anywhere reaches
every rank: a failing rank sends an ABORT to the ranks that still expect a message from it,
and a rank waiting on a peer that reports a failure, or dies, raises and passes it on the
same way (``Transport.abort``). A rank whose last actions send nothing (weight gradients at
the end of a zero-bubble schedule) reports "done" to the finishing rank, so that a failure
there is still heard.

The order in which a call sends its messages is the one ``seqpipe.distributed.plan``
lists (every rank derives it to receive ahead); the transport checks each send against it.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    Iterator,
    List,
    Optional,
    Sequence,
    Set,
    Tuple,
)

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

from seqpipe.distributed import traced
from seqpipe.distributed.accumulate import StepGrads
from seqpipe.distributed.plan import Planned
from seqpipe.distributed.transport import Kind, Message, PeerError, Transport
from seqpipe.microbatch import Batch
from seqpipe.schedule import Action, Phase, Placement
from seqpipe.sink import GradSink
from seqpipe.skip.layout import SkipLayout
from seqpipe.skip.tracker import SkipKey
from seqpipe.stage import Received, Stage, TaskState, moved
from seqpipe.trace import hooks
from seqpipe.trace.events import EventKind

__all__ = ["Call", "LossFn", "describe"]

LossFn = Callable[[Any, Any], Tensor]
_WHAT = traced.WHAT


@dataclass
class Call:
    """The state of one ``train_step`` or ``forward`` on this rank.

    ``stages``: the stages this rank holds (several under interleaved and V-shaped
    schedules); ``placement`` says which rank holds every stage. Messages between stages
    on one rank are handed over in ``local``, without the transport.
    """

    stages: Dict[int, Stage]
    transport: Transport
    layout: SkipLayout
    placement: Placement
    grad: bool
    checkpoint_stop: int = 0
    microbatches: int = 0  # in this call, once it is open
    seed: Optional[Tensor] = None  # the last stage's backward starts from it (loss scale), else 1
    grads: Dict[int, StepGrads] = field(default_factory=dict)  # per stage (train_step)
    split: Set[Tuple[int, int]] = field(default_factory=set)  # (stage, i) run as I then W
    inbox: Dict[Tuple[Kind, int, int, int], Message] = field(default_factory=dict)
    local: Dict[Tuple[Kind, int, int, int], Message] = field(default_factory=dict)
    states: Dict[Tuple[int, int], TaskState] = field(default_factory=dict)
    outputs: List[Batch] = field(default_factory=list)
    losses: List[Tensor] = field(default_factory=list)
    action: str = "the start of the step"

    @property
    def rank(self) -> int:
        return self.transport.index

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    def name(self, rank: Optional[int] = None) -> str:
        """How messages name a rank: by its stage when it holds one."""
        rank = self.rank if rank is None else rank
        held = self.placement.stages_of(rank)
        if self.placement.num_stages == self.placement.num_ranks:
            return f"stage {held[0]}"
        return f"rank {rank} (stages {', '.join(map(str, held))})"

    def key_index(self, key: SkipKey) -> int:
        return [skip.key for skip in self.layout].index(key)

    def _sink(self, stage: int, i: int) -> Optional[GradSink]:
        grads = self.grads.get(stage)
        return grads.sink_for(i) if grads is not None else None

    def _handing_over(self, stage: int, i: int) -> ContextManager[None]:
        grads = self.grads.get(stage)
        return grads.handing_over(i) if grads is not None else nullcontext()

    # -- receiving ---------------------------------------------------------------------
    def need(self, src: int, kind: Kind, microbatch: int = -1, key: int = -1,
             origin: int = -1) -> Message:
        """Wait for one message from rank ``src``, keeping others that arrive first."""
        wanted = (kind, microbatch, key, origin)
        if src == self.rank:  # from a stage of this rank: handed over already
            return self.local.pop(wanted)
        with traced.receiving(self, src, wanted):
            while wanted not in self.inbox:
                self._take(src, kind)
        return self.inbox.pop(wanted)

    def _take(self, src: int, kind: Kind) -> None:
        """Receive the next message from rank ``src`` into the inbox (waiting for a
        ``kind``)."""
        try:
            message = self.transport.recv(src)
        except PeerError as exc:
            raise PeerError(f"{exc}\n  {self.name()} was at {self.action}, waiting "
                            f"for the {_WHAT[kind]} from {self.name(src)}",
                            peer=src) from None
        except Exception as exc:
            raise PeerError(
                f"{self.name()} lost {self.name(src)} while at {self.action}, waiting "
                f"for the {_WHAT[kind]}: {type(exc).__name__}: {exc}", peer=src) from exc
        self.inbox[(message.kind, message.microbatch, message.key, message.origin)] = message

    def expect(self, src: int, planned: Sequence[Planned]) -> None:
        """Tell the transport what rank ``src`` will send next; posting a receive from a
        lost peer fails there and then, and is that peer's failure, as in ``need``."""
        try:
            self.transport.expect(src, planned)
        except PeerError:
            raise
        except Exception as exc:
            raise PeerError(
                f"{self.name()} lost {self.name(src)} while at {self.action}, posting the "
                f"receive of its next message: {type(exc).__name__}: {exc}", peer=src) from exc

    def send(self, dst: int, kind: Kind, microbatch: int, tensors: Sequence[Optional[Tensor]],
             flags: Optional[Sequence[bool]] = None, **options: Any) -> None:
        """Queue a message to rank ``dst``; a failure to send is the peer's failure."""
        if dst == self.rank:  # to a stage of this rank: cut from the graph, as if sent
            kept = tuple(t.detach() if t is not None else None for t in tensors)
            self.local[(kind, microbatch, options.get("key", -1), options.get("origin", -1))] = \
                Message(kind, microbatch, options.get("key", -1), kept,
                        tuple(flags) if flags is not None else (False,) * len(kept),
                        atomic=options.get("atomic", True), origin=options.get("origin", -1))
            return
        try:
            with traced.sending(self, dst, kind, microbatch, options):
                self.transport.send(dst, kind, microbatch, tensors, flags, **options)
        except (TypeError, ValueError):  # what cannot be sent at all: this stage's error
            raise
        except Exception as exc:
            raise PeerError(
                f"{self.name()} lost {self.name(dst)} while at {self.action}, sending the "
                f"{_WHAT[kind]}: {type(exc).__name__}: {exc}", peer=dst) from exc

    def flush(self) -> None:
        """Wait for this call's sends to go out."""
        try:
            self.transport.flush()
        except PeerError as exc:
            raise PeerError(f"{self.name()} {exc} (at {self.action})", peer=exc.peer) from exc

    # -- actions -----------------------------------------------------------------------
    def run(self, action: Action, inputs: Optional[Sequence[Batch]],
            targets: Optional[Sequence[Any]], loss_fn: Optional[LossFn],
            weights: Sequence[float]) -> None:
        """Run one action of the schedule, whatever its phase."""
        s, i = action.stage, action.microbatch
        assert s is not None
        if action.phase is Phase.FORWARD:
            self.forward(s, i, inputs, targets, loss_fn, weights)
        elif action.phase is Phase.BACKWARD_WEIGHT:
            self.backward_weight(s, i)
        else:
            self.backward(s, i, split=action.phase is Phase.BACKWARD_INPUT)

    def forward(self, s: int, i: int, inputs: Optional[Sequence[Batch]],
                targets: Optional[Sequence[Any]], loss_fn: Optional[LossFn],
                weights: Sequence[float]) -> None:
        """Run ``F(s, i)``: receive, compute, send on (or take the loss on the last stage)."""
        rank = self.placement.rank_of
        if s == 0:
            assert inputs is not None
            received_batch, flags = moved(inputs[i], self.stages[s].device)
        else:
            message = self.need(rank(s - 1), Kind.ACTIVATION, i, origin=s - 1)
            received_batch = Batch(message.tensors, message.atomic)  # type: ignore[arg-type]
            flags = message.flags
        skips: Dict[SkipKey, Optional[Tensor]] = {}
        for skip in self.layout.skips_popped_by(s):
            message = self.need(rank(skip.stash_partition), Kind.SKIP, i,
                                self.key_index(skip.key), skip.stash_partition)
            skips[skip.key] = message.tensors[0]
            flags += message.flags
        with hooks.span(EventKind.FORWARD, s, i):
            sent, state = self.stages[s].forward(
                Received(received_batch, skips, flags), grad=self.grad,
                checkpoint=self.grad and i < self.checkpoint_stop, sink=self._sink(s, i),
                split=(s, i) in self.split)
        for key, tensor in sorted(sent.skips.items(), key=lambda kv: self.key_index(kv[0])):
            self.send(rank(self.layout.pop_partition(*key)), Kind.SKIP, i, [tensor],
                      [sent.wants_grad(tensor)], key=self.key_index(key), origin=s)
        if s < self.num_stages - 1:
            outs = sent.outputs.tensors
            self.send(rank(s + 1), Kind.ACTIVATION, i, outs, [sent.wants_grad(t) for t in outs],
                      atomic=sent.outputs.atomic, origin=s)
        elif loss_fn is not None and targets is not None:
            assert state is not None
            with hooks.span(EventKind.LOSS, s, i):
                loss = self._loss(i, sent.outputs, targets[i], loss_fn, weights[i])
            if state.replay is None:
                state.roots = [get_gradient_edge(loss)]
            else:  # recomputed at I, the loss with it
                target, weight = targets[i], weights[i]
                state.head = lambda out: self._loss(i, out, target, loss_fn, weight, keep=False)
        else:
            self.outputs.append(sent.outputs)
        if state is not None:
            self.states[(s, i)] = state

    def _loss(self, i: int, outputs: Batch, target: Any, loss_fn: LossFn,
              weight: float, keep: bool = True) -> Tensor:
        if isinstance(target, Tensor) and target.dim() > 0 and \
                target.shape[0] != outputs.tensors[0].shape[0]:
            raise ValueError(
                f"micro-batch {i}: the output has {outputs.tensors[0].shape[0]} samples but "
                f"its slice of the target has {target.shape[0]}; input and target need the "
                f"same batch size")
        with torch.enable_grad():
            loss = loss_fn(outputs.value, target)
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                got = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor)
                       else type(loss).__name__)
                raise TypeError(f"loss_fn must return a scalar tensor (one number, e.g. a "
                                f"mean-reduced loss), got {got}")
            scaled = loss.reshape(()) * weight
        if keep:
            self.losses.append(scaled.detach())
        return scaled

    def backward(self, s: int, i: int, split: bool = False) -> None:
        """Run ``B(s, i)`` (or, with ``split``, ``I(s, i)``: the input gradients only):
        receive gradients, backpropagate, send gradients back."""
        rank = self.placement.rank_of
        stage = self.stages[s]
        if s == self.num_stages - 1:
            seed = self.seed if self.seed is not None else torch.ones((), device=stage.device)
            grads: Tuple[Optional[Tensor], ...] = (seed,)
        else:
            grads = self.need(rank(s + 1), Kind.GRAD, i, origin=s + 1).tensors
        skip_grads = {skip.key: self.need(rank(skip.pop_partition), Kind.SKIP_GRAD, i,
                                          self.key_index(skip.key), skip.pop_partition
                                          ).tensors[0]
                      for skip in self.layout.skips_stashed_by(s)}
        with hooks.span(EventKind.INPUT_GRAD if split else EventKind.BACKWARD, s, i):
            if split:
                received = stage.backward_input(self.states[(s, i)], grads, skip_grads)
            else:
                with self._handing_over(s, i):  # hooks: once
                    received = stage.backward(self.states.pop((s, i)), grads, skip_grads,
                                              sink=self._sink(s, i))
        if s > 0:
            self.send(rank(s - 1), Kind.GRAD, i, received.inputs, origin=s)
        for key, grad in received.skips.items():
            self.send(rank(self.layout.stash_partition(*key)), Kind.SKIP_GRAD, i, [grad],
                      key=self.key_index(key), origin=s)

    def backward_weight(self, s: int, i: int) -> None:
        """Run ``W(s, i)``: the parameters' gradients of micro-batch ``i`` (after its ``I``)."""
        with self._handing_over(s, i), hooks.span(EventKind.WEIGHT_GRAD, s, i):
            self.stages[s].backward_weight(self.states.pop((s, i)), sink=self._sink(s, i))

    # -- failure handling --------------------------------------------------------------
    @contextmanager
    def guard(self, action: str, stage: Optional[int] = None) -> Iterator[None]:
        """Run a piece of the call (an action of ``stage``); on failure tell every other
        rank before raising."""
        self.action = action if stage is None else f"{action} on stage {stage}"
        try:
            yield
        except PeerError as exc:
            self.abort(str(exc), exc.peer)
            raise
        except Exception as exc:
            who = self.name() if stage is None else f"stage {stage}"
            if stage is not None and self.placement.num_stages != self.placement.num_ranks:
                who += f" (rank {self.rank})"
            text = f"{who} failed in the {action}"
            self.abort(f"{text}: {type(exc).__name__}: {exc}")
            exc.add_note(f"seqpipe: {text}")
            raise

    def abort(self, text: str, heard_from: Optional[int] = None) -> None:
        """Pass the news on to the stages still expecting a message from this one."""
        self.transport.abort(text, heard_from)


def describe(action: Action) -> str:
    """``forward of micro-batch 3``: how errors name an action (``guard`` adds its stage)."""
    return f"{action.phase.value} of micro-batch {action.microbatch}"
