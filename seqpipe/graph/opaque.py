"""Opaque units: a unit the trace cannot enter runs as the user's module, traced as one call.

A unit runs eagerly in the converted model anyway; it is traced only so that the glue
after it knows its outputs (their structure, dtypes and sizes). When its code cannot be
traced (Mixtral's ``grouped_mm`` in float32, whose fake kernel takes bfloat16 only; a
branch on tensor values), ``to_sequential`` makes it **opaque** and traces again: during
the dry run and the export its ``forward`` is replaced by a stand-in that does not run
its code on fake tensors. The stand-in runs the user's module itself, eagerly, on zeros
of its inputs' sizes (no gradient, the RNG and its buffers restored), once at the
example's sizes (and once on seeded random values: the sizes must not change), once more
per symbolic size (each doubled), and answers with empty tensors whose sizes follow the
inputs' symbolic sizes: an output dimension equal to an input dimension at every probe
is that dimension (the batch stays dynamic), one that never changes is a constant.
This is ``torch.fx``'s leaf module, and ``torch.export``'s
``leaf_function`` with its fake implementation, learned from the module instead of
written by hand. Only the unit's call signature and its outputs enter the graph; its
region is then swapped for the call of the user's object like any unit's (``trace``).

What cannot be learned this way is refused naming the unit: an output size that is
neither constant nor equal to an input size (the mend: choose units whose outputs keep
their inputs' sizes), a module that fails on zeros, one built on ``meta`` (it cannot run).
An output size that depends on the inputs' values (rows a boolean mask picks) is refused
when a second run at the example's sizes, on seeded random values, gives other sizes.

Values that pick the same sizes in both runs slip through the conversion, so the converted
model checks at run time (``check_sizes``, put after each opaque call by ``trace``): each
tensor output must have the sizes inferred, evaluated on the call's actual input
sizes; else a ``ValueError`` names the unit, the output, both sizes and the mend, instead
of glue that computes with the inferred sizes (a mean divided by the batch, not by the
rows the unit kept) silently wrong, or fails somewhere after with no name. It reads a few
sizes: about a microsecond per call (``docs/models.md``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import sympy
import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.nn.modules import module as module_mod
from torch.nn.utils.stateless import _reparametrize_module
from torch.overrides import _len_torch_function_stack, _pop_mode, _push_mode
from torch.utils._python_dispatch import _disable_current_modes

from seqpipe.graph.errors import ConversionError

__all__ = ["Opaque", "check_sizes", "size_plan", "stand_ins"]


class Opaque:
    """The opaque units of one conversion, with the real tensors they run on and why each
    could not be traced (captured before tracing swaps fake tensors into the model)."""

    def __init__(self) -> None:
        self.reasons: Dict[str, str] = {}
        self.state: Dict[str, Dict[str, torch.Tensor]] = {}

    def add(self, name: str, module: nn.Module, reason: str) -> None:
        self.reasons[name] = reason
        self.state[name] = dict((*module.named_parameters(remove_duplicate=False),
                                 *module.named_buffers(remove_duplicate=False)))

    def __contains__(self, name: object) -> bool:
        return name in self.reasons


@contextlib.contextmanager
def stand_ins(units: Dict[str, nn.Module], opaque: Opaque) -> Iterator[None]:
    """While the block runs, each opaque unit's ``forward`` is its stand-in."""
    patched: List[Tuple[nn.Module, Any]] = []
    try:
        for name in opaque.reasons:
            module = units[name]
            patched.append((module, module.__dict__.get("forward")))
            module.forward = _stand_in(name, module, module.forward, opaque)  # type: ignore[method-assign]
        yield
    finally:
        for module, before in reversed(patched):
            if before is None:
                del module.forward
            else:
                module.forward = before


def _stand_in(name: str, module: nn.Module, forward: Callable[..., Any],
              opaque: Opaque) -> Callable[..., Any]:
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        flat, spec = pytree.tree_flatten((args, kwargs))
        base = {s: hint for x in flat for s, hint in _symbols(x).items()}
        if None in base.values():
            raise ConversionError(
                f"unit {name!r} cannot be traced ({opaque.reasons[name]}), and an input size "
                f"of it depends on tensor values, so its output sizes cannot be learned; "
                f"choose other units (units=[...]) or write the nn.Sequential by hand")

        def run(at: Dict[Any, int], noise: bool = False) -> List[Any]:
            return _probe(name, module, forward, opaque, flat, spec, at, noise)

        probes, runs = [base], [run(base)]
        try:
            noisy = run(base, noise=True)
        except ConversionError:  # fails on other values: this run cannot tell
            noisy = runs[0]
        _same_sizes(name, runs[0], noisy)
        pending = list(base)
        while pending:  # each symbolic size doubled, alone if the unit allows
            group = [pending.pop(0)]
            try:
                runs.append(run({**base, group[0]: 2 * base[group[0]]}))
            except ConversionError:
                # sizes the unit needs equal (a query and a key length, two symbols to
                # the trace): doubled together with the others of the same example size
                group += [s for s in pending if base[s] == base[group[0]]]
                if len(group) == 1:
                    raise
                pending = [s for s in pending if s not in group]
                runs.append(run({**base, **{s: 2 * base[s] for s in group}}))
            probes.append({**base, **{s: 2 * base[s] for s in group}})
        return _fake_outputs(name, flat, probes, runs)
    return stand_in


def _sizes(value: Any) -> Sequence[Any]:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    return (value,) if isinstance(value, torch.SymInt) else ()


def _symbols(value: Any) -> Dict[Any, Optional[int]]:
    """The symbols in ``value``'s sizes, each with its value in the example (its hint; None
    for a size that depends on tensor values)."""
    found: Dict[Any, Optional[int]] = {}
    for size in _sizes(value):
        if isinstance(size, torch.SymInt):
            hints = size.node.shape_env.backed_var_to_val
            for s in size.node.expr.free_symbols:
                found[s] = int(hints[s]) if s in hints else None
    return found


def _value(size: Any, at: Dict[Any, int]) -> int:
    """``size`` (an int or a symbolic size) with its symbols set to ``at``."""
    if isinstance(size, torch.SymInt):
        return int(size.node.expr.xreplace({s: sympy.Integer(v) for s, v in at.items()}))
    return int(size)


_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks",
          "_global_forward_hooks_always_called", "_global_forward_hooks_with_kwargs")


@contextlib.contextmanager
def _eager(device: Optional[torch.device]) -> Iterator[None]:
    """Real computation inside a trace that the trace never sees: no torch function or
    dispatch mode (fake tensors, the tracer), no global module hook (the dry run's call
    counts, ``module_stack``) and no patched ``nn.Module.__call__`` (export's module
    stack, which a probe that fails half-way would leave unbalanced) sees it; no gradient
    is recorded, and the RNG is left as it was."""
    modes = [_pop_mode() for _ in range(_len_torch_function_stack())]
    hooks = {name: dict(getattr(module_mod, name)) for name in _HOOKS}
    call = nn.Module.__call__
    try:
        for name in _HOOKS:
            getattr(module_mod, name).clear()
        nn.Module.__call__ = nn.Module._wrapped_call_impl  # type: ignore[method-assign]
        cuda = [device] if device is not None and device.type == "cuda" else []
        with _disable_current_modes(), torch.no_grad(), torch.random.fork_rng(devices=cuda):
            yield
    finally:
        nn.Module.__call__ = call  # type: ignore[method-assign]
        for name, saved in hooks.items():
            getattr(module_mod, name).update(saved)
        for mode in reversed(modes):
            _push_mode(mode)


def _probe(name: str, module: nn.Module, forward: Callable[..., Any], opaque: Opaque,
           flat: List[Any], spec: pytree.TreeSpec, at: Dict[Any, int],
           noise: bool = False) -> List[Any]:
    """The flat outputs of the unit run eagerly on zeros of its inputs' sizes at ``at``
    (``noise``: floating-point inputs drawn from a fixed seed instead, to see whether the
    output sizes follow the values)."""
    state = opaque.state[name]
    if any(t.is_meta for t in state.values()):
        raise ConversionError(
            f"unit {name!r} cannot be traced ({opaque.reasons[name]}), so it runs as an opaque "
            f"call whose output sizes are learned by running it on zeros; built on meta it "
            f"cannot run. Build {name!r} on a real device before converting (a layer whose "
            f"tensors are real is moved, never re-initialised), or write the nn.Sequential "
            f"by hand")
    device = next(iter(state.values())).device if state else None
    with _eager(device):
        seeded = torch.Generator().manual_seed(0)

        def fill(x: torch.Tensor) -> torch.Tensor:
            shape = [_value(s, at) for s in x.shape]
            if noise and x.dtype.is_floating_point:
                return torch.randn(shape, generator=seeded, dtype=x.dtype).to(device or x.device)
            return torch.zeros(shape, dtype=x.dtype, device=device or x.device)

        real = [fill(x) if isinstance(x, torch.Tensor) else
                _value(x, at) if isinstance(x, torch.SymInt) else x for x in flat]
        args, kwargs = pytree.tree_unflatten(real, spec)
        saved = {key: t.clone() for key, t in state.items() if not isinstance(t, nn.Parameter)}
        try:
            with _reparametrize_module(module, state):
                out = forward(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised naming the unit and both causes
            raise ConversionError(
                f"unit {name!r} cannot be traced ({opaque.reasons[name]}), and running it "
                f"on zeros to learn its output sizes failed too ({type(exc).__name__}: "
                f"{exc}); choose other units (units=[...]) or write the nn.Sequential by "
                f"hand") from exc
        finally:
            for key, value in saved.items():  # BatchNorm statistics, counters
                state[key].copy_(value)
    leaves, out_spec = pytree.tree_flatten(out)
    return [out_spec, *leaves]


def _same_sizes(name: str, zeros: List[Any], noise: List[Any]) -> None:
    """Refuse a unit whose output sizes changed when only its input values did."""
    for index, (a, b) in enumerate(zip(zeros[1:], noise[1:])):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape != b.shape:
            raise ConversionError(
                f"output {index} of unit {name!r} (which cannot be traced: it runs as an "
                f"opaque call) has sizes that depend on its input values ({tuple(a.shape)} on "
                f"zeros, {tuple(b.shape)} on other values); an opaque unit's output sizes "
                f"must follow its input sizes. Make the code that reads that output part of "
                f"the unit (units=[...] naming a parent), or write the nn.Sequential by hand")


def _fake_outputs(name: str, flat: List[Any], probes: List[Dict[Any, int]],
                  runs: List[List[Any]]) -> Any:
    """Empty tensors (in the trace's mode) shaped like the probes' outputs, their sizes
    written in the inputs' symbolic sizes (see the module doc)."""
    out_spec = runs[0][0]
    if any(run[0] != out_spec for run in runs):
        raise ConversionError(f"unit {name!r} returns a structure that changes with its "
                              f"input sizes; it cannot be an opaque unit")
    sizes = [size for x in flat for size in _sizes(x)]
    known = [(size, [_value(size, at) for at in probes]) for size in sizes
             if isinstance(size, torch.SymInt)]
    device = next((x.device for x in flat if isinstance(x, torch.Tensor)), None)
    leaves = []
    for index, first in enumerate(runs[0][1:], start=1):
        if not isinstance(first, torch.Tensor):
            if any(run[index] != first for run in runs):
                raise ConversionError(f"unit {name!r} returns a value ({first!r}) that "
                                      f"changes with its input sizes")
            leaves.append(first)
            continue
        shape: List[Any] = []
        for dim in range(first.dim()):
            seen = [run[index].shape[dim] for run in runs]
            if len(set(seen)) == 1:  # no probe changed it: a constant
                shape.append(seen[0])
                continue
            match = next((size for size, values in known if values == seen), None)
            if match is None:
                raise ConversionError(
                    f"output {index - 1} of unit {name!r} (which cannot be traced: it runs "
                    f"as an opaque call) has a size in dim {dim} ({seen[0]}) that is no size "
                    f"of its inputs; an opaque unit's output sizes must be constants or "
                    f"sizes of its inputs. Choose units whose outputs keep their inputs' "
                    f"sizes (units=[...]), or write the nn.Sequential by hand")
            shape.append(match)  # the first input size that agrees at every probe
        leaves.append(torch.empty(shape, dtype=first.dtype, device=device or first.device))
    return pytree.tree_unflatten(leaves, out_spec)


Size = Union[int, Tuple[int, int], None]  # a constant; (input, dim), dim -1: the input itself
SizePlan = Tuple[Tuple[int, Tuple[Size, ...]], ...]  # (output, its sizes) per tensor output


def size_plan(inputs: Sequence[Any], outputs: Dict[int, Any]) -> SizePlan:
    """Where each size of an opaque call's tensor outputs comes from, as ``check_sizes``
    reads it: ``inputs`` are the call's flat inputs and ``outputs`` its flat outputs by
    index, as traced (fake tensors, symbolic sizes). An output size is a constant or the
    first input size with the same expression (``_fake_outputs`` wrote it so); one that
    is neither (None) is left unchecked."""
    found: Dict[Any, Tuple[int, int]] = {}
    for j, value in enumerate(inputs):
        sizes = enumerate(value.shape) if isinstance(value, torch.Tensor) else [(-1, value)]
        for dim, size in sizes:
            if isinstance(size, torch.SymInt):
                found.setdefault(size.node.expr, (j, dim))
    plan = []
    for index, value in sorted(outputs.items()):
        if isinstance(value, torch.Tensor):
            plan.append((index, tuple(found.get(s.node.expr) if isinstance(s, torch.SymInt)
                                      else int(s) for s in value.shape)))
    return tuple(plan)


def check_sizes(flat: List[Any], inputs: List[Any], plan: SizePlan, unit: str) -> List[Any]:
    """``flat`` (the opaque call's flat outputs), once every output in ``plan`` has the
    sizes inferred when converting, evaluated on ``inputs`` (the call's flat inputs)."""
    for index, sizes in plan:
        actual = flat[index].shape
        if len(actual) != len(sizes):
            _mismatch(unit, index, tuple(actual), inputs, sizes)
        for dim, size in enumerate(sizes):  # a plain loop: this runs at every call
            if size is not None and actual[dim] != (
                    size if type(size) is int else _size(inputs, size)):
                _mismatch(unit, index, tuple(actual), inputs, sizes)
    return flat


def _size(inputs: List[Any], at: Tuple[int, int]) -> int:
    value = inputs[at[0]]
    return value if at[1] < 0 else value.shape[at[1]]


def _mismatch(unit: str, index: int, actual: Tuple[int, ...], inputs: List[Any],
              sizes: Tuple[Size, ...]) -> None:
    inferred = tuple("?" if s is None else s if type(s) is int else _size(inputs, s)
                     for s in sizes)
    raise ValueError(
        f"output {index} of unit {unit!r} (which cannot be traced: it runs as an opaque "
        f"call) has sizes {actual}, but to_sequential inferred {inferred} for these input "
        f"sizes (by running it on zeros and on seeded random values when converting): its "
        f"output sizes depend on its input values, and the glue after it was traced with "
        f"the inferred ones. Choose units whose outputs keep their inputs' sizes, or make "
        f"the code that reads that output part of the unit (units=[...] naming a parent), "
        f"or write the nn.Sequential by hand")
