"""A partition that starts by modifying its input in place, under every checkpoint mode.

The received micro-batch is a checkpoint's input, which its recomputation needs intact:
a first layer with ``inplace=True``, an in-place layer nested inside a block, or a custom
layer calling ``x.mul_()`` must all give the plain model's outputs and gradients, whether
``torch.utils.checkpoint`` recomputes the micro-batch or a split backward's ``I`` does
(zero-bubble schedules, both engines).
"""
from __future__ import annotations

import copy
from typing import Callable, List

import pytest
import torch
from torch import Tensor, nn

from distributed_harness import run_workers
from seqpipe import Pipe
from seqpipe.distributed import DistributedPipe

MODES = ("always", "except_last", "never")


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("first", [nn.ReLU(inplace=True), nn.Dropout(0.0, inplace=True)])
def test_inplace_first_layer_of_partition_matches_plain(checkpoint: str, first: nn.Module) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), copy.deepcopy(first),
                          nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 3))
    plain = copy.deepcopy(model)
    pipe = Pipe(model, chunks=3, checkpoint=checkpoint, balance=[2, 2, 2], devices=["cpu"] * 3)
    x = torch.randn(9, 6)
    pipe(x).square().sum().backward()
    # BatchNorm here sees micro-batches; compare against the plain model run per micro-batch.
    out = torch.cat([plain(part) for part in x.tensor_split(3)])
    out.square().sum().backward()
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


class Doubles(nn.Module):
    """A custom layer that writes its input in place (and declares nothing)."""

    def forward(self, x: Tensor) -> Tensor:
        return x.mul_(2.0)


def nested_block() -> nn.Module:
    return nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8))


def nested_leaky() -> nn.Module:
    """Not idempotent, unlike ReLU: applied twice to the same tensor, it shows."""
    return nn.Sequential(nn.LeakyReLU(0.1, inplace=True), nn.Linear(8, 8))


def custom_mul() -> nn.Module:
    return Doubles()


SHAPES: List[Callable[[], nn.Module]] = [nested_block, nested_leaky, custom_mul]
# Split backward (I then W), one and two stages per device: the balance puts the in-place
# layer (layer 2 of _model) first in a partition.
SPLIT = {"zb_h1": [2, 4], "zb_h2": [2, 4], "interleaved_zb": [1, 1, 2, 2], "zbv": [1, 1, 2, 2]}
CHECKPOINTED = ("always", "except_last")


def _model(head: Callable[[], nn.Module]) -> nn.Sequential:
    """Partition 1 (of [2, 3]) starts with ``head``, which modifies its input in place."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 8), head(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3)).double()


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("head", SHAPES)
def test_inplace_write_nested_or_custom_at_partition_start(
        checkpoint: str, head: Callable[[], nn.Module]) -> None:
    model = _model(head)
    plain = copy.deepcopy(model)
    x = torch.randn(8, 6, dtype=torch.float64)
    expected = plain(x)
    expected.square().mean().backward()
    pipe = Pipe(model, chunks=4, checkpoint=checkpoint, balance=[2, 4], devices=["cpu"] * 2)
    out = pipe(x)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-10)
    out.square().mean().backward()
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-12, rtol=1e-10, msg=name)


@pytest.mark.parametrize("schedule", sorted(SPLIT))
def test_inplace_write_at_partition_start_under_a_split_backward(schedule: str) -> None:
    """A checkpointed micro-batch runs its forward without a graph and is recomputed at
    its ``I``: that recomputation must start from the values the partition received."""
    x = torch.randn(8, 6, dtype=torch.float64)
    y = torch.randn(8, 3, dtype=torch.float64)
    balance = SPLIT[schedule]
    for head in SHAPES:
        plain = _model(head)
        expected_loss = nn.functional.mse_loss(plain(x), y)
        expected_loss.backward()
        for mode in CHECKPOINTED:
            model = _model(head)
            pipe = Pipe(model, chunks=4, checkpoint=mode, balance=balance,
                        devices=["cpu"] * len(balance))
            loss = pipe.train_step(x, y, nn.functional.mse_loss, schedule=schedule)
            torch.testing.assert_close(loss, expected_loss, atol=1e-12, rtol=1e-10)
            for (name, a), b in zip(model.named_parameters(), plain.parameters()):
                torch.testing.assert_close(a.grad, b.grad, atol=1e-12, rtol=1e-10,
                                           msg=f"{head.__name__}/{mode}/{name}")


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1", "zb_h2"])
def test_a_recomputation_leaves_the_received_tensors_unwritten(schedule: str) -> None:
    """A checkpointed micro-batch copies its input in its recomputation too, as
    ``torch.utils.checkpoint``'s does: the caller's input, which partition 0 receives, is
    not written by a first layer ``x.mul_(2)``, whichever pass recomputes it."""
    torch.manual_seed(2)
    model = nn.Sequential(Doubles(), nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 6, dtype=torch.float64)
    y = torch.randn(8, 3, dtype=torch.float64)
    given = x.clone()
    nn.functional.mse_loss(plain(x.clone()), y).backward()
    pipe = Pipe(model, chunks=4, checkpoint="always", balance=[2, 2], devices=["cpu"] * 2)
    pipe.train_step(x, y, nn.functional.mse_loss, schedule=schedule)
    assert torch.equal(x, given)
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-12, rtol=1e-10)


def _distributed(rank: int, world: int) -> None:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    y = torch.randn(8, 3, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    runs = [("1f1b", [2, 4], mode) for mode in MODES]
    runs += [(name, balance, mode) for name, balance in SPLIT.items() for mode in CHECKPOINTED]
    for head in SHAPES:
        plain = _model(head)
        nn.functional.mse_loss(plain(x), y).backward()
        for schedule, balance, mode in runs:
            pipe = DistributedPipe(_model(head), chunks=4, balance=balance, checkpoint=mode,
                                   schedule=schedule)
            loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                                   nn.functional.mse_loss)
            if pipe.is_last:
                expected = nn.functional.mse_loss(plain(x), y)
                torch.testing.assert_close(loss, expected, atol=1e-12, rtol=1e-10)
            mine = dict(pipe.named_parameters())
            assert mine
            for name, param in mine.items():  # by the plain model's names
                torch.testing.assert_close(param.grad, plain.get_parameter(name).grad,
                                           atol=1e-12, rtol=1e-10,
                                           msg=f"{head.__name__}/{schedule}/{mode}/{name}")


def test_inplace_write_at_partition_start_in_a_distributed_pipe() -> None:
    run_workers(_distributed, 2, timeout=180.0)
