"""Per-task random streams for CPU stages that run side by side in threads.

PyTorch has one global CPU generator. When two CPU partitions run in two threads, their
random ops (dropout) draw from it in whatever order the threads happen to reach it, so
results would change from run to run and a checkpoint's recomputation could not replay
the mask of the original forward. Each (stage, micro-batch) task therefore draws from
a private generator seeded from the global one in a fixed order; recomputation reseeds
it with the same seed. CUDA devices each have their own generator and one worker, so
they keep ``torch.utils.checkpoint``'s own RNG preservation.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, Iterator, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["draw_seeds", "isolated_rng"]

_TAKES_GENERATOR: Dict[Any, bool] = {}


def _takes_generator(func: Any) -> bool:
    known = _TAKES_GENERATOR.get(func)
    if known is None:
        known = any(arg.name == "generator" for arg in func._schema.arguments)
        _TAKES_GENERATOR[func] = known
    return known


class _PrivateGenerator(TorchDispatchMode):
    """Gives every random CPU op that was not handed a generator the task's own."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.generator = generator

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _takes_generator(func) and kwargs.get("generator") is None:
            kwargs = {**kwargs, "generator": self.generator}
        return func(*args, **kwargs)


def draw_seeds(count: int) -> List[int]:
    """``count`` seeds from the global CPU generator, so a fixed global seed fixes them all."""
    return torch.randint(0, 2**62, (count,), dtype=torch.int64).tolist() if count else []


@contextmanager
def isolated_rng(seed: int) -> Iterator[None]:
    """Within the block, CPU random ops in this thread draw from a generator seeded ``seed``."""
    with _PrivateGenerator(torch.Generator().manual_seed(seed)):
        yield
