"""The process groups that the sums of weights tied across ranks run on.

A tie's all-reduce (``seqpipe.distributed.ties``) runs on a process group of the ranks that
hold it. Creating a group takes every rank of the world, in the same order; that is possible
when the pipeline spans the world, or when the pipelines and their data-parallel groups tile
the world (``mesh_groups``), since then every rank is constructing its stage now and can
learn every pipeline's ranks. Otherwise (a pipeline on a hand-made group of part of the
world) ``tie_groups`` gives ``None`` and the sums run over the whole pipeline group.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from seqpipe.distributed.agreement import gather_ints
from seqpipe.distributed.mesh import _new_group

__all__ = ["tie_groups"]


def _pipelines(group: Optional[dist.ProcessGroup],
               data_parallel_group: Optional[dist.ProcessGroup],
               device: torch.device) -> Optional[List[List[int]]]:
    """Every pipeline's ranks (global, by stage) when every rank of the world is building
    a stage now, so that groups can be created; else ``None``."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    world = dist.get_world_size()
    if len(ranks) == world:
        return [ranks]
    if data_parallel_group is None:
        return None
    if len(ranks) * dist.get_world_size(data_parallel_group) != world:
        return None
    lines = sorted({tuple(r) for r in gather_ints(ranks, data_parallel_group, device)})
    covered = sorted(r for line in lines for r in line)
    if covered != list(range(world)):
        return None
    return [list(line) for line in lines]


def tie_groups(stage_sets: Sequence[Tuple[int, ...]], group: Optional[dist.ProcessGroup],
               data_parallel_group: Optional[dist.ProcessGroup], device: torch.device
               ) -> Optional[Dict[Tuple[int, ...], dist.ProcessGroup]]:
    """For each set of stages, the group of this pipeline's ranks at those stages; every
    pipeline's are created, by every rank in the same order. ``None`` where groups cannot
    be created (then the pipeline group is used)."""
    lines = _pipelines(group, data_parallel_group, device)
    if lines is None:
        assert group is not None  # a pipeline on the world has its lines
        return None
    like = group if group is not None else dist.group.WORLD
    assert like is not None
    me = dist.get_rank()
    mine: Dict[Tuple[int, ...], dist.ProcessGroup] = {}
    for stages in sorted(set(stage_sets)):
        for line in lines:
            members = [line[s] for s in stages]
            made = _new_group(members, like)
            if me in members:
                mine[stages] = made
    return mine
