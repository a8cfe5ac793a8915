"""Opening the communicators of a pipeline's pairs of stages, all ranks in one order.

NCCL creates a communicator per pair of ranks of a group on first use, and that blocks until
both ends arrive; ranks that first touch their pairs in different orders deadlock. So
``Transport.connect`` opens, when the pipeline is built, every (group, pair) the plan will
use (``seqpipe.distributed.plan.pipeline_channels``), in one order all ranks agree on. A
failure notice travels only over those pairs: each stage tells the stages that still expect
a message from it, and a stage that hears of a failure passes it on the same way
(``Transport.abort``), so no new communicator is ever needed after construction.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Protocol, Tuple

import torch
import torch.distributed as dist

__all__ = ["open_pairs"]


class _Ends(Protocol):
    """What ``open_pairs`` needs of a ``Transport`` (which imports this module)."""

    group: Optional[dist.ProcessGroup]
    reverse: Optional[dist.ProcessGroup]
    device: torch.device
    index: int
    tag: int

    def global_rank(self, stage: int) -> int: ...

    def group_between(self, src: int, dst: int) -> Optional[dist.ProcessGroup]: ...

    def _wait(self, work: Any) -> None: ...


def open_pairs(transport: _Ends, channels: Iterable[Tuple[int, int]]) -> None:
    """Open the communicator of every pair of stages in ``channels`` (``(sender,
    receiver)``) now, all ranks in one order, so that no rank meets a first use its peer is
    not ready for.

    Every rank walks the same sorted list (messages to higher stages, on ``group``, before
    those to lower stages, on ``reverse``; pairs in order) and exchanges one byte on each of
    its own pairs, waiting for it, so the first unfinished pair always has both ends ready.
    Every rank must call it, with the same ``channels``.
    """
    links: Dict[Tuple[int, int, int], Tuple[int, int]] = {}
    for src, dst in sorted(channels):
        on_reverse = src > dst and transport.reverse is not transport.group
        links.setdefault((int(on_reverse), min(src, dst), max(src, dst)), (src, dst))
    token = torch.zeros(1, dtype=torch.uint8, device=transport.device)
    for _, (src, dst) in sorted(links.items()):
        group = transport.group_between(src, dst)
        if transport.index == src:
            work = dist.isend(token, dst=transport.global_rank(dst), group=group,
                              tag=transport.tag)
        elif transport.index == dst:
            work = dist.irecv(token, src=transport.global_rank(src), group=group,
                              tag=transport.tag)
        else:
            continue
        assert work is not None  # None only for ranks outside the group
        transport._wait(work)
