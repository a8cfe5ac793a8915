"""seqpipe: pipeline parallelism for PyTorch ``nn.Sequential`` models.

``Pipe`` runs a model split over several devices in one process; ``DistributedPipe``
(imported lazily, it pulls in ``torch.distributed``) runs one stage per process.
``to_sequential`` (lazily too: it pulls in ``torch.export``) turns any model into the
``nn.Sequential`` both take.
"""
from __future__ import annotations

from typing import Any

from seqpipe.checkpoint import is_checkpointing, is_recomputing
from seqpipe.nochunk import NoChunk
from seqpipe.pipe import Pipe

__all__ = ["Pipe", "DistributedPipe", "NoChunk", "is_checkpointing", "is_recomputing",
           "to_sequential"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "DistributedPipe":
        from seqpipe.distributed import DistributedPipe

        return DistributedPipe
    if name == "to_sequential":
        from seqpipe.graph.convert import to_sequential

        return to_sequential
    raise AttributeError(f"module 'seqpipe' has no attribute {name!r}")
