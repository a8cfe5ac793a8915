"""The gradients of weights tied across ranks over one ``train_step``: what the step added,
summed over the ranks that hold a copy.

Each rank that uses a tie holds a copy (``seqpipe.distributed.ties``); at the end of a step
each copy's gradient is summed over the holders, so every copy gets the plain model's
gradient, the sum over all uses. Two things make "each copy's gradient" more than
``.grad``:

* **Accumulation.** ``.grad`` may hold earlier steps' gradients (two ``train_step`` calls
  without ``zero_grad()`` between them), which every copy already holds summed; summing
  ``.grad`` again would count them once more per holder. So at the start of the step
  each trained copy's ``.grad`` is set aside (``None`` meanwhile), the step's backward
  fills a fresh one, that is summed, and the earlier gradient is added back, in place
  in the tensor ``.grad`` held (as autograd accumulates). Exact: nothing is subtracted.
  Meanwhile a hook on a tied copy (a post-accumulate hook, the data-parallel reducer's)
  sees this step's gradient, not the earlier steps' (the reducer's mean is unchanged by
  it). A failed step puts the earlier gradient back under what the step left, unsummed.
* **Freezing.** Which ties are summed follows ``requires_grad`` at the start of every
  step, as the data-parallel reducer does: a tie unfrozen later is summed from then on,
  and a frozen one is left alone (``.grad`` stays ``None`` after ``zero_grad()``, so
  AdamW leaves it alone too). The ranks agree in one small all-gather over the pipeline
  group at the end of the step: per tie and rank, no copy, frozen, trained, or trained
  and given a gradient by this step. That names a tie frozen on some of its holders only
  (each rank raises, instead of one rank waiting in a sum the others never start), tells
  a rank without a copy whether to take part (on a pipeline group made by hand, where
  it adds zeros), and skips a tie that no holder got a gradient for in this step (its
  ``.grad`` stays as it was, ``None`` included, as with DDP); a holder that got none while
  another did gets the sum.
* **Sharding.** A copy FSDP2 manages keeps its gradient, unreduced, in FSDP2's unsharded
  parameter until FSDP2's reduce-scatter, which adds it to the sharded ``.grad``: that
  gradient is the one summed (nothing set aside), and its stage's reduction waits for the
  sum (``ShardedStep.claim``). The all-gather also carries each copy's layout, from which
  every rank picks whether a ``DTensor`` tie is summed by local shards or whole
  (``TiedCopies.whole``).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from seqpipe.distributed.agreement import gather_ints
from seqpipe.distributed.fsdp import ShardedStep, unsharded_grad
from seqpipe.distributed.tie_layout import layout
from seqpipe.distributed.ties import TiedCopies

__all__ = ["TieGrads"]

# A rank's word on a tie, per step (the all-gather's values).
NO_COPY, FROZEN, TRAINED, GIVEN = -1, 0, 1, 2


class TieGrads:
    """One step's gradients of this rank's tied copies: ``set_aside`` at the start,
    ``reduce`` at the end (collective over the pipeline group), or ``put_back`` after a
    failure."""

    def __init__(self, copies: TiedCopies) -> None:
        self.copies = copies
        # Per tie, from the start of the step: this rank's copy (as its layer held it
        # then), the FSDPParam that manages it (if FSDP2 does), whether it is trained, and
        # what its .grad held then (set aside).
        self.now: List[Optional[Tensor]] = list(copies.copies)
        self.fsdp: List[Optional[object]] = [None] * len(copies.ties)
        self.trained: List[bool] = [False] * len(copies.ties)
        self.earlier: List[Optional[Tensor]] = [None] * len(copies.ties)

    def set_aside(self, sharded: Optional[ShardedStep] = None) -> None:
        """Start of a step: note which copies are trained (``requires_grad`` now) and set
        their ``.grad`` aside, so that the step's backward fills a fresh one. A copy that
        FSDP2 manages (``sharded.claim``) keeps its sharded ``.grad``: its sum goes into
        the step's unsharded gradient before FSDP2 reduces it (and adds it to ``.grad``)."""
        self.now = list(self.copies.copies)
        self.fsdp = [sharded.claim(c) if sharded is not None and c is not None else None
                     for c in self.now]
        self.trained = [c is not None and c.requires_grad for c in self.now]
        for t, copy in enumerate(self.now):
            if self.trained[t] and self.fsdp[t] is None:
                assert copy is not None
                self.earlier[t], copy.grad = copy.grad, None

    def put_back(self) -> None:
        """Add what was set aside back to each copy's ``.grad`` (the tensor it was)."""
        for t, copy in enumerate(self.now):
            earlier, self.earlier[t] = self.earlier[t], None
            if earlier is None:
                continue
            assert copy is not None
            if copy.grad is not None:
                earlier.add_(copy.grad)
            copy.grad = earlier

    def _grad(self, t: int, create: bool = False) -> Optional[Tensor]:
        """This step's gradient of this rank's copy of tie ``t`` (FSDP2's unsharded one
        for a copy it manages); zeros set where there is none if ``create``."""
        fsdp_param, copy = self.fsdp[t], self.now[t]
        if fsdp_param is not None:
            return unsharded_grad(fsdp_param, create)
        if copy is None:
            return None
        if copy.grad is None and create:
            copy.grad = torch.zeros_like(copy)
        return copy.grad

    def _like(self, t: int, grad: Optional[Tensor]) -> Tensor:
        """What tie ``t``'s gradient here is laid out like: ``grad``, else what it would be
        made like (FSDP2's unsharded parameter, or the copy)."""
        if grad is not None:
            return grad
        leaf = getattr(self.fsdp[t], "_unsharded_param", None)
        copy = leaf if leaf is not None else self.now[t]
        assert copy is not None
        return copy

    def reduce(self) -> None:
        """End of a step: agree on which ties to sum, sum this step's gradient of each over
        its holders (every all-reduce started before any is waited for; by local shards,
        or whole where the copies are laid out differently, see
        ``seqpipe.distributed.tie_layout``), then add back what earlier steps left.

        Raises:
            RuntimeError: on every rank, a tie trained on some holders and frozen on
                others.
        """
        words, layouts = self._words()
        said = [[words[r][t] for r in tie.stages] for t, tie in enumerate(self.copies.ties)]
        for tie, theirs in zip(self.copies.ties, said):
            if FROZEN in theirs and any(w >= TRAINED for w in theirs):
                self.put_back()
                raise RuntimeError(_mixed(tie.describe(), tie.stages, theirs))
        waits = []
        for t in range(len(self.copies.ties)):
            if GIVEN not in said[t] or self.copies.sum_groups[t] is None:
                continue  # frozen, or no gradient anywhere, or not this rank's sum
            whole = self.copies.whole(t, [row[t] for row in layouts])
            waits.append(self.copies.start_sum(t, self._grad(t, create=True), whole))
        for wait in waits:
            wait()
        self.put_back()

    def _words(self) -> Tuple[List[List[int]], List[List[int]]]:
        """Per rank of the pipeline, per tie: its word (``NO_COPY`` ... ``GIVEN``), and its
        gradient's layout (``tie_layout.layout``; -1 without a copy or a gradient)."""
        mine = []
        for t, (copy, trained) in enumerate(zip(self.now, self.trained)):
            grad = self._grad(t) if trained else None
            if copy is None:
                word = NO_COPY
            elif not trained:
                word = FROZEN
            else:
                word = GIVEN if grad is not None else TRAINED
            mine.append([word, -1 if copy is None else layout(self._like(t, grad))])
        everyone = gather_ints([v for pair in mine for v in pair], self.copies.group,
                               self.copies.device)
        return [w[0::2] for w in everyone], [w[1::2] for w in everyone]


def _mixed(tie: str, stages: Sequence[int], said: List[int]) -> str:
    """The error for a tie trained on some of its holders (``stages``) and frozen on others."""
    trained = [s for s, w in zip(stages, said) if w >= TRAINED]
    frozen = [s for s, w in zip(stages, said) if w == FROZEN]
    return (f"the tied parameter {tie} requires grad on stages {trained} but not on "
            f"{frozen}: its copies would no longer get the same gradient. Set requires_grad "
            f"of a tied parameter on every rank alike, between steps: through the model you "
            f"built the pipe from (e.g. model[0].weight.requires_grad_(False)), which "
            f"reaches each rank's copy")
