"""``DistributedDataParallel(Pipe(...))``: pipeline inside each replica, data parallel across.

torchgpipe's reentrant checkpointing breaks DDP ("Expected to mark a variable ready only
once") and the removed torch Pipe allowed DDP only with ``checkpoint='never'``; here every
mode must give the gradients of one process training on the global batch.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distributed_harness import run_workers
from seqpipe import Pipe


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 12), nn.Tanh(),
                         nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 3)).double()


def _data(step: int) -> tuple:
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randn(16, 6, generator=gen, dtype=torch.float64),
            torch.randn(16, 3, generator=gen, dtype=torch.float64))


def _ddp_worker(rank: int, world: int) -> None:
    for mode in ("always", "except_last", "never"):
        reference = _model()
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        pipe = Pipe(_model(), chunks=3, checkpoint=mode, balance=[3, 4], devices=["cpu"] * 2)
        ddp = DistributedDataParallel(pipe)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(2):
            x, y = _data(step)
            local = slice(rank * 8, rank * 8 + 8)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x[local]), y[local]).backward()
            ref_opt.zero_grad()
            nn.functional.mse_loss(reference(x), y).backward()
            for (name, p), q in zip(pipe.named_parameters(), reference.parameters()):
                assert torch.allclose(p.grad, q.grad, atol=1e-10), (mode, step, name)
            opt.step()
            ref_opt.step()
        dist.barrier()


def test_ddp_of_pipe_matches_one_process_on_the_global_batch() -> None:
    run_workers(_ddp_worker, 2, timeout=120)


def test_pipe_inside_ddp_needs_no_unused_parameter_search() -> None:
    """The pipeline marks every parameter exactly once per backward, as DDP expects."""
    pipe = Pipe(copy.deepcopy(_model()), chunks=4, checkpoint="always", balance=[3, 4],
                devices=["cpu"] * 2)
    counts = {p: 0 for p in pipe.parameters()}
    hooks = [p.register_post_accumulate_grad_hook(lambda q: counts.__setitem__(q, counts[q] + 1))
             for p in pipe.parameters()]
    pipe(torch.randn(8, 6, dtype=torch.float64)).sum().backward()
    for hook in hooks:
        hook.remove()
    assert set(counts.values()) == {1}


def _train_step_worker(rank: int, world: int) -> None:
    """``ddp.module.train_step(..., ddp=ddp)``: the gradients of one process on the global
    batch, reduced once per step; under ``no_sync`` they accumulate locally until the next
    synchronised step, as with ``ddp(x)`` + ``backward``."""
    local = slice(rank * 8, rank * 8 + 8)
    for schedule, mode, unused in (("1f1b", "except_last", False), ("zb_h1", "always", True),
                                   ("fill_drain", "never", False)):
        reference = _model()
        pipe = Pipe(_model(), chunks=3, checkpoint=mode, balance=[3, 4], devices=["cpu"] * 2)
        ddp = DistributedDataParallel(pipe, find_unused_parameters=unused)
        x, y = _data(0)
        loss = ddp.module.train_step(x[local], y[local], nn.functional.mse_loss,
                                     schedule=schedule, ddp=ddp)
        torch.testing.assert_close(loss, nn.functional.mse_loss(reference(x[local]), y[local]))
        nn.functional.mse_loss(reference(x), y).backward()
        for (name, p), q in zip(pipe.named_parameters(), reference.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-10), (schedule, mode, name)
        x2, y2 = _data(1)
        with ddp.no_sync():
            ddp.module.train_step(x2[local], y2[local], nn.functional.mse_loss,
                                  schedule=schedule, ddp=ddp)
        ddp.module.train_step(x[local], y[local], nn.functional.mse_loss, schedule=schedule,
                              ddp=ddp)
        nn.functional.mse_loss(reference(x2), y2).backward()
        nn.functional.mse_loss(reference(x), y).backward()
        for (name, p), q in zip(pipe.named_parameters(), reference.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-10), (schedule, "no_sync", name)
        dist.barrier()


def test_train_step_through_ddp_matches_one_process_on_the_global_batch() -> None:
    run_workers(_train_step_worker, 2, timeout=120)


if __name__ == "__main__":
    pytest.main([__file__])
