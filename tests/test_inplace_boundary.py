"""A partition that starts by modifying its input in place, under every checkpoint mode.

The received micro-batch is a checkpoint's input, which its recomputation needs intact:
a first layer with ``inplace=True``, an in-place layer nested inside a block, or a custom
layer calling ``x.mul_()`` must all give the plain model's outputs and gradients, whether
``torch.utils.checkpoint`` recomputes the micro-batch or a split backward's ``I`` does
(zero-bubble schedules, both engines).

The first partition's input is the caller's, cut into micro-batches that are views of it
sharing its version counter: there a writing first layer runs on a copy, in every mode
(so the caller's tensor keeps its values and version), and a first layer that writes
nothing runs on the views themselves, uncopied, from its second call on.
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


def _first(head: Callable[[], nn.Module]) -> nn.Sequential:
    """Partition 0 starts with ``head``: it writes the caller's micro-batches."""
    torch.manual_seed(3)
    return nn.Sequential(head(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()


FIRST: List[Callable[[], nn.Module]] = [lambda: nn.ReLU(inplace=True), *SHAPES]


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("head", FIRST)
def test_inplace_first_layer_of_the_pipe_leaves_the_callers_input_alone(
        checkpoint: str, head: Callable[[], nn.Module]) -> None:
    """Outputs and gradients (the parameters', and the input's through a non-leaf input)
    are the plain model's; the plain model writes its input, the pipe does not, twice."""
    model = _first(head)
    plain = copy.deepcopy(model)
    pipe = Pipe(model, chunks=4, checkpoint=checkpoint, balance=[2, 2], devices=["cpu"] * 2)
    given = torch.randn(8, 8, dtype=torch.float64)
    for _ in range(2):  # the second call: what the first learned
        leaf, plain_leaf = given.clone().requires_grad_(), given.clone().requires_grad_()
        x = leaf * 1  # a non-leaf input, which an in-place layer may write in the plain model
        version = x._version
        expected = plain(plain_leaf * 1)
        expected.square().mean().backward()
        out = pipe(x)
        torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-10)
        out.square().mean().backward()
        assert torch.equal(x, given) and x._version == version, "the caller's input changed"
        torch.testing.assert_close(leaf.grad, plain_leaf.grad, atol=1e-12, rtol=1e-10)
        for (name, a), b in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-12, rtol=1e-10, msg=name)
        x = given.clone()  # an input without a gradient: under torch.no_grad too
        with torch.no_grad():
            pipe(x)
        assert torch.equal(x, given)


class Sees(nn.Module):
    """Records the address of the memory of each input it is called with."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace
        self.seen: List[int] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(x.untyped_storage().data_ptr())
        return x.add_(1.0) if self.inplace else x + 1.0


@pytest.mark.parametrize("inplace", [False, True])
def test_the_first_partition_copies_only_when_its_layers_write(inplace: bool) -> None:
    """The first micro-batch is copied, to see whether the layers write it; from then on
    only a writing partition copies: the others run on the caller's memory (no copy)."""
    sees = Sees(inplace)
    pipe = Pipe(nn.Sequential(sees, nn.Linear(8, 8), nn.Linear(8, 3)), chunks=4,
                checkpoint="never", balance=[2, 1], devices=["cpu"] * 2)
    x = torch.randn(8, 8)
    given = x.clone()
    for call in range(3):
        sees.seen.clear()
        pipe(x).sum().backward()
        callers = sees.seen.count(x.untyped_storage().data_ptr())
        assert callers == (0 if inplace else 3 if call == 0 else 4), (call, callers)
    assert torch.equal(x, given)


def test_an_inplace_dropout_first_writes_only_in_training_and_is_copied_then() -> None:
    """``Dropout(inplace=True)`` writes in ``train()`` only: a first call in ``eval()``
    learns nothing about training, whose first call copies again."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Dropout(0.5, inplace=True), nn.Linear(8, 8), nn.Linear(8, 3))
    pipe = Pipe(model, chunks=4, checkpoint="never", balance=[2, 1], devices=["cpu"] * 2)
    x = torch.randn(8, 8)
    given = x.clone()
    pipe.eval()
    torch.testing.assert_close(pipe(x), nn.Sequential(*model[1:])(given))
    pipe.train()
    for _ in range(2):
        pipe(x).sum().backward()
        assert torch.equal(x, given)


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
    _distributed_first(x, y)


def _distributed_first(x: Tensor, y: Tensor) -> None:
    """A first stage that writes the caller's micro-batches: as in ``Pipe``."""
    x = torch.cat([x, x[:, :2]], dim=1)  # 8 wide
    for head in FIRST:
        plain = _first(head)
        nn.functional.mse_loss(plain(x.clone()), y).backward()
        for schedule, mode in [("1f1b", m) for m in MODES] + [("zb_h1", "never")]:
            pipe = DistributedPipe(_first(head), chunks=4, balance=[2, 2], checkpoint=mode,
                                   schedule=schedule)
            given = x.clone()
            for _ in range(2):  # the second call: what the first learned
                pipe.zero_grad()
                loss = pipe.train_step(x if pipe.is_first else None,
                                       y if pipe.is_last else None, nn.functional.mse_loss)
                assert torch.equal(x, given), "the caller's input changed"
                if pipe.is_last:
                    expected = nn.functional.mse_loss(plain(x.clone()), y)  # it writes x
                    torch.testing.assert_close(loss, expected)
                for name, param in pipe.named_parameters():
                    torch.testing.assert_close(param.grad, plain.get_parameter(name).grad,
                                               atol=1e-12, rtol=1e-10,
                                               msg=f"first/{schedule}/{mode}/{name}")


def test_inplace_write_at_partition_start_in_a_distributed_pipe() -> None:
    run_workers(_distributed, 2, timeout=180.0)
