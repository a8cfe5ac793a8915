"""``Unit``: one layer of a converted model — the glue its unit needs, then the unit.

A ``Unit`` holds the user's own module object (and any weight the glue reads) at its
original path, so its ``state_dict()`` keys are the model's own (``"transformer.h.0.
attn.c_attn.weight"``), and the converted ``nn.Sequential``'s are those behind the
layer's index. Its ``forward`` is seqpipe-skippable: it pops the values that skip to it,
runs its generated code, stashes the values that skip ahead, and returns the values the
next layer needs (one tensor alone, several as a tuple). The code is generated once
(``torch.fx``), not interpreted, so a layer costs its unit plus a few Python calls.

A device written into the traced glue (``arange(..., device="cpu")``) is replaced by the
device of the layer's first tensor input, so a layer placed on another device computes
its constants there. Dropout in the glue reads the training flag of the layer's unit when
it runs (``seqpipe.graph.mode``).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
import torch.fx as fx
from torch import nn

from seqpipe.graph.cut import Layer
from seqpipe.graph.mode import FOLLOWS_MODE, MODE_ARG, check_mode
from seqpipe.skip import Namespace, pop, skippable, stash

__all__ = ["Unit", "build_unit"]


class Unit(nn.Module):
    """One layer of a converted model (see the module doc); built by ``to_sequential``."""

    stash_order: Tuple[str, ...] = ()
    pop_order: Tuple[str, ...] = ()
    # set where the model's glue branches on ``training``: (the unit's mode at conversion,
    # its name, the model's class); then the layer runs in that mode only (graph.mode)
    traced_mode: Optional[Tuple[bool, str, str]] = None

    def __init__(self, unit: str, opaque: bool = False) -> None:
        super().__init__()
        self.unit = unit
        self.opaque = opaque  # traced as one call, never entered (``seqpipe.graph.opaque``)
        self._code: Callable[..., Tuple[Any, ...]] = _nothing  # generated: (self, *values)
        self._outputs = 0
        self._inputs = 0

    def forward(self, input: Any) -> Iterator[Any]:
        if self.traced_mode is not None:
            check_mode(self.get_submodule(self.unit), self.traced_mode)
        items = input if isinstance(input, tuple) else (input,)
        if len(items) != self._inputs:
            raise TypeError(_arity(self, len(items)))
        popped = []
        for name in self.pop_order:
            popped.append((yield pop(name)))
        try:
            results = self._code(self, *items, *popped)
        except RuntimeError as exc:  # export's dtype check in the glue: the model was cast
            if str(exc).startswith(_DTYPE_CHECK):
                exc.add_note(_DTYPE_MEND)
            raise
        outs = results[:self._outputs]
        for name, value in zip(self.stash_order, results[self._outputs:]):
            yield stash(name, value)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def extra_repr(self) -> str:
        return f"unit={self.unit!r}" + (", opaque" if self.opaque else "")


def _nothing(self: nn.Module, *args: Any) -> Tuple[Any, ...]:
    return ()


# the message of ``aten._assert_tensor_metadata``, which export puts before a ``.to(dtype)``
_DTYPE_CHECK = "Tensor dtype mismatch!"
_DTYPE_MEND = (
    "seqpipe: the glue between units (the code of the model's own forward) was traced with "
    "the dtypes of the conversion, which are fixed like the sizes; the model or its input "
    "now has another dtype (model.to(torch.bfloat16), pipe.half() after converting). Convert "
    "the model in the dtype it runs in: cast it first, then seqpipe.to_sequential(model, "
    "...)")


def _arity(unit: Unit, given: int) -> str:
    """What is wrong when ``unit`` is handed ``given`` values: for the first layer, the
    model's own arguments instead of the pipeline's flat input (``pipe(ids)``)."""
    return (f"layer {type(unit).__name__} (unit {unit.unit!r}) of a model converted by "
            f"seqpipe.to_sequential takes {unit._inputs} values, got {given}. A pipeline of a "
            f"converted model takes the flat tuple that seq.origin.pipeline_input(*args, "
            f"**kwargs) makes from the model's own arguments, by the names of the example "
            f"(pipe(seq.origin.pipeline_input(ids, attention_mask=mask, use_cache=False))); "
            f"calling seq itself takes the model's arguments (seq(ids, attention_mask=mask, "
            f"use_cache=False))")


def build_unit(index: int, layer: Layer, root: fx.GraphModule, free: Set[fx.Node],
               device: torch.device, ns: Namespace, persistent: Set[str],
               opaque: bool = False) -> Unit:
    """The ``Unit`` for ``layer``: generate its code and adopt the objects it uses.

    ``persistent`` are the model's own ``state_dict()`` keys: a tensor the trace added
    (a constant of the glue) is kept out of the state dict.
    """
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    for node in layer.inputs:
        env[node] = graph.placeholder(f"in_{node.name}")
    for _, node in layer.pops:
        env[node] = graph.placeholder(f"pop_{node.name}")
    first_tensor = next((env[n] for n in [*layer.inputs, *(v for _, v in layer.pops)]
                         if isinstance(n.meta.get("val"), torch.Tensor)), None)
    place: List[fx.Node] = []

    def here() -> fx.Node:
        if not place:
            assert first_tensor is not None
            with graph.inserting_after(first_tensor):
                place.append(graph.call_function(getattr, (first_tensor, "device")))
        return place[0]

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:
            assert node in free, f"{node.name} is neither computed in nor handed to layer {index}"
            env[node] = copy(node)
        return env[node]

    def copy(node: fx.Node) -> fx.Node:
        new = graph.node_copy(node, lookup)
        if new.op == "call_function" and new.target in FOLLOWS_MODE:  # the unit's mode
            with graph.inserting_before(new):
                flag = graph.get_attr(f"{layer.unit}.training")
            args = list(new.args)
            args[MODE_ARG] = flag
            new.args = tuple(args)
        if first_tensor is not None:
            new.args = _devices(new.args, device, here)
            new.kwargs = _devices(new.kwargs, device, here)
        return new

    for node in layer.nodes:
        if node.op != "placeholder":
            env[node] = copy(node)
    outs = [lookup(v) if isinstance(v, fx.Node) else v for v in layer.outputs]
    stashed = [lookup(v) for _, v in layer.stashes]
    graph.output(tuple([*outs, *stashed]))
    code = fx.GraphModule(root, graph, class_name=f"Layer{index}")
    cls = skippable(stash=[n for n, _ in layer.stashes], pop=[n for n, _ in layer.pops])(
        type(f"Unit{index}", (Unit,), {"__module__": __name__}))
    cls.stash_order = tuple(n for n, _ in layer.stashes)
    cls.pop_order = tuple(n for n, _ in layer.pops)
    unit = cls(layer.unit, opaque)
    for attr in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"):
        setattr(unit, attr, getattr(code, attr))  # the objects the code reads, at their paths
    for node in graph.nodes:  # and the pytree specs it reads: constants of the class
        if node.op == "get_attr" and "." not in str(node.target):
            value = getattr(code, str(node.target))
            if not isinstance(value, (torch.Tensor, nn.Module)):
                setattr(cls, str(node.target), value)
    _hide_trace_tensors(unit, persistent)
    unit._code = type(code).forward  # a plain function of the unit: copies stay whole
    unit._outputs = len(outs)
    unit._inputs = len(layer.inputs)
    unit.isolate(ns)
    return unit


def _devices(value: Any, device: torch.device, here: Callable[[], fx.Node]) -> Any:
    """``value`` (node args) with the traced device replaced by the layer's own."""
    if isinstance(value, torch.device) and value == device:
        return here()
    if isinstance(value, tuple):
        return tuple(_devices(v, device, here) for v in value)
    if isinstance(value, list):
        return [_devices(v, device, here) for v in value]
    if isinstance(value, dict):
        return {k: _devices(v, device, here) for k, v in value.items()}
    return value


def _hide_trace_tensors(unit: nn.Module, persistent: Set[str]) -> None:
    """Mark buffers the trace introduced (not in the model's state dict) non-persistent."""
    for name, module in unit.named_modules():
        prefix = f"{name}." if name else ""
        for key in module._buffers:
            if f"{prefix}{key}" not in persistent:
                module._non_persistent_buffers_set.add(key)
