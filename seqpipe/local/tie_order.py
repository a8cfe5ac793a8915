"""Gradients of a parameter that several stages use, added up in a fixed order.

In the local engine each stage's backward runs on its stage's thread and accumulates its
parameters' gradients as it goes (``seqpipe.core.sink``). A parameter that two
partitions use (tied weights: a language model's embedding and output head) then receives
the contributions of two threads, and ``.grad`` added them in the order the threads
happened to reach it: float addition is not associative, so the sum, and the training,
changed from run to run in the last bits (stage 1's micro-batch 1 before or after stage
0's micro-batch 0), even with one intra-op thread.

``TieOrder`` fixes the order for the length of one call. A pre-hook on each shared leaf's
gradient accumulator (the node autograd accumulates ``.grad`` with; the parameter's own
hooks are not touched) takes each contribution before it is accumulated and adds it to a
running sum of the thread's group, in that thread's program order; ``flush`` then adds the
groups' sums in group order (the order of their first stages: stage order with one stage
per thread) and accumulates the total once. So a tied
weight's gradient is each stage's sum over its micro-batches, then the stages' sums added
up: the way the unpipelined model sums each use's gradient over the batch and then adds
the uses. A contribution from any other thread (an accelerator's autograd thread) is
accumulated as before.
"""
from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from seqpipe.local.worker import current_group

__all__ = ["TieOrder"]


class TieOrder:
    """For one call: the gradients of ``leaves`` (each used by several partitions) summed
    per thread group, then added in group order by ``flush`` (see the module docstring)."""

    def __init__(self, leaves: Sequence[Tensor]) -> None:
        self.leaves = list(leaves)
        self._sums: Dict[Tuple[int, int], Tensor] = {}  # (leaf, group) -> its running sum
        self._fresh: Dict[Tuple[int, int], bool] = {}  # the sum is a tensor made here
        self._nodes: List[Any] = []  # the accumulators, kept alive while hooked
        self._handles: List[Any] = []
        for n, leaf in enumerate(self.leaves):
            node = _accumulator(leaf)
            self._nodes.append(node)
            self._handles.append(node.register_prehook(functools.partial(self._keep, n)))

    def _keep(self, n: int, grads: Tuple[Optional[Tensor], ...]) -> Optional[Tuple[None]]:
        group, grad = current_group(), grads[0]
        if group is None or grad is None:
            return None  # accumulated as usual
        key = (n, group)  # written only by this group's thread
        summed = self._sums.get(key)
        self._sums[key] = grad if summed is None else summed + grad
        self._fresh[key] = summed is not None
        return (None,)  # nothing for the accumulator to add now

    def flush(self) -> None:
        """Accumulate each leaf's total (its groups' sums, in group order) into its
        ``.grad``, and unhook."""
        self.close()
        for n, leaf in enumerate(self.leaves):
            keys = sorted(key for key in self._sums if key[0] == n)
            if not keys:
                continue
            total, fresh = self._sums[keys[0]], self._fresh[keys[0]]
            for key in keys[1:]:
                total, fresh = total + self._sums[key], True
            if not fresh:  # a tensor autograd handed over: .grad gets a copy, as it would
                total = total.clone(memory_format=torch.contiguous_format)
            with torch.no_grad():
                if leaf.grad is None:
                    leaf.grad = total
                elif leaf.grad.is_sparse or total.is_sparse:
                    leaf.grad = leaf.grad + total
                else:
                    leaf.grad.add_(total)
        self._sums.clear()

    def close(self) -> None:
        """Unhook (after a failed call: the sums are dropped)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._nodes.clear()


def _accumulator(leaf: Tensor) -> Any:
    """The node autograd accumulates ``leaf``'s ``.grad`` with (``AccumulateGrad``)."""
    with torch.enable_grad():
        return leaf.view_as(leaf).grad_fn.next_functions[0][0]
