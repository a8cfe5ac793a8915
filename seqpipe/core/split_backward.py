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
A root off ``P`` (an output computed from parameters only) is all weight path: ``W``
backpropagates it with its gradient.

Right after ``I``, what only ``P`` needed is freed (``seqpipe.core.saved``): the saved tensors of
the nodes of ``P`` that ``W`` does not run again (a ReLU's output, the loss's input), and
the roots' gradients; only the weight path's saved tensors and the kept gradients wait for
``W``, so a micro-batch between its ``I`` and its ``W`` holds no more than its schedule
counts on.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.overrides import has_torch_function

from seqpipe.core.saved import SavedTensors

__all__ = ["SplitBackward", "autograd_inputs", "reachable"]

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


def reachable(edges: Sequence[GradientEdge]) -> List[Node]:
    """Every node reachable through ``edges`` (the weight path behind a boundary node; a
    stage's whole graph from its roots)."""
    seen: Dict[Node, None] = {}
    stack = [e.node for e in edges]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen[node] = None
        stack.extend(c for c, _ in node.next_functions if c is not None)
    return list(seen)


def _leaves(nodes: Sequence[Node]) -> List[Tensor]:
    """The leaf tensors behind the ``AccumulateGrad`` nodes among ``nodes``."""
    found = (getattr(node, "variable", None) for node in nodes)
    return [v for v in found if isinstance(v, Tensor)]


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
    saved: Optional[SavedTensors] = None  # what the forward saved: freed after I but W's
    # Roots off the input path (an output computed from parameters only): W's alone.
    off_path: List[Tuple[GradientEdge, Tensor, List[Tensor]]] = field(default_factory=list)

    def input(self) -> None:
        """Backpropagate to the stage input only, keeping what ``weight`` needs."""
        if self.wrt_input is None or self.input_node is None or not self.roots:
            return
        reaches = _walk([r.node for r in self.roots], self.input_node)
        # a dict, not a set: it iterates in the walk's order, the same on every replica
        path = {node: None for node, reached in reaches.items() if reached}
        # A node off the path with several parents (a parameter used twice, say) could be
        # reached from one boundary node through another, which would then run part of
        # the input path again. Rare; then W runs the whole backward again into the
        # parameters (exact, as slow as a naive split).
        parents = Counter(c for node in reaches for c, _ in node.next_functions if c is not None)
        self.whole = any(parents[node] > 1 for node in reaches if node not in path)
        if self.whole:
            return self._input_only()
        weight_path: List[Node] = []
        for root, grad in zip(self.roots, self.grads):
            if root.node not in path:
                below = reachable([root])
                self.off_path.append((root, grad, _leaves(below)))
                weight_path += below
        for node in path:
            if node is self.input_node:
                continue
            edges = [GradientEdge(c, nr) for c, nr in node.next_functions
                     if c is not None and c not in path]
            if edges:
                below = reachable(edges)
                self.leaves[node] = _leaves(below)
                weight_path += [node, *below]
        handles = [node.register_prehook(self._keeper(node)) for node in self.leaves]
        try:
            self._input_only()
        finally:
            for handle in handles:
                handle.remove()
        # W starts from the kept gradients: drop the roots, their gradients, and what only
        # the input path saved (a ReLU's output, the loss's input), keeping W's tensors.
        self.roots, self.grads = [], []
        if self.saved is not None:
            self.saved.release(path, weight_path)

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
        output tensor, rare inside a stage, therefore runs in both halves.) The boundary
        nodes run in a fixed order: the one whose parameters come last in ``wrt`` first.
        """
        if self.wrt_input is None or self.input_node is None or self.whole:  # all of it
            if self.roots and wrt:
                torch.autograd.backward(self.roots, self.grads, inputs=autograd_inputs(list(wrt)))
            return
        order = {id(t): n for n, t in enumerate(wrt)}
        captured, self.captured = self.captured, {}
        leaves, self.leaves = self.leaves, {}
        work = [([root], [grad], behind) for root, grad, behind in self.off_path]
        self.off_path = []
        for node, behind in leaves.items():
            incoming = captured.get(node)
            if incoming is not None:
                work.append(([GradientEdge(node, k) for k, g in enumerate(incoming)
                              if g is not None], [g for g in incoming if g is not None], behind))
        runs: List[Tuple[int, List[GradientEdge], List[Tensor], List[Tensor]]] = []
        for outs, grads, behind in work:
            targets = sorted((t for t in behind if id(t) in order), key=lambda t: order[id(t)])
            if outs and targets:
                runs.append((order[id(targets[-1])], outs, grads, targets))
        # In a fixed order, the same on every replica (not the nodes' addresses): the
        # parameters registered last first, the order a plain backward produces them in
        # (and a reducer's buckets follow), so that post-accumulate hooks that issue
        # per-layer collectives issue them in the same order on every replica.
        runs.sort(key=lambda run: -run[0])
        for _, outs, grads, targets in runs:
            torch.autograd.backward(outs, grads, inputs=autograd_inputs(targets))
