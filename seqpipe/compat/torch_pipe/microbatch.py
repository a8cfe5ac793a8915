"""``torch.distributed.pipeline.sync.microbatch``: ``NoChunk``, seqpipe's own.

``NoChunk(tensor)`` marks an input tensor that every micro-batch receives whole instead of
a slice of it; its gradient is the sum of the micro-batches'. Non-tensor inputs need no
wrapper: they reach every micro-batch unchanged. See ``seqpipe.core.nochunk``.
"""
from __future__ import annotations

from seqpipe.core.nochunk import NoChunk

__all__ = ["NoChunk"]
