"""Reductions over a pipeline's whole mesh: its group and every group it is copied over.

A ``DistributedPipe`` runs on its pipeline group; its stages may be copied over more groups:
``data_parallel_group`` (seqpipe's own reducer), and the mesh dimensions of the stages'
``DTensor`` parameters (FSDP2's ``fully_shard`` and HSDP, the FSDP2-style ``replicate``, tensor
parallelism). What every rank must agree on (``schedule="auto"``'s costs, ``PipeGradScaler``'s
``found_inf``) and what spans the whole model (the gradient norm) is reduced over all of them:
over the pipeline group first, then over each copy group in turn. The copy groups are read
from the parameters when needed, so sharding a stage after building the pipe (as the recipe
does) is seen.

A sum (or a maximum) over the pipeline group and then over each copy group is the one over
every rank of the mesh when the mesh is a product: every rank of the pipeline is copied over
groups of the same sizes, in the same order (``check_product``, which sums check).
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from seqpipe.core.lazy_classes import is_dtensor
from seqpipe.distributed.fsdp_verdict import group_ranks
from seqpipe.distributed.mesh import Held, resolved

__all__ = ["MeshReduce", "copy_groups"]


def copy_groups(params: Iterable[Tensor],
                data_parallel_group: Optional[dist.ProcessGroup]) -> List[dist.ProcessGroup]:
    """The groups this rank's stages are copied over besides the pipeline group:
    ``data_parallel_group``, then each dimension of each ``DTensor`` parameter's mesh, in mesh
    order; each once, none of one rank."""
    found: Dict[Tuple[int, ...], dist.ProcessGroup] = {}
    candidates: List[dist.ProcessGroup] = []
    if data_parallel_group is not None:
        candidates.append(data_parallel_group)
    meshes: Dict[int, object] = {}
    for param in params:
        if is_dtensor(param):
            meshes.setdefault(id(param.device_mesh), param.device_mesh)
    for mesh in meshes.values():
        candidates += [mesh.get_group(d) for d in range(mesh.ndim)]  # type: ignore[attr-defined]
    for group in candidates:
        if dist.get_world_size(group) > 1:
            found.setdefault(group_ranks(group), group)
    return list(found.values())


class MeshReduce:
    """All-reduces over ``pipeline`` and then each of ``groups`` (``copy_groups``)."""

    def __init__(self, pipeline: Optional[dist.ProcessGroup],
                 groups: Sequence[dist.ProcessGroup]) -> None:
        self.pipeline = pipeline
        self.groups = list(groups)

    @classmethod
    def of(cls, pipeline: Optional[dist.ProcessGroup], module: nn.Module,
           data_parallel_group: Held) -> "MeshReduce":
        """Over ``pipeline`` and the groups ``module``'s parameters (this rank's layers)
        are copied over. ``data_parallel_group`` as a pipe keeps it (``mesh.held_group``)."""
        return cls(pipeline, copy_groups(module.parameters(), resolved(data_parallel_group)))

    def check_product(self, device: torch.device) -> None:
        """Raise ``ValueError`` on every rank of the pipeline unless all are copied over
        groups of the same sizes (so a sum over them is a sum over the whole mesh)."""
        sizes = [dist.get_world_size(g) for g in self.groups]
        code = float(hash(tuple(sizes)) % (1 << 40))
        seen = torch.tensor([code, -code], dtype=torch.float64, device=device)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self.pipeline)
        if seen[0] != -seen[1]:
            raise ValueError(
                f"this rank's stages are copied (replicated or sharded) over groups of sizes "
                f"{sizes}, other stages of its pipeline over others; shard or replicate every "
                f"stage over the same mesh dimensions (data_parallel_group, fully_shard, "
                f"replicate), so that every rank of a mesh dimension holds the same stage")

    def sum_(self, tensor: Tensor) -> Tensor:
        """``tensor`` summed in place over every rank of the mesh (``check_product`` first)."""
        check = self.groups and dist.get_world_size(self.pipeline) > 1
        if check:
            self.check_product(tensor.device)
        for group in [self.pipeline, *self.groups]:
            dist.all_reduce(tensor, group=group)
        return tensor

    def max_(self, tensor: Tensor) -> Tensor:
        """``tensor`` maximised in place over every rank of the mesh (a product mesh)."""
        for group in [self.pipeline, *self.groups]:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        return tensor

    def counted(self, tensor: Tensor) -> bool:
        """Whether this rank counts ``tensor`` (a gradient) in a sum over the mesh: its shard
        along the mesh dimensions it is sharded over, and on the first rank only of each copy
        group it is replicated over (a plain tensor: all of them)."""
        sharded: set = set()
        if is_dtensor(tensor):
            mesh = tensor.device_mesh
            for d, placement in enumerate(tensor.placements):
                if placement.is_partial():
                    raise ValueError(f"a sum over the mesh met a DTensor with a Partial "
                                     f"placement ({tensor.placements}), not yet reduced")
                if placement.is_shard():
                    sharded.add(group_ranks(mesh.get_group(d)))
        return all(dist.get_rank(g) == 0 for g in self.groups if group_ranks(g) not in sharded)
