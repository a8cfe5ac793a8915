"""``ConversionError``: why ``to_sequential`` could not convert a model, and the mend.

Every refusal names what is wrong (the module, the unit, the operation, the line of the
user's code) and says what to do: make the offending module a unit (``units=[...]``),
change the example inputs, or write the ``nn.Sequential`` by hand. Code the trace cannot
follow inside a unit is no refusal: that unit becomes opaque (``UntracedUnit`` tells
``to_sequential`` which, ``seqpipe.graph.opaque``). A conversion never splits a model
silently wrong.
"""
from __future__ import annotations

import contextlib
import logging
import os
import traceback
from typing import Collection, Iterator, List, Optional

import torch

__all__ = ["ConversionError", "MEND", "TRACE_MEND", "UntracedUnit", "explain",
           "quiet_kernel_log", "user_frame"]

MEND = ("make that module a unit (pass units=[...] naming it, or its parent), or write the "
        "nn.Sequential by hand (see docs/models.md)")


TRACE_MEND = ("code outside every unit (the glue) is traced: make the module that runs it "
              "a unit (units=[...] naming it; code of the model's own forward: move it into "
              "a submodule), since a unit the trace cannot enter runs as an opaque call of "
              "your module; or make that code traceable by "
              "torch.export(strict=False) on the example (a branch on tensor values as "
              "torch.where or torch.cond; another dtype or keyword argument, such as "
              "attn_implementation=, use_cache=False), or write the nn.Sequential by hand "
              "(see docs/models.md)")


class ConversionError(RuntimeError):
    """``to_sequential`` cannot turn the model into an ``nn.Sequential`` of units."""


class UntracedUnit(ConversionError):
    """The trace failed inside ``unit`` (``reason``, one line): ``to_sequential`` makes that
    unit opaque and traces again (``seqpipe.graph.opaque``)."""

    def __init__(self, message: str, unit: str, reason: str) -> None:
        super().__init__(message)
        self.unit = unit
        self.reason = reason


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
    if in_unit is not None:  # made opaque by to_sequential; seen only if that fails too
        return UntracedUnit(
            f"cannot trace {where}{at}, inside unit {in_unit!r}, even as an opaque call: "
            f"{kind}. Choose other units (units=[...]) or write the nn.Sequential by hand",
            in_unit, f"{kind}, in {where}{at}")
    return ConversionError(f"cannot trace {where}{at}: {kind}. Mend: {TRACE_MEND}")


@contextlib.contextmanager
def quiet_kernel_log() -> Iterator[None]:
    """Keep torch's log of a fake kernel that failed (``failed while attempting to run meta
    for aten._grouped_mm``, with its traceback) off stderr while the block runs: the failure
    is raised, and explained or handled (``seqpipe.graph.opaque``) by ``to_sequential``."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)
