"""A partition that provably draws no random numbers runs without a private random stream.

Side-by-side stages draw from private generators through a ``TorchDispatchMode``
(``seqpipe.core.rng``), which slows every aten op; ``seqpipe.core.draws.draws_nothing``
finds the partitions that need none: only exact ``torch.nn`` classes from its list, without
forward hooks or an instance ``forward``. Their tasks then enter no private stream, and the
gradients stay the plain model's; any other partition keeps its stream (tests/test_rng.py
and tests/test_determinism.py hold what the stream keeps exact).
"""
from __future__ import annotations

import copy
from typing import Any, List

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import seqpipe.core.checkpoint
from seqpipe import Pipe
from seqpipe.core.batchnorm import DeferredBatchNorm, convert_deferred_batch_norm
from seqpipe.core.draws import draws_nothing

DTYPE = torch.float64


def _cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)).to(DTYPE)


class MyLinear(nn.Linear):
    """A subclass: its forward may do anything."""


def test_only_listed_modules_without_hooks_draw_nothing() -> None:
    assert draws_nothing(_cnn())
    assert draws_nothing(nn.Sequential(nn.BatchNorm2d(3), nn.Embedding(4, 2)))
    assert draws_nothing(convert_deferred_batch_norm(_cnn().append(nn.BatchNorm1d(3))))

    class Deferred(DeferredBatchNorm, nn.BatchNorm1d):
        def forward(self, x: Tensor) -> Tensor:
            return x + torch.rand_like(x)
    assert not draws_nothing(nn.Sequential(Deferred(3)))
    assert not draws_nothing(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)))
    assert not draws_nothing(nn.Sequential(MyLinear(2, 2)))
    assert not draws_nothing(nn.TransformerEncoderLayer(8, 2, 16))
    hooked = _cnn()
    handle = hooked[2].register_forward_hook(lambda m, i, o: None)
    assert not draws_nothing(hooked)
    handle.remove()
    assert draws_nothing(hooked)
    hooked[5].forward = lambda x: x + torch.rand_like(x)  # type: ignore[method-assign]
    assert not draws_nothing(hooked)
    quiet = _cnn()
    with torch.overrides.TorchFunctionMode():  # the caller's mode may draw
        assert not draws_nothing(quiet)
    handle = nn.modules.module.register_module_forward_pre_hook(lambda m, i: None)
    try:
        assert not draws_nothing(_cnn())
    finally:
        handle.remove()


def _streams(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    """The seed of every private stream a task enters from now on."""
    seeds: List[int] = []
    isolated = seqpipe.core.checkpoint.isolated_rng

    def watch(seed: int) -> Any:
        seeds.append(seed)
        return isolated(seed)
    monkeypatch.setattr(seqpipe.core.checkpoint, "isolated_rng", watch)
    return seeds


@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
@pytest.mark.parametrize("call", ["forward", "1f1b", "zb_h1"])
def test_a_quiet_partition_enters_no_stream_and_trains_like_the_plain_model(
        mode: str, call: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _cnn()
    plain = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, 8, 8, dtype=DTYPE, generator=gen)
    y = torch.randint(3, (8,), generator=gen)
    F.cross_entropy(plain(x), y).backward()
    pipe = Pipe(model, chunks=4, balance=[4, 5], devices=["cpu", "cpu"], checkpoint=mode)
    seeds = _streams(monkeypatch)
    if call == "forward":
        F.cross_entropy(pipe(x), y).backward()
    else:
        pipe.train_step(x, y, F.cross_entropy, schedule=call)
    assert seeds == []
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-12, rtol=1e-10, msg=name)


def test_a_partition_that_may_draw_keeps_its_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the partition with the dropout: the quiet one enters none."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Dropout(0.5))
    pipe = Pipe(model, chunks=2, balance=[2, 2], devices=["cpu", "cpu"], checkpoint="never")
    seeds = _streams(monkeypatch)
    out: Tensor = pipe(torch.randn(4, 4))
    out.sum().backward()
    assert len(seeds) == 2  # stage 1's two micro-batches
