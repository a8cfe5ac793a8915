"""seqpipe: pipeline parallelism for PyTorch ``nn.Sequential`` models.

``Pipe`` runs a model split over several devices in one process; ``DistributedPipe``
(imported lazily, it pulls in ``torch.distributed``) runs one stage per process.
The face lives here (``pipe``, ``demo``, ``launch``); the engines in ``seqpipe.local``
and ``seqpipe.distributed``; what both share in ``seqpipe.core`` (docs/index.md).
``to_sequential`` (lazily too: it pulls in ``torch.export``) turns any model into the
``nn.Sequential`` both take.
"""
from __future__ import annotations

import importlib
from typing import Any

from seqpipe import _moved

_moved.install()  # before anything can ask for a module by its path before the move

from seqpipe.core.checkpoint import ReentrantCheckpointError  # noqa: E402
from seqpipe.core.flags import is_checkpointing, is_recomputing  # noqa: E402
from seqpipe.core.nochunk import NoChunk  # noqa: E402
from seqpipe.core.teardown import unbind_default_group  # noqa: E402
from seqpipe.pipe import Pipe  # noqa: E402

# Whatever the order of this import and init_process_group(): see seqpipe/core/teardown.py.
unbind_default_group()

__all__ = ["Pipe", "DistributedPipe", "NoChunk", "ReentrantCheckpointError", "is_checkpointing",
           "is_recomputing", "to_sequential"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "DistributedPipe":
        from seqpipe.distributed import DistributedPipe

        return DistributedPipe
    if name == "to_sequential":
        from seqpipe.graph.convert import to_sequential

        return to_sequential
    if f"seqpipe.{name}" in _moved.MOVED:  # seqpipe.batchnorm etc., by their old paths
        return importlib.import_module(f"seqpipe.{name}")
    raise AttributeError(f"module 'seqpipe' has no attribute {name!r}")
