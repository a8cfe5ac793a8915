"""One stage of a pipeline: a partition's forward and backward, one micro-batch at a time.

Both engines drive stages the same way. A stage receives its micro-batch input and the
skip tensors popped in it, already on its device and cut from the sender's autograd
graph; it runs its partition (checkpointed or not) and hands back its output and the
skip tensors stashed for later partitions. For the backward it takes the gradients of
what it sent and returns the gradients of what it received; its parameters' gradients
accumulate into a ``GradSink``, whose sums reach the parameters once per step (the local
engine hands them to autograd; the distributed one adds them to ``.grad`` before the
stage's last backward, which runs with the real parameters), or into ``.grad``. Cutting
the graph at every boundary is what lets each stage's backward run on its own thread
(local engine) or process (distributed engine), in the order a schedule says.
"""
from __future__ import annotations

import functools
import operator
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from seqpipe.core.autograd_calls import run_backward
from seqpipe.core.batchnorm import end_statistics
from seqpipe.core.boundary import Grads, Received, moved, wants_grad
from seqpipe.core.caller_input import CallerInput, versions
from seqpipe.core.checkpoint import (
    check_reentrant,
    first_pass,
    refusing_reentrant,
    run_task,
)
from seqpipe.core.draws import NO_DRAWS, draws_nothing
from seqpipe.core.entry import enter
from seqpipe.core.in_flight import settle
from seqpipe.core.microbatch import Batch, Constants
from seqpipe.core.parametrize_cache import forget_cached
from seqpipe.core.rng import backward_stream, captures
from seqpipe.core.saved import SavedTensors
from seqpipe.core.segments import run_segments, segments_of, skips_between
from seqpipe.core.sink import GradSink
from seqpipe.core.split_backward import SplitBackward, autograd_inputs
from seqpipe.core.task_state import Pending, Sent, TaskState, edge_of, gradient_edge
from seqpipe.skip.layout import SkipLayout
from seqpipe.skip.tracker import SkipKey, StageSkipTracker, swap_skip_tracker

__all__ = ["Received", "Sent", "Grads", "TaskState", "Stage", "moved", "wants_grad"]

Crossing = Callable[[SkipKey], bool]
_TRAINING = operator.attrgetter("training")


class Stage:
    """A partition on its device, run one micro-batch task at a time."""

    def __init__(self, index: int, partition: nn.Sequential, device: torch.device,
                 layout: SkipLayout, *, checkpoint_every: Optional[int] = None) -> None:
        self.index = index
        self.partition = partition
        self.device = device
        self.layout = layout
        self.crossing: Crossing = frozenset(k.key for k in layout if k.crosses).__contains__
        self.outgoing = frozenset(k.key for k in layout.skips_stashed_by(index))
        self.segments = segments_of(partition, checkpoint_every)  # [] : checkpointed whole
        self.between = skips_between(layout, index, checkpoint_every) if self.segments \
            else frozenset()
        # Where the leaves autograd records for the parameters come from, when a wrapper
        # registers others while its module runs (FSDP2's unsharded parameters:
        # seqpipe.distributed.fsdp sets this then); None: the parameters themselves. It is
        # given the stage rather than holding it, so that the stage is in no cycle.
        self.leaves: Optional[Callable[["Stage"], List[Tensor]]] = None
        self.caller_input = CallerInput() if index == 0 else None

    def parameters(self) -> List[nn.Parameter]:
        """The parameters that receive gradients, in a fixed order."""
        return [p for p in self.partition.parameters() if p.requires_grad]

    def used_parameters(self) -> List[Tensor]:
        """The leaves the forward used for the parameters, so that backward targets them:
        the parameters themselves, or what ``leaves`` says a wrapper put in their place."""
        return self.parameters() if self.leaves is None else self.leaves(self)

    def _call(self, tracker: StageSkipTracker, like: Batch, protect: bool = False,
              sink: Optional[GradSink] = None) -> Callable[..., Any]:
        """The partition as a function of its input tensors (run with ``sink``'s aliases).

        With ``protect``, the inputs are copied inside the function: a checkpoint keeps
        its inputs for the recomputation, and a layer that writes its input in place (say
        ``ReLU(inplace=True)`` just after a partition boundary, at the top level, nested in
        a block, or a custom ``x.mul_()``) would overwrite them. Which layer will write
        cannot be known beforehand, so every checkpointed task copies (a copy per input
        in the forward and again in the recomputation; see docs/pipe.md for its cost),
        whether ``torch.utils.checkpoint`` recomputes it or a split backward's ``I`` does.
        The input's non-tensor values come from ``like`` (the recomputation gets the same).
        The first stage's input is the caller's: it is copied whenever its layers would
        write it, checkpointed or not (``seqpipe.core.caller_input``).
        """
        atomic, constants = like.atomic, like.constants  # not its tensors: not kept alive

        def run(*tensors: Tensor) -> Any:
            return self._run(tensors, atomic, constants, tracker, sink, protect)
        return run

    def _run(self, tensors: Tuple[Tensor, ...], atomic: bool, constants: Constants,
             tracker: Optional[StageSkipTracker], sink: Optional[GradSink],
             protect: bool) -> Any:
        """The partition on ``tensors`` (the rest of the input: ``atomic``, ``constants``),
        copied first with ``protect`` or where they are the caller's and its layers write
        them (see ``_call``). One function, not nested closures: this is every
        micro-batch's path, in both engines and the direct call."""
        caller = self.caller_input  # (the first stage's: the caller's input)
        copied = protect
        if caller is not None:
            modes = tuple(map(_TRAINING, self.partition._modules.values()))  # layer flags
            copied = protect or caller.copies(modes)
        if copied:
            tensors = tuple([t.clone() for t in tensors])
        before = None if caller is None else versions(tensors)
        value = tensors[0] if atomic else Batch(tensors, atomic, constants).value
        if tracker is None:  # (run_inline's: no tracker asked for, no sink)
            forget_cached(self.partition)  # as ``_in_task``
            out = self.partition(value)
        else:
            out = self._in_task(tracker, sink, self.partition, value)
        if caller is not None:
            after = versions(tensors)
            if copied or before != after:  # (else nothing to learn)
                caller.saw(modes, copied, before, after)
        return out

    def run_inline(self, tensors: Tuple[Tensor, ...], like: Optional[Batch],
                   tracker: Optional[StageSkipTracker]) -> Union[Tensor, Sent]:
        """The whole partition on ``tensors`` (placed as in ``like``; ``None``: one tensor),
        not checkpointed, in the current grad mode and graph (no entry node), with
        ``tracker`` (``None``: a partition without skippable layers, where none asks): a
        one-micro-batch call run as the plain model (``seqpipe.local.direct``). Returns a
        tensor output as it is where there is no tracker (nothing else to hand on)."""
        atomic, constants = (True, ()) if like is None else (like.atomic, like.constants)
        out = self._run(tensors, atomic, constants, tracker, None, False)
        if tracker is None and isinstance(out, Tensor):
            return out
        return self._sent(out, tracker)

    def _in_task(self, tracker: StageSkipTracker, sink: Optional[GradSink],
                 layers: nn.Module, value: Any) -> Any:
        """Some of the partition's ``layers`` (all, or a segment) on ``value``, with the
        task's tracker and ``sink``."""
        forget_cached(layers)  # parametrize.cached(): this task's own (usually nothing)
        previous = swap_skip_tracker(tracker)  # use_skip_tracker, without a generator
        try:
            if sink is None:
                return layers(value)
            return sink.call(self.index, layers, value)
        finally:
            swap_skip_tracker(previous)

    def forward(self, received: Received, *, grad: bool, checkpoint: bool = False,
                seed: Optional[int] = None, sink: Optional[GradSink] = None,
                split: bool = False) -> Tuple[Sent, Optional[TaskState]]:
        """Run the partition on one micro-batch; with ``grad``, keep what backward needs.

        With a ``sink``, the parameters' gradients will accumulate there, not in ``.grad``.
        With ``split`` the backward will run as ``backward_input`` then ``backward_weight``;
        a checkpointed forward then keeps no graph at all, and ``backward_input``
        recomputes it once, for both halves (a torch checkpoint would recompute in each).
        """
        if seed is not None and not (checkpoint and self.segments) and \
                draws_nothing(self.partition):
            seed = NO_DRAWS  # no private stream to pay for (seqpipe.core.draws)
        if grad and split and checkpoint:
            return self._forward_to_replay(received, seed, sink)
        if not grad:
            tracker = StageSkipTracker(self.crossing, dict(received.skips))
            with torch.no_grad():
                out = run_task(self._call(tracker, received.inputs),
                               received.inputs.tensors, checkpoint=False, seed=seed)
            return self._sent(out, tracker), None
        if torch.is_grad_enabled():  # (enable_grad's object costs a few µs per task)
            return self._forward_with_grad(received, checkpoint, seed, sink, split=split)
        with torch.enable_grad():  # inside autograd.Function.forward, where it is off
            return self._forward_with_grad(received, checkpoint, seed, sink, split=split)

    def _forward_to_replay(self, received: Received, seed: Optional[int],
                           sink: Optional[GradSink]) -> Tuple[Sent, TaskState]:
        tracker = StageSkipTracker(self.crossing, dict(received.skips))
        out, replay = first_pass(self._call(tracker, received.inputs, True, sink),
                                 received.inputs.tensors, seed=seed, device=self.device)
        state = TaskState(len(received.inputs), tuple(received.skips))
        state.replay = Pending(received, replay, sink)
        sent = self._sent(out, tracker)
        sent.replayed = bool(self.parameters()) or any(received.grad_flags)
        return sent, state

    def _sent(self, out: Any, tracker: Optional[StageSkipTracker]) -> Sent:
        # Take the outgoing skips out of the tracker: a checkpoint keeps the tracker (for
        # its recomputation) until backward, and must not keep the skips alive with it.
        outgoing: Dict[SkipKey, Optional[Tensor]] = {}
        if tracker is not None:
            outgoing, tracker.outgoing = tracker.outgoing, {}
        missing = self.outgoing - set(outgoing) if self.outgoing else None
        if missing:
            raise RuntimeError(
                f"skip {sorted(name for _, name in missing)} is popped in a later partition "
                f"but was not stashed in this call; a skippable layer must stash every "
                f"name it declares each time it runs (stash None to send nothing)")
        if isinstance(out, Tensor):  # the common case: nothing to name in an error
            return Sent(Batch((out,), True), outgoing)
        last = self.index == self.layout.num_partitions - 1
        return Sent(Batch.of(out, layer=type(self.partition[-1]).__name__, last=last), outgoing)

    def _forward_with_grad(self, received: Received, checkpoint: bool, seed: Optional[int],
                           sink: Optional[GradSink], replaying: bool = False,
                           split: bool = False) -> Tuple[Sent, TaskState]:
        keys = tuple(received.skips)
        incoming = [*received.inputs.tensors, *(received.skips[k] for k in keys)]
        state = TaskState(len(received.inputs), keys,
                          enter(incoming, received.grad_flags, self.device))
        inputs = tuple(incoming[:state.num_inputs])
        tracker = StageSkipTracker(self.crossing, dict(zip(keys, incoming[state.num_inputs:])))
        tracker.replaying = replaying
        state.saved = SavedTensors() if split and state.entry.phony is not None else None
        read = captures() if seed is not None else 0  # (a thread-local read: cold, ~10 µs)
        with state.recording():
            if checkpoint and self.segments:  # checkpoint_every: segment by segment
                tracker.between = self.between
                out = run_segments(self.partition, self.segments,
                                   functools.partial(self._in_task, tracker, sink),
                                   received.inputs.like(inputs).value, seed=seed)
            else:
                out = run_task(self._call(tracker, received.inputs, checkpoint or replaying,
                                          sink), inputs, checkpoint=checkpoint, seed=seed)
        # a layer's own checkpoint saved the private stream's state (none without a seed)
        if seed is not None and captures() != read:
            state.stream = seed
        sent = self._sent(out, tracker)
        state.roots = [edge_of(t) for t in sent.outputs.tensors]
        state.skip_roots = {k: edge_of(t) for k, t in sent.skips.items()}
        return sent, state

    def loss(self, state: TaskState, sent: Sent, compute: Callable[[Batch], Tensor]) -> Tensor:
        """The micro-batch's loss, ``compute(sent.outputs)``, made the root of its backward.

        ``compute`` (the user's ``loss_fn``) runs here, once. A forward that ``I`` will
        recompute (``state.replay``) has no graph yet: its outputs then enter a graph of the
        loss's own (``state.head``, saving into its own holders), which ``I`` backpropagates
        first, to the outputs' gradients the recomputed forward starts from. So the loss
        is never recomputed, and a ``loss_fn`` that draws random numbers is differentiated
        at the draw whose loss it returned.
        """
        if state.replay is None:
            with state.recording():
                loss = compute(sent.outputs)
            state.roots = [gradient_edge(loss)]
            return loss
        tensors: List[Optional[Tensor]] = list(sent.outputs.tensors)
        head = TaskState(len(tensors), (), saved=SavedTensors())
        head.entry = enter(tensors, [sent.wants_grad(t) for t in tensors], self.device)
        with head.recording():
            loss = compute(sent.outputs.like(tensors))  # type: ignore[arg-type]
        head.roots = [get_gradient_edge(loss)]
        state.head = head
        return loss

    def backward(self, state: TaskState, grad_outputs: Sequence[Optional[Tensor]],
                 skip_grads: Dict[SkipKey, Optional[Tensor]], *,
                 sink: Optional[GradSink] = None) -> Grads:
        """Backpropagate one micro-batch; return the gradients of its inputs and skips.

        The parameters' gradients accumulate into ``sink`` (the one the forward ran
        with), else into ``.grad`` (their post-accumulate hooks fire, e.g. a gradient
        reducer's); where the sink is ``plain``, as the plain model's (every leaf reached:
        a tensor outside the pipe too), else for those and the received tensors' only
        (``inputs=``). A parameter that reached autograd without its alias (a custom
        ``autograd.Function.apply``) still gets its gradient, in ``.grad``.
        """
        roots, grads = self._pairs(state, grad_outputs, skip_grads)
        phony = state.entry.phony
        wrt = self._weights(sink)
        if phony is not None:
            wrt = [phony, *wrt]
        plain = sink is not None and sink.plain
        if roots and (wrt or plain):
            only = () if plain else autograd_inputs(wrt)
            try:  # _backpropagating, without its generators' cost per micro-batch
                if state.stream is None:
                    run_backward(roots, grads, only)
                else:
                    with backward_stream(state.stream):
                        run_backward(roots, grads, only)
            except RuntimeError as error:
                check_reentrant(self.index, state.edges(), error)
                raise
        return self._received_grads(state)

    @contextmanager
    def _backpropagating(self, state: TaskState) -> Iterator[None]:
        """Around a backward through ``state``'s graph: a reentrant checkpoint refused by
        name, and the private stream that a layer's own checkpoint recomputes from."""
        with refusing_reentrant(self.index, state.edges()), backward_stream(state.stream):
            yield

    def _weights(self, sink: Optional[GradSink]) -> List[Tensor]:
        """What the parameters' gradients accumulate into: ``sink``'s weights, else the
        leaves the forward used (``used_parameters``: the parameters, or FSDP2's)."""
        return sink.weights(self.index) if sink is not None else self.used_parameters()

    def backward_input(self, state: TaskState, grad_outputs: Sequence[Optional[Tensor]],
                       skip_grads: Dict[SkipKey, Optional[Tensor]], *,
                       free: bool = True) -> Grads:
        """The first half of a split backward (``I``): the gradients of the micro-batch's
        inputs and skips only, returned as ``backward`` returns them. The parameters'
        gradients wait in ``state`` for ``backward_weight``. What only the input path
        saved is freed before returning; with ``free=False``, by ``free_input_path``
        (a schedule's step: after sending the gradients, which are not to wait for it)."""
        if state.replay is not None:  # a checkpointed forward: recompute it, once
            if state.head is not None:  # the loss's graph first: the outputs' gradients
                grad_outputs = self._input_half(state.head, grad_outputs, {}).inputs
            pending, state.replay = state.replay, None
            with pending.replay.recomputing():
                again, fresh = self._forward_with_grad(pending.received, False, pending.replay.seed,
                                                       pending.sink, replaying=True, split=True)
            settle((*again.outputs.tensors, *again.skips.values()))  # unread: their collectives
            state.__dict__.update({k: v for k, v in fresh.__dict__.items()
                                   if k not in ("replay", "head")})
        grads = self._input_half(state, grad_outputs, skip_grads)
        if free:
            self.free_input_path(state)
        return grads

    @staticmethod
    def free_input_path(state: TaskState) -> None:
        """After ``backward_input(free=False)``: free what only its input path saved."""
        for half in (state, state.head):
            if half is not None and half.split is not None:
                half.split.free_input_path()

    def _input_half(self, state: TaskState, grad_outputs: Sequence[Optional[Tensor]],
                    skip_grads: Dict[SkipKey, Optional[Tensor]]) -> Grads:
        roots, grads = self._pairs(state, grad_outputs, skip_grads)
        state.split = SplitBackward(roots, grads, state.entry.phony, state.entry.node,
                                    saved=state.saved, cheap=self.leaves is None)
        with self._backpropagating(state):
            state.split.input()
        return self._received_grads(state)

    def backward_weight(self, state: TaskState, *, sink: Optional[GradSink] = None) -> None:
        """The second half of a split backward (``W``): the parameters' gradients (and the
        outside tensors'), as ``backward`` gives them; frees the micro-batch's graph."""
        split, state.split = state.split, None
        assert split is not None, "backward_weight before backward_input"
        weights = self._weights(sink)
        call = self.leaves is None  # FSDP2: hooks that W must run (SplitBackward.weight)
        plain = sink is not None and sink.plain  # as ``backward``: every leaf reached
        with self._backpropagating(state):
            split.weight(weights, call=call, plain=plain)
        if state.head is not None and state.head.split is not None:  # what loss_fn used
            state.head.split.weight(weights, call=call, plain=plain)

    @staticmethod
    def _pairs(state: TaskState, grad_outputs: Sequence[Optional[Tensor]],
               skip_grads: Dict[SkipKey, Optional[Tensor]]
               ) -> Tuple[List[GradientEdge], List[Tensor]]:
        """The graph's roots that get a gradient, and their gradients."""
        pairs: List[Tuple[GradientEdge, Tensor]] = [
            (r, g) for r, g in zip(state.roots, grad_outputs) if r is not None and g is not None]
        for key, grad in skip_grads.items():
            root = state.skip_roots.get(key)
            if root is not None and grad is not None:
                pairs.append((root, grad))
        return [r for r, _ in pairs], [g for _, g in pairs]

    @staticmethod
    def _received_grads(state: TaskState) -> Grads:
        grads = state.entry.grads(state.num_inputs + len(state.skip_keys))
        skips = dict(zip(state.skip_keys, grads[state.num_inputs:]))
        return Grads(tuple(grads[:state.num_inputs]), skips)

    def finish_forward(self, *, failed: bool = False) -> None:
        """End of a mini-batch's forwards: commit deferred BatchNorm statistics (after a
        failed call, drop them, so they cannot leak into the next mini-batch's update)."""
        end_statistics(self.partition, failed=failed)
