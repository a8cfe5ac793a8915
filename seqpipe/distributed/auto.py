"""``schedule="auto"`` on a ``DistributedPipe``: measure the first step, agree, then switch.

The first ``train_step`` runs ``Auto``'s measuring schedule (a split one with every other
backward joined: it times ``F``, ``B``, ``I`` and ``W`` of every stage) with an
``ActionTimer`` around each stage computation (not around the waits for data, which are
the bubble, not the cost). At its end every rank adds
its stages' times, in integer nanoseconds per action, into one table with an all-reduce over the
pipeline group and then over every group its stages are copied over (the data-parallel
group, FSDP2's and ``replicate``'s mesh: ``MeshReduce``), so replicas and shards agree too:
integer sums do
not depend on the order of the reduction, so every rank holds the same costs, bit for bit,
and ``Auto.choose``, deterministic, picks the same schedule everywhere. No object is pickled.
From the next call on, each call of ``m`` micro-batches runs the pick for ``m``, predicted
as this engine runs it (each stage's last backward split: ``split_tails``).

The pick is logged once per ``m`` on the pipeline's rank 0, on the ``seqpipe.distributed``
logger at INFO (a library does not print); ``DistributedPipe.auto_choice`` holds it.
"""
from __future__ import annotations

import logging
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from seqpipe.distributed.mesh_reduce import MeshReduce
from seqpipe.distributed.plan import split_tails
from seqpipe.schedule import AnySchedule, Phase
from seqpipe.schedule.auto import Auto, AutoChoice, Costs

__all__ = ["ActionTimer", "AutoRunner"]

logger = logging.getLogger("seqpipe.distributed")
_PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.BACKWARD_INPUT, Phase.BACKWARD_WEIGHT)


class ActionTimer:
    """Nanoseconds each stage spends computing each phase of each micro-batch in one step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: Dict[Tuple[int, int, int], int] = {}  # (phase row, stage, micro-batch)

    @contextmanager
    def timed(self, phase: Phase, stage: int, microbatch: int) -> Iterator[None]:
        """Around one stage computation (on a GPU, synchronised: the first step only)."""
        self._sync()
        start = time.perf_counter_ns()
        yield
        self._sync()
        key = (_PHASES.index(phase), stage, microbatch)
        self.times[key] = self.times.get(key, 0) + time.perf_counter_ns() - start

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def table(self, num_stages: int, num_microbatches: int) -> Tensor:
        """``[time ns, count]`` per phase, stage and micro-batch (zeros: not run here)."""
        table = torch.zeros(2, len(_PHASES), num_stages, num_microbatches, dtype=torch.int64)
        for (row, stage, i), ns in self.times.items():
            table[0, row, stage, i] = ns
            table[1, row, stage, i] = 1
        return table


def _costs(table: Tensor) -> Costs:
    """Per stage, the median over micro-batches (robust to the first one's one-time costs:
    allocations, lazy initialisation), in seconds.

    ``B`` is the median of the backwards run whole, no more than ``I + W`` (a split does a
    ``B``'s work and its own: where ``B`` reads higher, that is noise, and the split is
    taken as free); a stage measured only split gets ``B = I + W``, one measured only
    whole ``I = W = B / 2``. ``F`` is the median of the whole-backward micro-batches'
    forwards where there are both kinds: a split micro-batch's forward also records its
    saved tensors in holders (to free the input path's after ``I``), and that extra, which
    a split brings, is counted in its ``W``.
    """
    total, count = table.tolist()

    def median(row: int, stage: int, where: Optional[int] = None) -> float:
        seen = [t / c for i, (t, c) in enumerate(zip(total[row][stage], count[row][stage]))
                if c and (where is None or count[where][stage][i])]
        return statistics.median(seen) / 1e9 if seen else 0.0

    fwd, inp, wgt, full = [], [], [], []
    for s in range(table.shape[2]):
        split, whole = any(count[2][s]), any(count[1][s])
        if split and whole:
            plain = median(0, s, where=1)
            fwd.append(plain)
            inp.append(median(2, s))
            wgt.append(median(3, s) + max(0.0, median(0, s, where=2) - plain))
            full.append(min(median(1, s), inp[-1] + wgt[-1]))
        elif split:
            fwd.append(median(0, s))
            inp.append(median(2, s))
            wgt.append(median(3, s))
            full.append(inp[-1] + wgt[-1])
        else:
            fwd.append(median(0, s))
            inp.append(median(1, s) / 2)
            wgt.append(median(1, s) / 2)
            full.append(median(1, s))
    return Costs(tuple(fwd), tuple(inp), tuple(wgt), tuple(full))


class AutoRunner:
    """A pipe's ``Auto`` schedule: the measuring one until the costs are known, then the
    pick for each number of micro-batches."""

    def __init__(self, auto: Auto, num_ranks: int, num_stages: int,
                 group: Optional[dist.ProcessGroup], mesh: Callable[[], MeshReduce],
                 device: torch.device) -> None:
        self.auto = auto
        self.num_ranks, self.num_stages = num_ranks, num_stages
        self.group, self.mesh, self.device = group, mesh, device
        self.costs: Optional[Costs] = None
        self.tables: List[Tensor] = []  # per measured step so far: ``ActionTimer.table``
        self.choices: Dict[int, AutoChoice] = {}

    def schedule_for(self, m: int) -> AnySchedule:
        """What a call of ``m`` micro-batches runs."""
        if self.costs is None:
            return self.auto
        if m not in self.choices:
            self.choices[m] = self.auto.choose(self.costs, self.num_ranks, m,
                                               runs_as=split_tails)
            if dist.get_rank(self.group) == 0:
                logger.info(self.choices[m].describe(self.auto.max_live_microbatches))
        return self.choices[m].schedule

    def timer(self) -> Optional[ActionTimer]:
        """A timer for the next training step while the costs are unknown."""
        return ActionTimer(self.device) if self.costs is None else None

    def decide(self, timer: ActionTimer, num_microbatches: int) -> None:
        """After a step of ``num_microbatches`` that every rank completed: keep its times;
        after ``Auto.measure_steps`` such steps, a collective over the whole mesh
        (``mesh``): the costs, from every measured step's micro-batches, the same on every
        rank."""
        self.tables.append(timer.table(self.num_stages, num_microbatches))
        if len(self.tables) < self.auto.measure_steps:
            return
        table = torch.cat(self.tables, dim=3).to(self.device)  # the steps' micro-batches
        self.tables = []
        self.mesh().sum_(table)
        self.costs = _costs(table.cpu())
