"""``Auto``: pick the built-in schedule the simulator predicts fastest for measured costs.

An engine runs ``Auto`` as a schedule of its own for its first training step: the first
candidate that splits its backward and keeps within the memory cap, with every other
micro-batch's backward joined into one ``B`` (so the step measures ``F``, ``B``, ``I`` and
``W`` of every stage: ``I + W - B`` is what a split costs). With the per-stage costs of
that step (``Costs``), :meth:`Auto.choose` simulates every candidate that can lay out the
call's micro-batches and keeps within the cap, and, for each that splits,
``joined(name)``: its orders with a split kept only where the simulator predicts its ``W``
fills a wait (``seqpipe.schedule.join``). It picks the shortest predicted step; ties
(within ``Auto.TIE``, 2 %) go to the smaller peak memory, then to the earlier candidate,
so every rank, given the same costs, picks the same.

A pipeline's placement (which rank holds which stages, and the layers of each) is fixed
when it is built, so the candidates must share one: ``Auto.ONE_PER_RANK`` (the default),
``Auto.LOOPED`` (stage ``s`` on rank ``s mod K``, two per rank) or ``Auto.V_SHAPE``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from seqpipe.schedule.action import Action, Phase
from seqpipe.schedule.costs import Costs
from seqpipe.schedule.join import Orders, RunsAs, join_splits, joined, simulate_orders
from seqpipe.schedule.placement import Placement
from seqpipe.schedule.protocol import AnySchedule, ScheduleError, placement_of, rank_orders
from seqpipe.schedule.registry import SCHEDULES, builtin_or_object, normalized
from seqpipe.schedule.replay import replay

__all__ = ["Auto", "AutoChoice", "Costs", "Prediction"]


@dataclass(frozen=True)
class Prediction:
    """One candidate's simulated step: its makespan (seconds) and peak memory (the most
    whole micro-batches of a rank's layers alive at once, ``peak_activation_memory``);
    ``schedule``: what runs if it is picked (a built-in, or the ``Orders`` of a
    ``joined(...)`` candidate)."""

    name: str
    makespan: float
    peak: float
    fits: bool  # within the memory cap
    schedule: Optional[AnySchedule] = field(default=None, repr=False)


@dataclass(frozen=True)
class AutoChoice:
    """What :meth:`Auto.choose` picked for a call of ``num_microbatches``, and why."""

    name: str
    num_microbatches: int
    predictions: tuple[Prediction, ...]  # the candidates that can run, fastest first
    costs: Costs

    @property
    def schedule(self) -> AnySchedule:
        """What the pick runs: a built-in, or (``joined(...)``) its ``Orders``."""
        picked = next(p for p in self.predictions if p.name == self.name)
        return picked.schedule if picked.schedule is not None else SCHEDULES[self.name]()

    def describe(self, cap: Optional[float]) -> str:
        """One line: the pick (and which backwards it still splits) and every candidate's
        predicted step."""
        shown = ", ".join(f"{p.name} {p.makespan * 1e3:.1f} ms"
                          + ("" if p.fits else f" (peak {p.peak:g} > cap)")
                          for p in self.predictions)
        limit = "" if cap is None else f", at most {cap:g} live micro-batches per rank"
        picked = self.schedule
        kept = ""
        if isinstance(picked, Orders):
            by_stage: dict[int, list[str]] = {}
            for stage, i in sorted(picked.splits):
                by_stage.setdefault(stage, []).append(str(i))
            kept = " (split: " + ("; ".join(f"stage {s} micro-batches {', '.join(i)}"
                                             for s, i in by_stage.items()) or "none") + ")"
        return (f"seqpipe: schedule='auto' picked {self.name!r}{kept} for "
                f"{self.num_microbatches} micro-batches{limit}; predicted step: {shown}")


def _splits(schedule: object, num_ranks: int, m: int) -> bool:
    _, orders = rank_orders(schedule, num_ranks, m)  # type: ignore[arg-type]
    return any(a.phase is Phase.BACKWARD_INPUT for row in orders for a in row)


class Auto:
    """The schedule ``DistributedPipe(..., schedule="auto")`` runs (``Auto()``).

    Args:
        candidates: built-in names sharing one placement, in order of preference on ties
            (of step and peak memory).
        max_live_microbatches: the most activations a rank may hold, in whole micro-batches
            of its layers (``Simulation.peak_activation_memory``); candidates above it are
            not picked (if none fits, the one with the smallest peak is). Default: no cap.
        join: also weigh, for each candidate that splits its backward, ``joined(name)``:
            the same orders with a split joined into one ``B`` wherever the simulator,
            charging a split what it was measured to cost, predicts it fills no wait
            (:func:`~seqpipe.schedule.join_splits`). The first step then measures ``B``
            too, running every other micro-batch's backward joined. ``False``: the named
            candidates only, measured with their own orders.
        measure_steps: how many first steps measure (the costs are the medians over all
            their micro-batches): more samples where one step's times vary (a shared
            machine); the pick runs from the step after them.
    """

    ONE_PER_RANK = ("zb_h1", "zb_h2", "1f1b", "fill_drain")
    LOOPED = ("interleaved_zb", "interleaved_1f1b", "looped_bfs")
    V_SHAPE = ("zbv", "dualpipev")
    TIE = 0.02
    """Predicted steps within this share of the fastest count as equal, and the one holding
    the least memory is picked (then the earlier candidate): the simulator models no
    communication, and the costs are one step's medians, so closer predictions do not
    tell which is faster (a ``joined(zb_h2)`` predicted 1.3 % faster than ``1f1b`` on the
    2-rank transformer ran 1.7 % slower, and holds one more micro-batch on rank 0)."""

    def __init__(self, candidates: Sequence[str] = ONE_PER_RANK, *,
                 max_live_microbatches: Optional[float] = None, join: bool = True,
                 measure_steps: int = 1) -> None:
        if isinstance(candidates, str) or not candidates:
            raise ValueError("Auto needs a non-empty sequence of built-in schedule names, "
                             f"e.g. Auto.ONE_PER_RANK = {Auto.ONE_PER_RANK}")
        names = []
        for name in candidates:
            builtin_or_object(name)  # an unknown name: ValueError listing the valid ones
            key = normalized(name)
            names.append("fill_drain" if key == "gpipe" else key)
        self.candidates = tuple(dict.fromkeys(names))
        if max_live_microbatches is not None and not max_live_microbatches > 0:
            raise ValueError(f"max_live_microbatches must be > 0, got {max_live_microbatches!r}")
        self.max_live_microbatches = max_live_microbatches
        self.join = bool(join)
        if isinstance(measure_steps, bool) or not isinstance(measure_steps, int) or \
                measure_steps < 1:
            raise ValueError(f"measure_steps must be an int >= 1, got {measure_steps!r}")
        self.measure_steps = measure_steps

    def __repr__(self) -> str:
        return (f"Auto({list(self.candidates)}, "
                f"max_live_microbatches={self.max_live_microbatches}, join={self.join}, "
                f"measure_steps={self.measure_steps})")

    def placement(self, num_ranks: int) -> Placement:
        """The candidates' common placement; ``ScheduleError`` if they differ."""
        placements = {n: placement_of(SCHEDULES[n](), num_ranks) for n in self.candidates}
        first = placements[self.candidates[0]]
        for name, placement in placements.items():
            if placement.ranks != first.ranks:
                raise ScheduleError(
                    f"Auto's candidates must place stages alike, since a pipeline cannot "
                    f"move layers once built: {self.candidates[0]!r} places stages on ranks "
                    f"{list(first.ranks)}, {name!r} on {list(placement.ranks)}; choose "
                    f"among one of Auto.ONE_PER_RANK, Auto.LOOPED, Auto.V_SHAPE")
        return first

    def _runnable(self, num_ranks: int, m: int) -> list[tuple[str, float]]:
        """The candidates that can lay out ``m`` micro-batches, with their peak memory."""
        out = []
        for name in self.candidates:
            try:
                peak = max(replay(SCHEDULES[name](), num_ranks, m).peak_activation_memory)
            except ScheduleError:
                continue
            out.append((name, peak))
        if not out:
            raise ScheduleError(f"none of Auto's candidates {list(self.candidates)} can run "
                                f"{m} micro-batches on {num_ranks} ranks")
        return out

    def _fits(self, peak: float) -> bool:
        cap = self.max_live_microbatches
        return cap is None or peak <= cap + 1e-9

    def measuring(self, num_ranks: int, m: int) -> str:
        """The schedule of the first step: the first runnable candidate within the cap
        that splits its backward; else the first within the cap; else the smallest peak."""
        runnable = self._runnable(num_ranks, m)
        fitting = [n for n, peak in runnable if self._fits(peak)]
        split = [n for n in fitting if _splits(SCHEDULES[n](), num_ranks, m)]
        if split or fitting:
            return (split or fitting)[0]
        return min(runnable, key=lambda np: np[1])[0]

    def measuring_schedule(self, num_ranks: int, m: int) -> AnySchedule:
        """What the first step runs: :meth:`measuring`'s schedule; with ``join`` and a split
        one, its odd micro-batches' backwards joined into ``B`` (in ``I``'s place), so
        that the step measures ``B`` beside ``I`` and ``W`` (their difference is what a
        split costs) on every stage, alternately, so that both meet the same conditions."""
        name = self.measuring(num_ranks, m)
        schedule = SCHEDULES[name]()
        if not self.join or not _splits(schedule, num_ranks, m):
            return schedule
        return joined(schedule, num_ranks, m, lambda stage, i: i % 2 == 0,
                      f"{name}, odd micro-batches joined")

    def rank_actions(self, rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
        """Before costs are known: the measuring schedule's actions."""
        measuring = self.measuring_schedule(num_ranks, num_microbatches)
        return rank_orders(measuring, num_ranks, num_microbatches)[1][rank]

    def choose(self, costs: Costs, num_ranks: int, m: int, *,
               runs_as: Optional[RunsAs] = None) -> AutoChoice:
        """The runnable candidate with the shortest simulated step for ``costs`` within the
        cap (the smallest peak if none fits); ties (steps within ``TIE`` of the fastest):
        the smaller peak, then the earlier candidate.

        With ``join``, each split candidate ``name`` is preceded by ``joined(name)`` (unless
        that joins nothing, or gives another candidate's orders), so on a tie the one
        that splits less wins. ``runs_as``: what the engine runs for given orders (its own
        splits, ``DistributedPipe``'s ``split_tails``), which every step is simulated as.
        """
        predictions: list[Prediction] = []
        runnable = self._runnable(num_ranks, m)
        table = {name: _fixed(SCHEDULES[name](), num_ranks, m, name) for name, _ in runnable}
        for name, peak in runnable:
            schedule = SCHEDULES[name]()
            if self.join and _splits(schedule, num_ranks, m):
                refined = join_splits(schedule, num_ranks, m, costs, runs_as=runs_as,
                                      name=f"joined({name})")
                if refined.orders not in {o.orders for o in table.values()}:
                    sim = simulate_orders(refined, costs, runs_as)
                    low = max(sim.peak_activation_memory)
                    predictions.append(Prediction(refined.name, sim.makespan, low,
                                                  self._fits(low), refined))
            step = simulate_orders(table[name], costs, runs_as).makespan
            predictions.append(Prediction(name, step, peak, self._fits(peak)))
        fitting = [p for p in predictions if p.fits]
        if fitting:  # steps within TIE of the fastest are equal: the smaller peak wins
            fastest = min(p.makespan for p in fitting)
            best = min((p for p in fitting if p.makespan <= fastest * (1 + self.TIE)),
                       key=lambda p: p.peak)  # min keeps the first: the earlier candidate
        else:
            best = min(predictions, key=lambda p: p.peak)
        ranked = tuple(sorted(predictions, key=lambda p: p.makespan))  # stable: ties keep order
        return AutoChoice(best.name, m, ranked, costs)


def _fixed(schedule: AnySchedule, num_ranks: int, m: int, name: str) -> Orders:
    """``schedule``'s orders for ``m`` micro-batches as ``Orders`` (each naming its stage)."""
    return joined(schedule, num_ranks, m, lambda stage, i: True, name)
