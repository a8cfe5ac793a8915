"""A schedule's actions run on stages: the part of a training step both engines share.

Every action of a schedule is one task on one stage: ``F`` runs the stage's forward on a
micro-batch (on the last stage of a training step, also that micro-batch's loss, which
becomes the root of its backward), ``B`` its backward, ``I`` and ``W`` the two halves of a
split backward (``seqpipe.core.split_backward``). The engines differ only in how a task's inputs
arrive and where its results go: the local engine hands them between threads through a
mailbox, the distributed one sends them between ranks. ``Tasks`` runs the tasks and asks the
engine for those through four methods (``receive_forward``, ``send_forward``,
``receive_backward``, ``send_backward``). A call's actions are compiled before the first
runs (``Tasks.steps``): what the call fixes for all of them is decided once, so that each
action between layers runs only its own work.

The mini-batch loss is the sum of the micro-batch losses, each times a weight fixed before
the step (``seqpipe.core.loss_weights``: its share of the samples, or one over the mini-batch's
count), so that the loss and the gradients are those of the whole batch, whatever the
micro-batches hold; the losses are added in micro-batch order (``loss_weights.in_order``),
not in the order the schedule computed them.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager, nullcontext
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Set,
    Tuple,
)

import torch
from torch import Tensor

from seqpipe.core.loss_weights import in_order, joined
from seqpipe.core.microbatch import Batch
from seqpipe.core.sink import GradSink
from seqpipe.core.stage import Grads, Received, Sent, Stage, TaskState
from seqpipe.schedule import Action, Phase
from seqpipe.skip.tracker import SkipKey
from seqpipe.trace import hooks
from seqpipe.trace.events import KIND_OF_PHASE, EventKind

__all__ = ["LossFn", "Step", "Tasks", "microbatch_loss"]

LossFn = Callable[[Any, Any], Tensor]
Step = Callable[[], None]  # one action of a call, compiled (``Tasks.steps``)
Optionals = Tuple[Optional[Tensor], ...]


@contextmanager
def _both(first: ContextManager[None], second: ContextManager[None]) -> Iterator[None]:
    with first, second:
        yield


FLAT_OUTPUT = (
    "seqpipe: loss_fn receives each micro-batch's output as the pipeline's last layer returns "
    "it (a tensor, or a tuple of tensors), never a model's output structure: for a model "
    "converted by seqpipe.to_sequential, the flat output (GPT-2 without labels: the logits "
    "tensor; with labels: (loss, logits)); seq.origin.rebuild(out) gives the structure back")


def microbatch_loss(i: int, outputs: Batch, target: Any, loss_fn: LossFn) -> Tensor:
    """Micro-batch ``i``'s loss (its weight is applied by ``Tasks``: to the value it reports,
    and to the gradient its backward starts from); checks what ``loss_fn`` returns."""
    # the first output with a batch dimension (a model's own loss, a scalar, may come first)
    batched = next((t for t in outputs.tensors if t.dim() > 0), None)
    if isinstance(target, Tensor) and target.dim() > 0 and batched is not None and \
            target.shape[0] != batched.shape[0]:
        raise ValueError(
            f"micro-batch {i}: the output has {batched.shape[0]} samples but "
            f"its slice of the target has {target.shape[0]}; input and target need the "
            f"same batch size")
    if torch.is_grad_enabled():  # (an enable_grad object costs a few µs per micro-batch)
        return _checked(_called(loss_fn, outputs, target), outputs)
    with torch.enable_grad():
        return _checked(_called(loss_fn, outputs, target), outputs)


def _called(loss_fn: LossFn, outputs: Batch, target: Any) -> Any:
    """``loss_fn(output, target)``; an ``AttributeError`` read on the output (``out.logits``)
    gets a note: ``loss_fn`` receives the flat output, not a ``ModelOutput``."""
    try:
        return loss_fn(outputs.value, target)
    except AttributeError as exc:
        if getattr(exc, "obj", None) is outputs.value:
            exc.add_note(FLAT_OUTPUT)
        raise


def _checked(loss: Any, outputs: Batch) -> Tensor:
    """``loss_fn``'s result as a 0-dim tensor the backward can start from (``joined``)."""
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        got = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor)
               else type(loss).__name__)
        raise TypeError(f"loss_fn must return a scalar tensor (one number, e.g. a "
                        f"mean-reduced loss), got {got}")
    return joined(loss if loss.dim() == 0 else loss.reshape(()), outputs.tensors)


class Tasks:
    """Runs the actions of one training step (or forward) on the stages of one engine.

    The engine provides the attributes below and the four transport methods; the
    per-micro-batch gradient destination (``_sink``, ``_handing_over``) and private RNG
    seeds (``rng_seed``) default to ``.grad`` and the global generators.
    """

    stages: Mapping[int, Stage]
    grad: bool
    checkpoint_stop: int
    seed: Optional[Tensor]  # the last stage's backward starts from it (loss scale), else 1
    split: Set[Tuple[int, int]]  # (stage, micro-batch) run as I then W
    states: Dict[Tuple[int, int], TaskState]
    losses: Dict[int, Tuple[Tensor, float]]  # by micro-batch: its loss (detached), its weight
    starts: Dict[Tuple[torch.dtype, torch.device, float], Tensor]  # ``_start``'s, per call
    watched = False  # traced or timed: the computations' spans are entered (``steps``)

    @property
    def num_stages(self) -> int:
        raise NotImplementedError

    # -- what the engine provides ------------------------------------------------------
    def receive_forward(self, s: int, i: int, inputs: Optional[Sequence[Batch]]) -> Received:
        """Micro-batch ``i``'s input (and skips) for stage ``s``, on its device."""
        raise NotImplementedError

    def send_forward(self, s: int, i: int, sent: Sent) -> None:
        """Hand ``sent`` on: to the next stage and the skips' popping stages; on the last
        stage of a call without a loss, keep the output."""
        raise NotImplementedError

    def receive_backward(self, s: int, i: int) -> Tuple[Optionals, Dict[SkipKey, Optional[Tensor]]]:
        """The gradients of what stage ``s`` (not the last) sent for micro-batch ``i``."""
        raise NotImplementedError

    def send_backward(self, s: int, i: int, received: Grads) -> None:
        """Hand the gradients of what stage ``s`` received back to their senders."""
        raise NotImplementedError

    def output_grads(self, s: int, i: int) -> Tuple[Optionals, Dict[SkipKey, Optional[Tensor]]]:
        """The gradients stage ``s``'s backward of micro-batch ``i`` starts from: on the last
        stage, that of the loss (``seed``, else 1); elsewhere, what ``receive_backward`` gets."""
        if s == self.num_stages - 1:
            return (self.states[(s, i)].start,), {}
        return self.receive_backward(s, i)

    def _start(self, loss: Tensor, weight: float) -> Tensor:
        """The gradient a last stage's backward starts from: ``weight`` times the loss
        scale (``seed``, else 1) in the loss's dtype, as a 0-dim tensor made once per call
        for each weight (``starts``; nothing writes it, autograd copies before keeping it)."""
        key = (loss.dtype, loss.device, weight)
        start = self.starts.get(key)
        if start is None:
            one = self.seed.to(loss.dtype) if self.seed is not None else \
                torch.ones((), dtype=loss.dtype, device=loss.device)
            start = self.starts[key] = one * weight
        return start

    def loss_sum(self) -> Tensor:
        """The mini-batch loss: each micro-batch's loss times its weight, added in
        micro-batch order (``loss_weights.in_order``: the plain model's sum, whatever order
        the schedule ran them in; the products made here rather than one per micro-batch)."""
        return in_order({i: loss * weight for i, (loss, weight) in self.losses.items()})

    def _sink(self, s: int, i: int) -> Optional[GradSink]:
        return None

    def _handing_over(self, s: int, i: int) -> ContextManager[None]:
        return nullcontext()

    def watch(self) -> None:
        """Decide ``watched`` for the call from now on: whether a recording or a profiler
        wants spans (``seqpipe.trace``) or ``_timed`` times the computations."""
        self.watched = hooks.enabled() or self.timing

    @property
    def timing(self) -> bool:
        """Whether ``_timed`` times the computations (``schedule="auto"``'s first step)."""
        return False

    def _timed(self, phase: Phase, s: int, i: int) -> ContextManager[None]:
        """Around each stage computation (``schedule="auto"`` measures them)."""
        return nullcontext()

    def _computing(self, phase: Phase, s: int, i: int,
                   kind: Optional[EventKind] = None) -> ContextManager[None]:
        """Around one computation of ``phase`` on stage ``s``: its traced span (``kind``,
        by default the phase's own) and its timing for ``schedule="auto"``; nothing to
        enter (one shared no-op) while neither is on, the usual case."""
        span = hooks.span(kind or KIND_OF_PHASE[phase], s, i)
        timed = self._timed(phase, s, i)
        if isinstance(span, nullcontext) and isinstance(timed, nullcontext):
            return span
        return _both(span, timed)

    def rng_seed(self, s: int, i: int) -> Optional[int]:
        """The seed of the task's private random streams (``None``: the global ones)."""
        return None

    # -- actions -----------------------------------------------------------------------
    def steps(self, actions: Sequence[Action], inputs: Optional[Sequence[Batch]],
              targets: Optional[Sequence[Any]], loss_fn: Optional[LossFn],
              weights: Sequence[float]) -> List[Step]:
        """The call's ``actions`` compiled into steps, in order: each a call without
        arguments that does its action's work and nothing else.

        What a call fixes for all its actions is decided here, once, in one pass, not at
        each action between layers (where the same bookkeeping costs several times as much:
        cold code, docs/benchmark-history.md "Session 14: plan4"): the phase's method, the
        stage, the checkpoint mode, the random seed, where the parameters' gradients go,
        whether the backward is split, the micro-batch's target and weight on the last
        stage, and whether anything traces or times the computations (``watched``). So the
        engine must have set up all of these (its ``_sink``, ``split``, ``checkpoint_stop``,
        ``rng_seed``, timer) before it asks for the steps; what a step still reads when it
        runs is what its action's neighbours change (``states``, messages, the sink's
        aliases)."""
        self.watch()
        return [self.step(action, inputs, targets, loss_fn, weights) for action in actions]

    def step(self, action: Action, inputs: Optional[Sequence[Batch]],
             targets: Optional[Sequence[Any]], loss_fn: Optional[LossFn],
             weights: Sequence[float]) -> Step:
        """One action compiled (see ``steps``, which sets ``watched`` first)."""
        s, i = action.stage, action.microbatch
        assert s is not None
        stage = self.stages[s]
        if action.phase is Phase.FORWARD:
            scored = None
            if s == self.num_stages - 1 and loss_fn is not None and targets is not None:
                scored = (targets[i], weights[i], loss_fn)
            return functools.partial(
                self._forward, s, i, stage, inputs, self.grad and i < self.checkpoint_stop,
                self.rng_seed(s, i), self._sink(s, i), (s, i) in self.split, scored)
        if action.phase is Phase.BACKWARD_INPUT:
            return functools.partial(self._backward_input, s, i, stage)
        if action.phase is Phase.BACKWARD_WEIGHT:
            return functools.partial(self._backward_weight, s, i, stage, self._sink(s, i))
        return functools.partial(self._backward, s, i, stage, self._sink(s, i))

    def _forward(self, s: int, i: int, stage: Stage, inputs: Optional[Sequence[Batch]],
                 checkpoint: bool, seed: Optional[int], sink: Optional[GradSink], split: bool,
                 scored: Optional[Tuple[Any, float, LossFn]]) -> None:
        """``F(s, i)``: receive, compute, send on (``scored``: the last stage of a training
        step, with the micro-batch's target, weight and ``loss_fn``: take its loss)."""
        received = self.receive_forward(s, i, inputs)
        with self._computing(Phase.FORWARD, s, i) if self.watched else hooks.OFF:
            sent, state = stage.forward(received, grad=self.grad, checkpoint=checkpoint,
                                        seed=seed, sink=sink, split=split)
        if scored is None:
            self.send_forward(s, i, sent)
        else:
            assert state is not None
            target, weight, loss_fn = scored
            with self._computing(Phase.FORWARD, s, i, EventKind.LOSS) if self.watched \
                    else hooks.OFF:  # loss_fn: once
                loss = stage.loss(state, sent,
                                  lambda out: microbatch_loss(i, out, target, loss_fn))
            # The weight is not recorded by autograd: the loss's value is reported times it
            # (``loss_sum``), and its backward starts from it (times the loss scale), as the
            # gradient of ``loss * weight`` would reach the loss: the same numbers, one node
            # and two small operations (cold, after a layer) fewer per micro-batch.
            self.losses[i] = (loss.detach(), weight)  # added in order: ``loss_sum``
            state.start = self._start(loss, weight)
        if state is not None:
            self.states[(s, i)] = state

    def _backward(self, s: int, i: int, stage: Stage, sink: Optional[GradSink]) -> None:
        """``B(s, i)``: receive gradients, backpropagate, send gradients back."""
        grads, skip_grads = self.output_grads(s, i)
        with self._handing_over(s, i):  # hooks: once
            with self._computing(Phase.BACKWARD, s, i) if self.watched else hooks.OFF:
                received = stage.backward(self.states.pop((s, i)), grads, skip_grads,
                                          sink=sink)
        self.send_backward(s, i, received)

    def _backward_input(self, s: int, i: int, stage: Stage) -> None:
        """``I(s, i)``: the input gradients only, sent before the input path is freed."""
        grads, skip_grads = self.output_grads(s, i)
        state = self.states[(s, i)]
        with self._computing(Phase.BACKWARD_INPUT, s, i) if self.watched else hooks.OFF:
            received = stage.backward_input(state, grads, skip_grads, free=False)
        self.send_backward(s, i, received)
        stage.free_input_path(state)  # after the send: the gradients are not to wait

    def _backward_weight(self, s: int, i: int, stage: Stage,
                         sink: Optional[GradSink]) -> None:
        """``W(s, i)``: the parameters' gradients of micro-batch ``i`` (after its ``I``)."""
        with self._handing_over(s, i), \
                self._computing(Phase.BACKWARD_WEIGHT, s, i) if self.watched else hooks.OFF:
            stage.backward_weight(self.states.pop((s, i)), sink=sink)
