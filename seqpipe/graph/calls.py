"""Which units a model's forward calls, how often and in what order: one dry run.

Before tracing, ``to_sequential`` runs the model once on the example with fake tensors
(``FakeTensorMode``: shapes, no data, as ``torch.export`` runs it), with global module
hooks counting the units' calls. The run computes and changes nothing (BatchNorm
statistics, the RNG state), takes the branches the trace will take (Hugging Face skips
its mask shortcut, which reads tensor values, when tracing), and works for a model built
on the ``meta`` device. A failure is explained like a failure to trace. The
counts decide what becomes a layer: a unit runs exactly once per forward; a module
without state called several times (one ``nn.ReLU`` reused) is traced as glue instead,
and one with parameters called twice is refused, since its parameters cannot sit at two
places of a pipeline.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Tuple

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)

from seqpipe.graph.errors import MEND, ConversionError, explain

__all__ = ["call_order", "dry_run", "module_stack", "is_stateful"]


def is_stateful(module: nn.Module) -> bool:
    """Whether tracing ``module`` into glue would change what it does: it holds parameters
    or buffers of the state dict, or it behaves differently in train and eval mode in a way
    the glue cannot follow (batch norm). (Dropout in the glue follows the mode:
    ``seqpipe.graph.mode``; so a dropout module called twice, like T5's, is glue. Buffers
    kept out of the state dict, like a rotary embedding's tables computed in ``__init__``,
    are constants the glue reads; Gemma 3 calls its rotary embedding once per attention
    type. A glue that writes such a buffer is refused by ``to_sequential``.)"""
    if next(module.parameters(), None) is not None:
        return True
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()):
        return True
    return any(buffer is not None and key not in m._non_persistent_buffers_set
               for m in module.modules() for key, buffer in m._buffers.items())


@contextlib.contextmanager
def module_stack(model: nn.Module) -> Iterator[List[str]]:
    """A list kept equal to the qualified names of the modules of ``model`` whose forward
    is running (outermost first) while the block runs: a failure names the innermost."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    stack: List[str] = []

    def pre(module: nn.Module, args: Any) -> None:
        name = names.get(id(module))
        if name is not None:
            stack.append(name)

    def post(module: nn.Module, args: Any, output: Any) -> None:
        if names.get(id(module)) is not None and stack:
            stack.pop()

    handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
    try:
        yield stack
    finally:
        for handle in handles:
            handle.remove()


def dry_run(model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """Run ``model`` on the example with fake tensors (shapes, dtypes and devices, no data),
    as ``torch.export`` will: the same branches are taken, nothing real is computed or
    changed (BatchNorm statistics, the RNG), and a model built on ``meta`` runs too."""
    # static shapes: cheap (about as fast as an eager run of a small model); the shape
    # environment still turns a read of tensor values into a data-dependent error
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True)
    state = {name: mode.from_tensor(tensor) for name, tensor in
             (*model.named_parameters(remove_duplicate=False),
              *model.named_buffers(remove_duplicate=False))}
    fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
    with mode, torch.no_grad(), torch.random.fork_rng(devices=[]):
        functional_call(model, state, fake_args, fake_kwargs, tie_weights=True, strict=False)


def call_order(model: nn.Module, units: Dict[str, nn.Module], args: Tuple[Any, ...],
               kwargs: Dict[str, Any], explicit: bool) -> List[str]:
    """The units the forward calls, in the order of their (only) call.

    Default units (``explicit`` False) that are never called are left out, and stateless
    ones called several times become glue; otherwise a unit called twice is a
    ``ConversionError`` naming it, and so is an explicit unit never called.
    """
    counts: Dict[str, int] = {name: 0 for name in units}
    order: List[str] = []
    ids = {id(m): n for n, m in units.items()}

    def pre(module: nn.Module, _: Any) -> None:
        name = ids.get(id(module))
        if name is not None:
            counts[name] += 1
            order.append(name)

    handle = register_module_forward_pre_hook(pre)
    try:
        with module_stack(model) as stack:
            try:
                dry_run(model, args, kwargs)
            except ConversionError:  # an opaque unit's own refusal: already explained
                raise
            except Exception as exc:  # noqa: BLE001 - re-raised naming the module and line
                raise explain(exc, list(stack), units) from exc
    finally:
        handle.remove()
    kept: List[str] = []
    for name in dict.fromkeys(order):
        if counts[name] == 1:
            kept.append(name)
        elif explicit or is_stateful(units[name]):
            raise ConversionError(
                f"unit {name!r} ({type(units[name]).__name__}) is called {counts[name]} times "
                f"in one forward; a unit runs once, since its parameters and state sit at one "
                f"place of the pipeline. Make the module that calls it twice the unit "
                f"(units=[...] naming the parent), or give each call its own module object; "
                f"or write the nn.Sequential by hand")
    if explicit:
        missing = [n for n in units if counts[n] == 0]
        if missing:
            raise ConversionError(f"units {missing} are never called by the model's forward "
                                  f"on the example input; leave them out of units=")
    if not kept:
        raise ConversionError("the model's forward calls none of its units; " + MEND)
    return kept
