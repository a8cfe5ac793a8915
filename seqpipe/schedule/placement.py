"""Placement: which rank holds each stage of a pipeline.

Stages are the model's consecutive pieces, ``0 .. S-1``; ranks are the processes,
``0 .. K-1``. With one stage per rank they coincide. Interleaved schedules loop the stages
over the ranks (stage ``s`` on rank ``s mod K``); V-shaped ones fold them (rank ``r`` holds
stages ``r`` and ``2K-1-r``, so the first and last stage share rank 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from seqpipe.schedule.args import check_stages_per_rank

__all__ = ["Placement", "Looped"]


@dataclass(frozen=True)
class Placement:
    """``ranks[s]`` is the rank that holds stage ``s``; every rank holds at least one stage."""

    ranks: tuple[int, ...]
    num_ranks: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(self.ranks))
        if isinstance(self.num_ranks, bool) or not isinstance(self.num_ranks, int) \
                or self.num_ranks < 1:
            raise ValueError(f"num_ranks must be an int >= 1, got {self.num_ranks!r}")
        for stage, rank in enumerate(self.ranks):
            if isinstance(rank, bool) or not isinstance(rank, int) \
                    or not 0 <= rank < self.num_ranks:
                raise ValueError(f"stage {stage} is placed on rank {rank!r}, "
                                 f"but ranks are 0..{self.num_ranks - 1}")
        empty = sorted(set(range(self.num_ranks)) - set(self.ranks))
        if empty:
            raise ValueError(f"rank(s) {empty} hold no stage; every rank needs at least one")

    @classmethod
    def one_per_rank(cls, num_ranks: int) -> Placement:
        """Stage ``s`` on rank ``s``."""
        return cls(tuple(range(num_ranks)), num_ranks)

    @classmethod
    def looped(cls, num_ranks: int, stages_per_rank: int) -> Placement:
        """Stage ``s`` on rank ``s mod K`` (interleaved and looped schedules)."""
        return cls(tuple(s % num_ranks for s in range(num_ranks * stages_per_rank)), num_ranks)

    @classmethod
    def v_shape(cls, num_ranks: int) -> Placement:
        """Rank ``r`` holds stages ``r`` and ``2K-1-r`` (ZB-V, DualPipeV)."""
        down = tuple(range(num_ranks))
        return cls(down + tuple(reversed(down)), num_ranks)

    @property
    def num_stages(self) -> int:
        """How many stages the pipeline has."""
        return len(self.ranks)

    def rank_of(self, stage: int) -> int:
        """The rank holding ``stage``."""
        return self.ranks[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` holds, in increasing order."""
        return tuple(s for s, r in enumerate(self.ranks) if r == rank)


@dataclass(frozen=True)
class Looped:
    """Base of the schedules that loop ``stages_per_rank`` stages over the ranks (stage
    ``s`` on rank ``s mod K``): the argument, its check and the placement."""

    stages_per_rank: int = 2
    name: ClassVar[str] = "looped"

    def __post_init__(self) -> None:
        check_stages_per_rank(self.stages_per_rank, self.name)

    def placement(self, num_ranks: int) -> Placement:
        """Stage ``s`` on rank ``s mod K``."""
        return Placement.looped(num_ranks, self.stages_per_rank)
