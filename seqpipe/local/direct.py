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

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from seqpipe.core.autograd_calls import apply_function
from seqpipe.core.microbatch import Batch, Input, gather
from seqpipe.core.sink import ddp_forward_running
from seqpipe.core.stage import Stage, wants_grad
from seqpipe.skip.tracker import StageSkipTracker
from seqpipe.trace import hooks

__all__ = ["DOUBLE_BACKWARD", "PHONY", "SECOND_BACKWARD", "any_trainable",
           "pipeline_outputs", "refuse_create_graph", "runs_direct", "run_direct",
           "whole_backward"]

# What the engine and the direct call refuse, in the same words.
SECOND_BACKWARD = ("this pipeline output was already backpropagated; its activations are "
                   "freed. Run the forward again (there is no retain_graph for a Pipe)")
DOUBLE_BACKWARD = ("Pipe does not support higher-order gradients (backward or autograd.grad "
                   "with create_graph=True); compute them on the unwrapped model")


def pipeline_outputs(ctx: Any, outputs: Tuple[Tensor, ...]) -> Tuple[Tensor, ...]:
    """In the forward of the Function that hands a call's outputs to the caller: no
    zero-filled gradients, and the outputs that cannot have one marked so."""
    ctx.set_materialize_grads(False)
    fixed = [t for t in outputs if not (t.is_floating_point() or t.is_complex())]
    if fixed:  # (usually none: no call)
        ctx.mark_non_differentiable(*fixed)
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
    def forward(ctx: Any, used: List[bool], phony: Tensor,  # type: ignore[override]
                *tensors: Tensor) -> Tuple[Tensor, ...]:
        ctx.used = used
        return pipeline_outputs(ctx, tuple([t.detach() for t in tensors]))

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        refuse_create_graph()
        if ctx.used[0]:
            raise RuntimeError(SECOND_BACKWARD)
        ctx.used[0] = True
        return (None, None, *grads)


def runs_direct(stages: Sequence[Stage], given: Input, chunks: int, checkpoint_stop: int,
                isolate_rng: bool) -> bool:
    """Whether a ``Pipe`` call of ``given`` can run as the plain model (module docstring):
    one ``cpu`` stage, one micro-batch with every tensor on the CPU, no checkpoint, no
    private RNG, nothing tracing, no ``DistributedDataParallel`` forward."""
    if len(stages) != 1 or stages[0].device.type != "cpu" or checkpoint_stop or isolate_rng:
        return False
    if hooks.enabled() or ddp_forward_running():
        return False
    if chunks != 1 and given.size != 1:
        return False
    for tensor in given.batch.tensors:  # a loop, not a generator: a call's fixed cost
        if not tensor.is_cpu:
            return False
    return True


def any_trainable(module: nn.Module) -> bool:
    """Whether some parameter of ``module`` (or of its submodules) requires grad:
    ``any(p.requires_grad for p in module.parameters())``, walked without generators (a
    call's fixed cost)."""
    for param in module._parameters.values():
        if param is not None and param.requires_grad:
            return True
    for child in module._modules.values():
        if child is not None and any_trainable(child):
            return True
    return False


def run_direct(stage: Stage, given: Input, grad: bool) -> Tuple[Batch, Tuple[Tensor, ...]]:
    """Run ``stage``'s partition on ``given`` as one micro-batch in the caller's graph (with
    ``grad``, which only a caller in grad mode gives; else under ``no_grad``); its deferred
    BatchNorm statistics committed (or dropped on failure). Returns the output's shape (its
    tensors left out) and tensors."""
    tensors = given.batch.tensors
    if grad and any([wants_grad(t) for t in tensors]):
        tensors = _Enter.apply(*tensors)
    tracker = StageSkipTracker(stage.crossing, {})
    try:
        if grad:  # grad mode is on already (``Pipe._run`` asked)
            sent = stage.run_inline(given.batch.like(tensors), tracker)
        else:
            with torch.no_grad():
                sent = stage.run_inline(given.batch.like(tensors), tracker)
    except BaseException as exc:
        stage.finish_forward(failed=True)
        if isinstance(exc, Exception):
            exc.add_note(f"seqpipe: raised by stage {stage.index} in the forward of "
                         f"micro-batch 0")
        raise
    stage.finish_forward()
    gathered = sent.outputs
    if not gathered.atomic or not gathered.tensors[0].dim():  # else one tensor: as it is
        gathered = Batch.of(gather([gathered]))  # the checks and their errors
    if not grad:
        return gathered.like(()), tuple(t.detach() for t in gathered.tensors)
    # The outputs require grad, as the engine's, even where the partition's do not.
    return gathered.like(()), apply_function(_Exit, [False], PHONY, *gathered.tensors)
