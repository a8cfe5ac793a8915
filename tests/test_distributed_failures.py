"""A failure anywhere in a DistributedPipe reaches every rank, named, and never hangs."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed_harness import run_workers
from seqpipe.distributed import DistributedPipe, PeerError


class Boom(nn.Module):
    """A linear layer that raises on its ``when``-th forward (or backward)."""

    def __init__(self, when: int, in_backward: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.when, self.in_backward, self.calls = when, in_backward, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.when and not self.in_backward:
            raise ZeroDivisionError("boom in layer")
        y = self.lin(x)
        if self.calls == self.when:
            y.register_hook(_raise_in_backward)
        return y


def _raise_in_backward(grad: torch.Tensor) -> torch.Tensor:
    raise ZeroDivisionError("boom in backward")


def _pipe(boom: nn.Module, schedule: str, group: object = None) -> DistributedPipe:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), boom, nn.Linear(4, 4))
    return DistributedPipe(model, chunks=4, balance=[1, 2, 1], schedule=schedule,
                           checkpoint="never", group=group)  # type: ignore[arg-type]


def _step(pipe: DistributedPipe, rank: int, world: int,
          loss_fn: object = nn.functional.mse_loss) -> torch.Tensor:
    x = torch.randn(8, 4) if rank == 0 else None
    y = torch.randn(8, 4) if rank == world - 1 else None
    return pipe.train_step(x, y, loss_fn)  # type: ignore[arg-type]


def _check_injected(exc: BaseException, rank: int, phase: str) -> None:
    if rank == 1:  # the failing stage: the original exception, with a note
        assert isinstance(exc, ZeroDivisionError), repr(exc)
        assert f"stage 1 failed in the {phase} of micro-batch 2" in " ".join(exc.__notes__)
    else:  # everyone else: who failed, where, and what this rank was waiting for
        assert isinstance(exc, PeerError), repr(exc)
        text = str(exc)
        assert f"stage 1 failed in the {phase} of micro-batch 2" in text, text
        assert "ZeroDivisionError: boom in" in text, text
        assert f"stage {rank} was at" in text and "waiting for the" in text, text


def _vector_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square()  # not reduced: a vector


def _injected(rank: int, world: int) -> None:
    # Each scenario runs on a fresh process group, so nothing left over from a failed
    # step (an abort nobody read) can reach the next one.
    for schedule in ("fill_drain", "1f1b"):
        for in_backward in (False, True):
            pipe = _pipe(Boom(3, in_backward), schedule, dist.new_group(list(range(world))))
            with pytest.raises(Exception) as info:
                _step(pipe, rank, world)
            _check_injected(info.value, rank, "backward" if in_backward else "forward")
    pipe = _pipe(nn.Linear(4, 4), "1f1b", dist.new_group(list(range(world))))
    with pytest.raises(Exception) as info:
        _step(pipe, rank, world, _vector_loss)
    if rank == world - 1:
        assert isinstance(info.value, TypeError), repr(info.value)
        assert "scalar tensor" in str(info.value) and "shape (2, 4)" in str(info.value)
    else:
        assert isinstance(info.value, PeerError)
        assert "loss_fn must return a scalar tensor" in str(info.value)
    pipe = _pipe(nn.Linear(4, 4), "1f1b", dist.new_group(list(range(world))))
    with pytest.raises(Exception) as info:  # a target of 16 samples for an input of 8
        pipe.train_step(torch.randn(8, 4) if rank == 0 else None,
                        torch.randn(16, 4) if rank == world - 1 else None,
                        nn.functional.mse_loss)
    assert "the output has 2 samples but its slice of the target has 4" in str(info.value)
    pipe = _pipe(nn.Linear(4, 4), "1f1b", dist.new_group(list(range(world))))
    assert torch.isfinite(_step(pipe, rank, world))  # a fresh group works after failures


def test_exception_in_one_stage_raises_on_every_rank() -> None:
    """Forward and backward failures under both clocks, and a bad loss_fn."""
    run_workers(_injected, 3, timeout=150)


def _killed(rank: int, world: int) -> None:
    pipe = _pipe(nn.Linear(4, 4), "1f1b")
    dist.barrier()  # every rank has connected its pipeline's groups before one dies
    if rank == 1:
        os._exit(0)  # dies without a word, like a SIGKILLed process
    started = time.monotonic()
    with pytest.raises(PeerError) as info:
        _step(pipe, rank, world)
    text = str(info.value)
    assert "lost stage 1" in text and f"stage {rank}" in text, text
    # The action is named: a micro-batch's, or the opening of the step when this rank's
    # first send to the dead rank already fails (a race with its exit, not a defect).
    assert "micro-batch" in text or "start of the step" in text, text
    assert time.monotonic() - started < 20  # the connection drops: well inside the timeout
    os._exit(0)  # the group lost a member; skip the collective teardown


def test_killed_rank_raises_on_the_others() -> None:
    run_workers(_killed, 3, timeout=90)


def _stalled(rank: int, world: int) -> None:
    pipe = _pipe(nn.Linear(4, 4), "fill_drain")
    if rank == 1:
        time.sleep(12)  # alive but silent, longer than the group's timeout
        os._exit(0)  # its peers gave up on it: no collective teardown to join
    started = time.monotonic()
    with pytest.raises(PeerError) as info:
        _step(pipe, rank, world)
    assert time.monotonic() - started < 11
    assert f"stage {rank}" in str(info.value) and "stage 1" in str(info.value)
    os._exit(0)  # the group lost a member; skip the collective teardown


def test_stalled_rank_raises_within_the_group_timeout() -> None:
    run_workers(_stalled, 3, timeout=90, pg_timeout=4)
