"""Pipelines across processes: one stage per rank over ``torch.distributed``."""
from __future__ import annotations

from seqpipe.distributed.grad_scaler import PipeGradScaler
from seqpipe.distributed.mesh import mesh_groups
from seqpipe.distributed.pipe import DistributedPipe
from seqpipe.distributed.ties import SharedBufferError
from seqpipe.distributed.transport import PeerError

__all__ = ["DistributedPipe", "PeerError", "PipeGradScaler", "SharedBufferError", "mesh_groups"]
