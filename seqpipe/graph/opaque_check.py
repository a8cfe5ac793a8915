"""The run-time check of an opaque unit's outputs against what the conversion learned.

The glue after an opaque unit was traced with the outputs its probes showed
(``seqpipe.graph.opaque``): tensor sizes written in the inputs' sizes, a dtype, the device
of the unit's first tensor input, and each non-tensor output (an ``int``, a flag) as a
constant. Values the probes did not show can change any of these: an output whose rows a
mask picks, a dtype that follows autocast or the input's values, a count of what the
input holds. The glue would then compute with the learned ones, silently wrong (a mean
divided by the batch instead of the rows kept; a branch on the dtype the trace fixed; the
count the probes saw). So ``trace`` puts ``check_outputs`` after every opaque call: each
tensor output must have the sizes (evaluated on this call's input sizes), the dtype and
the device learned, each non-tensor output the value learned; else a ``ValueError`` names
the unit, the output, what it is and what was learned, and the mend. It reads a few
attributes: about a microsecond per call (``docs/models.md``); other units pay nothing.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

__all__ = ["PLAIN", "OutputPlan", "check_outputs", "output_plan"]

PLAIN = (int, float, str, type(None))  # non-tensor outputs compared by value (bool: an int)
Size = Union[int, Tuple[int, int], None]  # a constant; (input, dim), dim -1: the input itself
# (tensor outputs: (index, sizes, dtype)), (non-tensor outputs: (index, value)), and the
# index of the first tensor input, whose device every tensor output shares (None: no check)
OutputPlan = Tuple[Tuple[Tuple[int, Tuple[Size, ...], torch.dtype], ...],
                   Tuple[Tuple[int, Any], ...], Optional[int]]


def output_plan(inputs: Sequence[Any], outputs: Dict[int, Any],
                constants: Dict[int, Any]) -> OutputPlan:
    """What ``check_outputs`` checks after one opaque call: ``inputs`` are the call's flat
    inputs and ``outputs`` its flat tensor outputs by index, as traced (fake tensors,
    symbolic sizes); ``constants`` its non-tensor outputs by index, as the trace fixed
    them (those of ``PLAIN`` types are checked by value). An output size is a constant or
    the first input size with the same expression (``opaque._fake_outputs`` wrote it so);
    one that is neither (None) is left unchecked."""
    found: Dict[Any, Tuple[int, int]] = {}
    for j, value in enumerate(inputs):
        sizes = enumerate(value.shape) if isinstance(value, torch.Tensor) else [(-1, value)]
        for dim, size in sizes:
            if isinstance(size, torch.SymInt):
                found.setdefault(size.node.expr, (j, dim))
    tensors = []
    for index, value in sorted(outputs.items()):
        if isinstance(value, torch.Tensor):
            tensors.append((index, tuple(found.get(s.node.expr) if isinstance(s, torch.SymInt)
                                         else int(s) for s in value.shape), value.dtype))
    first = next((j for j, v in enumerate(inputs) if isinstance(v, torch.Tensor)), None)
    plain = sorted((i, v) for i, v in constants.items() if isinstance(v, PLAIN))
    return tuple(tensors), tuple(plain), first


def check_outputs(flat: List[Any], inputs: List[Any], plan: OutputPlan,
                  unit: str) -> List[Any]:
    """``flat`` (the opaque call's flat outputs), once every output is as ``plan`` says
    (sizes evaluated on ``inputs``, the call's flat inputs; see the module doc)."""
    tensors, constants, first = plan
    device = None if first is None else inputs[first].device
    for index, sizes, dtype in tensors:  # plain loops: this runs at every call
        out = flat[index]
        actual = out.shape
        if len(actual) != len(sizes):
            _mismatch(unit, index, tuple(actual), inputs, sizes)
        for dim, size in enumerate(sizes):
            if size is not None and actual[dim] != (
                    size if type(size) is int else _size(inputs, size)):
                _mismatch(unit, index, tuple(actual), inputs, sizes)
        if out.dtype is not dtype:
            _wrong(unit, index, f"dtype {out.dtype}", f"{dtype}", _DTYPE_MEND)
        if device is not None and out.device != device:
            _wrong(unit, index, f"device {out.device}",
                   f"{device} (the device of its first tensor input)", _DEVICE_MEND)
    for index, value in constants:
        got = flat[index]
        if got is not value and (type(got) is not type(value) or got != value):
            _wrong(unit, index, repr(got), f"{value!r} (a constant of the traced glue)",
                   _VALUE_MEND)
    return flat


def _size(inputs: List[Any], at: Tuple[int, int]) -> int:
    value = inputs[at[0]]
    return value if at[1] < 0 else value.shape[at[1]]


_OPAQUE = ("it runs as an opaque call, and the glue after it was traced with what running "
           "it showed")
_DTYPE_MEND = ("An output dtype that follows autocast or the input's dtype: convert under the "
               "same autocast and with inputs of the dtype you run (call to_sequential "
               "inside `with torch.autocast(...)`); one that follows the input's values: "
               "cast it inside the unit to one dtype, or make the code that reads it part of "
               "the unit (units=[...] naming a parent), or write the nn.Sequential by hand")
_DEVICE_MEND = ("Keep the unit's outputs on its input's device (move them inside the unit), "
                "or write the nn.Sequential by hand")
_VALUE_MEND = ("A non-tensor output that follows the input's values is fixed by the trace: "
               "return it as a tensor (torch.tensor(n), or keep the 0-dim tensor instead of "
               "calling .item() or int()), or make the code that reads it part of the unit "
               "(units=[...] naming a parent), or write the nn.Sequential by hand")


def _wrong(unit: str, index: int, actual: str, learned: str, mend: str) -> None:
    raise ValueError(f"output {index} of unit {unit!r} is {actual}, but when converting "
                     f"to_sequential learned {learned} ({_OPAQUE}). {mend}")


def _mismatch(unit: str, index: int, actual: Tuple[int, ...], inputs: List[Any],
              sizes: Tuple[Size, ...]) -> None:
    inferred = tuple("?" if s is None else s if type(s) is int else _size(inputs, s)
                     for s in sizes)
    raise ValueError(
        f"output {index} of unit {unit!r} has sizes {actual}, but to_sequential inferred "
        f"{inferred} for these input sizes (by running it on zeros and on seeded random "
        f"values when converting: {_OPAQUE}): its output sizes depend on its input values. "
        f"Choose units whose outputs keep their inputs' sizes, or make the code that reads "
        f"that output part of the unit (units=[...] naming a parent), or write the "
        f"nn.Sequential by hand")
