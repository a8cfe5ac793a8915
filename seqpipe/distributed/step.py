"""One call of a distributed pipeline on one rank: its stage's actions, in schedule order.

Data comes in through ``Transport`` messages; whatever arrives before it is needed waits
in an inbox. Stage 0 opens every call by telling the others how many micro-batches it has
cut; the last stage closes it by sending the loss (or just "done") to every other stage, so
a failure anywhere reaches every rank: a failing stage sends an ABORT to the stages that
still expect a message from it, and a stage waiting on a peer that reports a failure, or
dies, raises and passes it on the same way (``Transport.abort``).

The order in which a call sends its messages is the one ``seqpipe.distributed.plan``
lists (every rank derives it to receive ahead); the transport checks each send against it.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

from seqpipe.distributed.accumulate import StepGrads
from seqpipe.distributed.transport import Kind, Message, PeerError, Transport
from seqpipe.microbatch import Batch
from seqpipe.schedule import Action
from seqpipe.skip.layout import SkipLayout
from seqpipe.skip.tracker import SkipKey
from seqpipe.stage import Received, Stage, TaskState, moved

__all__ = ["Call", "LossFn", "describe"]

LossFn = Callable[[Any, Any], Tensor]
_WHAT = {Kind.ACTIVATION: "activation", Kind.GRAD: "gradient", Kind.SKIP: "skip tensor",
         Kind.SKIP_GRAD: "skip gradient", Kind.STEP: "start of the step",
         Kind.DONE: "end of the step", Kind.LOSS: "loss"}


@dataclass
class Call:
    """The state of one ``train_step`` or ``forward`` on this rank."""

    stage: Stage
    transport: Transport
    layout: SkipLayout
    num_stages: int
    grad: bool
    checkpoint_stop: int = 0
    seed: Optional[Tensor] = None  # the last stage's backward starts from it (loss scale), else 1
    grads: Optional[StepGrads] = None  # where parameter gradients add up (train_step)
    inbox: Dict[Tuple[Kind, int, int], Message] = field(default_factory=dict)
    states: Dict[int, TaskState] = field(default_factory=dict)
    outputs: List[Batch] = field(default_factory=list)
    losses: List[Tensor] = field(default_factory=list)
    action: str = "the start of the step"

    @property
    def index(self) -> int:
        return self.stage.index

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1

    def key_index(self, key: SkipKey) -> int:
        return [skip.key for skip in self.layout].index(key)

    # -- receiving ---------------------------------------------------------------------
    def need(self, src: int, kind: Kind, microbatch: int = -1, key: int = -1) -> Message:
        """Wait for one message from stage ``src``, keeping others that arrive first."""
        wanted = (kind, microbatch, key)
        while wanted not in self.inbox:
            try:
                message = self.transport.recv(src)
            except PeerError as exc:
                raise PeerError(f"{exc}\n  stage {self.index} was at {self.action}, waiting "
                                f"for the {_WHAT[kind]} from stage {src}", peer=src) from None
            except Exception as exc:
                raise PeerError(
                    f"stage {self.index} lost stage {src} while at {self.action}, waiting for "
                    f"the {_WHAT[kind]}: {type(exc).__name__}: {exc}", peer=src) from exc
            self.inbox[(message.kind, message.microbatch, message.key)] = message
        return self.inbox.pop(wanted)

    def send(self, dst: int, kind: Kind, microbatch: int, tensors: Sequence[Optional[Tensor]],
             flags: Optional[Sequence[bool]] = None, **options: Any) -> None:
        """Queue a message to stage ``dst``; a failure to send is the peer's failure."""
        try:
            self.transport.send(dst, kind, microbatch, tensors, flags, **options)
        except (TypeError, ValueError):  # what cannot be sent at all: this stage's error
            raise
        except Exception as exc:
            raise PeerError(
                f"stage {self.index} lost stage {dst} while at {self.action}, sending the "
                f"{_WHAT[kind]}: {type(exc).__name__}: {exc}", peer=dst) from exc

    def flush(self) -> None:
        """Wait for this call's sends to go out."""
        try:
            self.transport.flush()
        except PeerError as exc:
            raise PeerError(f"stage {self.index} {exc} (at {self.action})",
                            peer=exc.peer) from exc

    # -- actions -----------------------------------------------------------------------
    def forward(self, i: int, inputs: Optional[Sequence[Batch]], targets: Optional[Sequence[Any]],
                loss_fn: Optional[LossFn], weights: Sequence[float], split: bool = False) -> None:
        """Run ``F(i)``: receive, compute, send on (or take the loss on the last stage)."""
        s = self.index
        if s == 0:
            assert inputs is not None
            received_batch, flags = moved(inputs[i], self.stage.device)
        else:
            message = self.need(s - 1, Kind.ACTIVATION, i)
            received_batch = Batch(message.tensors, message.atomic)  # type: ignore[arg-type]
            flags = message.flags
        skips: Dict[SkipKey, Optional[Tensor]] = {}
        for skip in self.layout.skips_popped_by(s):
            message = self.need(skip.stash_partition, Kind.SKIP, i, self.key_index(skip.key))
            skips[skip.key] = message.tensors[0]
            flags += message.flags
        sent, state = self.stage.forward(Received(received_batch, skips, flags), grad=self.grad,
                                         checkpoint=self.grad and i < self.checkpoint_stop,
                                         sink=self.grads.sink_for(i) if self.grads else None,
                                         split=split)
        for key, tensor in sorted(sent.skips.items(), key=lambda kv: self.key_index(kv[0])):
            self.send(self.layout.pop_partition(*key), Kind.SKIP, i, [tensor],
                      [sent.wants_grad(tensor)], key=self.key_index(key))
        if not self.last:
            outs = sent.outputs.tensors
            self.send(s + 1, Kind.ACTIVATION, i, outs, [sent.wants_grad(t) for t in outs],
                      atomic=sent.outputs.atomic)
        elif loss_fn is not None and targets is not None:
            assert state is not None
            loss = self._loss(i, sent.outputs, targets[i], loss_fn, weights[i])
            if state.replay is None:
                state.roots = [get_gradient_edge(loss)]
            else:  # recomputed at I, the loss with it
                target, weight = targets[i], weights[i]
                state.head = lambda out: self._loss(i, out, target, loss_fn, weight, keep=False)
        else:
            self.outputs.append(sent.outputs)
        if state is not None:
            self.states[i] = state

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

    def backward(self, i: int) -> None:
        """Run ``B(i)``: receive gradients, backpropagate into ``.grad``, send gradients back."""
        self._backward(i, split=False)

    def backward_input(self, i: int) -> None:
        """Run ``I(i)``: receive gradients, compute and send back the input gradients only."""
        self._backward(i, split=True)

    def backward_weight(self, i: int) -> None:
        """Run ``W(i)``: the parameters' gradients of micro-batch ``i`` (after its ``I``)."""
        sink = self.grads.sink_for(i) if self.grads else None
        with self.grads.handing_over(i) if self.grads else nullcontext():  # hooks: once
            self.stage.backward_weight(self.states.pop(i), sink=sink)

    def _backward(self, i: int, split: bool) -> None:
        s = self.index
        if self.last:
            seed = self.seed if self.seed is not None else torch.ones((), device=self.stage.device)
            grads: Tuple[Optional[Tensor], ...] = (seed,)
        else:
            grads = self.need(s + 1, Kind.GRAD, i).tensors
        skip_grads = {skip.key: self.need(skip.pop_partition, Kind.SKIP_GRAD, i,
                                          self.key_index(skip.key)).tensors[0]
                      for skip in self.layout.skips_stashed_by(s)}
        if split:
            received = self.stage.backward_input(self.states[i], grads, skip_grads)
        else:
            sink = self.grads.sink_for(i) if self.grads else None
            with self.grads.handing_over(i) if self.grads else nullcontext():  # hooks: once
                received = self.stage.backward(self.states.pop(i), grads, skip_grads, sink=sink)
        if s > 0:
            self.send(s - 1, Kind.GRAD, i, received.inputs)
        for key, grad in received.skips.items():
            self.send(self.layout.stash_partition(*key), Kind.SKIP_GRAD, i, [grad],
                      key=self.key_index(key))

    # -- failure handling --------------------------------------------------------------
    @contextmanager
    def guard(self, action: str) -> Iterator[None]:
        """Run a piece of the call; on failure tell every other stage before raising."""
        self.action = action
        try:
            yield
        except PeerError as exc:
            self.abort(str(exc), exc.peer)
            raise
        except Exception as exc:
            text = f"stage {self.index} failed in the {action}"
            self.abort(f"{text}: {type(exc).__name__}: {exc}")
            exc.add_note(f"seqpipe: {text}")
            raise

    def abort(self, text: str, heard_from: Optional[int] = None) -> None:
        """Pass the news on to the stages still expecting a message from this one."""
        self.transport.abort(text, heard_from)


def describe(action: Action) -> str:
    """``forward of micro-batch 3``: how errors name an action."""
    return f"{action.phase.value} of micro-batch {action.microbatch}"
