"""Stages split with tensor parallelism (``parallelize_module``): ``DTensor`` parameters.

torchtitan's recipe, which ``DistributedPipe`` follows (docs/distributed.md, "Sharded
stages"): build the pipeline, split the blocks of this rank's ``stage_modules`` with
``parallelize_module`` on the mesh's tensor-parallel dimension (their parameters become
``DTensor``s, sharded or replicated over it), optionally ``fully_shard`` them on the
data-parallel dimension, and train. Such a stage needs nothing special from the runtime:
the ranks of a tensor-parallel group each run their own pipeline (one per coordinate on
the "tp" dimension) with the same schedule over the same micro-batches, so the
collectives a ``DTensor`` layer issues in its forward, its recomputation and its
backward (``I`` and ``W`` included) come in the same order on every rank of the group;
autograd records the ``DTensor`` parameters, and their gradients accumulate in ``.grad``
as ``DTensor``s, as without a pipeline.

What this module adds:

* seqpipe's own data-parallel reducer (``data_parallel_group``, pipeline × data × tensor
  parallelism) averages a tensor-parallel parameter's **local shard** (``local``): every
  replica of a stage holds the same shard, so averaging the shards averages the
  parameter. It leaves out only what FSDP2 reduces itself (``reducible``).
* Weights tied across ranks may be split: their copies are summed by local shards, or
  whole where the copies are split differently (``seqpipe.distributed.tie_layout``). What
  every rank must agree on (``schedule="auto"``'s costs, a ``PipeGradScaler``'s ``found_inf``)
  and the gradient norm are reduced over the tensor-parallel dimension too: it is one of
  the mesh dimensions of the stages' ``DTensor`` parameters (``MeshReduce``).
* A ``DTensor`` activation or gradient (a stage ending in a layer with
  ``use_local_output=False``, ``SequenceParallel``'s default) crosses a stage boundary as
  its local shard and a description: ``seqpipe.distributed.dtensor_wire``.
"""
from __future__ import annotations

from typing import Collection, Dict, Iterable, List

import torch
from torch import Tensor, nn

from seqpipe.core.lazy_classes import is_dtensor
from seqpipe.core.stage import Stage

__all__ = ["as_grad", "local", "reducible"]


def local(tensor: Tensor) -> Tensor:
    """The local shard of a ``DTensor`` (sharing its storage: writing it writes the
    ``DTensor``), or ``tensor`` itself."""
    if not is_dtensor(tensor):
        return tensor
    with torch.no_grad():
        return tensor.to_local()


def as_grad(param: Tensor, shard: Tensor) -> Tensor:
    """``shard`` (a local gradient) as a gradient for ``param``: a ``DTensor`` laid out as
    ``param`` if ``param`` is one, else ``shard`` itself."""
    if not is_dtensor(param):
        return shard
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(shard, param.device_mesh, param.placements,
                              run_check=False, shape=param.shape, stride=param.stride())


def reducible(stages: Iterable[Stage], managed: Collection[int]) -> List[nn.Parameter]:
    """The trainable parameters of ``stages`` that seqpipe's data-parallel reducer
    averages, each once, in model order: all but FSDP2's (``managed``: their ids), which
    FSDP2 reduces itself; tensor-parallel ones included (their local shards)."""
    seen: Dict[int, nn.Parameter] = {}
    for stage in stages:
        for param in stage.parameters():
            if id(param) not in managed:
                seen.setdefault(id(param), param)
    return list(seen.values())
