"""A partition that starts by modifying its input in place, under every checkpoint mode.

The received micro-batch is a checkpoint's input, which its recomputation needs intact:
a first layer with ``inplace=True``, an in-place layer nested inside a block, or a custom
layer calling ``x.mul_()`` must all give the plain model's outputs and gradients.
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


def custom_mul() -> nn.Module:
    return Doubles()


SHAPES: List[Callable[[], nn.Module]] = [nested_block, custom_mul]


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


def _distributed(rank: int, world: int) -> None:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    y = torch.randn(8, 3, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    for head in SHAPES:
        plain = _model(head)
        nn.functional.mse_loss(plain(x), y).backward()
        for mode in MODES:
            pipe = DistributedPipe(_model(head), chunks=4, balance=[2, 4], checkpoint=mode)
            loss = pipe.train_step(x if rank == 0 else None, y if rank == world - 1 else None,
                                   nn.functional.mse_loss)
            if rank == world - 1:
                expected = nn.functional.mse_loss(plain(x), y)
                torch.testing.assert_close(loss, expected, atol=1e-12, rtol=1e-10)
            mine = dict(pipe.named_parameters())
            assert mine
            for name, param in mine.items():  # by the plain model's names
                torch.testing.assert_close(param.grad, plain.get_parameter(name).grad,
                                           atol=1e-12, rtol=1e-10,
                                           msg=f"{head.__name__}/{mode}/{name}")


def test_inplace_write_at_partition_start_in_a_distributed_pipe() -> None:
    run_workers(_distributed, 2, timeout=180.0)
