"""Process groups for ``DistributedPipe``: from a ``DeviceMesh``, and one per direction.

A pipeline sends messages to higher stages on its group and to lower stages on a second
group of the same ranks (see ``Transport``: with NCCL, one group per direction keeps a
receive posted ahead from holding up sends the other way). A new process group must be
created by every rank of the world, in the same order, so the second group can only be
made where every rank takes part: for the whole world, when ``DistributedPipe`` runs on
it, and for every pipeline of a mesh at once, in ``mesh_groups``.

A pipe keeps no reference to the default group, whichever object named it: a
``DeviceMesh`` dimension that spans every rank *is* the default group, and a pipe that kept
it would keep it alive past the user's ``destroy_process_group()`` (see "Ending a script" in
docs/distributed.md). A pipeline on the whole world keeps ``None`` for its group (``kept``);
a ``data_parallel_group`` that is the default group is kept as ``DEFAULT_GROUP`` (``held_group``;
``None`` there means no data parallelism), read as the default group when used
(``resolved``); a ``mesh=`` is kept without its process groups (``kept_mesh``). Any other
group is kept as it is, as ``DistributedDataParallel`` keeps its group.
"""
from __future__ import annotations

import weakref
from datetime import timedelta
from typing import Any, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["DEFAULT_GROUP", "Held", "NOT_COPIED", "held_group", "kept", "kept_mesh", "mesh_groups",
           "resolved", "reverse_group"]

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


class _DefaultGroup:
    """The default group, whichever it is when used (``DEFAULT_GROUP``)."""

    def __repr__(self) -> str:
        return "DEFAULT_GROUP"

    def __reduce__(self) -> str:
        return "DEFAULT_GROUP"  # one object: a copied or unpickled pipe keeps it


DEFAULT_GROUP = _DefaultGroup()
"""What a pipe keeps for an optional group (``data_parallel_group``) that is the default
group, where ``None`` already means "none": a stand-in that keeps nothing alive."""

Held = Union[None, dist.ProcessGroup, _DefaultGroup]

NOT_COPIED = (
    "a DistributedPipe cannot be copied or pickled (copy.deepcopy, "
    "torch.optim.swa_utils.AveragedModel, torch.save(pipe)): it is this rank's part of a "
    "pipeline that runs on process groups. Save pipe.state_dict() (or "
    "seqpipe.distributed.checkpoint.save) instead. For an EMA of the weights keep this "
    "rank's parameters: after each optimizer step, under torch.no_grad(), for name, param in "
    "pipe.named_parameters(): ema[name] = ema[name].lerp_(param, 1 - decay) (param.clone() "
    "the first time); to evaluate it, pipe.load_state_dict(ema, strict=False)")


def held_group(group: Optional[dist.ProcessGroup]) -> Held:
    """``group`` as a pipe (or its reducer, or a ``PipeGradScaler``) keeps an optional
    group: ``DEFAULT_GROUP`` for the default group, else ``group`` (``None``: no group).
    Holding the default group itself would keep it past ``destroy_process_group()``."""
    return DEFAULT_GROUP if group is not None and group is dist.group.WORLD else group


def resolved(group: Held) -> Optional[dist.ProcessGroup]:
    """The group ``held_group`` kept, to use now: ``DEFAULT_GROUP`` is the default group of this
    moment (the one bound while that group lives)."""
    return dist.group.WORLD if group is DEFAULT_GROUP else group  # type: ignore[return-value]


def kept_mesh(mesh: Any) -> Any:
    """``mesh`` (``DistributedPipe(mesh=...)``) as a pipe keeps it: what a received
    ``DTensor`` is rebuilt on, without a reference to the default group.

    torch's ``DeviceMesh`` keeps its dimensions' process groups (``_pg_registry`` of its
    root mesh, torch 2.13), and a dimension that spans every rank is the default group.
    Only then is ``mesh`` replaced by a copy that is its own root: equal to it (same ranks,
    layout, names and device type, so ``DTensor``s on either mix), naming the same groups,
    and keeping every group but the default one. Outside ``torch.compile`` a mesh finds its
    groups by name, so the copy works as the mesh does; code compiled with a collective
    of a ``DTensor`` rebuilt over a dimension spanning every rank (a one-rank pipeline's
    stages split over the whole world) would not find the group in the copy. A mesh without
    a ``_pg_registry`` (another torch) is kept as it is."""
    root = getattr(mesh, "_root_mesh", None) or mesh
    registry = getattr(root, "_pg_registry", None)
    world = dist.group.WORLD
    if not isinstance(registry, dict) or not any(g is world for g in registry.values()):
        return mesh
    copy = object.__new__(type(mesh))
    copy.__dict__.update(mesh.__dict__)
    copy._root_mesh = None
    copy._flatten_mapping = {}
    copy._pg_registry = {name: g for name, g in registry.items() if g is not world}
    return copy


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


def _new_group(ranks: list, like: dist.ProcessGroup, *, local: bool = False
               ) -> dist.ProcessGroup:
    """A group of ``ranks`` with ``like``'s backend and timeout (not the backend default,
    30 minutes on gloo: the timeout bounds how long a receive waits for a silent peer).
    Every rank of the world makes it, or with ``local`` only ``ranks`` do
    (``use_local_synchronization``; this rank must be one of them)."""
    new = dist.new_group(ranks, timeout=_timeout(like), backend=dist.get_backend(like),
                         use_local_synchronization=local)
    assert new is not None
    return new


def _timeout(group: dist.ProcessGroup) -> Optional[timedelta]:
    device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None
