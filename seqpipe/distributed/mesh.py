"""Process groups for ``DistributedPipe``: from a ``DeviceMesh``, and one per direction.

A pipeline sends messages to higher stages on its group and to lower stages on a second
group of the same ranks (see ``Transport``: with NCCL, one group per direction keeps a
receive posted ahead from holding up sends the other way). A new process group must be
created by every rank of the world, in the same order, so the second group can only be
made where every rank takes part: for the whole world, when ``DistributedPipe`` runs on
it, and for every pipeline of a mesh at once, in ``mesh_groups``.

A pipeline on the whole world keeps ``None`` for its group (``kept``), whichever object
named it: a ``DeviceMesh`` dimension that spans every rank *is* the default group, and a
pipe that kept it would keep it alive past the user's ``destroy_process_group()`` (see
"Ending a script" in docs/distributed.md).
"""
from __future__ import annotations

import weakref
from datetime import timedelta
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["kept", "mesh_groups", "reverse_group"]

# Weak keys: a group's second group lives as long as the group, not longer. A strong key
# would keep the default group (and its gloo worker threads) alive past the user's
# destroy_process_group(); see "Ending a script" in docs/distributed.md.
_REVERSE: "weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup]" = (
    weakref.WeakKeyDictionary())


def mesh_groups(mesh: DeviceMesh, pipeline_dim: str = "pp",
                data_dim: str = "dp") -> Tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """``(group, data_parallel_group)`` for ``DistributedPipe`` from a 2-D mesh.

    Along ``pipeline_dim`` a rank's neighbours are the other stages of its pipeline; along
    ``data_dim`` they are the replicas of its stage. E.g. 8 ranks as
    ``init_device_mesh("cuda", (2, 4), mesh_dim_names=("pp", "dp"))``: 2 stages × 4 replicas.
    Every rank of the mesh must call it (it also creates each pipeline's second group).
    """
    names = mesh.mesh_dim_names or ()
    for dim in (pipeline_dim, data_dim):
        if dim not in names:
            raise ValueError(f"the mesh has dimensions {names}; name them with "
                             f"mesh_dim_names=({pipeline_dim!r}, {data_dim!r}) or pass "
                             f"pipeline_dim/data_dim")
    group = mesh.get_group(pipeline_dim)
    if group not in _REVERSE:
        ranks = mesh.mesh.movedim(names.index(pipeline_dim), -1)
        lines = ranks.reshape(-1, ranks.shape[-1]).tolist()
        mine = [_new_group(line, group) for line in lines]  # every rank makes every one
        _REVERSE[group] = next(g for g, line in zip(mine, lines) if dist.get_rank() in line)
    return group, mesh.get_group(data_dim)


def kept(group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """``group`` as a pipe keeps it: ``None`` for the default group (which every
    ``torch.distributed`` call reads as the default group at call time), else ``group``.

    ``DeviceMesh.get_group`` returns the default group object itself for a dimension that
    spans every rank (``init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))``, or
    ``mesh_groups`` of a ``(world, 1)`` mesh); a pipe holding it would keep it, and its gloo
    worker threads, alive past ``destroy_process_group()`` into the interpreter's teardown.
    """
    return None if group is dist.group.WORLD else group


def reverse_group(group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The second group of ``group`` (``None``: the world), or ``None`` if it has none.

    For the world it is created on first use: every rank must be constructing its
    ``DistributedPipe`` then, as it must anyway.
    """
    world = dist.group.WORLD
    key = group if group is not None else world
    assert key is not None
    if key not in _REVERSE and key is world:
        _REVERSE[key] = _new_group(list(range(dist.get_world_size())), key)
    return _REVERSE.get(key)


def _new_group(ranks: list, like: dist.ProcessGroup) -> dist.ProcessGroup:
    """A group of ``ranks`` with ``like``'s backend and timeout (not the backend default,
    30 minutes on gloo: the timeout bounds how long a receive waits for a silent peer)."""
    new = dist.new_group(ranks, timeout=_timeout(like), backend=dist.get_backend(like))
    assert new is not None
    return new


def _timeout(group: dist.ProcessGroup) -> Optional[timedelta]:
    device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None
