"""``to_sequential``: any model, as written, into the ``nn.Sequential`` seqpipe runs.

The steps, each in its own module: choose the units (``units``), run the model once to
learn which units it calls and in what order (``calls``), trace it with the units kept
as calls of the user's objects (``trace``; a unit the trace cannot enter is made opaque and
the two steps run again: ``opaque``), refuse glue that would silently change
behaviour, cut the graph at the units and route the values between them (``cut``), and
build one layer per unit (``unit``). See ``docs/models.md``.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from seqpipe.core.own_hooks import call_hooks_of
from seqpipe.distributed.ties import canonical_names
from seqpipe.graph.calls import call_order, is_stateful
from seqpipe.graph.cut import plan_layers
from seqpipe.graph.errors import ConversionError, UntracedUnit, quiet_kernel_log
from seqpipe.graph.mode import FOLLOWS_MODE, REFUSED_MODE_OPS, TorchCalls, mode_dependent
from seqpipe.graph.opaque import CHOSEN, Opaque, choose_opaque, stand_ins
from seqpipe.graph.origin import Origin
from seqpipe.graph.trace import trace
from seqpipe.graph.unit import build_unit
from seqpipe.graph.units import check_units
from seqpipe.skip import Namespace

__all__ = ["ConvertedSequential", "to_sequential"]


class ConvertedSequential(nn.Sequential):
    """The ``nn.Sequential`` of units ``to_sequential`` returns.

    Everything that takes an ``nn.Sequential`` takes it: ``Pipe``, ``DistributedPipe``,
    the balance helpers, ``checkpoint_every``. Its layers take and return the flat values
    of the trace; called itself, it takes the model's own arguments and returns the
    model's own output structure. ``origin`` converts between the two.
    """

    origin: Origin

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """The model's forward: ``seq(input_ids, attention_mask=mask)`` as ``model(...)``."""
        value: Any = self.origin.pipeline_input(*args, **kwargs)
        value = value[0] if len(value) == 1 else value
        for layer in self:
            value = layer(value)
        return self.origin.rebuild(value)


def to_sequential(model: nn.Module, example_args: Any = (),
                  example_kwargs: Optional[Mapping[str, Any]] = None, *,
                  units: Optional[Sequence[str]] = None,
                  dynamic_shapes: Optional[Any] = None,
                  opaque: Sequence[Union[str, type]] = ()) -> ConvertedSequential:
    """Convert ``model`` into an ``nn.Sequential`` with one layer per unit.

    Args:
        model: any ``nn.Module``; it is not copied: the layers hold its very module,
            parameter and buffer objects, so its own ``state_dict()``, optimizer and hooks
            keep working, and ``model.train()``/``eval()`` reach the layers too.
        example_args: the positional arguments of one call of ``model`` (a tensor or a
            tuple), with a batch of at least 2 on dim 0 of every tensor. For a model built
            on the ``meta`` device only their shapes count (real tensors are fine).
        example_kwargs: its keyword arguments. Non-tensor values (``use_cache=False``)
            are fixed by the trace.
        units: fully qualified names of the modules that become layers, in any order;
            default: the top-level children, descending into ``ModuleList`` /
            ``Sequential`` / ``ModuleDict`` trunks (see ``seqpipe.graph.units``).
        dynamic_shapes: ``torch.export``'s argument for dimensions besides the batch
            (e.g. a sequence length); default: dim 0 of every tensor input is dynamic.
        opaque: units to run opaque without trying to trace them (a unit whose trace is
            slow or wrong): unit names, and ``nn.Module`` classes (every unit that is one).

    Returns:
        A ``ConvertedSequential``. Feed a pipeline ``seq.origin.pipeline_input(*args,
        **kwargs)``; read its output with ``seq.origin.rebuild(out)`` (``Pipe.forward`` and
        ``DistributedPipe.forward`` already return the model's structure).

    A unit whose code the trace cannot enter (an op without a fake kernel for the dtype,
    a branch on tensor values) is made opaque, with the units of its class, and so is each
    unit ``opaque`` names: traced as one call of the user's module, its outputs learned by
    running it on zeros (``seqpipe.graph.opaque``) and checked at every call; its layer's
    ``opaque`` is True.

    Raises:
        ConversionError: a part of the model cannot be traced or cut; the message names
            the module, unit or line and the mend.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"to_sequential converts an nn.Module, got {type(model).__name__}")
    args: Tuple[Any, ...] = example_args if isinstance(example_args, tuple) else (example_args,)
    kwargs: Dict[str, Any] = dict(example_kwargs or {})
    _check_batch(args, kwargs, dynamic_shapes)
    # fresh tensors: export would guard on an example that is a view (``x[:, :-1]``)
    # being one, and every input after it would fail that guard
    args, kwargs = pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        # built on meta (each stage materialises its own layers, see DistributedPipe's
        # base_seed): tracing needs shapes alone, and the glue's device constants then
        # follow each layer's input device like any traced device
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"),
                                            (args, kwargs))
        _warn_unloadable(model)
    found = check_units(model, units)
    _check_glue_hooks(model, list(found.values()))  # before anything runs them
    dark = Opaque()
    chosen = choose_opaque(found, opaque)
    for name in chosen:
        dark.add(name, found[name], CHOSEN)
    while True:  # a unit the trace cannot enter becomes opaque, and the trace starts again
        try:
            with stand_ins(found, dark), quiet_kernel_log():
                with TorchCalls(model) as calls:
                    order = call_order(model, found, args, kwargs, explicit=units is not None)
                _check_chosen(chosen, order)
                by_mode = mode_dependent(model, {n: found[n] for n in order}, args, kwargs,
                                         calls.calls)
                traced = trace(model, args, kwargs, found, order, dynamic_shapes,
                               dark.reasons)
            break
        except UntracedUnit as exc:
            if exc.unit in dark:
                raise
            kind = type(found[exc.unit])  # its siblings run the same code: opaque at once
            for name, module in found.items():
                if type(module) is kind and name not in dark:
                    dark.add(name, module, exc.reason)
    _check_glue(traced.graph_module, model, set(order))
    plan = plan_layers(traced.graph_module.graph, traced.units)
    ns = Namespace()
    persistent = set(model.state_dict().keys())
    layers = [build_unit(i, layer, traced.graph_module, plan.free, traced.device, ns,
                         persistent, layer.unit in dark) for i, layer in enumerate(plan.layers)]
    _own_tables(layers, model, persistent)
    if by_mode:  # its glue branches on training: each layer runs in this mode only
        for layer in layers:
            layer.traced_mode = (found[layer.unit].training, layer.unit, type(model).__name__)
    seq = ConvertedSequential(*layers)
    flat = pytree.tree_leaves((args, kwargs))
    seq.origin = Origin(type(model).__name__, traced.in_spec, traced.out_spec,
                        {i: v for i, v in enumerate(flat) if not isinstance(v, torch.Tensor)},
                        canonical_names(model))
    return seq


def _check_chosen(chosen: Sequence[str], order: Sequence[str]) -> None:
    """Refuse an ``opaque=`` unit that is no layer: a default unit without state that the
    forward calls several times is traced as glue, which an opaque call cannot be."""
    glue = [name for name in chosen if name not in order]
    if glue:
        raise ConversionError(
            f"opaque= names {glue}, which the forward on the example does not call exactly "
            f"once: such a unit is traced as glue (called several times, it has no state) or "
            f"not at all, and an opaque unit must be a layer of its own; leave it out of "
            f"opaque=, or make the module that calls it the unit (units=[...])")


def _own_tables(layers: Sequence[nn.Module], model: nn.Module, persistent: Set[str]) -> None:
    """A constant table the glue of several layers reads (a non-persistent buffer of a
    module traced into the glue, which the glue never writes: ``_check_glue``) is copied
    into each layer after the first that reads it, so that no buffer is shared by layers
    that may sit on different stages (``DistributedPipe`` refuses a shared buffer: it
    cannot keep a written one in step across ranks; a constant needs no keeping)."""
    theirs = {id(m) for m in model.modules()}  # a unit's own buffers stay the model's
    seen: Set[int] = set()
    for layer in layers:
        for path, module in layer.named_modules():
            if id(module) in theirs:
                continue
            for key, buffer in list(module._buffers.items()):
                name = f"{path}.{key}" if path else key
                if buffer is None or name in persistent:
                    continue
                if id(buffer) in seen:
                    module._buffers[key] = buffer.clone()
                seen.add(id(buffer))


def _warn_unloadable(model: nn.Module) -> None:
    """Warn of buffers on ``meta`` that no checkpoint restores: non-persistent ones (a
    rotary embedding's ``inv_freq``, computed in ``__init__``) are not in ``state_dict()``,
    so after materialising they hold arbitrary values however the weights are loaded."""
    persistent = set(model.state_dict().keys())
    lost = [name for name, buffer in model.named_buffers()
            if buffer.is_meta and name not in persistent]
    if lost:
        owners = sorted({name.rpartition(".")[0] or "the model" for name in lost})
        warnings.warn(
            f"{type(model).__name__} is built on meta with non-persistent buffers {lost}: no "
            f"checkpoint holds them (they are not in state_dict()) and no reset_parameters() "
            f"computes them, so once materialised they hold arbitrary values and the model "
            f"computes garbage. Build the modules that own them ({', '.join(owners)}) on a "
            f"real device before converting (e.g. model.model.rotary_emb = "
            f"LlamaRotaryEmbedding(config) outside the meta context): a layer whose tensors "
            f"are real is moved, never re-initialised; or set the buffers after "
            f"materialising", stacklevel=3)


def _check_batch(args: Tuple[Any, ...], kwargs: Dict[str, Any],
                 dynamic_shapes: Optional[Any]) -> None:
    tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if not tensors:
        raise ConversionError("the example has no tensor; a pipeline cuts its input tensors "
                              "into micro-batches, so pass at least one")
    small = [tuple(t.shape) for t in tensors if t.dim() == 0 or t.shape[0] < 2]
    if small and dynamic_shapes is None:
        raise ConversionError(
            f"example tensors of shapes {small} have a batch (dim 0) smaller than 2; the "
            f"batch dimension is traced as dynamic, which needs an example batch of at "
            f"least 2 (torch.export fixes sizes 0 and 1). Use a bigger example batch")


def _check_glue(gm: fx.GraphModule, model: nn.Module, units: set) -> None:
    """Refuse glue that would freeze train/eval behaviour (dropout is not frozen: it
    follows the layer's unit, see ``seqpipe.graph.mode``) or take a stateful module's
    work out of the user's object: name the module and the mend."""
    modules = dict(model.named_modules(remove_duplicate=False))
    ancestors = {".".join(u.split(".")[:i]) for u in units for i in range(len(u.split(".")))}
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        path = list(stack.values())[-1][0] if stack else ""
        path = path if path in modules else ""  # export's own root entries
        owner = modules[path]
        op = str(node.target)
        if node.op == "call_function" and node.target not in FOLLOWS_MODE and \
                any(word in op for word in REFUSED_MODE_OPS):
            raise ConversionError(
                f"{_where(path)} calls {op} in the traced glue between units, whose "
                f"train/eval behaviour the trace would fix; make the module that calls it a "
                f"unit (units=[...]), or write the nn.Sequential by hand")
        written = _written_attribute(node)
        if written is not None:  # a table read as a constant must stay one
            raise ConversionError(
                f"{_where(path)} writes {written!r} in the traced glue between units (an "
                f"in-place {op}), which would run once per layer that computes it, and again "
                f"when recomputed; make the module that writes it a unit (units=[...]), or "
                f"write the nn.Sequential by hand")
        if path and path not in ancestors and is_stateful(owner) and path not in units:
            raise ConversionError(
                f"module {path!r} ({type(owner).__name__}) holds parameters, buffers or "
                f"train/eval behaviour but is not inside a unit, so the trace would take its "
                f"work out of your module object; add it to units=[...] (or its parent)")


def _check_glue_hooks(model: nn.Module, units: Sequence[nn.Module]) -> None:
    """Refuse a forward or backward hook on a module whose forward is traced into the glue
    (the model itself, a container above the units): the trace ran it at conversion only,
    and kept what it changed in every call, removed or not (a logging hook never ran again,
    an output hook stayed after ``handle.remove()``)."""
    inside = {id(m) for unit in units for m in unit.modules()}
    for path, module in model.named_modules():
        if id(module) in inside:
            continue
        found = call_hooks_of(module)
        if found:
            who = f"module {path!r}" if path else "the model itself"
            raise ConversionError(
                f"{who} ({type(module).__name__}) has {', '.join(found)}, and its forward is "
                f"traced into the glue between units: the hook would run at conversion only, "
                f"and what it changed would stay in every call (even once it is removed). "
                f"Remove it before converting (handle.remove()) and register it on a unit "
                f"(units run eagerly, hooks included), or on the converted model, or on its "
                f"Pipe, which run it once per call on the whole batch")


def _written_attribute(node: fx.Node) -> Optional[str]:
    """The parameter or buffer an in-place op of the glue writes (through views), if any."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.is_mutable:
        return None
    source = node.args[0] if node.args else None
    while isinstance(source, fx.Node) and source.op == "call_function" and source.args \
            and _is_view(source):
        source = source.args[0]  # back through views (``buffer[0].add_(1)``)
    if isinstance(source, fx.Node) and source.op == "get_attr":
        return str(source.target)
    return None


def _is_view(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and bool(schema.returns) and \
        schema.returns[0].alias_info is not None


def _where(path: str) -> str:
    return f"module {path!r}" if path else "the model's own forward"
