"""Old module paths of the modules that moved into ``seqpipe.core`` and ``seqpipe.local``.

Code, and pickles such as a ``torch.save`` of a model holding a ``DeferredBatchNorm``
(whose class was saved as ``seqpipe.batchnorm.DeferredBatchNorm``), may name a module by
its path before the move. A finder on ``sys.meta_path`` answers those names with the
moved module itself, so ``import seqpipe.batchnorm`` gives ``seqpipe.core.batchnorm``
(the same module object, hence the same classes and functions) without a stub file per
old path.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Optional, Sequence

__all__ = ["MOVED", "MovedFinder", "install"]

MOVED = {
    **{f"seqpipe.{name}": f"seqpipe.core.{name}" for name in (
        "arguments", "batchnorm", "checkpoint", "microbatch", "nochunk", "partition", "rng",
        "saved", "seeding", "segments", "sink", "split_backward", "stage", "stream", "tasks")},
    "seqpipe.pipeline": "seqpipe.local.pipeline",
    "seqpipe.worker": "seqpipe.local.worker",
    "seqpipe.thread_state": "seqpipe.local.thread_state",
    "seqpipe.local_step": "seqpipe.local.step",
    "seqpipe.pipe_step": "seqpipe.local.train_step",
}
"""Old module name -> where that module lives now."""


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module at its new path (importing that one once)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.own_spec: Optional[importlib.machinery.ModuleSpec] = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the moved module ran under its own name); only give the module
        back the spec of its own name, which the import system replaced with the alias's."""
        module.__spec__ = self.own_spec


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of ``MOVED``; every other name is left to the other finders."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (called when ``seqpipe`` is imported).

    First, so that a stale file left at an old path (an install over an older seqpipe)
    or an editable install's own finder cannot answer an old name with a second copy of
    the module."""
    if not any(isinstance(finder, MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
