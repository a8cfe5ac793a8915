"""How the micro-batch losses of a training step add up to the mini-batch loss.

A step cuts the target like the input and calls ``loss_fn`` once per micro-batch; each
micro-batch loss is multiplied by a weight fixed before the step's first backward, and the
mini-batch loss is the weighted sum. There are two ways to weigh them, and both make the loss
and the gradients exactly those of the whole mini-batch:

* **A mean over samples** (``loss_fn`` returns ``mse_loss``, ``cross_entropy`` with
  ``reduction="mean"`` and no ignored labels): each micro-batch weighs its share of the
  samples, ``n_i / N``, read from the tensors of the target that are cut into micro-batches
  (never from a ``NoChunk`` given whole).
* **A mean over counted items** (tokens that are not padding, the summed class weights):
  ``loss_fn`` returns the micro-batch's *sum*, and ``count_fn(target)`` how many items the
  whole mini-batch counts. Every micro-batch weighs ``1 / N``, ``N`` the total count, so the
  loss is the sum over the mini-batch divided by its count, whatever the micro-batches hold.
  Over ``D`` data-parallel replicas, ``N`` is summed over them and every weight is ``D / N``:
  the replicas' gradients, averaged, are those of the global sum over the global count.

Why ``count_fn`` and not a ``(sum, count)`` pair returned by ``loss_fn``: under 1F1B and
the zero-bubble schedules a micro-batch's backward starts right after its forward, before
the later micro-batches' losses exist, so the normaliser must be known when the first
backward starts. The count depends on the target alone, which the last stage holds whole at
the start of the step: counting it there costs one pass over the labels and one read of the
number, and leaves every gradient path (hooks, accumulation into ``.grad``, tied weights,
the data-parallel reducer, the fp16 loss scale) as it is, since each micro-batch's backward
starts from its final weight. Dividing the gradients by the count afterwards would instead
give every hook that fires during the step an unscaled gradient.

A mean over counted items given as a mean (``cross_entropy(..., ignore_index=-100)`` with
the default reduction) is not the mini-batch's mean once micro-batches count different
numbers of items per sample; ``loss_weights`` warns once per process when a target's
``-100`` labels (the ignore index of ``cross_entropy`` and of Hugging Face's padding) show
that, and no ``count_fn`` was given.
"""
from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from seqpipe.core.caller_grads import TargetLeaves
from seqpipe.core.microbatch import Batch, Input

__all__ = ["CountFn", "IGNORED_LABEL", "LossWeights", "Replicas", "in_order", "joined",
           "loss_weights"]

CountFn = Callable[[Any], Union[int, float, Tensor]]
IGNORED_LABEL = -100  # torch's cross_entropy ignore_index, Hugging Face's label padding

_warned = False  # the uneven-count warning is given once per process


@dataclass(frozen=True)
class Replicas:
    """Data-parallel replicas whose gradients are averaged: how many there are, and the
    in-place sum over them (a collective every replica's last stage calls together) of a
    tensor on ``device``."""

    size: int
    all_reduce: Callable[[Tensor], None]
    device: torch.device

    def sum(self, value: float) -> float:
        """``value`` summed over the replicas."""
        total = torch.tensor(value, dtype=torch.float64, device=self.device)
        self.all_reduce(total)
        return total.item()


@dataclass(frozen=True)
class LossWeights:
    """A step's target cut per micro-batch, each micro-batch loss's weight, and the factor
    that turns the weighted sum into the loss ``train_step`` returns (1 unless a count is
    summed over replicas: then the returned loss is this replica's own mean)."""

    targets: List[Any]
    weights: List[float]
    reported: float = 1.0
    leaves: Optional[TargetLeaves] = None  # what the target's tensors that want a gradient
    # accumulate into (``seqpipe.core.caller_grads``)

    def report(self, weighted_sum: Tensor) -> Tensor:
        """The mini-batch loss ``train_step`` returns, from the weighted losses' sum."""
        return weighted_sum if self.reported == 1.0 else weighted_sum * self.reported

    def target_grads(self) -> List[Tuple[Tensor, Optional[Tensor]]]:
        """Each of the caller's target tensors that wants a gradient, with the step's
        gradient of it (for ``caller_grads.hand_over``, after the step's backwards)."""
        return self.leaves.pairs() if self.leaves is not None else []


def loss_weights(target: Any, m: int, count_fn: Optional[CountFn] = None,
                 replicas: Optional[Replicas] = None) -> LossWeights:
    """``target`` cut like an input of ``m`` micro-batches, and their weights: each
    micro-batch's share of the samples, or, with ``count_fn``, one over the total count
    (summed over ``replicas``, if given); see the module's docstring."""
    if target is None:
        raise ValueError("the target is None, but the last stage needs it for the loss; "
                         "pass it (to DistributedPipe, on the rank that holds the last "
                         "stage: pipe.is_last)")
    leaves: Optional[TargetLeaves] = TargetLeaves(target)  # a target from the caller's
    given = Input.of(leaves.value)  # graph is cut from leaves of its tensors
    if leaves.value is target:  # none of them wants a gradient
        leaves = None
    pieces = given.scatter(m)
    if len(pieces) != m:
        raise ValueError(f"the target has {given.size} samples but the input was cut into "
                         f"{m} micro-batches; input and target need the same batch size")
    targets = [p.value for p in pieces]
    if count_fn is None:
        sizes = given.sizes(pieces)
        _warn_if_uneven(given, pieces, sizes)
        return LossWeights(targets, [n / given.size for n in sizes], leaves=leaves)
    if not callable(count_fn):
        raise TypeError(f"count_fn must be callable as count_fn(target), got "
                        f"{type(count_fn).__name__}")
    local = _count(count_fn(target))
    total, size = (local, 1) if replicas is None else (replicas.sum(local), replicas.size)
    weight = size / total if total else 0.0  # nothing counted: the sums are 0, so is the loss
    reported = total / (size * local) if local else 0.0
    return LossWeights(targets, [weight] * m, reported, leaves)


def in_order(losses: Mapping[int, Tensor]) -> Tensor:
    """The weighted micro-batch losses (by micro-batch index) added one at a time in
    micro-batch order, ``((l0 + l1) + l2) + ...``: the plain model's sum of its micro-batch
    losses in order, bit for bit, whichever order the schedule computed them in (a custom
    schedule may run the last stage's forwards out of order) and on either engine. Float
    addition is not associative: summed in the order they arrived, or as one
    ``torch.stack(...).sum()`` (which adds 16 or more values in another association), the
    returned loss differed in its last bits between schedules."""
    total: Optional[Tensor] = None
    for i in sorted(losses):
        total = losses[i] if total is None else total + losses[i]
    if total is None:
        raise ValueError("no micro-batch loss to add up: the step ran no forward on the last "
                         "stage")
    return total


class _Joined(torch.autograd.Function):
    """A micro-batch loss that does not depend on the outputs, joined to them with a zero
    gradient (zeros of their shapes, not ``0 * output``, which an ``inf`` would make NaN)."""

    @staticmethod
    def forward(ctx: Any, loss: Tensor, *outputs: Tensor) -> Tensor:  # type: ignore[override]
        ctx.like = [(o.shape, o.dtype, o.device) for o in outputs]
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        return (None, *[torch.zeros(shape, dtype=dtype, device=device)
                        for shape, dtype, device in ctx.like])


def joined(loss: Tensor, outputs: Sequence[Tensor]) -> Tensor:
    """``loss`` as the stage's backward can start from it. A ``loss_fn`` may return a
    constant for a micro-batch that counts nothing (``if not mask.any(): return
    out.new_zeros(())``), which the plain model never meets on the whole batch; its
    backward would fail (autograd has no edge to start from). Such a loss is joined to the
    outputs that require grad with a zero gradient: the micro-batch adds nothing, as in the
    plain model."""
    if loss.requires_grad:
        return loss
    wanting = [o for o in outputs if o.requires_grad]
    return _Joined.apply(loss, *wanting) if wanting else loss


def _count(value: object) -> float:
    """``count_fn``'s result as a number, checked."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise TypeError(f"count_fn must return one number (how many items loss_fn's sums "
                            f"add over in the whole mini-batch), got a tensor of shape "
                            f"{tuple(value.shape)}; reduce it, e.g. (target != -100).sum()")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"count_fn must return a number or a one-element tensor (how many "
                        f"items loss_fn's sums add over in the whole mini-batch), got "
                        f"{type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"count_fn returned {value}, but a count is finite and not negative; "
                         f"return how many items loss_fn's sums add over in the whole "
                         f"mini-batch")
    return float(value)


def _warn_if_uneven(given: Input, pieces: Sequence[Batch], sizes: Sequence[int]) -> None:
    """Warn (once per process) when the target's first cut integer tensor holds ignored
    labels (``-100``) and its micro-batches count different numbers of the others per
    sample: a mean over the counted labels, weighted by samples, is then not the
    mini-batch's mean."""
    global _warned
    if _warned or len(pieces) < 2:
        return
    j = next((j for j, (t, w) in enumerate(zip(given.batch.tensors, given.whole))
              if not w and not t.is_floating_point() and not t.is_complex()
              and t.dtype != torch.bool), None)
    if j is None:
        return
    counted = [p.tensors[j].ne(IGNORED_LABEL).sum() for p in pieces]
    counts = torch.stack(counted).tolist()  # one read of the counts per step, until it warns
    if sum(counts) == given.batch.tensors[j].numel():
        return  # nothing ignored: a mean over labels is a mean over samples
    if len({Fraction(c, n) for c, n in zip(counts, sizes)}) > 1:
        _warned = True
        warnings.warn(
            f"the target's micro-batches hold different numbers of counted labels per sample "
            f"(labels other than {IGNORED_LABEL}: {counts} in micro-batches of {list(sizes)} "
            f"samples). If loss_fn averages over them (cross_entropy with ignore_index), the "
            f"micro-batch means weighted by samples are not the mini-batch's mean, and the "
            f"gradients are off: return the sum (reduction='sum') and pass count_fn=lambda "
            f"target: (target != {IGNORED_LABEL}).sum(), so that seqpipe divides by the "
            f"whole mini-batch's count", stacklevel=_callers_level())


def _callers_level() -> int:
    """The ``stacklevel`` that names the first caller outside seqpipe."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and \
            frame.f_globals.get("__name__", "").split(".")[0] == "seqpipe":
        frame, level = frame.f_back, level + 1
    return level
