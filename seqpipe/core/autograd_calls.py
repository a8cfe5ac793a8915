"""Autograd's two entry points that a stage calls per micro-batch, without torch's Python layer.

``Function.apply`` and ``torch.autograd.backward`` are Python functions around C++ ones. Their
Python layers check and convert what a user might pass (functorch wrappers, a
``setup_context``, tensor subclasses with their own ``__torch_function__``, the gradients'
shapes and dtypes against the roots'); a stage passes what it built itself, every micro-batch:
its own autograd Functions, and the gradient edges of its outputs with the gradients that
came back for them. Those layers then cost a stage about 5 µs per ``apply`` and 10-20 µs per
backward (four small transformer layers: ~0.5 % of a micro-batch's forward and backward),
and buy nothing: the C++ engine itself still checks every root gradient's shape
(``validate_outputs``) and runs the same backward, entered the way
``torch.autograd.backward`` enters it.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

__all__ = ["apply_function", "run_backward"]

# What torch.autograd.backward calls once it has checked its arguments (it also carries the
# caller's context to the engine's device threads, for compiled code's settings).
_engine_run = getattr(torch.autograd.graph, "_engine_run_backward", None)


def apply_function(function: Any, *args: Any) -> Any:
    """``function.apply(*args)`` without ``Function.apply``'s Python layer, where that layer
    does nothing: no functorch transform is active, ``function`` has no ``setup_context``,
    and no argument is a tensor that a transform wrapped (the dead wrappers that layer
    unwraps come only out of a transform: a partition's outputs, a fresh leaf, a plain
    object are never one)."""
    if torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    return super(torch.autograd.Function, function).apply(*args)


def run_backward(roots: Sequence[GradientEdge], grads: Sequence[Tensor],
                 inputs: Sequence[Any] = ()) -> None:
    """``torch.autograd.backward(roots, grads, inputs=inputs or None)`` for gradient edges
    ``roots`` with a gradient each (none ``None``), ``inputs`` tensors or gradient edges
    (``()``: accumulate into every leaf reached, as ``loss.backward()`` does)."""
    if _engine_run is None:  # a torch without it: the public call
        torch.autograd.backward(list(roots), list(grads), inputs=list(inputs) or None)
        return
    _engine_run(tuple(roots), tuple(grads), False, False, tuple(inputs),
                allow_unreachable=True, accumulate_grad=True)
