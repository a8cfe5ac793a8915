"""``schedule="auto"``: the first step measures, every rank agrees, the simulator's best runs.

``Auto.choose`` is checked against ``simulate`` directly; ``DistributedPipe`` with an ``Auto``
schedule on a deliberately unbalanced pipe (layers that sleep in their forward, input and
weight gradients: stage 0 with a long weight gradient) must pick, on every rank, what
the simulator says is best for the costs it measured (within a memory cap when given),
run it from the second step on, log one line on rank 0, and give the plain model's
gradients on every step, the switch included.
"""
from __future__ import annotations

import logging
import time
import zlib
from typing import Any, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from distributed_harness import Failures, run_workers
from seqpipe.distributed import DistributedPipe
from seqpipe.distributed.plan import call_actions, split_tails
from seqpipe.schedule import (
    Auto,
    Costs,
    ScheduleError,
    get_schedule,
    join_splits,
    rank_orders,
    simulate,
)

DTYPE = torch.float64
UNEVEN = Costs(forward=(1.0, 1.0), input=(0.0, 1.0), weight=(3.0, 0.5))  # zb_h2 wins at M=4
# session 13's transformer costs (units of ~9 ms) with a split costing 0.1 on stage 1:
# at M = 4, join_splits keeps two of stage 1's splits and joins the others
MIXED = Costs((0.9, 1.0), (0.0, 1.1), (1.6, 0.7), (1.6, 1.7))


# --------------------------------------------------------------------------- choosing


def test_auto_picks_the_fastest_simulated_candidate_within_the_cap() -> None:
    steps = {n: simulate(n, 2, 4, forward_cost=UNEVEN.forward, input_cost=UNEVEN.input,
                         weight_cost=UNEVEN.weight).makespan for n in Auto.ONE_PER_RANK}
    assert min(steps, key=steps.__getitem__) == "zb_h2"
    choice = Auto(join=False).choose(UNEVEN, 2, 4)
    assert choice.name == "zb_h2"
    assert [p.name for p in choice.predictions] == sorted(steps, key=steps.__getitem__)
    assert {p.name: p.makespan for p in choice.predictions} == steps
    capped = Auto(max_live_microbatches=2, join=False).choose(UNEVEN, 2, 4)  # zb_h2: 3
    assert capped.name == "zb_h1"
    assert "zb_h2 16000.0 ms (peak 3 > cap)" in capped.describe(2)
    assert "picked 'zb_h1' for 4 micro-batches, at most 2 live" in capped.describe(2)


def test_auto_breaks_ties_by_peak_then_candidate_order_else_the_smallest_peak() -> None:
    even = Costs((1.0,) * 3, (1.0,) * 3, (1.0,) * 3)  # zb_h1 and zb_h2 take as long
    assert Auto(join=False).choose(even, 3, 6).name == "zb_h1"
    assert Auto(["zb_h2", "zb_h1"], join=False).choose(even, 3, 6).name == "zb_h1"  # peak
    # the same step and peak: the earlier, and joined(zb_h1) comes before zb_h1 (a free
    # split, B = I + W: joining the splits whose W fills no wait changes nothing)
    assert [(p.name, p.makespan, p.peak) for p in Auto().choose(even, 3, 6).predictions][:2] \
        == [("joined(zb_h1)", 20.0, 3.0), ("zb_h1", 20.0, 3.0)]
    assert Auto().choose(even, 3, 6).name == "joined(zb_h1)"
    assert Auto(["fill_drain", "1f1b"], max_live_microbatches=1).choose(even, 3, 6).name == \
        "1f1b"  # neither fits: the smaller peak (3 against 6)


def test_auto_measures_with_a_split_schedule_within_the_cap() -> None:
    assert Auto().measuring(3, 6) == "zb_h1"
    assert Auto(["1f1b", "zb_h2", "zb_h1"], max_live_microbatches=3).measuring(3, 6) == "zb_h1"
    assert Auto(["fill_drain", "1f1b"]).measuring(3, 6) == "fill_drain"  # no split: I = W = B/2
    assert Auto(Auto.LOOPED).measuring(2, 4) == "interleaved_zb"
    assert Auto(Auto.V_SHAPE).measuring(2, 3) == "zbv"  # dualpipev needs M >= 4 here
    auto = get_schedule("auto")
    assert isinstance(auto, Auto) and auto.candidates == Auto.ONE_PER_RANK
    assert rank_orders(Auto(join=False), 3, 6)[1] == rank_orders(get_schedule("zb_h1"), 3, 6)[1]


def test_auto_refuses_bad_options_with_what_to_do() -> None:
    with pytest.raises(ScheduleError, match="must place stages alike.*'zbv' on"):
        Auto(["1f1b", "zbv"]).placement(2)
    with pytest.raises(ValueError, match="unknown schedule 'zb_h3'"):
        Auto(["zb_h3"])
    with pytest.raises(ValueError, match="non-empty sequence of built-in schedule names"):
        Auto("zb_h1")
    with pytest.raises(ValueError, match="max_live_microbatches must be > 0"):
        Auto(max_live_microbatches=0)
    with pytest.raises(ValueError, match="measure_steps must be an int >= 1, got 0"):
        Auto(measure_steps=0)
    with pytest.raises(ScheduleError, match="none of Auto's candidates"):
        Auto(["dualpipev"]).measuring(2, 3)


# --------------------------------------------------------------------------- running


class _Input(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float) -> Tensor:
        ctx.seconds = seconds
        return x * 0.9

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:
        time.sleep(ctx.seconds)
        return grad * 0.9, None


class _Weight(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, weight: Tensor, a: Tensor, seconds: float) -> Tensor:
        ctx.save_for_backward(a)
        ctx.seconds = seconds
        return weight * a

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None, None]:
        time.sleep(ctx.seconds)
        (a,) = ctx.saved_tensors
        return (grad * a).sum(0), None, None


class Sleepy(nn.Module):
    """``a + w * a`` with ``a = 0.9 x``; the forward, the input path (``a``) and the weight
    path (``w``) each sleep their milliseconds, so a stage's F, I and W are known."""

    def __init__(self, forward_ms: float, input_ms: float, weight_ms: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-0.5, 0.5, 4, dtype=DTYPE))
        self.ms = (forward_ms / 1e3, input_ms / 1e3, weight_ms / 1e3)

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(self.ms[0])
        a = _Input.apply(x, self.ms[1])
        return a + _Weight.apply(self.weight, a.detach(), self.ms[2])


def uneven() -> nn.Sequential:
    """The costs of ``UNEVEN`` in tens of milliseconds (stage 0 has no input gradient)."""
    return nn.Sequential(Sleepy(10, 0, 30), Sleepy(10, 10, 5))


def _steps(rank: int, world: int, cap: Optional[float], failures: Failures) -> None:
    x = torch.randn(7, 4, dtype=DTYPE, generator=torch.Generator().manual_seed(0))  # ragged
    ref = uneven()
    F.mse_loss(ref(x), x).backward()
    records: List[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("seqpipe.distributed")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    auto = Auto(max_live_microbatches=cap)
    pipe = DistributedPipe(uneven(), 4, schedule=auto, balance=[1, 1], checkpoint="never")
    try:
        for step in range(3):
            pipe.zero_grad(set_to_none=True)
            pipe.train_step(x if pipe.is_first else None, x if pipe.is_last else None,
                            F.mse_loss)
            failures.grads(pipe, ref, f"cap {cap}, step {step}")
            choice = pipe.auto_choice
            failures.expect(choice is not None, f"cap {cap}: no choice after step {step}")
            if choice is None:
                continue
            expected = auto.choose(choice.costs, world, 4, runs_as=split_tails)  # simulate's
            failures.expect(choice == expected, f"cap {cap}: {choice} != {expected}")
            if cap is not None:
                failures.expect(max(simulate(choice.schedule, world, 4).peak_activation_memory)
                                <= cap, f"cap {cap}: {choice.name} holds more")
            if step > 0:  # the call that just ran: the pick's
                ran = pipe._calls.plans[(4, True)].actions
                wanted = call_actions(choice.schedule, world, 4, True)[rank]
                failures.expect(ran == wanted, f"cap {cap}, step {step}: ran {ran}, "
                                f"not {choice.name}'s")
            _same_on_every_rank(failures, world, str(choice))
        lines = [r.getMessage() for r in records]
        if rank == 0 and pipe.auto_choice is not None:
            failures.expect(len(lines) == 1 and f"picked '{pipe.auto_choice.name}'" in lines[0]
                            and "predicted step: " in lines[0], f"cap {cap}: logged {lines}")
        if rank != 0:
            failures.expect(not lines, f"rank {rank} logged {lines}")
        pipe.train_step(x[:3] if pipe.is_first else None, x[:3] if pipe.is_last else None,
                        F.mse_loss)  # 3 micro-batches: picked (and logged) for M = 3
        failures.expect(3 in pipe._auto.choices, "no choice for M = 3")  # type: ignore[union-attr]
        failures.expect(len(records) == (2 if rank == 0 else 0), f"logged {records}")
    finally:
        logger.removeHandler(handler)


def _same_on_every_rank(failures: Failures, world: int, text: str) -> None:
    mine = torch.tensor(zlib.crc32(text.encode()))
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    failures.expect(len(set(map(int, everyone))) == 1, f"ranks differ: {everyone}: {text}")


def _joined(rank: int, world: int, failures: Failures) -> None:
    """A schedule with some backwards joined and some split (``MIXED``'s) trains to the
    plain model's gradients and runs the orders it names."""
    x = torch.randn(8, 4, dtype=DTYPE, generator=torch.Generator().manual_seed(2))
    ref = uneven()
    F.mse_loss(ref(x), x).backward()
    schedule = join_splits(get_schedule("zb_h1"), world, 4, MIXED, runs_as=split_tails)
    failures.expect(schedule.splits == ((1, 0), (1, 2)), f"kept {schedule.splits}")
    pipe = DistributedPipe(uneven(), 4, schedule=schedule, balance=[1, 1], checkpoint="never")
    pipe.train_step(x if pipe.is_first else None, x if pipe.is_last else None, F.mse_loss)
    failures.grads(pipe, ref, "joined(zb_h1)")
    ran = pipe._calls.plans[(4, True)].actions
    failures.expect(ran == call_actions(schedule, world, 4, True)[rank], f"ran {ran}")


def _two_measured(rank: int, world: int, failures: Failures) -> None:
    """``Auto(measure_steps=2)``: the first two steps run the measuring schedule, the costs
    are the medians over both steps' micro-batches, and the pick runs from the third."""
    x = torch.randn(8, 4, dtype=DTYPE, generator=torch.Generator().manual_seed(3))
    ref = uneven()
    F.mse_loss(ref(x), x).backward()
    auto = Auto(measure_steps=2)
    pipe = DistributedPipe(uneven(), 4, schedule=auto, balance=[1, 1], checkpoint="never")
    measuring = call_actions(auto, world, 4, True)[rank]
    for step in range(3):
        pipe.zero_grad(set_to_none=True)
        pipe.train_step(x if pipe.is_first else None, x if pipe.is_last else None, F.mse_loss)
        failures.grads(pipe, ref, f"measure_steps=2, step {step}")
        failures.expect((pipe.auto_choice is None) == (step == 0), f"step {step}: "
                        f"{pipe.auto_choice}")
    choice = pipe.auto_choice
    failures.expect(choice is not None and pipe._calls.plans[(4, True)].actions ==
                    call_actions(choice.schedule, world, 4, True)[rank], "not the pick")
    failures.expect(measuring != call_actions(get_schedule("zb_h1"), world, 4, True)[rank],
                    "the first steps ran zb_h1 as named, not with B measured")
    if choice is not None:
        _same_on_every_rank(failures, world, repr((choice, choice.schedule)))


def _auto(rank: int, world: int) -> None:
    failures = Failures(rank)
    for cap in (None, 2.0):
        _steps(rank, world, cap, failures)
    _joined(rank, world, failures)
    _two_measured(rank, world, failures)
    failures.finish()


def test_auto_picks_the_simulators_best_for_measured_costs_on_every_rank() -> None:
    """Two ranks, an unbalanced pipe, with and without a memory cap."""
    run_workers(_auto, 2, timeout=120)


def even() -> nn.Sequential:
    """F = I = W on both stages: zb_h1 and zb_h2 tie, and the tie goes to zb_h1."""
    return nn.Sequential(Sleepy(10, 0, 10), Sleepy(10, 10, 10))


def _replicas(rank: int, world: int) -> None:
    """2 stages x 2 replicas; replica 0 measures ``uneven`` costs (zb_h2 alone would win),
    replica 1 ``even`` ones (zb_h1 would): the costs are summed over the replicas too, so
    all four ranks hold the same costs and pick the same schedule."""
    from torch.distributed.device_mesh import init_device_mesh

    from seqpipe.distributed import mesh_groups

    failures = Failures(rank)
    pp, dp = mesh_groups(init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp")))
    replica = dist.get_rank(dp)
    pipe = DistributedPipe(uneven() if replica == 0 else even(), 4, schedule="auto",
                           balance=[1, 1], checkpoint="never", group=pp,
                           data_parallel_group=dp)
    x = torch.randn(8, 4, dtype=DTYPE, generator=torch.Generator().manual_seed(replica))
    for _ in range(2):
        pipe.train_step(x if pipe.is_first else None, x if pipe.is_last else None, F.mse_loss)
    choice = pipe.auto_choice
    assert choice is not None
    _same_on_every_rank(failures, world, repr((choice, choice.schedule)))  # costs: bit for bit
    failures.finish()


def test_auto_replicas_agree_on_costs_and_pick() -> None:
    run_workers(_replicas, 4, timeout=150)
