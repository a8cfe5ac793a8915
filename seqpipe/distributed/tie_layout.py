"""Summing the copies of a weight tied across ranks when they are ``DTensor``\\ s.

A tied copy on a stage split with tensor parallelism (``parallelize_module``) is a ``DTensor``
parameter, and so is, under FSDP2 over tensor parallelism, the unsharded gradient FSDP2
accumulates; the copies of one tie may be laid out differently (an embedding split
``ColwiseParallel``, ``Shard(1)``, and its head ``ColwiseParallel``, ``Shard(0)``; one copy
split and the other not). Their sum (``seqpipe.distributed.ties``) takes one of two ways,
which every rank of the sum picks alike from the copies' ``layout`` codes (exchanged once
per step):

* **local shards**, when every rank of the sum holds a copy of one layout (mesh shape,
  placements, coordinate on the mesh, local shape and dtype; plain tensors: shape and dtype):
  the local shards then hold the same elements, and the all-reduce moves one shard;
* **whole tensors** otherwise: each copy is gathered whole over its own mesh (``full``, a
  collective its tensor-parallel peers join, as they run the same step), the whole tensors
  are summed (a rank without a copy adds zeros), in float32 at least, and each copy takes
  back its own part (``write_full``: slicing a replicated tensor to the copy's placements
  communicates nothing).
"""
from __future__ import annotations

import zlib
from typing import Any, Tuple

import torch
from torch import Tensor

from seqpipe.core.lazy_classes import is_dtensor
from seqpipe.distributed.tensor_parallel import local

__all__ = ["full", "layout", "sum_dtype", "write_full"]


def layout(tensor: Tensor) -> int:
    """A code (a non-negative int64) equal for two tensors whose local parts hold the same
    elements of the same whole tensor: same layout, same place on a mesh of the same
    shape."""
    key: Tuple[Any, ...]
    if is_dtensor(tensor):
        mesh = tensor.device_mesh
        key = ("dtensor", tuple(mesh.shape), tuple(str(p) for p in tensor.placements),
               tuple(mesh.get_coordinate() or ()), tuple(local(tensor).shape),
               str(tensor.dtype))
    else:
        key = ("plain", tuple(tensor.shape), str(tensor.dtype))
    return zlib.crc32(repr(key).encode())


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype whole tensors are summed in: ``dtype``, at least float32 (the copies'
    gradients may come in their own dtypes, a mixed-precision reduce dtype among them)."""
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else dtype


def full(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """``tensor``'s whole value as a plain contiguous tensor of ``dtype`` (for a ``DTensor``
    an all-gather over its mesh, which its peers on that mesh join)."""
    if is_dtensor(tensor):
        tensor = tensor.full_tensor()
    return tensor.detach().to(dtype).contiguous()


@torch.no_grad()
def write_full(tensor: Tensor, whole: Tensor) -> None:
    """Set ``tensor`` to ``whole`` (a plain tensor of its global shape): for a ``DTensor``,
    its local part, as its placements cut ``whole`` (no communication)."""
    if not is_dtensor(tensor):
        tensor.copy_(whole)
        return
    from torch.distributed.tensor import DTensor, Replicate

    mesh = tensor.device_mesh
    replicated = DTensor.from_local(whole.to(tensor.dtype), mesh, [Replicate()] * mesh.ndim,
                                    run_check=False)
    local(tensor).copy_(replicated.redistribute(mesh, tensor.placements).to_local())
