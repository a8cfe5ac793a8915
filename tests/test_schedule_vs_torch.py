"""Cross-check: the several-stages-per-rank built-ins give, rank by rank, the same order as
torch 2.13's schedules of the same names.

seqpipe generates its orders from the papers' rules; torch's generators are private methods,
called here on a bare instance (no process group, no stages), so the check is pinned to the
torch version it was written against and skipped on another.
"""
from __future__ import annotations

import pytest
import torch

from seqpipe.schedule import get_schedule

pytestmark = pytest.mark.skipif(not torch.__version__.startswith("2.13"),
                                reason="compares with torch 2.13's private order generators")

_LETTER = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def torch_orders(class_name: str, k: int, m: int) -> list[list[str]]:
    """Every rank's order from torch's generator, without padding, ``2F3`` style."""
    from torch.distributed.pipelining import schedules

    sched = object.__new__(getattr(schedules, class_name))
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = k, 2, m
    sched.number_of_rounds = max(1, m // k)
    sched.microbatches_per_round = m // sched.number_of_rounds
    sched.num_stages = sched._num_stages = 2 * k
    sched._stages = [None, None]
    orders = []
    for rank in range(k):
        flat = []
        for action in sched._calculate_single_rank_operations(rank):
            if action is not None:
                flat += list(action.sub_actions) if action.sub_actions else [action]
        orders.append([f"{a.stage_index}{_LETTER[a.computation_type.name]}{a.microbatch_index}"
                       for a in flat])
    return orders


@pytest.mark.parametrize(("name", "class_name", "ms"), [
    ("interleaved_1f1b", "ScheduleInterleaved1F1B", [1, 2, 3, 4, 6, 8, 12]),
    ("looped_bfs", "ScheduleLoopedBFS", [1, 2, 3, 4, 8]),
    ("interleaved_zb", "ScheduleInterleavedZeroBubble", [1, 2, 3, 4, 6, 8, 12]),
    ("zbv", "ScheduleZBVZeroBubble", [1, 2, 3, 4, 8, 12]),
    ("dualpipev", "ScheduleDualPipeV", [8, 12, 16]),
])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_same_order_as_torch(name: str, class_name: str, ms: list[int], k: int) -> None:
    sched = get_schedule(name)
    for m in ms:
        if m % max(1, m // k):  # rounds that do not divide M: both refuse
            continue
        mine = [[str(a) for a in sched.rank_actions(r, k, m)] for r in range(k)]
        assert mine == torch_orders(class_name, k, m), (k, m)
