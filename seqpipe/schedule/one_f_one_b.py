"""The 1F1B family: warm up with forwards, then alternate one forward and one backward.

``OneFOneB`` is PipeDream-flush (one stage per rank). ``Interleaved1F1B`` is Narayanan et
al. 2021 (stage ``s`` on rank ``s mod K``): a rank walks its stages depth-first, a *round* of
micro-batches through one stage, then the same round through its next stage. The same walk,
with the backward split into ``I`` and a deferred ``W``, gives the zero-bubble schedules
``ZeroBubbleH1`` and ``InterleavedZeroBubble`` (see ``zero_bubble.py``); it lives here as
:func:`looped_one_f_one_b`.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import ClassVar

from seqpipe.schedule.action import Action, backward, backward_input, backward_weight, forward
from seqpipe.schedule.args import check_rank_args, check_stage_args
from seqpipe.schedule.placement import Looped
from seqpipe.schedule.protocol import ScheduleError

__all__ = ["Interleaved1F1B", "OneFOneB", "looped_one_f_one_b", "round_size"]


@dataclass(frozen=True)
class OneFOneB:
    """1F1B (PipeDream-flush): warm up, then alternate one forward and one backward.

    Stage ``s`` runs ``K - s - 1`` warm-up forwards, so it never holds more than
    ``min(K - s, M)`` micro-batches' activations, with the same bubble as fill-drain.
    """

    name: ClassVar[str] = "1f1b"

    def actions(self, stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
        """Warm-up forwards, steady ``F(w+j), B(j)`` pairs, then the remaining backwards."""
        check_stage_args(stage, num_stages, num_microbatches)
        m = num_microbatches
        warmup = min(num_stages - stage - 1, m)
        order = [forward(i) for i in range(warmup)]
        for j in range(m - warmup):
            order += [forward(warmup + j), backward(j)]
        order += [backward(j) for j in range(m - warmup, m)]
        return order


def round_size(name: str, num_ranks: int, num_microbatches: int) -> int:
    """Micro-batches per round of an interleaved walk: ``M / max(1, M // K)``.

    Narayanan et al. use rounds of ``K`` micro-batches, which needs ``M`` to be a multiple of
    ``K``; like torch, rounds may be longer, so ``M`` need only be a multiple of the number of
    rounds (any ``M < 2K`` works).
    """
    rounds = max(1, num_microbatches // num_ranks)
    if num_microbatches % rounds:
        lower = max(m for m in range(1, num_microbatches)
                    if m % max(1, m // num_ranks) == 0)
        upper = next(m for m in range(num_microbatches + 1, 2 * num_microbatches + 2)
                     if m % max(1, m // num_ranks) == 0)
        raise ScheduleError(
            f"{name} with {num_ranks} ranks walks the micro-batches in max(1, M // K) = "
            f"{rounds} rounds of equal size, so M must be a multiple of {rounds}; got "
            f"M = {num_microbatches}. Use M = {lower} or {upper}")
    return num_microbatches // rounds


def looped_one_f_one_b(rank: int, num_ranks: int, stages_per_rank: int,
                       num_microbatches: int, *, round_len: int, warmup: int,
                       defer_weight: int | None = None) -> list[Action]:
    """One rank's order in a depth-first (interleaved) 1F1B walk over stages ``r, r+K, ...``.

    The rank's ``n``-th forward runs on its local stage ``(n // round_len) mod V`` and its
    ``n``-th backward on local stage ``V - 1 - (n // round_len) mod V``; each stage takes its
    micro-batches in order. ``warmup`` forwards, then ``F, B`` pairs, then the remaining
    backwards. With ``defer_weight`` set, each ``B`` becomes an ``I``, and the ``W`` of the
    ``n``-th ``I`` follows the ``(n + defer_weight)``-th ``I`` (the rest end the list).
    """
    k, v, total = num_ranks, stages_per_rank, stages_per_rank * num_microbatches
    split = defer_weight is not None
    next_f: dict[int, int] = defaultdict(int)
    next_b: dict[int, int] = defaultdict(int)
    done: list[tuple[int, int]] = []  # (stage, micro-batch) of each backward, in order
    order: list[Action] = []

    def add_forward(n: int) -> None:
        stage = ((n // round_len) % v) * k + rank
        order.append(forward(next_f[stage], stage))
        next_f[stage] += 1

    def add_backward(n: int) -> None:
        stage = (v - 1 - (n // round_len) % v) * k + rank
        mb = next_b[stage]
        next_b[stage] += 1
        order.append((backward_input if split else backward)(mb, stage))
        done.append((stage, mb))
        if split and n >= defer_weight:  # type: ignore[operator]
            stage_w, mb_w = done[n - defer_weight]  # type: ignore[operator]
            order.append(backward_weight(mb_w, stage_w))

    for n in range(warmup):
        add_forward(n)
    for n in range(total - warmup):
        add_forward(warmup + n)
        add_backward(n)
    for n in range(total - warmup, total):
        add_backward(n)
    if split:
        order += [backward_weight(mb, s) for s, mb in done[max(0, total - defer_weight):]]
    return order


@dataclass(frozen=True)
class Interleaved1F1B(Looped):
    """Interleaved 1F1B (Narayanan et al. 2021): ``V`` stages per rank, stage ``s`` on ``s mod K``.

    Rank ``r`` warms up with ``(V-1)·R + 2(K-1-r)`` forwards (``R`` micro-batches per round,
    ``R = K`` when ``K`` divides ``M``), then alternates. The bubble shrinks ``V``-fold to
    ``(K-1) / (V·M + K-1)`` for the price of ``V`` times more messages.
    """

    name: ClassVar[str] = "interleaved_1f1b"

    def rank_actions(self, rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
        """Depth-first warm-up, steady ``F, B`` pairs, cool-down backwards."""
        check_rank_args(rank, num_ranks, num_microbatches)
        v, m = self.stages_per_rank, num_microbatches
        size = round_size(self.name, num_ranks, m)
        warmup = min((v - 1) * size + 2 * (num_ranks - 1 - rank), v * m)
        return looped_one_f_one_b(rank, num_ranks, v, m, round_len=size, warmup=warmup)
