"""A stage's backward split in two: the input gradient now (``I``), the weights' later (``W``).

Zero-bubble schedules send the gradient of a stage's input upstream as soon as it exists
and compute the parameters' gradients later, to fill an idle slot. Asking autograd first
for the input gradient (``retain_graph``) and then for the parameters' would run the
activation path twice, so the second half would cost a whole backward. Instead the graph
is cut where the two paths part (``torch.distributed.pipelining`` does the same in its
``stage_backward_input`` / ``stage_backward_weight``; this is written afresh on autograd's
public graph API):

* **the input path** ``P``: the nodes from which the stage's input node (``_Receive``) can
  be reached; every other node leads only to parameters (or nowhere that matters);
* **boundary nodes**: nodes of ``P`` with an edge leaving ``P`` (``AddmmBackward``: its
  edge to the weight). Their incoming gradients are exactly what the weight path needs.

``I`` backpropagates from the stage's outputs to its input only (``inputs=``), so autograd
computes nothing off ``P``, while pre-hooks on the boundary nodes keep their incoming
gradients. ``W`` then asks each boundary node, from those gradients, for the gradients of
its edges leaving ``P`` only, and runs one backward from those edges into the parameters
(which fires their hooks and frees the graph). Every operation runs once, as in one
backward: the gradients are those of a full backward.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

__all__ = ["SplitBackward"]

Node = Any  # torch.autograd.graph.Node


def _walk(roots: Sequence[Node], target: Node) -> Dict[Node, bool]:
    """Every node reachable from ``roots``, and whether ``target`` is reachable from it
    (iteratively: a deep model's graph would overflow Python's recursion)."""
    reaches: Dict[Node, bool] = {}
    for root in roots:
        stack: List[Tuple[Node, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node in reaches:
                continue
            children = [c for c, _ in node.next_functions if c is not None]
            if expanded:
                reaches[node] = node is target or any(reaches[c] for c in children)
                continue
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in reaches)
    return reaches


@dataclass
class SplitBackward:
    """One micro-batch's backward on one stage, run as ``input()`` then ``weight()``."""

    roots: List[GradientEdge]
    grads: List[Tensor]
    wrt_input: Optional[Tensor]  # the leaf behind the stage's input node; None: no input path
    input_node: Optional[Node]
    captured: Dict[Node, Tuple[Optional[Tensor], ...]] = field(default_factory=dict)
    leaving: Dict[Node, List[GradientEdge]] = field(default_factory=dict)
    whole: bool = False  # W reruns the whole backward (a node shared off the input path)

    def input(self) -> None:
        """Backpropagate to the stage input only, keeping what ``weight`` needs."""
        if self.wrt_input is None or self.input_node is None or not self.roots:
            return
        reaches = _walk([r.node for r in self.roots], self.input_node)
        path = {node for node, reached in reaches.items() if reached}
        parents = Counter(c for node in reaches for c, _ in node.next_functions if c is not None)
        for node in path:
            if node is self.input_node:
                continue
            edges = [GradientEdge(c, nr) for c, nr in node.next_functions
                     if c is not None and c not in path]
            if edges:
                self.leaving[node] = edges
        # A node off the path with several parents (a parameter used twice, say) could be
        # reached from one boundary node through another: its gradient would be asked for
        # twice. Rare; then W runs the whole backward again into the parameters (exact,
        # as slow as a naive split).
        self.whole = any(parents[e.node] > 1 for edges in self.leaving.values() for e in edges)
        if self.whole:
            self.leaving.clear()
        handles = [node.register_prehook(self._keeper(node)) for node in self.leaving]
        try:
            torch.autograd.backward(self.roots, self.grads, inputs=[self.wrt_input],
                                    retain_graph=True)
        finally:
            for handle in handles:
                handle.remove()

    def _keeper(self, node: Node) -> Any:
        def keep(grad_outputs: Tuple[Optional[Tensor], ...]) -> None:
            self.captured[node] = tuple(grad_outputs)
        return keep

    def weight(self, wrt: Sequence[Tensor]) -> None:
        """Accumulate the parameters' gradients (into the leaves ``wrt``); frees the graph."""
        if self.wrt_input is None or self.input_node is None or self.whole:  # all of it
            if self.roots and wrt:
                torch.autograd.backward(self.roots, self.grads, inputs=list(wrt))
            return
        edges: List[GradientEdge] = []
        grads: List[Tensor] = []
        for node, leaving in self.leaving.items():
            incoming = self.captured.get(node)
            if incoming is None:
                continue
            outs = [GradientEdge(node, k) for k, g in enumerate(incoming) if g is not None]
            if not outs:
                continue
            got = torch.autograd.grad(outs, leaving, [g for g in incoming if g is not None],
                                      retain_graph=True, allow_unused=True)
            for edge, grad in zip(leaving, got):
                if grad is not None:
                    edges.append(edge)
                    grads.append(grad)
        self.captured.clear()
        self.leaving.clear()
        if edges and wrt:
            torch.autograd.backward(edges, grads, inputs=list(wrt))
