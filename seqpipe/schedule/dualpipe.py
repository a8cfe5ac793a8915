"""DualPipeV: DeepSeek's DualPipe folded into a V (as torch 2.13's ``ScheduleDualPipeV``).

Rank ``r`` holds stages ``r`` (down) and ``2K-1-r`` (up), like ZB-V. In the steady state
each rank pairs a forward of one stage with a full backward of the other (``F`` then ``B``),
which an engine can overlap to hide communication behind compute; at the edges it splits
backwards into ``I`` and ``W`` and uses the ``W``s to fill the ramp-down. Needs at least
``2K`` micro-batches (one per stage).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import ClassVar

from seqpipe.schedule.action import Action, backward, backward_input, backward_weight, forward
from seqpipe.schedule.args import check_rank_args
from seqpipe.schedule.placement import Placement
from seqpipe.schedule.protocol import ScheduleError

__all__ = ["DualPipeV"]


@dataclass(frozen=True)
class DualPipeV:
    """DualPipeV: V-shaped, paired ``F``/``B`` in the steady state, ``I``/``W`` at the edges."""

    name: ClassVar[str] = "dualpipev"

    def placement(self, num_ranks: int) -> Placement:
        """Rank ``r`` holds stages ``r`` and ``2K-1-r``."""
        return Placement.v_shape(num_ranks)

    def rank_actions(self, rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
        """The eight phases of DualPipeV on ``rank``."""
        check_rank_args(rank, num_ranks, num_microbatches)
        if num_microbatches < 2 * num_ranks:
            raise ScheduleError(
                f"dualpipev needs at least as many micro-batches as stages: "
                f"{2 * num_ranks} for {num_ranks} ranks, got {num_microbatches}")
        return _DualRank(rank, 2 * num_ranks - 1 - rank).build(num_ranks, num_microbatches)


class _DualRank:
    """Counters of one rank's DualPipeV walk; ``I`` and ``B`` share a micro-batch counter."""

    def __init__(self, down: int, up: int) -> None:
        self.down, self.up = down, up
        self.order: list[Action] = []
        self.next_f = {down: 0, up: 0}
        self.next_b = {down: 0, up: 0}
        self.pending_w: deque[tuple[int, int]] = deque()  # (stage, micro-batch) after an I
        self.split = False

    def f(self, stage: int) -> None:
        self.order.append(forward(self.next_f[stage], stage))
        self.next_f[stage] += 1

    def b(self, stage: int, split: bool) -> None:
        mb = self.next_b[stage]
        self.next_b[stage] += 1
        self.order.append((backward_input if split else backward)(mb, stage))
        if split:
            self.pending_w.append((stage, mb))

    def w(self) -> None:
        if self.pending_w:
            stage, mb = self.pending_w.popleft()
            self.order.append(backward_weight(mb, stage))

    def build(self, k: int, m: int) -> list[Action]:
        r, down, up = self.down, self.down, self.up
        for _ in range(2 * (k - r - 1)):
            self.f(down)
        for _ in range(r + 1):
            self.f(down)
            self.f(up)
        for _ in range(k - r - 1):
            self.b(up, split=True)
            self.w()
            self.f(up)
        for _ in range(m - 2 * k + r + 1):
            self.f(down)
            self.b(up, split=False)
            self.f(up)
            self.b(down, split=False)
        for _ in range(k - r - 1):
            self.b(up, split=False)
            self.f(up)
            self.b(down, split=False)
        half = (r + 1) // 2
        for i in range(r + 1):
            self.split = self.split or (i == half and r % 2 == 1)
            self.b(up, self.split)
            self.split = self.split or (i == half and r % 2 == 0)
            self.b(down, self.split)
        for _ in range(k - r - 1):
            self.w()
            self.b(down, self.split)
        while self.pending_w:
            self.w()
        return self.order
