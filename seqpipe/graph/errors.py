"""``ConversionError``: why ``to_sequential`` could not convert a model, and the mend.

Every refusal names what is wrong (the module, the unit, the operation, the line of the
user's code) and says what to do: make the offending module a unit (``units=[...]``),
change the example inputs, or write the ``nn.Sequential`` by hand. A conversion never
splits a model silently wrong.
"""
from __future__ import annotations

import os
import traceback
from typing import Optional

import torch

__all__ = ["ConversionError", "MEND", "user_frame"]

MEND = ("make that module a unit (pass units=[...] naming it, or its parent), or write the "
        "nn.Sequential by hand (see docs/models.md)")


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
