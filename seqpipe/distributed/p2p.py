"""One point-to-point operation of the transport: ``torch.distributed.isend``/``irecv``,
without their per-call work where it cannot apply.

``dist.isend(tensor, dst, group)`` checks the tensor (a tensor, not complex, no
``__torch_function__``), finds the default group, translates ``dst`` into its rank in
``group``, checks that this process is a member, and then calls ``group.send([tensor],
rank, 0)`` (``irecv``: ``group.recv``). A transport's message buffers are plain byte tensors,
sent on a group this process is a member of, to a peer whose rank in that group it knows
(its stage): for them those checks decide nothing, and they cost ~20-40 µs of CPU per
operation right after a layer's compute (cold caches, measured: docs/benchmarks.md,
"Session 12: cpu2"), where one such operation sits on each end of every hop between two
stages. Such a buffer goes to the group directly. Anything else (a payload sent as it is,
of any dtype or tensor type: ``wire.direct``), and every operation while ``dist.isend`` or
``dist.irecv`` is not torch's own (a test or a benchmark wrapping it to record or to fail),
goes through ``dist.isend``/``dist.irecv`` as before, so what wraps them sees every
operation.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["isend", "irecv"]

_ISEND, _IRECV = dist.isend, dist.irecv  # torch's own, as imported


def _plain_bytes(tensor: Tensor) -> bool:
    """A message buffer: a plain byte tensor (no subclass, whose ``__torch_function__``
    ``dist.isend`` would honour)."""
    return type(tensor) is Tensor and tensor.dtype is torch.uint8


def _group(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    return group if group is not None else dist.group.WORLD  # type: ignore[return-value]


def _global(group: Optional[dist.ProcessGroup], group_rank: int) -> int:
    """The world rank of ``group``'s rank ``group_rank``."""
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def isend(tensor: Tensor, group: Optional[dist.ProcessGroup],
          group_rank: int) -> Optional[dist.Work]:
    """Send ``tensor`` to the rank ``group_rank`` of ``group`` (``None``: the world), as
    ``dist.isend(tensor, dst=<its world rank>, group=group)`` does."""
    if dist.isend is _ISEND and _plain_bytes(tensor):
        return _group(group).send([tensor], group_rank, 0)
    return dist.isend(tensor, dst=_global(group, group_rank), group=group)


def irecv(tensor: Tensor, group: Optional[dist.ProcessGroup],
          group_rank: int) -> Optional[dist.Work]:
    """Receive into ``tensor`` from the rank ``group_rank`` of ``group`` (``None``: the
    world), as ``dist.irecv(tensor, src=<its world rank>, group=group)`` does."""
    if dist.irecv is _IRECV and _plain_bytes(tensor):
        return _group(group).recv([tensor], group_rank, 0)
    return dist.irecv(tensor, src=_global(group, group_rank), group=group)
