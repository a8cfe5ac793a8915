"""Trace a model with its units kept as calls of the user's own module objects.

``torch.export.export(strict=False)`` traces the whole forward into an ATen graph while
``preserve_module_call_signature`` records how each unit was called (its inputs and
outputs in the graph, and the structure of its arguments). Each unit's region of the
graph is then replaced by one ``call_module`` node that calls the user's module object
with those arguments, eagerly, so only the glue between units stays traced. (``torch.fx``
symbolic tracing was tried first: it cannot trace Hugging Face models, whose glue
branches on shapes and takes ``**kwargs``; export handles both, with shapes symbolic.)

The batch dimension (dim 0 of every tensor input) is dynamic by default, so one trace
serves every batch and micro-batch size; other dimensions are fixed unless the caller
passes ``dynamic_shapes`` (``torch.export``'s own argument, e.g. the sequence length).
"""
from __future__ import annotations

import contextlib
import inspect
import operator
import warnings
from dataclasses import dataclass
from typing import Any, Collection, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree
from torch import nn
from torch.export import Dim, export
from torch.export.exported_program import ModuleCallSignature
from torch.export.graph_signature import ConstantArgument
from torch.fx.passes.tools_common import legalize_graph

from seqpipe.graph.calls import module_stack
from seqpipe.graph.errors import MEND, ConversionError, explain
from seqpipe.graph.opaque_check import check_outputs, output_plan

__all__ = ["Traced", "trace"]


@dataclass
class Traced:
    """A flat graph of glue and unit calls, and how to feed it and read its output."""

    graph_module: fx.GraphModule  # placeholders: the flat input leaves; units: call_module
    in_spec: pytree.TreeSpec  # of (args, kwargs)
    out_spec: pytree.TreeSpec  # of the model's output
    units: List[str]  # in the order the forward calls them
    device: torch.device  # of the example's tensors: device constants written in the glue


def default_dynamic_shapes(model: nn.Module, args: Tuple[Any, ...],
                           kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Dim 0 of every tensor input dynamic (``Dim.AUTO``), keyed like ``export`` wants."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs)

    def spec(value: Any) -> Any:
        return {0: Dim.AUTO} if isinstance(value, torch.Tensor) and value.dim() > 0 else None

    return {name: pytree.tree_map(spec, value) for name, value in bound.arguments.items()}


def trace(model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
          units: Dict[str, nn.Module], order: Sequence[str],
          dynamic_shapes: Optional[Any], opaque: Collection[str] = ()) -> Traced:
    """Export ``model`` on the example and swap its units back in (see the module doc);
    the outputs of each unit in ``opaque`` are checked when it runs."""
    if dynamic_shapes is None:
        dynamic_shapes = default_dynamic_shapes(model, args, kwargs)
    with module_stack(model) as stack, _texts_as_constants([units[n] for n in order]):
        try:
            program = export(model, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes,
                             preserve_module_call_signature=tuple(order))
        except ConversionError:  # an opaque unit's own refusal: already explained
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised as a ConversionError naming the place
            raise explain(exc, list(stack), units) from exc
    signatures = {e.fqn: e.signature for e in program.module_call_graph if e.signature}
    gm = program.module()
    assert isinstance(gm, fx.GraphModule)
    gm.graph._codegen = fx.graph.CodeGen()  # flat leaves in, flat leaves out
    # a unit's input that only its shape is read of (BART's ``embed_positions(
    # inputs_embeds[:, :, -1])``) has no user in the graph, yet the unit is called with it
    needed = {arg.name for sig in signatures.values() for arg in sig.inputs
              if not isinstance(arg, ConstantArgument)}
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.name in needed or n.is_impure())
    with warnings.catch_warnings():  # get_attr of a pytree spec: a plain attribute, on purpose
        warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node")
        renamed: Dict[str, fx.Node] = {}
        for name in order:
            _swap(gm, name, units[name], signatures[name], renamed, name in opaque)
    _drop_unused(gm.graph)
    if isinstance(getattr(gm, _GUARDS, None), nn.Module):
        setattr(gm, _GUARDS, InputGuards(getattr(gm, _GUARDS)))
    legalize_graph(gm)
    gm.recompile()
    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    device = leaves[0].device if leaves else torch.device("cpu")
    return Traced(gm, program.call_spec.in_spec, program.call_spec.out_spec, list(order),
                  device)


class Text(str):
    """A string a unit is called with (Gemma 3's ``rotary_emb(x, ids, "sliding_attention")``),
    carried in the structure of the unit's call (a pytree constant) rather than as one of
    its flat inputs: export's record of a call takes tensors and numbers there, and fails
    on a string. The unit's forward sees a ``str``."""


pytree.register_constant(Text)


@contextlib.contextmanager
def _texts_as_constants(units: Sequence[nn.Module]) -> Iterator[None]:
    """While the block runs, the strings each unit is called with are ``Text``s (a forward
    pre-hook, registered before export registers its own)."""
    def pre(module: nn.Module, args: Any, kwargs: Any) -> Any:
        return pytree.tree_map(lambda v: Text(v) if type(v) is str else v, (args, kwargs))

    handles = [unit.register_forward_pre_hook(pre, with_kwargs=True) for unit in units]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _swap(gm: fx.GraphModule, name: str, module: nn.Module,
          signature: ModuleCallSignature, renamed: Dict[str, fx.Node], opaque: bool) -> None:
    """Replace unit ``name``'s traced region of ``gm`` by a call of ``module`` itself;
    ``renamed`` maps the names of earlier units' replaced outputs to what replaced them;
    an ``opaque`` unit's call is followed by the check of its outputs."""
    graph = gm.graph
    nodes = [n for n in graph.nodes if _innermost_unit(n, name)]
    by_name = {n.name: n for n in graph.nodes}
    by_name.update(renamed)
    leaves: List[Any] = []
    for arg in signature.inputs:
        if isinstance(arg, ConstantArgument):
            leaves.append(arg.value)
        elif arg.name in by_name:
            leaves.append(by_name[arg.name])
        else:
            raise ConversionError(f"the trace lost input {arg.name} of unit {name!r}; "
                                  + MEND)
    args_spec, kwargs_spec = signature.in_spec.children()
    spec_name = _add_attr(gm, f"_spec_in_{name}", signature.in_spec)
    unflat = graph.call_function(pytree.tree_unflatten, (leaves, graph.get_attr(spec_name)))
    args_node = graph.call_function(operator.getitem, (unflat, 0))
    kwargs_node = graph.call_function(operator.getitem, (unflat, 1))
    call_args = tuple(graph.call_function(operator.getitem, (args_node, i))
                      for i in range(args_spec.num_children))
    call_kwargs = {k: graph.call_function(operator.getitem, (kwargs_node, k))
                   for k in kwargs_spec.context}
    _set_submodule(gm, name, module)
    call = graph.call_module(name, call_args, call_kwargs)
    out_name = _add_attr(gm, f"_spec_out_{name}", signature.out_spec)
    flat = graph.call_function(fx_pytree.tree_flatten_spec, (call, graph.get_attr(out_name)))
    outputs = {arg.name: i for i, arg in enumerate(signature.outputs)
               if not isinstance(arg, ConstantArgument)}
    if opaque:  # its outputs were learned by running it: checked at run time
        traced = {outputs[n.name]: n.meta.get("val") for n in nodes if n.name in outputs}
        constants = {i: arg.value for i, arg in enumerate(signature.outputs)
                     if isinstance(arg, ConstantArgument)}
        plan = output_plan([v.meta.get("val") if isinstance(v, fx.Node) else v
                            for v in leaves], traced, constants)
        flat = graph.call_function(check_outputs, (flat, list(leaves), plan, name))
    inside = set(nodes)
    for node in nodes:
        if node.name in outputs:
            piece = graph.call_function(operator.getitem, (flat, outputs[node.name]))
            node.replace_all_uses_with(piece)
            piece.meta = _call_site_meta(node, name)
            renamed[node.name] = piece
        elif any(user not in inside for user in node.users):
            copy = _size_outside(graph, node, inside, name, {})
            if copy is not None:  # a size export shares with a later unit: its own copy
                node.replace_all_uses_with(copy, delete_user_cb=lambda u: u not in inside)
                continue
            raise ConversionError(
                f"the glue after unit {name!r} uses a value computed inside it that the unit "
                f"does not return ({node.name}); a unit must hand on everything others use "
                f"through its outputs. " + MEND)
    for node in reversed(nodes):
        graph.erase_node(node)


_SIZES = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


def _is_size(node: fx.Node) -> bool:
    """A number computed from numbers (sizes): ``16 * s0``, ``x.size(0)``."""
    return node.op == "call_function" and isinstance(node.meta.get("val"), _SIZES)


def _size_outside(graph: fx.Graph, node: fx.Node, inside: Set[fx.Node], name: str,
                  copies: Dict[fx.Node, fx.Node]) -> Optional[fx.Node]:
    """A copy of ``node`` that does not lie in unit ``name``'s region, or None when it is
    not a size computed from sizes. Export computes one symbolic expression once and hands
    it to every later place that computes it too (Mixtral's experts: ``16 * batch`` in
    each layer), so a unit's region may compute a size that a later unit reads; that unit
    gets its own copy, computed from what the first one read."""
    if node not in inside:
        return node
    if node in copies:
        return copies[node]
    if not _is_size(node):
        return None
    sources = {}
    for source in node.all_input_nodes:
        copied = _size_outside(graph, source, inside, name, copies)
        if copied is None:
            return None
        sources[source] = copied
    with graph.inserting_after(node):
        copy = graph.node_copy(node, lambda n: sources[n])
    copy.meta = _call_site_meta(node, name)
    copies[node] = copy
    return copy


_GUARDS = "_guards_fn"  # export's check of the inputs against the trace's assumptions


class InputGuards(nn.Module):
    """Export's input checks, failing with the mend: a ``ValueError`` instead of an
    ``AssertionError`` deep in the glue (the first layer runs it before anything else)."""

    def __init__(self, check: nn.Module) -> None:
        super().__init__()
        self.check = check

    def forward(self, *args: Any) -> None:
        try:
            self.check(*args)
        except AssertionError as exc:
            raise ValueError(
                f"the input does not fit the traced model ({exc}): a size other than the "
                f"batch was fixed when tracing; declare it dynamic with to_sequential(..., "
                f"dynamic_shapes=...), or convert again with an example of this size") from exc


_PURE = (operator.getitem, pytree.tree_unflatten, fx_pytree.tree_flatten_spec)


def _drop_unused(graph: fx.Graph) -> None:
    """Erase attribute reads and pytree plumbing nothing uses (the swapped units' weights,
    unused output pieces); unlike ``eliminate_dead_code`` this never drops a unit call."""
    for node in reversed(list(graph.nodes)):
        if not node.users and (node.op == "get_attr" or _is_size(node) or
                               (node.op == "call_function" and node.target in _PURE)):
            graph.erase_node(node)


def _call_site_meta(node: fx.Node, name: str) -> Dict[str, Any]:
    """The meta of a unit's output piece: ``node``'s value, but the module stack of the
    unit's call site. (``node`` was computed inside the unit, perhaps by a submodule such
    as its last LayerNorm; the piece is read by the glue, which must not be taken for
    work of that submodule.)"""
    stack: Dict[str, Any] = {}
    for key, (path, kind) in (node.meta.get("nn_module_stack") or {}).items():
        if path == name:
            break
        stack[key] = (path, kind)
    return {"val": node.meta.get("val"), "nn_module_stack": stack}


def _innermost_unit(node: fx.Node, name: str) -> bool:
    stack = node.meta.get("nn_module_stack")
    return bool(stack) and any(path == name for path, _ in stack.values())


def _add_attr(gm: fx.GraphModule, name: str, value: Any) -> str:
    attr = name.replace(".", "_")
    setattr(gm, attr, value)
    return attr


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at ``name`` in ``root``, replacing what export left there."""
    *parents, last = name.split(".")
    owner = root
    for part in parents:
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    owner.add_module(last, module)
