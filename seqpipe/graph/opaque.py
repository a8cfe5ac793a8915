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

What the probes show is what the glue after the unit is traced with, so the converted
model checks every opaque call at run time (``seqpipe.graph.opaque_check``, put after
each call by ``trace``): each tensor output's sizes, dtype and device, each non-tensor
output's value (an ``int`` the unit returns is a constant of the traced glue).

A unit is opaque because the trace failed inside it, or because the user named it (or
its class) in ``to_sequential(..., opaque=[...])``: a unit whose trace is slow, or wrong
(``choose_opaque``).
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
from seqpipe.graph.opaque_check import PLAIN

__all__ = ["CHOSEN", "Opaque", "choose_opaque", "stand_ins"]


CHOSEN = "named in opaque="  # the reason of a unit the user made opaque


class Opaque:
    """The opaque units of one conversion, with the real tensors they run on and why each
    is opaque (captured before tracing swaps fake tensors into the model)."""

    def __init__(self) -> None:
        self.reasons: Dict[str, str] = {}
        self.state: Dict[str, Dict[str, torch.Tensor]] = {}

    def add(self, name: str, module: nn.Module, reason: str) -> None:
        self.reasons[name] = reason
        self.state[name] = dict((*module.named_parameters(remove_duplicate=False),
                                 *module.named_buffers(remove_duplicate=False)))

    def why(self, name: str) -> str:
        """Why unit ``name`` is opaque, as the refusals say it (with the extra mend of a
        unit the user chose)."""
        if self.reasons[name] == CHOSEN:
            return "is opaque (opaque= names it; leave it out to trace it)"
        return f"cannot be traced ({self.reasons[name]})"

    def __contains__(self, name: object) -> bool:
        return name in self.reasons


def choose_opaque(units: Dict[str, nn.Module], chosen: Sequence[Union[str, type]]) -> List[str]:
    """The units ``to_sequential(..., opaque=chosen)`` names: a unit's name, or a module
    class (every unit that is an instance of it). A name that is no unit, a class no unit
    is, or anything else is a ``ConversionError`` saying what the units are."""
    if isinstance(chosen, (str, type)):
        raise TypeError(f"opaque= takes a list of unit names and module classes, e.g. "
                        f"opaque=[{chosen!r}], not a single one")
    names: List[str] = []
    for entry in chosen:
        if isinstance(entry, str):
            if entry not in units:
                inside = [u for u in units if entry.startswith(u + ".")]
                where = (f"it is inside unit {inside[0]!r}; name that unit" if inside else
                         f"the units are {_listed(units)}; opaque= names units (choose "
                         f"them with units=[...])")
                raise ConversionError(f"opaque= names {entry!r}, which is not a unit: {where}")
            found = [entry]
        elif isinstance(entry, type) and issubclass(entry, nn.Module):
            found = [n for n, m in units.items() if isinstance(m, entry)]
            if not found:
                raise ConversionError(
                    f"opaque= names class {entry.__name__}, but no unit is one: the units are "
                    f"{_listed(units)}; name a unit's class, or choose units with units=[...]")
        else:
            raise ConversionError(f"opaque= entries are unit names (like 'encoder.layers.0') "
                                  f"or nn.Module classes, got {entry!r}")
        names += [n for n in found if n not in names]
    return names


def _listed(units: Dict[str, nn.Module]) -> str:
    shown = [f"{n!r} ({type(m).__name__})" for n, m in list(units.items())[:6]]
    return ", ".join(shown) + (f" and {len(units) - 6} more" if len(units) > 6 else "")


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
                f"unit {name!r} {opaque.why(name)}, and an input size of it depends on "
                f"tensor values, so its output sizes cannot be learned; "
                f"choose other units (units=[...]) or write the nn.Sequential by hand")

        def run(at: Dict[Any, int], noise: bool = False) -> List[Any]:
            return _probe(name, module, forward, opaque, flat, spec, at, noise)

        probes, runs = [base], [run(base)]
        try:
            noisy = run(base, noise=True)
        except ConversionError:  # fails on other values: this run cannot tell
            noisy = runs[0]
        _same_outputs(name, runs[0], noisy)
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
            f"unit {name!r} {opaque.why(name)}: it runs as an opaque call whose output "
            f"sizes are learned by running it on zeros; built on meta it "
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
                f"unit {name!r} {opaque.why(name)}, and running it on zeros to learn its "
                f"output sizes failed too ({type(exc).__name__}: "
                f"{exc}); choose other units (units=[...]) or write the nn.Sequential by "
                f"hand") from exc
        finally:
            for key, value in saved.items():  # BatchNorm statistics, counters
                state[key].copy_(value)
    leaves, out_spec = pytree.tree_flatten(out)
    return [out_spec, *leaves]


def _same_outputs(name: str, zeros: List[Any], noise: List[Any]) -> None:
    """Refuse a unit whose output sizes, dtypes or non-tensor values changed when only its
    input values did (the glue after it would be traced with those of the zeros)."""
    for index, (a, b) in enumerate(zip(zeros[1:], noise[1:])):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            if a is b or (type(a) is type(b) and (a == b or not isinstance(a, PLAIN))):
                continue
            what, seen = "a value that depends", f"{a!r} on zeros, {b!r} on other values"
            mend = ("return it as a tensor (torch.tensor(n), or the 0-dim tensor itself "
                    "instead of .item() or int()), or make the code that reads it part of "
                    "the unit (units=[...] naming a parent), or write the nn.Sequential by "
                    "hand")
        elif a.shape != b.shape or a.dtype != b.dtype:
            what = "sizes that depend" if a.shape != b.shape else "a dtype that depends"
            seen = (f"{tuple(a.shape)} on zeros, {tuple(b.shape)} on other values"
                    if a.shape != b.shape else f"{a.dtype} on zeros, {b.dtype} on other values")
            mend = ("an opaque unit's output sizes and dtypes must follow its inputs' sizes "
                    "and dtypes. Make the code that reads that output part of the unit "
                    "(units=[...] naming a parent), or write the nn.Sequential by hand")
        else:
            continue
        raise ConversionError(
            f"output {index} of unit {name!r} (an opaque call: its outputs are learned by "
            f"running it) has {what} on its input values ({seen}); {mend}")


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
                seen = ", ".join(repr(run[index]) for run in runs)
                raise ConversionError(
                    f"output {index - 1} of unit {name!r} (an opaque call: its outputs are "
                    f"learned by running it) is a value that follows its input sizes ({seen} "
                    f"at the sizes tried), which the glue after it would hold as a constant; "
                    f"return it as a tensor, or read the size in the code that uses it "
                    f"(h.shape[0]), or write the nn.Sequential by hand")
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
                    f"output {index - 1} of unit {name!r} (an opaque call: its outputs are "
                    f"learned by running it) has a size in dim {dim} ({seen[0]}) that is no size "
                    f"of its inputs; an opaque unit's output sizes must be constants or "
                    f"sizes of its inputs. Choose units whose outputs keep their inputs' "
                    f"sizes (units=[...]), or write the nn.Sequential by hand")
            shape.append(match)  # the first input size that agrees at every probe
        leaves.append(torch.empty(shape, dtype=first.dtype, device=device or first.device))
    return pytree.tree_unflatten(leaves, out_spec)
