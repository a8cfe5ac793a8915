"""``OpCount``: counts the aten operations that run inside a block (tests that a backward
runs each operation once)."""
from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCount"]


class OpCount(TorchDispatchMode):
    """Counts the aten operations that run inside the block, by name (``mm``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))
