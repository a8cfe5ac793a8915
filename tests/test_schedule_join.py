"""``join_splits``: a split backward joined into one ``B`` wherever its ``W`` fills no wait.

For hand-written costs (every split joined; only the drain's kept; every split kept) the
result validates, is what the simulator predicts best over every choice of which
backwards to split, and holds no more live micro-batches than the schedule it came from;
``Auto`` weighs it beside the named candidates, measures ``B`` by joining every other
backward in its first step, and ``Pipe.train_step`` trains it to the plain model's
gradients. (``DistributedPipe`` runs one in ``tests/test_schedule_auto.py``'s launch.)
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from seqpipe import Pipe
from seqpipe.distributed.auto import _costs
from seqpipe.distributed.plan import split_tails
from seqpipe.schedule import (
    Auto,
    B,
    Costs,
    I,
    Phase,
    Placement,
    ScheduleError,
    W,
    get_schedule,
    join_splits,
    joined,
    simulate,
    validate_schedule,
)
from seqpipe.schedule import F as Fwd
from seqpipe.schedule.join import Orders, RunsAs, simulate_orders
from seqpipe.schedule.protocol import placement_of, staged_orders

# session 13's transformer (units of ~9 ms: F 0.9 / 1.0, I 0 / 1.1, W 1.6 / 0.7) with a split
# costing stage 1 0.3 (B 1.5 < I + W 1.8): no W fills a wait that pays for its split
COSTLY = Costs((0.9, 1.0), (0.0, 1.1), (1.6, 0.7), (1.6, 1.5))
# the same with a split costing 0.2: the drain's W (after the last I) pays for it
CHEAP = Costs((0.9, 1.0), (0.0, 1.1), (1.6, 0.7), (1.6, 1.6))
# three ranks, stage 0 the heavier: every W of stages 1 and 2 fills a wait
FILLING = Costs((0.5,) * 3, (0.0, 0.5, 0.5), (1.0, 0.5, 0.5))


def _best_over_every_choice(name: str, k: int, m: int, costs: Costs,
                            runs_as: RunsAs | None) -> float:
    """The shortest simulated step over every set of kept splits of stages 1.. (stage 0's
    ``I`` is empty and its ``W`` right after it in these schedules: joining it moves
    nothing, so leaving it out of the search keeps it exhaustive and small)."""
    schedule = get_schedule(name)
    splits = [s for s in joined(schedule, k, m, lambda *_: True, name).splits if s[0] > 0]
    best = float("inf")
    for n in range(len(splits) + 1):
        for kept in itertools.combinations(splits, n):
            orders = joined(schedule, k, m, lambda s, i, kept=kept: s == 0 or (s, i) in kept,
                            name)
            best = min(best, simulate_orders(orders, costs, runs_as).makespan)
    return best


@pytest.mark.parametrize("costs, k, m, runs_as, kept", [
    (COSTLY, 2, 6, split_tails, ()),                    # every split joined: 1F1B
    (CHEAP, 2, 6, split_tails, ((1, 4),)),  # only the drain's: F4 I4 F5 I5 W5 W4 as run
    (FILLING, 3, 4, None, tuple((s, i) for s in (1, 2) for i in range(4))),  # all kept
], ids=["all-joined", "drain-kept", "all-kept"])
def test_join_splits_keeps_a_split_only_where_the_simulator_says_it_pays(
        costs: Costs, k: int, m: int, runs_as: RunsAs | None,
        kept: tuple[tuple[int, int], ...]) -> None:
    base = get_schedule("zb_h1")
    out = join_splits(base, k, m, costs, runs_as=runs_as)
    validate_schedule(out, k, m)
    assert out.name == "joined(zb_h1)"
    assert tuple(s for s in out.splits if s[0] > 0) == kept
    step = simulate_orders(out, costs, runs_as).makespan
    assert step == pytest.approx(_best_over_every_choice("zb_h1", k, m, costs, runs_as))
    every = joined(base, k, m, lambda *_: True, "zb_h1")
    assert step <= simulate_orders(every, costs, runs_as).makespan
    assert max(simulate(out, k, m).peak_live_microbatches) <= \
        max(simulate(base, k, m).peak_live_microbatches)


def test_joining_every_split_of_zb_h1_gives_1f1b_and_the_drains_run_last() -> None:
    out = join_splits(get_schedule("zb_h1"), 2, 6, COSTLY, runs_as=split_tails)
    assert [list(r) for r in out.orders] == staged_orders(get_schedule("1f1b"), 2, 6)
    drain = join_splits(get_schedule("zb_h1"), 2, 6, CHEAP, runs_as=split_tails)
    ran = split_tails(drain.orders, drain.layout)[1]  # the engine splits the last B, B5
    assert ran[-6:] == [Fwd(4, 1), I(4, 1), Fwd(5, 1), I(5, 1), W(5, 1), W(4, 1)]
    assert [a for a in ran if a.phase is not Phase.FORWARD][:4] == [B(i, 1) for i in range(4)]


def test_the_engine_splits_a_stages_last_backward_only_where_it_is_a_b() -> None:
    """``split_tails`` used to split the last ``B`` of a stage whose last backward was split
    already (a split that takes nothing off the step's end): ``joined(zb_h1)`` keeping the
    drain's splits ran ``B5`` as ``I5 W5``, and so did ``dualpipev``'s stage 1 its ``B2``."""
    drain = joined(get_schedule("zb_h1"), 2, 8, lambda s, i: s == 1 and i >= 6, "drain")
    assert split_tails(drain.orders, drain.layout)[1] == list(drain.orders[1])
    v = get_schedule("dualpipev")
    ran = split_tails(staged_orders(v, 2, 4), placement_of(v, 2))
    assert B(2, 1) in ran[1] and I(2, 1) not in ran[1]
    assert I(3, 3) in ran[0] and B(3, 3) not in ran[0]  # its last backward: a B, split
    one = split_tails(staged_orders(get_schedule("1f1b"), 2, 4), Placement.one_per_rank(2))
    assert one[1][-2:] == [I(3, 1), W(3, 1)] and one[0][-1] == B(3, 0)


def test_orders_are_for_one_size_and_joined_keeps_what_it_is_told() -> None:
    orders = joined(get_schedule("zb_h1"), 2, 3, lambda s, i: i == 2, "mine")
    assert isinstance(orders, Orders)
    assert orders.rank_actions(1, 2, 3) == [Fwd(0, 1), B(0, 1), Fwd(1, 1), B(1, 1), Fwd(2, 1),
                                            I(2, 1), W(2, 1)]
    assert orders.splits == ((0, 2), (1, 2))
    with pytest.raises(ScheduleError, match="'mine' was laid out for 2 ranks and 3 "
                                            "micro-batches, not 2 and 4.*join_splits"):
        validate_schedule(orders, 2, 4)


def test_auto_weighs_the_joined_candidates_and_measures_b_beside_i_and_w() -> None:
    assert Auto().choose(CHEAP, 2, 6, runs_as=split_tails).name == "joined(zb_h2)"
    choice = Auto(["zb_h1", "1f1b", "fill_drain"]).choose(CHEAP, 2, 6, runs_as=split_tails)
    assert choice.name == "joined(zb_h1)"
    assert choice.schedule == join_splits(get_schedule("zb_h1"), 2, 6, CHEAP,
                                          runs_as=split_tails)
    predicted = {p.name: p.makespan for p in choice.predictions}
    assert predicted["joined(zb_h1)"] < min(predicted["1f1b"], predicted["zb_h1"])
    assert "picked 'joined(zb_h1)' (split: stage 1 micro-batches 4) for 6 micro-batches; " \
        "predicted step: joined(zb_h1) 17500.0 ms, 1f1b 17600.0 ms, zb_h1 17900.0 ms" in \
        choice.describe(None)
    assert "joined" not in Auto(join=False).choose(CHEAP, 2, 6).describe(None)
    # the first step: every other micro-batch's backward joined, so B is measured too
    assert Auto().rank_actions(1, 2, 4) == [Fwd(0, 1), I(0, 1), Fwd(1, 1), B(1, 1), W(0, 1),
                                            Fwd(2, 1), I(2, 1), Fwd(3, 1), B(3, 1), W(2, 1)]
    assert Auto(join=False).rank_actions(1, 2, 4) == get_schedule("zb_h1").actions(1, 2, 4)


def test_auto_takes_steps_within_tie_as_equal_and_picks_the_smaller_peak() -> None:
    """Costs measured on the 2-rank transformer (ms): ``joined(zb_h2)`` (one more warm-up
    forward on stage 0: 3 live micro-batches) is predicted 1.3 % faster than ``1f1b`` (2),
    and ran 1.7 % slower; within ``Auto.TIE`` the smaller peak wins."""
    costs = Costs((7.48e-3, 7.92e-3), (0.09e-3, 9.69e-3), (14.27e-3, 8.22e-3),
                  (14.36e-3, 14.37e-3))
    choice = Auto().choose(costs, 2, 8, runs_as=split_tails)
    predicted = {p.name: p.makespan for p in choice.predictions}
    assert predicted["joined(zb_h2)"] < predicted["1f1b"] < predicted["joined(zb_h2)"] * 1.02
    assert choice.name == "1f1b"
    exact = Auto()
    exact.TIE = 0.0
    assert exact.choose(costs, 2, 8, runs_as=split_tails).name == "joined(zb_h2)"


def test_measured_costs_charge_a_split_what_it_costs() -> None:
    """``_costs`` of a measuring step (ns per action; rows F, B, I, W): on stage 1 the even
    micro-batches ran split (F 12, I 5, W 7), the odd ones whole (F 10, B 11); stage 0 ran
    whole only (F 10, B 30). B is the whole backwards' median and F theirs; a split
    forward's extra (12 - 10) is charged to W; a B above I + W is noise, taken as I + W."""
    table = torch.zeros(2, 4, 2, 4, dtype=torch.int64)
    for i in range(4):
        runs = [(0, 12), (2, 5), (3, 7)] if i % 2 == 0 else [(0, 10), (1, 11)]
        for row, ns in runs:
            table[:, row, 1, i] = torch.tensor([ns, 1])
        table[:, 0, 0, i] = torch.tensor([10, 1])
        table[:, 1, 0, i] = torch.tensor([30, 1])
    costs = _costs(table)
    assert costs.forward == (10e-9, 10e-9)
    assert costs.input == (15e-9, 5e-9) and costs.weight == (15e-9, 9e-9)
    assert costs.backward == (30e-9, 11e-9)
    table[0, 1, 1, 1] = table[0, 1, 1, 3] = 20
    assert _costs(table).backward == (30e-9, 14e-9)


class _Net(nn.Sequential):
    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3))


def test_pipe_trains_a_joined_schedule_to_the_plain_models_gradients() -> None:
    x, y = torch.randn(12, 6), torch.randn(12, 3)
    plain = _Net()
    F.mse_loss(plain(x), y).backward()
    schedule = join_splits(get_schedule("zb_h1"), 2, 6, CHEAP, runs_as=split_tails)
    assert schedule.splits and len(schedule.splits) < 12  # some joined, some kept
    pipe = Pipe(_Net(), chunks=6, balance=[3, 2], devices=["cpu", "cpu"])
    pipe.train_step(x, y, F.mse_loss, schedule=schedule)
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name
