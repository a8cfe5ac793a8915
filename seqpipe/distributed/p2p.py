"""One point-to-point operation of a pipeline's transport, handed straight to its group.

``torch.distributed.isend``/``irecv`` check, per operation, what a pipeline's transport
already knows: that the tensor is a tensor, that the group is registered (the rank
translation from a global rank back to a group rank is that lookup), that this rank is in
it. After a layer each such call costs a rank ~15-25 µs of CPU (cold Python), ~19 of them
per rank and 1F1B step. So a call opens (``Transport.begin``) with ``groups``, which asks
torch once whether each of its groups is still registered (``dist.get_rank``: the same
``ValueError`` a destroyed group gives ``dist.isend``), and its operations then go to the
group's own ``send``/``recv`` with the peer's rank in the group, as ``dist.isend`` itself
ends. While ``dist.isend`` or ``dist.irecv`` is not torch's own (a test or a benchmark that
wraps it to watch every operation), and for a complex tensor (which ``dist.isend`` sends as
its real view), the operation goes through ``torch.distributed`` as before.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch.distributed as dist
from torch import Tensor

__all__ = ["Groups", "groups", "isend", "irecv"]

Groups = Dict[bool, Optional[dist.ProcessGroup]]  # toward higher stages?: its group
_TORCH = (dist.isend, dist.irecv)
_DEFAULT = object()  # the default group: looked up per operation, never held (a pipe that
# held it would keep it alive past destroy_process_group: docs/distributed.md)


def groups(up: Optional[dist.ProcessGroup], down: Optional[dist.ProcessGroup]) -> Groups:
    """The groups of one call (``None``: the default group), checked registered."""
    for group in (up, down):
        dist.get_rank(group)  # a destroyed group: torch's "not registered" ValueError
    return {True: up if up is not None else _DEFAULT,  # type: ignore[dict-item]
            False: down if down is not None else _DEFAULT}


def _started(work: Optional[dist.Work]) -> dist.Work:
    assert work is not None  # isend/irecv return None only for ranks outside the group
    return work


def isend(buffer: Tensor, stage: int, direct: Optional[dist.ProcessGroup],
          group: Optional[dist.ProcessGroup], global_rank: Callable[[int], int],
          tag: int = 0) -> dist.Work:
    """Send ``buffer`` to ``stage`` (its rank in the group) with ``tag``: on ``direct``
    (this call's checked group, ``None`` before a call), else through ``dist.isend``."""
    if direct is not None and dist.isend is _TORCH[0] and not buffer.is_complex():
        return (dist.group.WORLD if direct is _DEFAULT else direct).send([buffer], stage, tag)
    return _started(dist.isend(buffer, dst=global_rank(stage), group=group, tag=tag))


def irecv(buffer: Tensor, stage: int, direct: Optional[dist.ProcessGroup],
          group: Optional[dist.ProcessGroup], global_rank: Callable[[int], int],
          tag: int = 0) -> dist.Work:
    """Receive ``buffer`` from ``stage`` (as ``isend``)."""
    if direct is not None and dist.irecv is _TORCH[1] and not buffer.is_complex():
        return (dist.group.WORLD if direct is _DEFAULT else direct).recv([buffer], stage, tag)
    return _started(dist.irecv(buffer, src=global_rank(stage), group=group, tag=tag))
