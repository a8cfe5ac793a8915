"""Pipeline and data-parallel process groups from a ``DeviceMesh``."""
from __future__ import annotations

from typing import Tuple

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["mesh_groups"]


def mesh_groups(mesh: DeviceMesh, pipeline_dim: str = "pp",
                data_dim: str = "dp") -> Tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """``(group, data_parallel_group)`` for ``DistributedPipe`` from a 2-D mesh.

    Along ``pipeline_dim`` a rank's neighbours are the other stages of its pipeline; along
    ``data_dim`` they are the replicas of its stage. E.g. 8 ranks as
    ``init_device_mesh("cuda", (2, 4), mesh_dim_names=("pp", "dp"))``: 2 stages × 4 replicas.
    """
    names = mesh.mesh_dim_names or ()
    for dim in (pipeline_dim, data_dim):
        if dim not in names:
            raise ValueError(f"the mesh has dimensions {names}; name them with "
                             f"mesh_dim_names=({pipeline_dim!r}, {data_dim!r}) or pass "
                             f"pipeline_dim/data_dim")
    return mesh.get_group(pipeline_dim), mesh.get_group(data_dim)
