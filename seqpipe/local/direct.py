"""A call with one partition and one micro-batch, on the CPU: the plain model's graph.

With one partition and one micro-batch there is nothing to pipeline and nothing to add
up: the engine's worker machinery, its gradient sink (whose job is to make hooks fire once
over several micro-batches) and its nested backward cost about 1.4 ms per training step
(a fifth of a step of four small ``TransformerEncoderLayer``s) and buy nothing. Such a call
(``Pipe.forward`` with ``chunks=1`` or a one-sample batch, no checkpoint for it, no trace
recording or profiler, no ``DistributedDataParallel`` forward) runs its partition on the
caller's thread directly in the caller's autograd graph, so the backward is the plain
model's: each parameter's gradient accumulates into ``.grad`` once, its hooks fire once.

Two identity autograd Functions keep what a caller can see of the engine's call:

* ``_Enter``: the input tensors that want a gradient enter as non-leaf tensors (no copy),
  so a first layer may modify its input in place as it may in the engine (``_Receive``);
  gradients pass straight through.
* ``_Exit``: the outputs leave as new tensors (never one the caller passed in), requiring
  grad whenever the call does (as the engine's ``_PipeFunction`` outputs do), and its
  backward refuses what the engine refuses: ``create_graph=True`` and a second backward
  through the same output, with the engine's messages.

The pipe makes one ``DirectCall`` when it is built (``Pipe.__init__``) where it has one
``cpu`` partition: what cannot change between calls is settled then, and a call checks only
what can (its input, grad mode, trainable parameters, the checkpoint mode, tracing, a DDP
forward), with as few Python calls as it can: each one after a backward costs several
microseconds, the caches holding the backward's data rather than the interpreter's.

What differs from the engine, by construction (the plain model's behaviour): a tensor
outside the pipe that a layer holds (a leaf that is not a parameter of the pipe, or a
value of the caller's graph) gets its gradient, and a layer checkpointing itself with
``use_reentrant=True`` works, under every autograd call, where the engine's stage
backward does so under a backward over the whole graph (``whole_backward``) and
otherwise (``torch.autograd.grad``, ``backward(inputs=...)``), limited to the pipe's own
parameters and inputs, leaves the tensor out and raises ``ReentrantCheckpointError``;
and an exception raised inside the partition's backward carries no seqpipe note.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from seqpipe.core.autograd_calls import apply_function
from seqpipe.core.checkpoint import checkpoint_stop
from seqpipe.core.microbatch import Batch, Input, TensorOrTensors, gather
from seqpipe.core.sink import ddp_forward_running
from seqpipe.core.stage import Sent, Stage, wants_grad
from seqpipe.skip.skippable import is_skippable
from seqpipe.skip.tracker import StageSkipTracker
from seqpipe.trace import hooks

__all__ = ["DOUBLE_BACKWARD", "PHONY", "SECOND_BACKWARD", "DirectCall", "any_trainable",
           "pipeline_outputs", "refuse_create_graph", "whole_backward"]

# What the engine and the direct call refuse, in the same words.
SECOND_BACKWARD = ("this pipeline output was already backpropagated; its activations are "
                   "freed. Run the forward again (there is no retain_graph for a Pipe)")
DOUBLE_BACKWARD = ("Pipe does not support higher-order gradients (backward or autograd.grad "
                   "with create_graph=True); compute them on the unwrapped model")


def pipeline_outputs(ctx: Any, outputs: Tuple[Tensor, ...]) -> Tuple[Tensor, ...]:
    """In the forward of the Function that hands a call's outputs to the caller: no
    zero-filled gradients, and the outputs that cannot have one marked so."""
    ctx.set_materialize_grads(False)
    for tensor in outputs:  # (usually all can: no list made, no call)
        if not (tensor.is_floating_point() or tensor.is_complex()):
            ctx.mark_non_differentiable(
                *[t for t in outputs if not (t.is_floating_point() or t.is_complex())])
            break
    return outputs


def refuse_create_graph() -> None:
    """In that Function's backward: autograd runs it with grad on for ``create_graph``."""
    if torch.is_grad_enabled():
        raise RuntimeError(DOUBLE_BACKWARD)


class _Enter(torch.autograd.Function):
    """The received tensors as non-leaf tensors on their own storage; gradients pass."""

    @staticmethod
    def forward(ctx: Any, *tensors: Tensor) -> Tuple[Tensor, ...]:  # type: ignore[override]
        ctx.set_materialize_grads(False)
        outputs = tuple(t.detach() for t in tensors)
        ctx.mark_non_differentiable(*(o for o, t in zip(outputs, tensors) if not wants_grad(t)))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        return grads


# A leaf that requires grad, given to every ``_Exit`` so that its outputs require grad,
# and to the engine's ``_PipeFunction`` as the probe of ``whole_backward``; its gradient is
# always ``None`` (their backwards return none for it), so nothing accumulates in it.
with torch.inference_mode(False):  # even if seqpipe is imported inside inference mode
    PHONY = torch.empty(0, device="cpu", requires_grad=True)
# Its gradient accumulator, held so that every graph uses this one node.
_PHONY_NODE = get_gradient_edge(PHONY).node
_will_execute = getattr(torch._C, "_will_engine_execute_node", None)


def whole_backward() -> bool:
    """In the backward of an autograd Function given ``PHONY``: whether the running
    autograd call is a backward over the whole graph (``loss.backward()``,
    ``torch.autograd.backward(tensors)``: no ``inputs=``), which accumulates into every leaf
    it reaches; not ``torch.autograd.grad`` (which accumulates into none) nor a backward
    with ``inputs=`` (into those only).

    Autograd's own answer (``torch._C._will_engine_execute_node``, as
    ``torch.autograd.graph.register_multi_grad_hook`` asks it): a call with ``inputs``
    executes only the nodes on the paths to them, and no caller can name ``PHONY``'s
    gradient accumulator among its inputs, so it is executed exactly when every node is.
    ``False`` where torch cannot tell (no such function, or no graph task running, as
    under compiled autograd): the question is then not asked."""
    return _will_execute is not None and torch._C._current_graph_task_id() != -1 and \
        _will_execute(_PHONY_NODE)


class _Exit(torch.autograd.Function):
    """The outputs as new tensors; refuses double and second backwards (see the module)."""

    @staticmethod
    def forward(ctx: Any, phony: Tensor, *tensors: Tensor) -> Tuple[Tensor, ...]:  # type: ignore[override]
        ctx.used = False
        return pipeline_outputs(ctx, tuple([t.detach() for t in tensors]))

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        refuse_create_graph()
        if ctx.used:
            raise RuntimeError(SECOND_BACKWARD)
        ctx.used = True
        return (None, *grads)


class _ExitOne(_Exit):
    """``_Exit`` of one floating-point tensor (the common case), in fewer Python calls."""

    @staticmethod
    def forward(ctx: Any, phony: Tensor, tensor: Tensor) -> Tensor:  # type: ignore[override]
        ctx.used = False
        ctx.set_materialize_grads(False)
        return tensor.detach()


def any_trainable(module: nn.Module) -> bool:
    """Whether some parameter of ``module`` (or of its submodules) requires grad:
    ``any(p.requires_grad for p in module.parameters())``, walked in one frame, without
    generators or recursion (a call's fixed cost)."""
    modules = [module]
    while modules:
        current = modules.pop()
        for param in current._parameters.values():
            if param is not None and param.requires_grad:
                return True
        for child in current._modules.values():
            if child is not None:  # (a module registered as None)
                modules.append(child)
    return False


class DirectCall:
    """A ``Pipe``'s calls that run as the plain model (module docstring), made once with a
    pipe of one ``cpu`` partition (so no private random streams either)."""

    def __init__(self, stage: Stage) -> None:
        assert stage.device.type == "cpu", "a DirectCall runs a cpu stage"
        self.stage = stage
        # Whether a skippable layer (at any depth) may ask for a skip tracker: a call makes
        # one only then. Read once, as the engine reads the skip layout.
        self.skips = any(is_skippable(layer) for layer in stage.partition.modules())

    def __call__(self, module: nn.Module, input: Any, given: Optional[Input], chunks: int,
                 checkpoint: str) -> Optional[TensorOrTensors]:
        """The output of ``module`` (the pipe, with ``chunks`` and ``checkpoint``) for
        ``input``, run as the plain model in the caller's graph; ``None`` where this call
        cannot be (one micro-batch with every tensor on the CPU, not checkpointed, nothing
        tracing, no ``DistributedDataParallel`` forward): the engine runs it. ``given`` is
        ``Input.of(input)``, or ``None`` for a tensor with a batch dimension (the common
        case, read without making one). Its deferred BatchNorm statistics are committed (or
        dropped on failure). One function: each call here is a call's fixed cost."""
        if given is None:
            tensors: Tuple[Tensor, ...] = (input,)
            if not input.is_cpu or (chunks != 1 and input.shape[0] != 1):
                return None
            trains = input.requires_grad
        else:
            tensors = given.batch.tensors
            trains = False
            for tensor in tensors:  # a loop, not a generator: a call's fixed cost
                if not tensor.is_cpu:
                    return None
                trains = trains or tensor.requires_grad
            if chunks != 1 and given.size != 1:
                return None
        if hooks.enabled() or ddp_forward_running():
            return None
        enabled = torch.is_grad_enabled()
        grad = enabled and (trains or any_trainable(module))
        if enabled and module.training and checkpoint_stop(checkpoint, 1):
            return None
        if trains and grad:
            for tensor in tensors:
                if wants_grad(tensor):  # they enter as non-leaf tensors (the engine's do)
                    tensors = _Enter.apply(*tensors)
                    break
        stage = self.stage
        tracker = StageSkipTracker(stage.crossing, {}) if self.skips else None
        like = None if given is None else given.batch
        try:
            # Grad mode on, even with nothing of the pipe's or the input requiring grad: a
            # tensor a layer holds may (an adapter beside a frozen base), and the plain
            # model records a graph exactly then (autograd records nothing otherwise).
            if enabled:
                ran = stage.run_inline(tensors, like, tracker)
            else:
                with torch.no_grad():
                    ran = stage.run_inline(tensors, like, tracker)
        except BaseException as exc:
            stage.finish_forward(failed=True)
            if isinstance(exc, Exception):
                exc.add_note(f"seqpipe: raised by stage {stage.index} in the forward of "
                             f"micro-batch 0")
            raise
        stage.finish_forward()
        if not isinstance(ran, Sent):  # one tensor, no skips
            if ran.dim() and (ran.is_floating_point() or ran.is_complex()):  # as it is
                # The output requires grad, as the engine's, even where the partition's does
                # not; a frozen pipe's only where the layers recorded a graph.
                return apply_function(_ExitOne, PHONY, ran) if grad or ran.requires_grad \
                    else ran.detach()
            ran = Sent(Batch((ran,), True), {})
        gathered = ran.outputs
        if not gathered.atomic or not gathered.tensors[0].dim():
            gathered = Batch.of(gather([gathered]))  # the checks and their errors
        if not grad and not any(t.requires_grad for t in gathered.tensors):
            return gathered.like([t.detach() for t in gathered.tensors]).value
        return gathered.like(apply_function(_Exit, PHONY, *gathered.tensors)).value
