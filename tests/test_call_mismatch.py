"""Ranks that make different calls (train_step on one, forward on another; a scaler on some
only) fail on every rank within seconds, naming the mismatch, instead of waiting out the
process group's timeout."""
from __future__ import annotations

import re
import time
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed_harness import run_workers
from seqpipe.distributed import DistributedPipe, PeerError, PipeGradScaler

Call = Callable[[DistributedPipe, int, int], object]
PG_TIMEOUT = 60.0
"""The process group's timeout in these launches: a mismatch reported sooner was found,
not waited out, whatever the machine's load."""


def _train(pipe: DistributedPipe, rank: int, world: int) -> object:
    x = torch.randn(8, 4) if rank == 0 else None
    y = torch.randn(8, 4) if rank == world - 1 else None
    return pipe.train_step(x, y, nn.functional.mse_loss)


def _forward(pipe: DistributedPipe, rank: int, world: int) -> object:
    return pipe(torch.randn(8, 4) if rank == 0 else None)


def _scaled(pipe: DistributedPipe, rank: int, world: int) -> object:
    x = torch.randn(8, 4) if rank == 0 else None
    y = torch.randn(8, 4) if rank == world - 1 else None
    return pipe.train_step(x, y, nn.functional.mse_loss, scaler=pipe.scaler_for_test)


def _pipe(world: int) -> DistributedPipe:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(world)])
    return DistributedPipe(model, chunks=2, group=dist.new_group(list(range(world))))


def _mismatches(rank: int, world: int) -> None:
    stage0 = "the rank of stage 0 called"
    cases = [((_train, _forward), f"{stage0} train_step but this rank called forward"),
             ((_forward, _train), f"{stage0} forward but this rank called train_step"),
             ((_scaled, _train), f"{stage0} train_step with a scaler but this rank called "
                                 f"train_step;")]
    for (first, others), message in cases:
        pipe = _pipe(world)
        pipe.scaler_for_test = PipeGradScaler(pipe)  # type: ignore[attr-defined]
        started = time.monotonic()
        with pytest.raises(Exception) as info:
            (first if rank == 0 else others)(pipe, rank, world)
        assert time.monotonic() - started < PG_TIMEOUT, "waited out the group's timeout"
        if rank == 0:
            assert isinstance(info.value, PeerError), repr(info.value)
        else:
            assert isinstance(info.value, (ValueError, PeerError)), repr(info.value)
        assert message in str(info.value), (rank, str(info.value))
    pipe = _pipe(world)  # the same calls everywhere still work, on a fresh group
    _train(pipe, rank, world)
    _forward(pipe, rank, world)
    # A rank that built another model is caught at construction, on every rank.
    model = nn.Sequential(*[nn.Linear(4, 4 if rank == 0 or n else 5) for n in range(world)])
    odd = list(range(1, world))
    with pytest.raises(ValueError, match=rf"stages {re.escape(str(odd))} built a different "
                                         rf"model or pipeline "
                                         rf"settings than stage 0 \(layers, .*every rank must "
                                         rf"construct DistributedPipe from the same model"):
        DistributedPipe(model, chunks=2, group=dist.new_group(list(range(world))))


@pytest.mark.parametrize("world", [2, 3])
def test_different_calls_on_different_ranks_fail_fast_everywhere(world: int) -> None:
    run_workers(_mismatches, world, timeout=150, pg_timeout=PG_TIMEOUT)
