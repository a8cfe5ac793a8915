"""How received tensors enter a graph: as non-leaf inputs whose gradients land in a box.

A stage's graph starts at the tensors it received (its input and popped skips), cut from
the sender's graph. ``enter`` makes them the outputs of one ``_Receive`` node, the
*input node*: not leaves, so a first layer may modify its input in place exactly as in the
unpipelined model, and their gradients are caught in a box by that node's backward rather
than asked for by tensor, so they stay right even when a layer rewrites a received tensor
in place. Backpropagating into the node's one input (``Entry.phony``) fills the box; a split
backward's ``I`` stops at the node (``seqpipe.core.split_backward``). The loss on a last stage
whose forward is recomputed at ``I`` enters the stage's outputs the same way
(``Stage.loss``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from seqpipe.core.autograd_calls import apply_function

__all__ = ["Entry", "enter"]


class _Box:
    """Carries received tensors into, and their gradients out of, ``_Receive``."""

    def __init__(self, tensors: Sequence[Tensor], flags: Sequence[bool]) -> None:
        self.tensors = tuple(tensors)
        self.flags = tuple(flags)
        self.grads: Tuple[Optional[Tensor], ...] = (None,) * len(self.tensors)


class _Receive(torch.autograd.Function):
    """Makes received tensors non-leaf graph nodes whose gradients land in a box.

    The outputs are the received tensors themselves (no copy) but not leaves; those not
    flagged are marked non-differentiable.
    """

    @staticmethod
    def forward(ctx: Any, phony: Tensor, box: _Box) -> Tuple[Tensor, ...]:  # type: ignore[override]
        ctx.box = box
        ctx.set_materialize_grads(False)
        outputs = tuple([t.detach() for t in box.tensors])
        if not all(box.flags):  # usually every one wants its gradient: nothing to mark
            ctx.mark_non_differentiable(*[t for t, f in zip(outputs, box.flags) if not f])
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[None, None]:  # type: ignore[override]
        ctx.box.grads = grads
        return None, None


@dataclass
class Entry:
    """Where received tensors entered a graph, and where their gradients land."""

    present: List[int] = field(default_factory=list)  # which received tensors were not None
    box: Optional[_Box] = None  # None: none of them wants a gradient
    phony: Optional[Tensor] = None  # the input node's input: backpropagate into it
    node: Any = None  # the input node (``_Receive``'s backward)

    def grads(self, width: int) -> List[Optional[Tensor]]:
        """The gradient of each of the ``width`` received tensors (``None`` for those that
        were ``None``, want none, or got none)."""
        grads: List[Optional[Tensor]] = [None] * width
        if self.box is not None:
            for i, g in zip(self.present, self.box.grads):
                grads[i] = g
        return grads


def enter(incoming: List[Optional[Tensor]], flags: Sequence[bool],
          device: torch.device) -> Entry:
    """Make the tensors in ``incoming`` (replaced in the list) the inputs of a graph whose
    gradients, for those ``flags`` marks, land in the returned entry's box."""
    present = [i for i, t in enumerate(incoming) if t is not None]
    entry = Entry(present)
    wanted = [flags[i] for i in present]
    if not any(wanted):
        return entry
    entry.box = _Box([incoming[i] for i in present], wanted)  # type: ignore[misc]
    entry.phony = torch.empty(0, device=device, requires_grad=True)
    # Straight to autograd's C++ apply (the arguments are a fresh leaf and a box).
    for i, t in zip(present, apply_function(_Receive, entry.phony, entry.box)):
        incoming[i] = t
        if entry.node is None and t.grad_fn is not None:
            entry.node = t.grad_fn
    entry.box.tensors = ()  # the graph holds what it needs; drop our references
    return entry
