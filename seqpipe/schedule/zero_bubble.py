"""The zero-bubble family (Qi et al. 2023): the backward split into ``I`` and a deferred ``W``.

``I`` (the input gradient) is what the upstream stage waits for; ``W`` (the weight gradient)
is wanted by nobody until the optimizer step, so a schedule can move it into the time a
stage would otherwise spend idle.

* ``ZeroBubbleH1`` (one stage per rank): 1F1B with ``I`` for ``B``; stage ``s`` defers its
  first ``s`` ``W``s to the end. Peak memory as 1F1B's first stage (``K`` micro-batches on
  every stage); bubble ``(K-1)(F + I - W)`` instead of ``(K-1)(F + I + W)``.
* ``ZeroBubbleH2`` (one stage per rank): warms up with ``2(K-1-s)+1`` forwards so the first
  ``I`` arrives exactly when they end, then ``I, W, F`` cycles with ZB-H1's deferral. Up to
  ``2K-1`` micro-batches live (under twice 1F1B's); no idle time between a stage's first
  action and its last ``I`` when ``F = I = W``. Its remaining gain over ZB-H1, the first
  stages finishing early, pays off only when the next step may start before the optimizer
  synchronises (the paper's post-validation), which seqpipe does not do.
* ``InterleavedZeroBubble`` (ZB1P, stage ``s`` on rank ``s mod K``): the interleaved 1F1B
  walk with one-hop warm-up and rank ``r`` deferring ``r`` ``W``s.
* ``ZeroBubbleV`` (ZB-V, two stages per rank in a V: rank ``r`` holds stages ``r`` and
  ``2K-1-r``): peak memory as 1F1B's, bubble near zero when ``F = I = W``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from seqpipe.schedule.action import Action, backward_input, backward_weight, forward
from seqpipe.schedule.args import check_rank_args, check_stage_args
from seqpipe.schedule.one_f_one_b import looped_one_f_one_b, round_size
from seqpipe.schedule.placement import Looped, Placement

__all__ = ["InterleavedZeroBubble", "ZeroBubbleH1", "ZeroBubbleH2", "ZeroBubbleV"]


@dataclass(frozen=True)
class ZeroBubbleH1:
    """ZB-H1: 1F1B with split backward; stage ``s`` defers its first ``s`` weight gradients."""

    name: ClassVar[str] = "zb_h1"

    def actions(self, stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
        """``K-1-s`` warm-up forwards, ``F, I`` (``, W``) steps, cool-down ``I``s, other ``W``s."""
        check_stage_args(stage, num_stages, num_microbatches)
        m = num_microbatches
        order = looped_one_f_one_b(stage, num_stages, 1, m, round_len=m,
                                   warmup=min(num_stages - 1 - stage, m), defer_weight=stage)
        return [Action(a.phase, a.microbatch) for a in order]


@dataclass(frozen=True)
class ZeroBubbleH2:
    """ZB-H2: more warm-up forwards fill the wait for the first gradient; ``I, W, F`` cycles.

    Stage ``s`` warms up with ``w = 2(K-1-s)+1`` forwards (the first ``I`` reaches it just as
    they end when ``F = I = W``), then runs ``I(j)``, the ``W`` deferred by ``s`` steps as in
    ZB-H1, and ``F(w+j)``; the deferred ``W``s end the list. At most ``2K-1-s`` micro-batches
    are live on stage ``s``.
    """

    name: ClassVar[str] = "zb_h2"

    def actions(self, stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
        """``2(K-1-s)+1`` warm-up forwards, then ``I(j), W(j-s), F(w+j)``, then the ``W``s."""
        check_stage_args(stage, num_stages, num_microbatches)
        m = num_microbatches
        warmup = min(2 * (num_stages - 1 - stage) + 1, m)
        order = [forward(i) for i in range(warmup)]
        for j in range(m):
            order.append(backward_input(j))
            if j >= stage:
                order.append(backward_weight(j - stage))
            if warmup + j < m:
                order.append(forward(warmup + j))
        return order + [backward_weight(j) for j in range(max(0, m - stage), m)]


@dataclass(frozen=True)
class InterleavedZeroBubble(Looped):
    """ZB1P: interleaved 1F1B with split backward, stage ``s`` on rank ``s mod K``.

    Rank ``r`` warms up with ``(V-1)·R + K-1-r`` forwards and defers its first ``r``
    weight gradients.
    """

    name: ClassVar[str] = "interleaved_zb"

    def rank_actions(self, rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
        """The interleaved walk with ``I`` for ``B`` and ``W`` deferred by ``rank`` steps."""
        check_rank_args(rank, num_ranks, num_microbatches)
        v, m = self.stages_per_rank, num_microbatches
        size = round_size(self.name, num_ranks, m)
        warmup = min((v - 1) * size + num_ranks - 1 - rank, v * m)
        return looped_one_f_one_b(rank, num_ranks, v, m, round_len=size, warmup=warmup,
                                  defer_weight=rank)


@dataclass(frozen=True)
class ZeroBubbleV:
    """ZB-V (Qi et al. 2023, section 6): two stages per rank in a V, split backward.

    Rank ``r`` holds stages ``r`` (down) and ``2K-1-r`` (up). It warms up with
    ``2(K-r)-1`` forwards of its down stage, then ``r`` pairs of up and down forwards, then
    ``K-r`` ``F, I, W`` triples of its up stage; steady state alternates
    ``F, I, W`` on the down and the up stage; the cool-down runs the remaining ``I``s,
    interleaving the ``W``s of the down stage, then the deferred ``W``s. The pattern is laid
    out for ``max(M, 2K-1)`` micro-batches; with fewer, the missing ones are left out.
    """

    name: ClassVar[str] = "zbv"

    def placement(self, num_ranks: int) -> Placement:
        """Rank ``r`` holds stages ``r`` and ``2K-1-r``."""
        return Placement.v_shape(num_ranks)

    def rank_actions(self, rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
        """The V-shaped zero-bubble order of ``rank``."""
        check_rank_args(rank, num_ranks, num_microbatches)
        k, m = num_ranks, num_microbatches
        order = _ZBVRank(rank, 2 * k - 1 - rank).build(k, max(m, 2 * k - 1))
        return [a for a in order if a.microbatch < m]


class _ZBVRank:
    """Counters of one rank's ZB-V walk: next ``F``, ``I`` and ``W`` of its two stages."""

    def __init__(self, down: int, up: int) -> None:
        self.down, self.up = down, up
        self.order: list[Action] = []
        self.next = {(phase, s): 0 for phase in "FIW" for s in (down, up)}

    def add(self, phase: str, stage: int) -> None:
        make = {"F": forward, "I": backward_input, "W": backward_weight}[phase]
        self.order.append(make(self.next[(phase, stage)], stage))
        self.next[(phase, stage)] += 1

    def fiw(self, stage: int) -> None:
        for phase in "FIW":
            self.add(phase, stage)

    def build(self, k: int, m: int) -> list[Action]:
        r, down, up = self.down, self.down, self.up
        for _ in range(2 * (k - r) - 1):
            self.add("F", down)
        for _ in range(r):
            self.add("F", up)
            self.add("F", down)
        for _ in range(k - r):
            self.fiw(up)
        while self.next[("F", up)] < self.next[("F", down)] or self.next[("F", down)] < m:
            if self.next[("F", down)] < m:
                self.add("F", down)
            self.add("I", down)
            self.add("W", down)
            self.fiw(up)
        for _ in range(r):
            self.add("I", down)
            self.add("I", up)
        for _ in range(k - r):
            self.add("I", down)
            self.add("W", down)
        for stage in (up, down):
            while self.next[("W", stage)] < self.next[("I", stage)]:
                self.add("W", stage)
        return self.order
