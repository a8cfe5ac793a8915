"""Cut a traced graph at its units: which layer computes each node, what travels where.

Layer ``i`` of the converted ``nn.Sequential`` runs the glue its unit needs and then unit
``i``. Each glue node goes to the layer of its first consumer ("as late as possible"), so
a value derived from the inputs (an attention mask) is computed where it is first used.
Nodes that read nothing but attributes and constants (a weight read by the glue, an
``arange`` of fixed length) are copied into every layer that uses them instead: a weight
then sits in two layers as a tie, which seqpipe handles. A node nothing uses (export's
check of a buffer's dtype and device before ``.to()``) goes where the value it checks is
first used, never to an earlier layer.

A tensor computed in layer ``p`` reaches each later layer that uses it straight from
``p``: the very next layer as an item of ``p``'s output tuple, any further one as a
seqpipe skip (stashed by ``p``, popped by the user), which goes straight from stage to
stage with its gradient. Values that are not tensors (sizes, flags) cannot be skips:
they ride in the output tuples of every layer in between. A layer must hand at
least one tensor to the next, so when none would, its nearest skip rides instead.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Dict, List, Set, Tuple

import torch
import torch.fx as fx
import torch.fx._pytree as fx_pytree

from seqpipe.graph.errors import ConversionError
from seqpipe.graph.opaque_check import check_outputs

__all__ = ["Layer", "Plan", "plan_layers"]

_FLAT = (fx_pytree.tree_flatten_spec, check_outputs)  # a unit's flat outputs


@dataclass
class Layer:
    """What one layer of the converted model receives, computes, and hands on."""

    unit: str
    nodes: List[fx.Node] = field(default_factory=list)  # computed here, in graph order
    inputs: List[fx.Node] = field(default_factory=list)  # items of the incoming tuple
    pops: List[Tuple[str, fx.Node]] = field(default_factory=list)  # (skip name, value)
    outputs: List[object] = field(default_factory=list)  # items of the outgoing tuple
    stashes: List[Tuple[str, fx.Node]] = field(default_factory=list)


@dataclass
class Plan:
    layers: List[Layer]
    free: Set[fx.Node]  # attribute reads and constants: copied where used
    results: List[object]  # the model's flat output leaves (nodes, constants)


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def plan_layers(graph: fx.Graph, units: List[str]) -> Plan:
    """Assign every node of ``graph`` to a layer and route the values between layers."""
    index = {name: i for i, name in enumerate(units)}
    last = len(units) - 1
    nodes = list(graph.nodes)
    output = next(n for n in nodes if n.op == "output")
    free: Set[fx.Node] = set()
    earliest: Dict[fx.Node, int] = {}
    for node in nodes:
        inputs = [n for n in node.all_input_nodes if n not in free]
        if node.op == "get_attr" or (node.op == "call_function" and not inputs
                                     and node.users and _repeatable(node)):
            free.add(node)
        earliest[node] = index[node.target] if node.op == "call_module" and \
            node.target in index else max((earliest[n] for n in inputs), default=0)
    where: Dict[fx.Node, int] = {}
    for node in reversed(nodes):
        if node in free or node is output:
            continue
        if node.op == "call_module" and node.target in index:
            where[node] = index[node.target]
        elif node.op == "placeholder" or node.target == "_guards_fn":
            where[node] = 0
        else:
            users = [last if u is output else where[u] for u in node.users if u not in free]
            where[node] = min(users) if users else _check_place(node, earliest, where, free)
    for node in nodes:  # a unit's output plumbing (and its sizes' check) stays in its layer
        if node.op == "call_function" and node.target in (*_FLAT, operator.getitem):
            source = node.args[0]
            if isinstance(source, fx.Node) and source in where and (
                    source.op == "call_module" and source.target in index
                    or source.target in _FLAT):
                where[node] = where[source]
    for node, layer in where.items():
        if layer < earliest[node]:
            raise ConversionError(
                f"the traced glue computes {node.name} from unit {units[earliest[node]]!r} "
                f"before that unit runs; the units' call order is not a pipeline order")
    layers = [Layer(unit) for unit in units]
    guards = [n for n in nodes if n.op == "call_module" and n.target == "_guards_fn"]
    layers[0].nodes.extend(guards)  # export's input checks, before anything reads an input
    for node in nodes:
        if node in where and node not in guards:
            layers[where[node]].nodes.append(node)
    results = list(output.args[0])
    _route(layers, [n for n in nodes if n in where], where, free, output, results)
    return Plan(layers, free, results)


def _check_place(node: fx.Node, earliest: Dict[fx.Node, int], where: Dict[fx.Node, int],
                 free: Set[fx.Node]) -> int:
    """The layer of a node nothing uses (a check: ``_assert_tensor_metadata`` of a buffer
    before ``.to(device)``): as soon as its computed inputs exist, and not before the first
    layer that uses its attribute inputs otherwise, so a buffer the glue reads at the
    end (BART's ``final_logits_bias``) is not pulled into the first layer too (a tie
    across stages, on another device)."""
    def uses(value: fx.Node) -> List[int]:  # through attribute reads and their copies
        return [i for u in value.users if u is not node
                for i in (uses(u) if u in free else [where[u]] if u in where else [])]

    first = [i for f in node.all_input_nodes if f in free for i in uses(f)]
    return max(earliest[node], min(first, default=0))


def _repeatable(node: fx.Node) -> bool:
    """Whether computing ``node`` again gives the same value and changes nothing (no
    random numbers, no in-place update), so each layer may compute its own copy."""
    target = node.target
    schema = getattr(target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return False
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded not in tags


def _route(layers: List[Layer], computed: List[fx.Node], where: Dict[fx.Node, int],
           free: Set[fx.Node], output: fx.Node, results: List[object]) -> None:
    """Fill the layers' inputs, outputs, stashes and pops (see the module doc)."""
    last = len(layers) - 1
    carried: List[List[fx.Node]] = [[] for _ in layers]  # handed from layer s to s + 1
    skips: List[Tuple[int, int, fx.Node]] = []
    for node in computed:
        source = where[node]
        used = {last if u is output else where[u] for u in node.users if u not in free}
        _hop(source, sorted(used - {source}), node, carried, skips)
    for s in range(last):  # every layer hands at least one tensor to the next
        if not any(_is_tensor(n) for n in carried[s]):
            ahead = sorted((d, n) for (src, d, n) in skips if src == s)
            if not ahead:
                raise ConversionError(
                    f"layer {s} (unit {layers[s].unit!r}) hands no tensor to the next layer: "
                    f"nothing it computes is used later. Merge it with a neighbour (units="
                    f"naming their parent) or write the nn.Sequential by hand")
            d, node = ahead[0]
            skips.remove((s, d, node))
            for t in range(s, d):
                carried[t].append(node)
    layers[0].inputs = [n for n in computed if n.op == "placeholder"]
    for s in range(last):
        layers[s].outputs = list(dict.fromkeys(carried[s]))
        layers[s + 1].inputs = layers[s].outputs
    layers[last].outputs = results
    for src, dst, node in sorted(skips, key=lambda t: (t[0], t[1], t[2].name)):
        name = f"{node.name}>{dst}"
        layers[src].stashes.append((name, node))
        layers[dst].pops.append((name, node))


def _hop(source: int, consumers: List[int], node: fx.Node, carried: List[List[fx.Node]],
         skips: List[Tuple[int, int, fx.Node]]) -> None:
    if not _is_tensor(node):  # not a skip: it rides through every layer in between
        for t in range(source, max(consumers, default=source)):
            carried[t].append(node)
        return
    for dst in consumers:  # a tensor goes straight from its layer to each that uses it
        if dst == source + 1:
            carried[source].append(node)
        else:
            skips.append((source, dst, node))
