"""seqpipe: pipeline parallelism for PyTorch ``nn.Sequential`` models.

``Pipe`` runs a model split over several devices in one process; ``DistributedPipe``
(imported lazily, it pulls in ``torch.distributed``) runs one stage per process.
"""
from __future__ import annotations

from typing import Any

from seqpipe.checkpoint import is_checkpointing, is_recomputing
from seqpipe.nochunk import NoChunk
from seqpipe.pipe import Pipe
from seqpipe.teardown import unbind_default_group

# Whatever the order of this import and init_process_group(): see seqpipe/teardown.py.
unbind_default_group()

__all__ = ["Pipe", "DistributedPipe", "NoChunk", "is_checkpointing", "is_recomputing"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "DistributedPipe":
        from seqpipe.distributed import DistributedPipe

        return DistributedPipe
    raise AttributeError(f"module 'seqpipe' has no attribute {name!r}")
