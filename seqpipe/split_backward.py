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
gradients. ``W`` then backpropagates from each boundary node, with those gradients, into
the parameters behind its edges leaving ``P`` only (``inputs=``), so autograd computes
those edges alone; each parameter is reached once, so its hooks fire once. Every
operation runs once, as in one backward: the gradients are those of a full backward.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.overrides import has_torch_function

__all__ = ["SplitBackward", "autograd_inputs"]

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


def _leaves_under(edges: Sequence[GradientEdge]) -> List[Tensor]:
    """The leaf tensors (behind ``AccumulateGrad`` nodes) reachable through ``edges``."""
    leaves: List[Tensor] = []
    seen: set = set()
    stack = [e.node for e in edges]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, Tensor):
            leaves.append(variable)
        stack.extend(c for c, _ in node.next_functions if c is not None)
    return leaves


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

@dataclass
class SplitBackward:
    """One micro-batch's backward on one stage, run as ``input()`` then ``weight()``."""

    roots: List[GradientEdge]
    grads: List[Tensor]
    wrt_input: Optional[Tensor]  # the leaf behind the stage's input node; None: no input path
    input_node: Optional[Node]
    captured: Dict[Node, Tuple[Optional[Tensor], ...]] = field(default_factory=dict)
    leaves: Dict[Node, List[Tensor]] = field(default_factory=dict)  # behind each boundary
    whole: bool = False  # W reruns the whole backward (a node shared off the input path)

    def input(self) -> None:
        """Backpropagate to the stage input only, keeping what ``weight`` needs."""
        if self.wrt_input is None or self.input_node is None or not self.roots:
            return
        reaches = _walk([r.node for r in self.roots], self.input_node)
        path = {node for node, reached in reaches.items() if reached}
        # A node off the path with several parents (a parameter used twice, say) could be
        # reached from one boundary node through another, which would then run part of
        # the input path again. Rare; then W runs the whole backward again into the
        # parameters (exact, as slow as a naive split).
        parents = Counter(c for node in reaches for c, _ in node.next_functions if c is not None)
        self.whole = any(parents[node] > 1 for node in reaches if node not in path)
        if self.whole:
            return self._input_only()
        for node in path:
            if node is self.input_node:
                continue
            edges = [GradientEdge(c, nr) for c, nr in node.next_functions
                     if c is not None and c not in path]
            if edges:
                self.leaves[node] = _leaves_under(edges)
        handles = [node.register_prehook(self._keeper(node)) for node in self.leaves]
        try:
            self._input_only()
        finally:
            for handle in handles:
                handle.remove()

    def _input_only(self) -> None:
        torch.autograd.backward(self.roots, self.grads, inputs=[self.wrt_input],
                                retain_graph=True)

    def _keeper(self, node: Node) -> Any:
        def keep(grad_outputs: Tuple[Optional[Tensor], ...]) -> None:
            self.captured[node] = tuple(grad_outputs)
        return keep

    def weight(self, wrt: Sequence[Tensor]) -> None:
        """Accumulate the parameters' gradients (into the leaves ``wrt``); frees the graph.

        Each boundary node runs again from the gradients it got in ``input``, asked only
        for the leaves behind its edges off the input path, so it computes those edges
        alone and nothing of the input path runs twice. (A hook on the boundary node's
        output tensor, rare inside a stage, therefore runs in both halves.)
        """
        if self.wrt_input is None or self.input_node is None or self.whole:  # all of it
            if self.roots and wrt:
                torch.autograd.backward(self.roots, self.grads, inputs=autograd_inputs(list(wrt)))
            return
        wanted = {id(t) for t in wrt}
        captured, self.captured = self.captured, {}
        leaves, self.leaves = self.leaves, {}
        for node, behind in leaves.items():
            incoming = captured.get(node)
            targets = [t for t in behind if id(t) in wanted]
            if incoming is None or not targets:
                continue
            outs = [GradientEdge(node, k) for k, g in enumerate(incoming) if g is not None]
            if outs:
                torch.autograd.backward(outs, [g for g in incoming if g is not None],
                                        inputs=autograd_inputs(targets))
