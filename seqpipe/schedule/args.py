"""Argument checks shared by the built-in schedules."""
from __future__ import annotations

__all__ = ["check_rank_args", "check_stage_args", "check_stages_per_rank"]


def check_stage_args(stage: int, num_stages: int, num_microbatches: int) -> None:
    """Reject arguments a one-stage-per-rank built-in cannot lay out."""
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(
            f"need num_stages >= 1 and num_microbatches >= 1, got {num_stages}, {num_microbatches}"
        )
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in 0..{num_stages - 1}, got {stage}")


def check_rank_args(rank: int, num_ranks: int, num_microbatches: int) -> None:
    """Reject arguments a several-stages-per-rank built-in cannot lay out."""
    if num_ranks < 1 or num_microbatches < 1:
        raise ValueError(
            f"need num_ranks >= 1 and num_microbatches >= 1, got {num_ranks}, {num_microbatches}"
        )
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank must be in 0..{num_ranks - 1}, got {rank}")


def check_stages_per_rank(value: int, name: str) -> int:
    """``stages_per_rank`` of an interleaved or looped schedule: an int >= 2."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise ValueError(f"{name} needs stages_per_rank >= 2 (an int), got {value!r}; "
                         "for one stage per rank use '1f1b', 'fill_drain' or 'zb_h1'")
    return value
