"""Micro-batches: scatter a mini-batch along dim 0 and gather the pieces back."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from seqpipe import Pipe
from seqpipe.core.microbatch import Batch, check_input, gather, scatter


def sizes(batches) -> list:
    return [b.tensors[0].shape[0] for b in batches]


@pytest.mark.parametrize("size, chunks, expected", [
    (10, 4, [3, 3, 2, 2]),
    (3, 8, [1, 1, 1]),
    (8, 4, [2, 2, 2, 2]),
    (10, 1, [10]),
    (10, 3, [4, 3, 3]),
    (10, 10, [1] * 10),
    (10, 16, [1] * 10),
    (1, 4, [1]),
])
def test_scatter_sizes(size, chunks, expected):
    assert sizes(scatter(torch.randn(size, 2), chunks)) == expected


def test_scatter_keeps_order_and_values():
    x = torch.arange(10).view(10, 1)
    pieces = scatter(x, 4)
    assert [b.value[:, 0].tolist() for b in pieces] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert all(b.atomic for b in pieces)


def test_scatter_keeps_the_other_dimensions_and_dtype():
    x = torch.randn(5, 3, 2, dtype=torch.float64)
    pieces = scatter(x, 2)
    assert [tuple(b.value.shape) for b in pieces] == [(3, 3, 2), (2, 3, 2)]
    assert all(b.value.dtype == torch.float64 for b in pieces)


def test_scatter_tuple_cuts_every_tensor_alike():
    x, ids = torch.randn(10, 3), torch.arange(10)
    pieces = scatter((x, ids), 4)
    assert sizes(pieces) == [3, 3, 2, 2]
    for piece, start in zip(pieces, [0, 3, 6, 8]):
        assert not piece.atomic and len(piece) == 2
        px, pids = piece.value
        assert pids[0].item() == start
        assert torch.equal(px, x[start:start + len(pids)])
        assert pids.dtype == torch.int64


def test_scatter_empty_batch_gives_nothing():
    assert scatter(torch.empty(0, 3), 4) == []


@pytest.mark.parametrize("size, chunks", [(10, 4), (3, 8), (7, 7), (1, 1)])
def test_gather_inverts_scatter_for_a_tensor(size, chunks):
    x = torch.randn(size, 4)
    out = gather(scatter(x, chunks))
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, x)


@pytest.mark.parametrize("chunks", [1, 3, 4])
def test_gather_inverts_scatter_for_a_tuple(chunks):
    value = (torch.randn(10, 4), torch.arange(10), torch.randn(10, 2, 2))
    out = gather(scatter(value, chunks))
    assert isinstance(out, tuple) and len(out) == 3
    assert all(torch.equal(a, b) for a, b in zip(out, value))


def test_gather_of_a_zero_dim_output_explains_the_fix():
    with pytest.raises(ValueError, match="0-dim tensor.*compute the loss outside"):
        gather([Batch((torch.tensor(1.0),), True), Batch((torch.tensor(2.0),), True)])


def test_batch_of_keeps_tensor_or_tuple():
    t = torch.randn(2)
    assert Batch.of(t).atomic and Batch.of(t).value is t
    pair = Batch.of((t, t))
    assert not pair.atomic and pair.value == (t, t) and isinstance(pair.value, tuple)
    assert Batch.of([t, t]).tensors == (t, t)  # a list is accepted as a tuple


@pytest.mark.parametrize("value, error", [
    ((), TypeError),
    (torch.tensor(3.0), ValueError),
    ((torch.randn(2, 1), torch.randn(3, 1)), ValueError),
    ((torch.randn(2, 1), torch.tensor(1)), ValueError),
    (3, TypeError),
])
def test_check_input_rejects(value, error):
    with pytest.raises(error):
        check_input(value)


class RecordSizes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def forward(self, x):
        self.seen.append(x.shape[0])
        return x


@pytest.mark.parametrize("size, chunks, expected", [(10, 4, [3, 3, 2, 2]), (3, 8, [1, 1, 1])])
def test_layers_inside_a_pipe_see_the_micro_batches(size, chunks, expected):
    first, last = RecordSizes(), RecordSizes()
    pipe = Pipe(nn.Sequential(first, nn.Linear(2, 2), last), chunks=chunks, checkpoint="never",
                balance=[1, 2], devices=["cpu", "cpu"])
    out = pipe(torch.randn(size, 2))
    assert first.seen == expected and last.seen == expected
    assert out.shape == (size, 2)
