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
gradients. ``W`` then runs each boundary node again on those gradients, computing only
its edges off ``P``, and backpropagates what they yield into the parameters behind them;
each parameter is reached once, so its hooks fire once. Every operation runs once, as in
one backward: the gradients are those of a full backward. A root off ``P`` (an output
computed from parameters only) is all weight path: ``W`` backpropagates it with its
gradient.

What a split costs beyond one backward is mostly per *call into autograd's engine* (a
graph task, two walks over every node reachable from its roots) and Python. So:

* ``I`` walks the graph once in Python (``seqpipe.core.split_walk``: the path, the
  boundary nodes and the leaves behind each of their edges off it, shared nodes) and
  calls the engine once;
* ``W`` makes one engine call, ``WithinTask``, whose only targets are the boundary nodes'
  edges off ``P``. Inside it each boundary node is *called* (``node(*grads)``): a node
  computes only the outputs whose next node the current graph task needs, so it computes
  its edges off ``P`` and not its input gradient (autograd's own rule,
  ``task_should_compute_output``). What those edges yield is backpropagated into the
  parameters behind them, one boundary node at a time, from inside that call: each such
  engine call walks the few nodes of one weight path, not the whole graph below the
  boundary node as a call rooted at the node would (a transformer stage: 26 boundary
  nodes, ~2,500 node visits per ``W`` instead of ~100); where every leaf behind a called
  node's edges is wanted, without ``inputs=``. One call for all of ``W`` is not
  exact: a boundary node upstream reaches a later one's parameters through ``P``, so
  autograd would run ``P`` again and count the later node's gradient twice. (One call for
  all the weight paths is exact, and saves ~7 µs an engine call, but the engine then
  accumulates every bias before any weight: the per-layer order below would be lost.)
  A boundary node that is a custom ``autograd.Function``, any under anomaly detection, and
  every one of a stage whose backward must run hooks on its outputs in ``W`` too
  (``weight(call=False)``: FSDP2's pre-backward hook queues, per backward, the move of the
  unsharded gradients into its accumulator, in float32 under a bfloat16 parameter dtype),
  is instead run by the engine from its kept gradients (as ``I`` ran it: hooks on its
  output tensor then run again in ``W``). A called node runs on the calling thread's
  current stream, where the engine would run it on the stream of its forward: the same
  one here, as both engines run a stage's forward and backward on the caller's current
  stream (``seqpipe.core.stream``).
* A boundary node whose weight gradients one kernel computes with its input gradient (a
  norm: ``CHEAP_WEIGHTS``) runs once, in ``I``: ``I``'s engine call also asks for the
  gradients entering its parameters' accumulators, which the engine captures without
  running those (``torch.autograd.grad``'s rule), and ``W`` backpropagates them from there
  in its order, as it does a root off ``P`` (``Roots``). Its backward would otherwise run
  twice, its input gradient in ``I`` and its weights' in ``W`` (~20 + ~12 us against ~20
  for a ``LayerNorm`` of the benchmark's transformer), beside a node call and an engine
  call of ``W``.

Right after ``I``, what only ``P`` needed is freed (``seqpipe.core.saved``): the saved tensors of
the nodes of ``P`` that ``W`` does not run again (a ReLU's output, the loss's input), and
the roots' gradients; only the weight path's saved tensors and the kept gradients wait for
``W``, so a micro-batch between its ``I`` and its ``W`` holds no more than its schedule
counts on. What the boundary nodes saved (and everything else the forward saved) is freed
when ``W`` ends.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Dict, List, Optional, Sequence, Set

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, _engine_run_backward

from seqpipe.core.saved import SavedTensors
from seqpipe.core.split_runs import (
    CHEAP_WEIGHTS,
    Boundary,
    Roots,
    autograd_inputs,
    backprop,
    hook_free,
    sorted_inputs,
    within_task,
)
from seqpipe.core.split_walk import ACCUMULATE, survey

__all__ = ["SplitBackward", "autograd_inputs", "reachable"]

Node = Any  # torch.autograd.graph.Node


def reachable(edges: Sequence[GradientEdge]) -> List[Node]:
    """Every node reachable through ``edges`` (a stage's whole graph from its roots)."""
    seen: Dict[Node, None] = {}
    stack = [e.node for e in edges]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen[node] = None
        stack.extend(c for c, _ in node.next_functions if c is not None)
    return list(seen)


def _with_outside(wrt: List[Tensor], roots: Sequence[GradientEdge],
                  entry: Optional[Tensor] = None) -> List[Tensor]:
    """``wrt``, and after it every other leaf the graph below ``roots`` reaches but
    ``entry`` (the stage's input node's leaf): a tensor outside the pipe that a layer or
    ``loss_fn`` holds. What a backward over the whole graph accumulates into, for one that
    must name them in ``inputs=`` (``W`` rerunning a whole backward past a shared node); a
    walk over the graph (``reachable``'s), where the plain backward needs none."""
    known = {id(t) for t in wrt}
    known.add(id(entry))
    outside: List[Tensor] = []
    seen: Set[Node] = set()
    stack = [e.node for e in roots]
    while stack:  # ``reachable``, picking the leaves on the way (~1.3 µs a node)
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if type(node) is ACCUMULATE:
            if id(node.variable) not in known:
                outside.append(node.variable)
            continue
        for child, _ in node.next_functions:
            if child is not None:
                stack.append(child)
    return [*wrt, *outside] if outside else wrt


@dataclass
class SplitBackward:
    """One micro-batch's backward on one stage, run as ``input()`` then ``weight()``."""

    roots: List[GradientEdge]
    grads: List[Tensor]
    wrt_input: Optional[Tensor]  # the leaf behind the stage's input node; None: no input path
    input_node: Optional[Node]
    whole: bool = False  # W reruns the whole backward (a node shared off the input path)
    saved: Optional[SavedTensors] = None  # what the forward saved: freed after I but W's
    # I may compute a norm's weight gradients (``CHEAP_WEIGHTS``, ``hook_free``): not where
    # W must run every boundary node through the engine (FSDP2's hooks), nor under anomaly.
    cheap: bool = True
    boundary: List[Boundary] = field(default_factory=list)  # in the walk's order
    # What W backpropagates as it is: roots off the input path (an output computed from
    # parameters only) and the weight gradients I computed.
    known: List[Roots] = field(default_factory=list)
    only: List[Node] = field(default_factory=list)  # what I ran that W will not (to free)

    def input(self) -> None:
        """Backpropagate to the stage input only, keeping what ``weight`` needs."""
        if self.wrt_input is None or self.input_node is None or not self.roots:
            return
        graph = survey([r.node for r in self.roots], self.input_node)
        # A node off the path with several parents (a parameter used twice, say) could be
        # reached from one boundary node through another, which would then run part of
        # the input path again. Rare; then W runs the whole backward again into the
        # parameters (exact, as slow as a naive split).
        self.whole = graph.shared
        if self.whole:
            if self.saved is not None:
                self.saved.let_go()  # the engine frees each node's as W runs it
            return self._input_only()
        on, behind = graph.on, graph.behind
        self.known = [Roots([root], [grad], [behind[root.node]], False)
                      for root, grad in zip(self.roots, self.grads) if root.node not in on]
        cheap = self.cheap and not torch.is_anomaly_enabled()
        computed: List[Roots] = []  # the cheap nodes', their gradients filled in below
        for node, off in graph.boundary:
            # (What such a node saved is freed when W ends, as a called node's: reading
            # its holders to free them after I costs more than its backward saves.)
            if cheap and type(node).__name__ in CHEAP_WEIGHTS and hook_free(off):
                computed.append(Roots([GradientEdge(child, nr) for _, child, nr, _ in off],
                                       [], [leaves for *_, leaves in off], True))
            else:
                self.boundary.append(Boundary(node, [(k, GradientEdge(child, nr), leaves)
                                                      for k, child, nr, leaves in off]))
        handles = [b.node.register_prehook(partial(setattr, b, "incoming"))
                   for b in self.boundary]
        try:
            if computed:
                self._input_capturing(computed)
            else:
                self._input_only()
        finally:
            for handle in handles:
                handle.remove()
        self.known += computed
        # W starts from the kept gradients: drop the roots and their gradients. What only
        # the input path saved (a ReLU's output, the loss's input) goes in
        # ``free_input_path``, once the input's gradient has been sent; what the boundary
        # nodes saved is freed when W ends; the weight path frees itself.
        self.roots, self.grads = [], []
        self.only = graph.only

    def free_input_path(self) -> None:
        """Free what only the input path saved (after ``input``; ``weight`` does it first
        if it was not done): a stage calls it once the input's gradient has left, so that
        the ~0.2 ms it takes (reading ~100 nodes' holders) does not delay that message."""
        only, self.only = self.only, []
        if only and self.saved is not None:
            self.saved.release(only, ())
            self.saved.prune()

    def _input_only(self) -> None:
        backprop(self.roots, self.grads, [self.wrt_input], keep=True)

    def _input_capturing(self, computed: List[Roots]) -> None:
        """``_input_only``, the engine also handing back the gradients that enter the
        ``computed`` nodes' edges: asked for (``inputs=``) without accumulating, they are
        captured where they enter the accumulators, which do not run (``autograd.grad``'s
        rule), so the parameters' post-accumulate hooks fire in W only, once."""
        edges = [e for c in computed for e in c.edges]
        got = _engine_run_backward(tuple(self.roots), tuple(self.grads), True, False,
                                   (self.wrt_input, *edges), allow_unreachable=True,
                                   accumulate_grad=False)
        at = 1  # got[0]: the input's, which the input node's backward keeps itself
        for c in computed:
            c.grads = list(got[at:at + len(c.edges)])
            at += len(c.edges)

    def weight(self, wrt: Sequence[Tensor], *, call: bool = True, plain: bool = False) -> None:
        """Accumulate the parameters' gradients (into the leaves ``wrt``); frees the graph.

        The boundary nodes run in a fixed order: the one whose parameters come last in
        ``wrt`` first (see the module's docstring for how each runs). ``call=False``:
        the engine runs every boundary node again, so that hooks on their outputs run
        in ``W`` too (FSDP2's pre-backward hook, which queues its gradient accumulation).
        What the forward saved is freed at the end (``SavedTensors.free_all``).
        ``plain``: the step's backward is over the whole graph (``GradSink.plain``), so
        every leaf behind the weight path gets its gradient, not only ``wrt``'s (after
        them): a tensor outside the pipe that a layer or ``loss_fn`` holds. A stage without
        an input path then backpropagates as the plain model does, without ``inputs=``;
        a whole rerun (a shared node) names them in ``inputs=`` (``_with_outside``).
        """
        try:
            self.free_input_path()
            self._weight(wrt, call, plain)
        finally:
            if self.saved is not None:
                self.saved.free_all()

    def _weight(self, wrt: Sequence[Tensor], call: bool, plain: bool) -> None:
        if self.wrt_input is None or self.input_node is None or self.whole:  # all of it
            if self.roots and (wrt or plain):
                if plain and self.wrt_input is None:
                    backprop(self.roots, self.grads, ())
                    return
                targets = list(wrt)
                if plain:
                    targets = _with_outside(targets, self.roots, self.wrt_input)
                backprop(self.roots, self.grads, autograd_inputs(targets))
            return
        order = {id(t): n for n, t in enumerate(wrt)}
        boundary, self.boundary = self.boundary, []
        known, self.known = self.known, []
        if plain:  # every leaf behind the weight path, each listed there already
            for behind in [b for k in known for b in k.behind] + \
                    [b for x in boundary for *_, b in x.off]:
                for leaf in behind:
                    order.setdefault(id(leaf), len(order))
        # In a fixed order, the same on every replica (not the nodes' addresses): the
        # parameters registered last first, the order a plain backward produces them in
        # (and a reducer's buckets follow), so that post-accumulate hooks that issue
        # per-layer collectives issue them in the same order on every replica.
        direct = call and not torch.is_anomaly_enabled()
        runs: List[Any] = [k for k in known if k.plan(order)]  # Roots and Boundary
        called: List[GradientEdge] = []  # what the nodes called directly must compute
        for b in boundary:  # each one's plan (inline: a call per node is measurable)
            if b.incoming is None:
                continue
            ks, edges, leaves, every, last = [], [], [], True, -1
            for k, edge, behind in b.off:  # (loops, not comprehensions: no call each)
                first = len(leaves)
                for leaf in behind:
                    at = order.get(id(leaf))
                    if at is not None:
                        leaves.append(leaf)
                        last = at if at > last else last
                if len(leaves) > first:
                    ks.append(k)
                    edges.append(edge)
                    every = every and len(leaves) - first == len(behind)
            if not ks:
                continue
            b.ks, b.edges, b.last = ks, edges, last
            b.here = here = direct and not isinstance(b.node, torch._C._FunctionBase)
            if here:
                called += edges
            # Called here, the node's outputs are the roots: when every leaf behind them is
            # wanted, the engine needs no ``inputs=`` (nor the walk that marks them).
            b.inputs = () if here and every else sorted_inputs(leaves, order)
            runs.append(b)
        runs.sort(key=lambda run: -run.last)
        nested = bool(called)

        def work() -> None:
            for run in runs:
                run.run(nested)
        if called:
            within_task(called, work)
        else:
            work()
