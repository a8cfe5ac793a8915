"""``ConversionError``: why ``to_sequential`` could not convert a model, and the mend.

Every refusal names what is wrong (the module, the unit, the operation, the line of the
user's code) and says what to do: make the offending module a unit (``units=[...]``),
change the example inputs, or write the ``nn.Sequential`` by hand. Code that cannot be
traced is the exception: the whole forward is traced, units included, so no choice of
units avoids it. A conversion never splits a model silently wrong.
"""
from __future__ import annotations

import os
import traceback
from typing import Collection, List, Optional

import torch

__all__ = ["ConversionError", "MEND", "TRACE_MEND", "explain", "user_frame"]

MEND = ("make that module a unit (pass units=[...] naming it, or its parent), or write the "
        "nn.Sequential by hand (see docs/models.md)")


TRACE_MEND = ("the whole forward, units included, is traced once (to record the units' "
              "calls), so no choice of units= avoids it: make that code traceable by "
              "torch.export(strict=False) on the example (a branch on tensor values as "
              "torch.where or torch.cond; another dtype or keyword argument, such as "
              "attn_implementation=, use_cache=False), or write the nn.Sequential by hand "
              "(see docs/models.md)")


class ConversionError(RuntimeError):
    """``to_sequential`` cannot turn the model into an ``nn.Sequential`` of units."""


_LIBRARY_DIRS = (os.path.dirname(torch.__file__),
                 os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def user_frame(exc: BaseException) -> Optional[str]:
    """``file:line (code)`` of the innermost frame of ``exc`` outside torch and seqpipe: the
    line of the user's (or their library's) model code that failed to trace."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if not frame.filename.startswith(_LIBRARY_DIRS) and "<" not in frame.filename:
            line = (frame.line or "").strip()
            return f"{frame.filename}:{frame.lineno} ({line})" if line else \
                f"{frame.filename}:{frame.lineno}"
    return None


def explain(exc: Exception, stack: List[str], units: Collection[str]) -> ConversionError:
    """A failure to run the model on fake tensors or to export it, as a ``ConversionError``
    naming the module (``stack``: the qualified names of the modules whose forward was
    running, outermost first), the line of the user's code and the mend."""
    inner = stack[-1] if stack else ""
    where = f"module {inner!r}" if inner else "the model's own forward"
    in_unit = next((u for u in reversed(stack) if u in units), None)
    line = user_frame(exc)
    at = f" at {line}" if line else ""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "Only Tensors or scalars are supported" in str(exc) and in_unit is not None:
        return ConversionError(
            f"unit {in_unit!r} is called with an argument that is neither a tensor nor a "
            f"plain value ({text}); a unit's inputs must be tensors, numbers, strings or None. "
            f"Pass example_kwargs that avoid it (e.g. use_cache=False), choose units= whose "
            f"inputs are tensors, or write the nn.Sequential by hand")
    if "data-dependent" in str(exc) or "DataDependent" in type(exc).__name__:
        kind = "data-dependent control flow (a branch or size that depends on tensor values)"
    else:
        kind = f"an operation that cannot be traced ({type(exc).__name__}: {text})"
    inside = (f"the code runs inside unit {in_unit!r}: units run eagerly afterwards, but "
              if in_unit is not None else "")
    return ConversionError(f"cannot trace {where}{at}: {kind}. Mend: {inside}{TRACE_MEND}")
