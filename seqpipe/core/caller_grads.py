"""The gradients a training step owes the caller's own tensors: its input's and its target's.

A step's input and target may come out of the caller's graph: an embedding or an encoder
run outside the pipe feeds the input, a second model (or a head outside the pipe) makes the
target. In the plain model ``loss_fn(model(input), target).backward()`` reaches through
both into that graph, once. A pipeline computes the loss per micro-batch, so:

* **The input.** A stage's graph starts at the micro-batches it received
  (``seqpipe.core.entry``): the first stage catches each micro-batch's input gradient in
  its entry's box, and ``input_grad`` puts them together (concatenated for a tensor that was
  cut, summed for a ``NoChunk``) for the step to hand to the caller's graph.
* **The target.** ``loss_fn`` reads the target's micro-batches. Cut from the caller's
  tensor, each micro-batch's backward would run through the caller's graph on its own,
  which frees that graph's saved tensors at the first (``Trying to backward through the
  graph a second time``) and fires its hooks once per micro-batch. ``TargetLeaves`` cuts
  the micro-batches from a detached leaf of each target tensor that wants a gradient
  instead: every micro-batch's backward accumulates into the leaf's ``.grad``, and the step
  hands that sum to the caller's graph once, at its end.

The hand-over is one backward of the caller's tensors (input and target together: a
tensor that is both, ``train_step(x, x, ...)``, gets the sum, and a graph both come from is
traversed once), with the gradients the plain model's backward would have given them.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from seqpipe.core.microbatch import Batch, Input, gather_grad
from seqpipe.core.nochunk import NoChunk

__all__ = ["TargetLeaves", "hand_over", "input_grad"]


def input_grad(given: Input, j: int, microbatches: Sequence[Batch],
               grads: Sequence[Tuple[Optional[Tensor], ...]]) -> Optional[Tensor]:
    """The gradient of the ``j``-th input tensor of ``given`` from the first stage's
    per-micro-batch input gradients ``grads`` (summed for a ``NoChunk`` tensor); ``None``
    if it has none."""
    tensor = given.batch.tensors[j]
    if not tensor.requires_grad:
        return None
    pieces = [g[j] if g else None for g in grads]
    return gather_grad(pieces, [mb.tensors[j] for mb in microbatches], given.whole[j],
                       tensor.device)


class TargetLeaves:
    """A target whose tensors that want a gradient are replaced by detached leaves.

    ``value`` is the target to cut (the caller's own when no tensor of it wants a
    gradient: nothing is copied); ``pairs()`` gives each caller's tensor with what the
    step's micro-batch losses accumulated into its leaf."""

    def __init__(self, target: Any) -> None:
        self._leaves: List[Tuple[Tensor, Tensor]] = []
        if isinstance(target, (tuple, list)):
            items = [self._leaf(item) for item in target]
            self.value: Any = type(target)(items) if self._leaves else target
        else:
            self.value = self._leaf(target)

    def _leaf(self, item: Any) -> Any:
        tensor = item.tensor if isinstance(item, NoChunk) else item
        if not isinstance(tensor, Tensor) or not tensor.requires_grad:
            return item
        leaf = tensor.detach().requires_grad_()
        self._leaves.append((tensor, leaf))
        return NoChunk(leaf) if isinstance(item, NoChunk) else leaf

    def pairs(self) -> List[Tuple[Tensor, Optional[Tensor]]]:
        """Each target tensor that wants a gradient, and the step's gradient of it (``None``
        where no micro-batch loss reached it); the leaves are let go of."""
        pairs = [(tensor, leaf.grad) for tensor, leaf in self._leaves]
        self._leaves = []
        return pairs


def hand_over(pairs: Sequence[Tuple[Tensor, Optional[Tensor]]]) -> None:
    """Backpropagate the step's gradients of the caller's tensors into the caller's graph
    (into ``.grad`` of a leaf), in one backward: as the plain model's backward reaches
    them. Tensors without a gradient are left alone."""
    given = [(t, g) for t, g in pairs if g is not None]
    if given:
        torch.autograd.backward([t for t, _ in given], [g for _, g in given])
