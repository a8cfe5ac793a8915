"""The mini-batch loss ``train_step`` returns is the plain model's sum of its micro-batch
losses, added in micro-batch order, bit for bit, under every schedule.

Float addition is not associative, so the order matters in the last bits. The engines used
to add the losses in the order the last stage computed them, as one
``torch.stack(losses).sum()``: 16 or more losses are then added in another association than
one by one, and a schedule running the last stage's forwards out of order (a custom one)
added them in its own order. The values below make each of those orders give another
float32 number: ``1e8`` swallows the ones it is added to (float32 has 8 between
neighbours there). ``DistributedPipe``'s side runs in the failures launch
(``tests/test_distributed_failures.py``).
"""
from __future__ import annotations

from typing import List

import pytest
import torch
from torch import Tensor, nn

from seqpipe import Pipe
from seqpipe.core.loss_weights import in_order
from seqpipe.schedule import Action, backward, forward

# One sample per micro-batch; a micro-batch's loss is its target (times a weight of 1).
VALUES = [1.0] * 13 + [1e8, 1.0, -1e8]


def targets() -> Tensor:
    return torch.tensor(VALUES).reshape(-1, 1)


def target_loss(out: Tensor, target: Tensor) -> Tensor:
    """The target itself (plus the output times 0, so that the backward reaches the pipe)."""
    return target.sum() + 0.0 * out.sum()


def one(target: Tensor) -> int:
    """``count_fn``: every micro-batch loss weighs 1, so the loss is their plain sum."""
    return 1


class ReversedForwards:
    """Fill-drain with every stage's forwards in reverse micro-batch order (a custom clock)."""

    def actions(self, stage: int, num_stages: int, num_microbatches: int) -> List[Action]:
        m = range(num_microbatches)
        return [forward(i) for i in reversed(m)] + [backward(i) for i in m]


def plain_sum() -> Tensor:
    """The plain model's micro-batch losses, added one by one in micro-batch order."""
    total = torch.tensor(VALUES[0])
    for value in VALUES[1:]:
        total = total + value
    return total


def test_the_values_tell_the_orders_apart() -> None:
    """What the old code computed differs from the plain sum: the test below can fail."""
    losses = torch.tensor(VALUES)
    assert plain_sum().item() == 16.0
    assert losses.sum().item() != plain_sum().item()  # torch.stack(...).sum()
    assert torch.tensor(VALUES[::-1]).sum().item() != plain_sum().item()  # reversed
    assert torch.equal(in_order(dict(enumerate(losses))), plain_sum())
    assert torch.equal(in_order(dict(reversed(list(enumerate(losses))))), plain_sum())


@pytest.mark.parametrize("schedule", ["fill_drain", "1f1b", "zb_h1", "interleaved_1f1b",
                                      "reversed"])
def test_train_step_returns_the_plain_sum_in_micro_batch_order(schedule: str) -> None:
    torch.manual_seed(0)
    stages = 4 if schedule == "interleaved_1f1b" else 2
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(4)])
    pipe = Pipe(model, chunks=len(VALUES), balance=[4 // stages] * stages,
                devices=["cpu"] * stages, checkpoint="never")
    clock = ReversedForwards() if schedule == "reversed" else schedule
    loss = pipe.train_step(torch.ones(len(VALUES), 1), targets(), target_loss,
                           count_fn=one, schedule=clock)
    assert torch.equal(loss, plain_sum()), (loss.item(), plain_sum().item())
