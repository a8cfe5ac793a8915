"""A new ``DistributedPipe`` on the process group of one whose call failed: the failed call's
messages can never reach it.

A failed call leaves messages in flight on its group: the abort a peer that had already
raised never read, activations a failed stage never received, receives a failed stage had
posted (``Transport.abort`` keeps them alive: dropping one can cancel it). Messages between
two ranks are matched in order per pair of ranks and tag. A pipe built later on that group
used the same pairs and tag, so its first receive (the one-byte handshake of
``communicators.open_pairs``, at construction) met a stale message: gloo aborted the
process (``SIGABRT``, "Received data size doesn't match expected size") where the sizes
differed, and would have handed over the old bytes where they fit.

* **Every pipe talks on its own tag.** The ranks agree on it at construction, in the
  all-gather that compares their models (``agreement.check_same_model``: no extra
  collective): one more than the highest tag any of them used on the group. Gloo matches a
  message by its tag, so a stale message never meets a later pipe's receive, however the
  failure left the pairs. It costs nothing per message, and nothing is refused: a rebuild
  on the group of a failed call trains as on a fresh group.
* **NCCL ignores tags**: a pair's messages are matched in order on the pair's
  communicator, where a stale send would meet the new pipe's first receive. There, a pipe
  built on a group on which a call failed talks on a fresh group of the same ranks (and a
  fresh second group where the group had one: ``mesh.reverse_group``), which the
  pipeline's ranks make together at construction, in one order. Whether a call failed is
  known everywhere: every rank of a failed call raises (the failure reaches every rank,
  docs/distributed.md "Failures") and marks the groups it used (``failed``), and the
  all-gather tells every rank whether any rank marked the group, so all make the fresh
  group or none does. A new communicator costs GPU memory, so only then; it lives until
  ``destroy_process_group()``. It is made with ``use_local_synchronization=True`` (only the
  pipeline's ranks take part), for which torch names the group from its ranks and the
  number of groups each rank knows: the pipeline's ranks must have made the same groups
  (they do when every group is made by every rank, as ``dist.new_group`` requires by
  default).
"""
from __future__ import annotations

import warnings
import weakref
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from seqpipe.distributed.mesh import _new_group, reverse_group
from seqpipe.distributed.transport import Channel, Transport
from seqpipe.trace.gather import _TAG as _CLOCK_TAG

__all__ = ["failed", "local_view", "pipeline_transport"]

# Per group (weak keys: a destroyed group's entries go with it), on this rank: the highest
# tag a pipe built on it talks on, and whether a call on it failed here.
_TAGS: "weakref.WeakKeyDictionary[dist.ProcessGroup, int]" = weakref.WeakKeyDictionary()
_FAILED: "weakref.WeakKeyDictionary[dist.ProcessGroup, bool]" = weakref.WeakKeyDictionary()
_RESERVED = {0, _CLOCK_TAG}  # tag 0: ``dist``'s default (checkpoint transfers, old pipes)


def _key(group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    return group if group is not None else dist.group.WORLD


def local_view(group: Optional[dist.ProcessGroup]) -> List[int]:
    """What this rank adds to the construction's all-gather: the highest tag a pipe on
    ``group`` talks on here, and 1 if a call on ``group`` failed here."""
    key = _key(group)
    return [_TAGS.get(key, 0), int(_FAILED.get(key, False))] if key is not None else [0, 0]


def failed(transport: Transport, group: Optional[dist.ProcessGroup]) -> None:
    """After a call raised: if it failed (``transport.failure``: its messages may still be
    in flight), mark ``group`` and the transport's groups as holding stale messages."""
    if transport.failure is None:
        return  # refused before it sent anything (no grad mode, a wrong scaler)
    for held in {id(g): g for g in (group, transport.group, transport.reverse)}.values():
        key = _key(held)
        if key is not None:
            _FAILED[key] = True


def agreed(group: Optional[dist.ProcessGroup],
           views: Sequence[Sequence[int]]) -> Tuple[int, bool]:
    """The tag every rank's new pipe on ``group`` talks on, and whether a call on the group
    failed on some rank, from every rank's ``local_view`` (the same on every rank)."""
    tag = max(v[0] for v in views) + 1
    while tag in _RESERVED:
        tag += 1
    key = _key(group)
    if key is not None:
        _TAGS[key] = tag
    return tag, any(v[1] for v in views)


def pipeline_transport(group: Optional[dist.ProcessGroup], device: torch.device,
                       views: Sequence[Sequence[int]], channels: Iterable[Channel],
                       ) -> Transport:
    """The transport of a new pipe on ``group``, its pairs opened (``Transport.connect``):
    on its own tag, and on NCCL after a failed call on a fresh group (module docstring).
    ``views``: every rank's ``local_view``, from the construction's all-gather."""
    reverse = reverse_group(group)
    if reverse is None and dist.get_backend(group) == "nccl":
        warnings.warn("DistributedPipe on a process group made with dist.new_group: both "
                      "directions share it, so on NCCL receives are posted only when "
                      "needed, and 1F1B may deadlock once a message outgrows NCCL's "
                      "buffers. Use group=None or seqpipe.distributed.mesh_groups, "
                      "which give each direction its own group", stacklevel=3)
    tag, stale = agreed(group, views)
    if stale and fresh_needed(group):
        ranks = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))] \
            if group is not None else list(range(dist.get_world_size()))
        like = _key(group)
        assert like is not None
        fresh = _new_group(ranks, like, local=True)
        reverse = _new_group(ranks, like, local=True) if reverse is not None else None
        group = fresh
    transport = Transport(group, device, reverse=reverse, tag=tag)
    transport.connect(channels)
    return transport


def fresh_needed(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether a new pipe on ``group`` after a failed call needs a fresh group: where the
    backend matches messages without their tags (NCCL)."""
    return dist.get_backend(group) == "nccl"
