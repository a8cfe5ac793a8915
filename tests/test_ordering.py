"""Order of work per partition: forwards 0..M-1, backwards M-1..0 (fill-drain).

Micro-batches are identified by an integer tensor of sample ids travelling alongside the
features; ``ids[0]`` is the first sample of the micro-batch, which names it.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from seqpipe import Pipe, is_recomputing
from seqpipe.core.microbatch import scatter


class _LogBackward(torch.autograd.Function):
    """Identity whose backward appends ``(stage, "B", micro-batch)`` to a log."""

    @staticmethod
    def forward(ctx, h, stage, microbatch, log):
        ctx.entry, ctx.log = (stage, "B", microbatch), log
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(ctx.entry)
        return grad, None, None, None


class Logger(nn.Module):
    """First layer of a partition: logs its forwards (not recomputations) and backwards."""

    def __init__(self, stage: int, log: list, first_ids: list) -> None:
        super().__init__()
        self.stage, self.log, self.first_ids = stage, log, first_ids
        self.linear = nn.Linear(3, 3)

    def forward(self, pair):
        h, ids = pair
        microbatch = self.first_ids.index(int(ids[0]))
        if not is_recomputing():
            self.log.append((self.stage, "F", microbatch))
        h = _LogBackward.apply(h, self.stage, microbatch, self.log)
        return self.linear(h), ids


def run_logged(stages: int, batch: int, chunks: int, mode: str) -> tuple:
    ids = torch.arange(batch)
    first_ids = [int(b.value[1][0]) for b in scatter((ids, ids), chunks)]
    log: list = []
    model = nn.Sequential(*[Logger(s, log, first_ids) for s in range(stages)])
    pipe = Pipe(model, chunks=chunks, checkpoint=mode, balance=[1] * stages,
                devices=["cpu"] * stages)
    h, _ = pipe((torch.randn(batch, 3, requires_grad=True), ids))
    forward_log = list(log)
    h.pow(2).sum().backward()
    return forward_log, log, len(first_ids)


def of_stage(log: list, stage: int, phase: str) -> list:
    return [i for s, p, i in log if s == stage and p == phase]


CASES = [(2, 8, 4), (3, 10, 4), (3, 10, 3), (4, 5, 8), (1, 6, 3)]  # stages, batch, chunks


@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
@pytest.mark.parametrize("stages, batch, chunks", CASES)
def test_forwards_in_order_then_backwards_in_reverse_per_partition(stages, batch, chunks, mode):
    forward_log, log, m = run_logged(stages, batch, chunks, mode)
    for s in range(stages):
        assert of_stage(forward_log, s, "F") == list(range(m))
        assert of_stage(forward_log, s, "B") == []
        assert of_stage(log, s, "F") == list(range(m))  # recomputations are not logged
        assert of_stage(log, s, "B") == list(reversed(range(m)))


@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("stages, batch, chunks", CASES)
def test_each_micro_batch_flows_forward_then_back_through_the_partitions(stages, batch, chunks,
                                                                         mode):
    _, log, m = run_logged(stages, batch, chunks, mode)
    position = {entry: n for n, entry in enumerate(log)}
    assert len(position) == len(log) == 2 * stages * m  # each task ran exactly once
    for i in range(m):
        for s in range(1, stages):
            assert position[(s - 1, "F", i)] < position[(s, "F", i)]
            assert position[(s, "B", i)] < position[(s - 1, "B", i)]
        assert position[(stages - 1, "F", m - 1)] < position[(stages - 1, "B", i)]
