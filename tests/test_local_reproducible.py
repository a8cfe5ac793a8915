"""The local ``Pipe`` is reproducible run to run at torch's default thread count, with ties.

Two things used to make a pipelined training differ between identical runs
(``python -m seqpipe``: final loss 1.5547-1.5585):

* the intra-op thread count of a stage's action (its share of the caller's threads, or
  all of them while no other stage can compute) was decided from what the other stage
  threads were doing when it started, i.e. from the timing; a kernel's reductions add in
  another order at another thread count. Now it follows from the schedule alone
  (``seqpipe.local.lone``): asserted here by making one stage slow, then the other, and
  finding the same count for every action, and the one the dependencies give.
* a parameter two stages use (tied weights) got its micro-batches' gradients in the order
  the two stage threads reached it. Now each stage's sum is taken in its own order and the
  stages' sums are added in stage order (``seqpipe.local.tie_order``): asserted with
  contributions whose float32 sum depends on the order (1e8, 1, -1e8), equal to the
  unpipelined model's.

``tests/test_determinism.py`` covers reruns at one intra-op thread (the suite's setting)
and ``DistributedPipe``.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import seqpipe.local.thread_state as thread_state
from seqpipe import Pipe
from seqpipe.local.lone import lone_actions
from seqpipe.schedule import Action, backward_phase, forward_phase, get_schedule


@pytest.fixture
def two_default_threads(monkeypatch: Any) -> Iterator[None]:
    """Torch's default intra-op count is 2 (so two stages get 1 each, a lone action 2)."""
    monkeypatch.setattr(thread_state, "_DEFAULT_THREADS", 2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _lone(schedule: str, phase: Callable[[List[Action]], List[Action]] = list
          ) -> List[List[str]]:
    clock = get_schedule(schedule)
    programs = [phase([Action(a.phase, a.microbatch, s) for a in clock.actions(s, 2, 4)])
                for s in range(2)]
    return [[str(a) for a, lone in zip(p, flags) if lone]
            for p, flags in zip(programs, lone_actions(programs))]


def test_lone_actions_are_the_fill_and_drain_whatever_the_timing() -> None:
    assert _lone("fill_drain", forward_phase) == [["0F0"], ["1F3"]]
    assert _lone("fill_drain", backward_phase) == [["0B0"], ["1B3"]]
    assert _lone("fill_drain") == [["0F0", "0B0"], ["1F3", "1B3"]]
    # 1F1B: stage 1's first backward may overlap stage 0's second forward, so it is not lone
    assert _lone("1f1b") == [["0F0", "0B3"], []]
    assert _lone("zb_h1") == [["0F0"], []]
    stuck = [[Action.backward(0, 0)], [Action.forward(0, 1), Action.backward(0, 1)]]
    stuck[1].reverse()  # stage 1's backward before its forward: nothing can run
    assert lone_actions(stuck) == ((False,), (False, False))


Record = Dict[Tuple[str, str], List[int]]  # (stage, "F"/"B") -> the counts, in call order


class _Backward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, record: List[int]) -> Tensor:  # type: ignore[override]
        ctx.record = record
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:  # type: ignore[override]
        ctx.record.append(torch.get_num_threads())
        return grad, None


class _Probe(nn.Module):
    """Records the intra-op thread count of each forward and backward; the forward sleeps."""

    def __init__(self, name: str, record: Record, delay: float) -> None:
        super().__init__()
        self.name, self.record, self.delay = name, record, delay

    def forward(self, x: Tensor) -> Tensor:
        self.record.setdefault((self.name, "F"), []).append(torch.get_num_threads())
        time.sleep(self.delay)
        return _Backward.apply(x, self.record.setdefault((self.name, "B"), []))


def _thread_counts(slow: int) -> Record:
    record: Record = {}
    delays = [0.05 if s == slow else 0.0 for s in range(2)]
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), _Probe("0", record, delays[0]),
                              nn.Linear(4, 4), _Probe("1", record, delays[1])),
                chunks=4, balance=[2, 2], devices=["cpu", "cpu"], checkpoint="never")
    pipe.train_step(torch.randn(8, 4), torch.randn(8, 4), F.mse_loss, schedule="1f1b")
    return record


def test_an_actions_thread_count_does_not_follow_the_timing(two_default_threads: None) -> None:
    """Stage 1 slow: when its first backward starts, stage 0 has long finished its second
    forward and waits; stage 0 slow: it has not. The count is the same both times, the
    one the dependencies give (``_lone("1f1b")``): all 2 threads for stage 0's first
    forward and last backward, the share (1) for everything else."""
    expected = {("0", "F"): [2, 1, 1, 1], ("0", "B"): [1, 1, 1, 2],
                ("1", "F"): [1, 1, 1, 1], ("1", "B"): [1, 1, 1, 1]}
    assert _thread_counts(slow=1) == expected
    assert _thread_counts(slow=0) == expected


class _Scale(nn.Module):
    """``x[:, k] * w`` in place of column ``k``: the tied ``w``'s gradient from this use
    is the sum of column ``k`` (times the output's gradient, 1)."""

    def __init__(self, weight: nn.Parameter, column: int) -> None:
        super().__init__()
        self.weight, self.column = weight, column

    def forward(self, x: Tensor) -> Tensor:
        k = self.column
        return torch.cat([x[:, :k], x[:, k:k + 1] * self.weight, x[:, k + 1:]], dim=1)


def _tied(weight: nn.Parameter) -> nn.Sequential:
    return nn.Sequential(_Scale(weight, 0), _Scale(weight, 1))


def _sum_loss(out: Tensor, target: Tensor) -> Tensor:
    return out.sum()


# One row per micro-batch: stage 0's contributions (column 0) sum to -1e8 in either order
# (each 1 is lost against 1e8 in float32), stage 1's (column 1) to +1e8, so the plain
# model's gradient, the two uses' batch sums added, is 0. Added as the threads arrived, the
# stage-1 1e8 always came first (its backward of that micro-batch precedes stage 0's), the
# stage-0 -1e8 next (stage 0's first backward), then the three 1s: not 0. ``train_step``
# (1F1B) runs each stage's backwards in micro-batch order, ``backward()`` in reverse.
_ROWS = {"train_step": torch.tensor([[-1e8, 1e8], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]),
         "backward": torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [-1e8, 1e8]])}


@pytest.mark.parametrize("hooked", [False, True])  # True: the aliases' path (AliasSink)
@pytest.mark.parametrize("how", ["train_step", "backward"])
def test_a_tied_weights_gradient_adds_each_stages_sum_in_stage_order(how: str,
                                                                     hooked: bool) -> None:
    check_stage_order(nn.Parameter(torch.ones(1)), _tied, how, hooked)


def check_stage_order(weight: Tensor, build: Callable[[Tensor], nn.Sequential], how: str,
                      hooked: bool, hooks_once: bool = True) -> None:
    """Three runs of ``how`` on a 2-partition ``Pipe`` of ``build(weight)`` (two layers
    using ``weight``, fed ``_ROWS[how]``) give ``weight`` the plain model's gradient, 0;
    with ``hooked`` and ``hooks_once``, its hook fires once per step with it."""
    rows = _ROWS[how]
    build(weight)(rows).sum().backward()
    expected = weight.grad.clone()
    assert expected.item() == 0.0
    seen: List[Tensor] = []
    if hooked:
        weight.register_hook(lambda grad: seen.append(grad.clone()))
    for _ in range(3):
        weight.grad = None
        pipe = Pipe(build(weight), chunks=4, balance=[1, 1], devices=["cpu", "cpu"],
                    checkpoint="never")
        if how == "train_step":
            pipe.train_step(rows, rows, _sum_loss, schedule="1f1b")
        else:
            pipe(rows).sum().backward()
        assert torch.equal(weight.grad, expected), weight.grad
    if hooked and hooks_once:  # once per step, with the whole gradient
        assert len(seen) == 3 and all(torch.equal(g, expected) for g in seen), seen


def _train(schedule: str, checkpoint: str, steps: int = 3) -> Dict[str, Tensor]:
    """A few SGD steps of a small CNN with BatchNorm in a 2-partition ``Pipe`` (4 stages
    under ``interleaved_1f1b``); ``"forward"``: ``pipe(x)`` + ``backward()``."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    stages = 4 if schedule == "interleaved_1f1b" else 2
    balance = [3, 3, 2, 1] if stages == 4 else [4, 5]
    pipe = Pipe(model, chunks=4, checkpoint=checkpoint, balance=balance,
                devices=["cpu"] * stages, deferred_batch_norm=True)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(32, 3, 16, 16, generator=gen)
        y = torch.randint(10, (32,), generator=gen)
        optimizer.zero_grad()
        if schedule == "forward":
            F.cross_entropy(pipe(x), y).backward()
        else:
            pipe.train_step(x, y, F.cross_entropy, schedule=schedule)
        optimizer.step()
    return {k: v.clone() for k, v in pipe.state_dict().items()}


@pytest.mark.parametrize("schedule, checkpoint", [
    ("forward", "except_last"), ("1f1b", "except_last"), ("zb_h1", "always"),
    ("interleaved_1f1b", "never")])
def test_two_identical_trainings_end_bitwise_equal(two_default_threads: None, schedule: str,
                                                   checkpoint: str) -> None:
    first, second = _train(schedule, checkpoint), _train(schedule, checkpoint)
    assert first.keys() == second.keys()
    for key, value in first.items():
        assert torch.equal(value, second[key]), key
