"""Micro-batch loss weights across processes: ``DistributedPipe`` on 2 ranks and 2×2 data
parallel, and ``Pipe`` under ``DistributedDataParallel``, against the plain model on the
whole (global) batch: a summed token loss with ``count_fn`` is the token mean over every
counted token, and a ``NoChunk`` first in the target does not set the weights.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.distributed as dist
from test_loss_weights import (
    class_model,
    counted,
    padded,
    scaled_ce,
    token_mean,
    token_model,
    token_sum,
    weighted_ce,
)
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from distributed_harness import Failures, run_workers
from seqpipe import NoChunk, Pipe
from seqpipe.distributed import DistributedPipe, mesh_groups

# Sixteen samples whose halves (the replicas' batches) and quarters (micro-batches) count
# different numbers of tokens per sample.
GLOBAL_LENGTHS = (6, 6, 1, 1, 4, 2, 6, 0, 1, 0, 0, 2, 5, 3, 6, 6)


def _check_step(failures: Failures, pipe: Any, loss: Tensor, expected_loss: Tensor,
                plain: torch.nn.Module, what: str) -> None:
    failures.close(loss, expected_loss, f"{what}: loss")
    failures.grads(pipe, plain, what)


def _two_ranks(rank: int, world: int) -> None:
    failures = Failures(rank, dict(atol=1e-12, rtol=0))
    tokens, labels = padded(1)
    for schedule, balance in (("1f1b", [3, 3]), ("zb_h1", [3, 3]), ("fill_drain", [3, 3]),
                              ("zbv", [2, 1, 2, 1])):
        plain = token_model()
        expected_loss = token_mean(plain(tokens), labels)
        expected_loss.backward()
        pipe = DistributedPipe(token_model(), chunks=4, balance=balance, schedule=schedule)
        loss = pipe.train_step(tokens if pipe.is_first else None,
                               labels if pipe.is_last else None, token_sum, count_fn=counted)
        _check_step(failures, pipe, loss, expected_loss.detach(), plain, f"token {schedule}")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    classes = torch.randint(3, (7,), generator=gen)
    for loss_fn, given in ((weighted_ce, torch.tensor([0.2, 1.0, 3.0], dtype=torch.float64)),
                           (scaled_ce, torch.tensor(2.5, dtype=torch.float64))):
        plain = class_model()
        expected_loss = loss_fn(plain(x), (given, classes))
        expected_loss.backward()
        pipe = DistributedPipe(class_model(), chunks=4, balance=[3, 2])
        loss = pipe.train_step(x if pipe.is_first else None,
                               (NoChunk(given), classes) if pipe.is_last else None, loss_fn)
        _check_step(failures, pipe, loss, expected_loss.detach(), plain,
                    f"NoChunk first in the target, {loss_fn.__name__}")
    failures.finish()


def test_two_ranks_train_a_token_mean_and_a_nochunk_target_as_the_plain_model() -> None:
    run_workers(_two_ranks, 2, timeout=240)


def _replica_batch(replica: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    tokens, labels = padded(7, GLOBAL_LENGTHS)
    half = slice(replica * 8, replica * 8 + 8)
    return tokens, labels, tokens[half], labels[half]


def _two_by_two(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh_groups(mesh)
    replica = dist.get_rank(dp)
    failures = Failures(rank, dict(atol=1e-12, rtol=0))
    tokens, labels, mine, my_labels = _replica_batch(replica)
    for schedule, balance in (("1f1b", [3, 3]), ("zbv", [2, 1, 2, 1])):
        plain = token_model()
        token_mean(plain(tokens), labels).backward()  # the global batch's token mean
        pipe = DistributedPipe(token_model(), chunks=4, balance=balance, schedule=schedule,
                               group=pp, data_parallel_group=dp)
        for step in range(2):  # the count is summed again at every step
            pipe.zero_grad()
            loss = pipe.train_step(mine if pipe.is_first else None,
                                   my_labels if pipe.is_last else None, token_sum,
                                   count_fn=counted)
            own = token_mean(token_model()(mine), my_labels).detach()  # this replica's
            _check_step(failures, pipe, loss, own, plain, f"{schedule} step {step}")
    failures.finish()


def test_two_stages_by_two_replicas_train_the_global_token_mean() -> None:
    run_workers(_two_by_two, 4, timeout=300)


def _ddp(rank: int, world: int) -> None:
    failures = Failures(rank, dict(atol=1e-12, rtol=0))
    tokens, labels, mine, my_labels = _replica_batch(rank)
    plain = token_model()
    token_mean(plain(tokens), labels).backward()
    pipe = Pipe(token_model(), chunks=4, balance=[3, 3], devices=["cpu"] * 2)
    ddp = DistributedDataParallel(pipe)
    for schedule in ("1f1b", "zb_h1"):
        pipe.zero_grad()
        loss = pipe.train_step(mine, my_labels, token_sum, count_fn=counted,
                               schedule=schedule, ddp=ddp)
        _check_step(failures, pipe, loss, token_mean(token_model()(mine), my_labels).detach(),
                    plain, f"ddp {schedule}")
    failures.finish()


def test_pipe_under_ddp_trains_the_global_token_mean() -> None:
    run_workers(_ddp, 2, timeout=240)
