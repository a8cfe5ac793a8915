"""The outputs of a recomputed forward: wait for the collectives still computing them.

A tensor-parallel layer's collectives (``RowwiseParallel``'s reduce-scatter, through
``torch.distributed``'s functional collectives) return their result at once, as an
``AsyncCollectiveTensor`` (the local shard of a ``DTensor`` output), and wait for the
collective when it is first read. A result nobody reads is never waited for: the process
group keeps it registered as in flight, one more entry each step (and warns at exit). A
split backward's ``I`` recomputes a checkpointed forward for its graph alone and does not
read its outputs (their values went out at the first pass), so it settles them here.
"""
from __future__ import annotations

from typing import Iterable, Optional

from torch import Tensor

from seqpipe.core.lazy_classes import is_dtensor, loaded_class

__all__ = ["settle"]


def settle(tensors: Iterable[Optional[Tensor]]) -> None:
    """Wait for the collectives computing ``tensors`` (``DTensor``s: their local shards),
    which will not be read."""
    pending = loaded_class("torch.distributed._functional_collectives", "AsyncCollectiveTensor")
    if pending is None:  # not imported: no collective is in flight this way
        return
    for tensor in tensors:
        if is_dtensor(tensor):
            tensor = tensor.to_local()
        if isinstance(tensor, pending):
            tensor.trigger_wait()
