"""The one walk a split backward's ``I`` makes over a micro-batch's graph (``survey``).

``seqpipe.core.split_backward`` cuts a stage's backward where the input path (the nodes
from which the stage's input node is reached) and the weight paths part. What it needs
to know of the graph, this finds in one pass over every node, reading each node's edges
once: the input path, its *boundary nodes* (nodes of the path with edges off it) with, for
each such edge, the leaves behind it (what ``W`` accumulates into), the path's other nodes
(whose saved tensors ``I`` frees), and whether a node off the path has several parents
(then ``W`` reruns the whole backward instead). It runs once per split micro-batch, so it
is written for Python's speed: ~1.5 µs a node, most of it making the nodes' Python objects.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Set, Tuple

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

__all__ = ["ACCUMULATE", "Walk", "survey"]

Node = Any  # torch.autograd.graph.Node
Edges = Tuple[Tuple[Any, int], ...]  # a node's ``next_functions``

with torch.inference_mode(False):  # the class of a leaf's gradient accumulator
    ACCUMULATE = type(get_gradient_edge(torch.empty(0, requires_grad=True)).node)


@dataclass
class Walk:
    """What one walk over a micro-batch's graph finds."""

    # The nodes of the input path with edges off it, in the walk's order (the same on
    # every replica), each with those edges: (index, next node, its input number, the
    # leaves at or below the next node).
    boundary: List[Tuple[Node, List[Tuple[int, Node, int, List[Tensor]]]]]
    on: Set[Node]  # the input path: the nodes from which the input node is reached
    only: List[Node]  # the nodes of the path without edges off it, and the input node
    behind: Dict[Node, List[Tensor]]  # every node off the path: the leaves at or below it
    shared: bool  # a node off the path has several parents


def survey(roots: Sequence[Node], target: Node) -> Walk:
    """Walk the graph below ``roots`` once, reading each node's edges once (iteratively:
    a deep model's graph would overflow Python's recursion). A node is done once its
    children are (a DAG, walked depth first: it is met again on the stack after them). It
    is on the input path if it is ``target`` or one of its children is; off it, it gathers
    the leaves at or below it from its children, so what each weight path accumulates into
    is known without walking it again. (~1.5 µs a node, most of it Python: one pass, few
    objects made.)"""
    edges: Dict[Node, Edges] = {}
    on: Set[Node] = set()
    behind: Dict[Node, List[Tensor]] = {}
    boundary: List[Tuple[Node, List[Tuple[int, Node, int, List[Tensor]]]]] = []
    only: List[Node] = []
    once: Set[Node] = set()  # nodes off the path with a parent (an edge into them) seen
    shared = False
    stack = list(roots)
    while stack:
        node = stack[-1]
        nexts = edges.get(node)
        if nexts is None:  # first met: its children go above it on the stack
            nexts = edges[node] = node.next_functions
            for child, _ in nexts:
                if child is not None and child not in edges:
                    stack.append(child)
            continue
        stack.pop()  # met again: its children are done (or it was, if pushed twice)
        if node in on or node in behind:
            continue
        reach = node is target
        off = []
        for k, (child, nr) in enumerate(nexts):
            if child is None:
                continue
            if child in on:
                reach = True
            else:
                off.append((k, child, nr))
                shared = shared or child in once
                once.add(child)
        if reach:
            on.add(node)
            if off and node is not target:
                boundary.append((node, [(k, c, nr, behind[c]) for k, c, nr in off]))
            else:
                only.append(node)
        elif type(node) is ACCUMULATE:
            behind[node] = [node.variable]
        else:
            leaves: List[Tensor] = []
            for _, child, _ in off:
                leaves += behind[child]
            behind[node] = leaves
    return Walk(boundary, on, only, behind, shared)
