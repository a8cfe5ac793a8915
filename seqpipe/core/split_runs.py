"""What a split backward's ``W`` runs, one engine call each, and the engine calls themselves.

``seqpipe.core.split_backward`` plans a micro-batch's ``W`` as a list of *runs* in a fixed
order (the parameters registered last first): a **boundary node** (``Boundary``) called on
the gradients ``I`` kept for it, computing only its edges off the input path, whose outputs
are then backpropagated into the parameters behind them; or **known roots** (``Roots``),
gradient edges whose gradients exist by ``W``'s time (a stage output computed from
parameters only, or a norm's weight gradients that ``I`` computed), backpropagated as they
are. Each run carries its plan in named fields (``SplitBackward._weight`` fills them), one
engine call (``backprop``) each; the nodes called directly run inside one graph task that
needs only their edges off the path (``within_task``).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, _engine_run_backward, get_gradient_edge
from torch.autograd.variable import Variable
from torch.overrides import has_torch_function

from seqpipe.core.split_walk import ACCUMULATE

__all__ = ["CHEAP_WEIGHTS", "Boundary", "Roots", "WithinTask", "autograd_inputs", "backprop",
           "hook_free", "sorted_inputs", "within_task"]

Node = Any  # torch.autograd.graph.Node


def autograd_inputs(tensors: List[Tensor]) -> List[Any]:
    """What to pass as ``inputs=`` to backpropagate into ``tensors``.

    The tensors themselves, unless one has its own ``__torch_function__`` (a parameter
    subclass): ``autograd.backward`` would then run the whole backward, a checkpoint's
    recomputation included, inside that override, with subclass overrides disabled, so
    the recomputation would compute something else. Their gradient edges avoid that.
    """
    if has_torch_function(tensors):
        return [get_gradient_edge(t) for t in tensors]
    return tensors


def backprop(roots: Sequence[GradientEdge], grads: Sequence[Tensor], inputs: Sequence[Any],
             keep: bool = False, nested: bool = False) -> None:
    """``torch.autograd.backward(roots, grads, inputs=inputs, retain_graph=keep)`` without
    its Python layer (tuple packing and per-root shape checks: our roots' gradients come
    from autograd itself, and the engine checks them again), ~20 us a call. ``nested``: a
    call from inside a running backward goes straight to the engine, as torch's own
    wrapper would, at its end, drop what the running call put in thread-local state."""
    args = (tuple(roots), tuple(grads), keep, False, tuple(inputs))
    if nested:
        Variable._execution_engine.run_backward(*args, True, True)  # type: ignore[attr-defined]
    else:
        _engine_run_backward(*args, allow_unreachable=True, accumulate_grad=True)


class WithinTask(torch.autograd.Function):
    """A node whose backward runs ``work`` inside the graph task of the engine call that
    reaches it, so that nodes called by ``work`` compute only what that task needs."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, work: Callable[[], None]) -> Tensor:  # type: ignore[override]
        ctx.work = work
        return anchor.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[None, None]:  # type: ignore[override]
        work, ctx.work = ctx.work, None
        work()
        return None, None


def within_task(targets: Sequence[GradientEdge], work: Callable[[], None]) -> None:
    """Run ``work`` inside a graph task whose targets are ``targets`` (and nothing else)."""
    anchor = torch.zeros((), device="cpu", requires_grad=True)  # run on the calling thread
    backprop([get_gradient_edge(WithinTask.apply(anchor, work))],
              [torch.ones((), device="cpu")], [*targets, anchor])


# Boundary nodes whose weight gradients cost little beside their input gradient (one
# kernel computes all of them: a norm's weight and bias gradients are row sums of what the
# input gradient reads anyway, ~20 us for a LayerNorm's three against ~12 + ~20 us apart).
# ``I`` has such a node compute them too, as a plain backward would, and keeps them for
# ``W`` (a few floats a channel), instead of calling the node again in ``W``.
CHEAP_WEIGHTS = frozenset({"NativeLayerNormBackward0", "NativeGroupNormBackward0",
                            "NativeBatchNormBackward0", "CudnnBatchNormBackward0"})


def hook_free(off: Sequence[Tuple[int, Node, int, List[Tensor]]]) -> bool:
    """Whether a cheap node's edges off the path (``off``) lead straight to parameters
    without ``register_hook`` hooks, so that ``I`` may compute their gradients. ``I``
    captures them where they enter the accumulators, without running these, but the engine
    still calls such hooks there (in ``I``, and a hook may replace the gradient): a hooked
    parameter's norm is called in ``W`` instead."""
    return all(type(child) is ACCUMULATE and not child.variable._backward_hooks
               for _, child, _, _ in off)


class Roots:
    """Gradient edges whose gradients are known by ``W``'s time: roots of the stage off the
    input path (an output computed from parameters only), or a cheap boundary node's
    edges to its parameters (``accumulators``), whose gradients ``I`` computed."""

    __slots__ = ("edges", "grads", "behind", "accumulators", "last", "inputs")

    def __init__(self, edges: List[GradientEdge], grads: List[Optional[Tensor]],
                 behind: List[List[Tensor]], accumulators: bool) -> None:
        self.edges, self.grads, self.behind = edges, grads, behind  # leaves behind each edge
        self.accumulators = accumulators  # each edge is its one leaf's accumulator
        self.last, self.inputs = -1, ()  # set by ``plan``

    def plan(self, order: Dict[int, int]) -> bool:
        """Keep what leads to wanted leaves (``order``: their positions); False: nothing."""
        edges, grads, leaves = [], [], []
        for edge, grad, behind in zip(self.edges, self.grads, self.behind):
            wanted = [t for t in behind if id(t) in order]
            if wanted and grad is not None:
                edges.append(edge)
                grads.append(grad)
                leaves += wanted
        if not leaves:
            return False
        self.edges, self.grads = edges, grads
        self.last = max(order[id(t)] for t in leaves)
        # An accumulator runs itself (no ``inputs=``); other roots may reach more leaves.
        self.inputs = () if self.accumulators else sorted_inputs(leaves, order)
        return True

    def run(self, nested: bool) -> None:
        """Backpropagate the gradients into the leaves behind the edges."""
        backprop(self.edges, self.grads, self.inputs, nested=nested)


def sorted_inputs(leaves: List[Tensor], order: Dict[int, int]) -> List[Any]:
    """``inputs=`` for ``leaves``, in ``order`` (the same on every replica)."""
    return autograd_inputs(sorted(leaves, key=lambda t: order[id(t)]))


class Boundary:
    """A boundary node: its kept incoming gradients and its edges off the input path, and,
    once ``W`` has planned it (``SplitBackward._weight``), what it computes there: the
    outputs ``ks`` along ``edges``, into ``inputs`` (``()``: every leaf behind them), by
    calling the node (``here``) or through the engine; ``last``: the latest position in
    ``W``'s order of a leaf it reaches (runs go highest first)."""

    __slots__ = ("node", "off", "incoming", "ks", "edges", "inputs", "here", "last")

    def __init__(self, node: Node, off: List[Tuple[int, GradientEdge, List[Tensor]]]) -> None:
        self.node = node
        self.off = off  # (output index, edge, leaves behind)
        self.incoming: Optional[Tuple[Optional[Tensor], ...]] = None  # set by ``I``'s pre-hook
        self.ks: Sequence[int] = ()  # (tuples: nothing allocated until W plans it)
        self.edges: Sequence[GradientEdge] = ()
        self.inputs: Sequence[Any] = ()
        self.here, self.last = False, -1

    def run(self, nested: bool) -> None:
        """Backpropagate the kept gradients through the planned edges into their leaves:
        ``here``, by calling the node inside a graph task that needs those edges only
        (``within_task``); else the engine runs the node (and hooks on its output again)."""
        incoming, self.incoming = self.incoming, None  # freed as soon as it is used
        assert incoming is not None
        if not self.here:
            backprop([GradientEdge(self.node, k) for k, g in enumerate(incoming)
                       if g is not None], [g for g in incoming if g is not None], self.inputs,
                      nested=nested)
            return
        out = self.node(*incoming)  # the outputs the current graph task needs only
        roots, grads = [], []
        for k, edge in zip(self.ks, self.edges):
            if out[k] is not None:
                roots.append(edge)
                grads.append(out[k])
        if grads:
            backprop(roots, grads, self.inputs, nested=nested)
