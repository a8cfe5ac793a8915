"""A failure in one data-parallel replica reaches the others: the step's verdict.

Replicas of a stage meet only at the end of a train step, in the gradient all-reduces
(``GradientReducer``). A replica whose pipeline failed never gets there, so the others
would wait in those all-reduces until its processes exit (and then get the backend's
``Connection closed by peer``), or for the process group's timeout. The failure notice of
the pipeline (``Transport.abort``) cannot cross over: it travels between the stages of one
pipeline, over pairs that already talk (on NCCL another pair needs a new communicator, and
a receive posted ahead on the data-parallel group would hold up its all-reduces).

So the end of every train step carries a verdict over the data-parallel group: one
all-reduced integer, the number of replicas that failed, started after the call has
closed on this rank (after the last point where news of a failure in its own pipeline can
reach it) and overlapping the gradient all-reduces. A rank that fails in a step joins, at
once and without waiting, the collectives its replica has not started (under ``count_fn``
the count summed over the replicas' last stages, then the gradient all-reduces), then
the verdict with a 1, then an all-gather of its failure text (``concede``); every rank
that reads a non-zero verdict joins that all-gather and raises ``PeerError`` with the
failing replicas' texts. Since each rank of a failing pipeline raises (the failure reaches
all of them), every replica of every stage hears it. On the happy path this costs one
all-reduce of 8 bytes per step, and its read on the host (see docs/benchmarks.md, "Pipeline ×
data parallelism").
"""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from seqpipe.distributed import inflight
from seqpipe.distributed.wire import HEADER_SLOTS, Kind, decode_text, encode_text

__all__ = ["Verdict", "concede"]

_Operation = Tuple[dist.Work, Tensor]


class Verdict:
    """This step's verdict over ``group``, started by a rank whose step went well."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group, self.device = group, device
        self.count = torch.zeros(1, dtype=torch.int64, device=device)
        self.work = dist.all_reduce(self.count, group=group, async_op=True)

    def failures(self) -> List[Tuple[int, str]]:
        """``(replica, text)`` of every replica that failed in this step (waits)."""
        self.work.wait()
        if int(self.count.item()) == 0:
            return []
        texts = [torch.zeros(HEADER_SLOTS, dtype=torch.int64, device=self.device)
                 for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(texts, torch.zeros_like(texts[0]), group=self.group)
        return [(r, decode_text(t.tolist())) for r, t in enumerate(texts) if t[0] != 0]


def concede(text: str, started: List[_Operation], group: dist.ProcessGroup,
            device: torch.device) -> None:
    """This rank failed in the step: join the verdict with a 1 and the all-gather of
    ``text``, after ``started`` (the collectives of the step the replicas still expect,
    started by the caller: a count, the gradient all-reduces), without waiting;
    ``seqpipe.distributed.inflight`` keeps them until they complete."""
    count = torch.ones(1, dtype=torch.int64, device=device)
    mine = encode_text(Kind.ABORT, text).to(device)
    texts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    operations = [*started, (dist.all_reduce(count, group=group, async_op=True), count),
                  (dist.all_gather(texts, mine, group=group, async_op=True), (mine, texts))]
    inflight.keep(operations, group=group)  # until they complete: the replicas join them
