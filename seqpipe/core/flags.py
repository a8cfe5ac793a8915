"""The flags layers read: is this thread running a checkpointed micro-batch's first
forward, or its recomputation? ``checkpoint.py`` sets them; layers, ``DeferredBatchNorm``
and the skip tracker read them. Plain thread-local data, so that ``seqpipe.skip`` may
read them without importing the checkpointing runtime.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["flag", "is_checkpointing", "is_recomputing"]

_flags = threading.local()


def is_checkpointing() -> bool:
    """True while a checkpointed micro-batch runs its first (activation-free) forward."""
    return getattr(_flags, "checkpointing", False)


def is_recomputing() -> bool:
    """True while a checkpointed micro-batch is recomputed for its backward.

    Layers with side effects (updating running statistics, counting steps) should skip
    them here, since the same micro-batch already ran once.
    """
    return getattr(_flags, "recomputing", False)


@contextmanager
def flag(name: str) -> Iterator[None]:
    """Set flag ``name`` (``"checkpointing"`` or ``"recomputing"``) on this thread for the
    body."""
    previous = getattr(_flags, name, False)
    setattr(_flags, name, True)
    try:
        yield
    finally:
        setattr(_flags, name, previous)
