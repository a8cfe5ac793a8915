"""The fill-drain family: every forward first, then every backward.

``FillDrain`` is GPipe (one stage per rank); ``LoopedBFS`` is its several-stages-per-rank
form, breadth-first pipeline parallelism (Lamy-Poirier 2022): a rank runs every micro-batch
through its first stage, then through its next, and the backwards in mirror order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from seqpipe.schedule.action import Action, backward, forward
from seqpipe.schedule.args import check_rank_args, check_stage_args
from seqpipe.schedule.placement import Looped

__all__ = ["FillDrain", "LoopedBFS"]


@dataclass(frozen=True)
class FillDrain:
    """GPipe: every forward, then every backward in reverse micro-batch order.

    Simple, but each stage holds the activations of all ``M`` micro-batches at once.
    """

    name: ClassVar[str] = "fill_drain"

    def actions(self, stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
        """``F0 .. F(M-1)`` then ``B(M-1) .. B0``."""
        check_stage_args(stage, num_stages, num_microbatches)
        m = num_microbatches
        return [forward(i) for i in range(m)] + [backward(i) for i in reversed(range(m))]


@dataclass(frozen=True)
class LoopedBFS(Looped):
    """Breadth-first looping: stage ``s`` on rank ``s mod K``, each stage's micro-batches in a row.

    Rank ``r`` runs ``F`` of all ``M`` micro-batches on stage ``r``, then on stage ``r + K``,
    and so on; then the backwards, last stage first, micro-batches in reverse. Every stage
    holds all ``M`` micro-batches, like fill-drain, and the bubble shrinks to
    ``(K-1) / (V*M + K-1)``.
    """

    name: ClassVar[str] = "looped_bfs"

    def rank_actions(self, rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
        """All forwards stage by stage, then all backwards in mirror order."""
        check_rank_args(rank, num_ranks, num_microbatches)
        stages = range(rank, num_ranks * self.stages_per_rank, num_ranks)
        m = range(num_microbatches)
        order = [forward(i, s) for s in stages for i in m]
        return order + [backward(i, s) for s in reversed(stages) for i in reversed(m)]
