"""A partition that starts with an in-place layer, under every checkpoint mode."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from seqpipe import Pipe


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
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
