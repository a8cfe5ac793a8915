"""Gradient-norm clipping over a whole pipeline: ``DistributedPipe.clip_grad_norm_``.

``torch.nn.utils.clip_grad_norm_`` on one rank sees only that rank's gradients: its stages,
and under FSDP2 only its shards. The model's norm is over every parameter once: summed over
the stages (the pipeline group), over the shards of a sharded parameter, but not over its
copies (data-parallel replicas, the replicate dimension of HSDP, FSDP2-style ``replicate``,
the copies of a weight tied across ranks, which hold the same gradient after the step). So
each rank adds ``|g|^p`` of the gradients it counts (``MeshReduce.counted``: the first copy
only, every shard), the sum is all-reduced over the mesh (``MeshReduce``), and every rank
scales its own gradients by the same factor: the result equals the single-process model's
``clip_grad_norm_`` on the whole batch. The infinity norm takes a maximum instead.
"""
from __future__ import annotations

import math
from typing import AbstractSet, List, Sequence

import torch
from torch import Tensor, nn

from seqpipe.core.lazy_classes import is_dtensor
from seqpipe.distributed.mesh_reduce import MeshReduce

__all__ = ["clip_grad_norm_"]


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if is_dtensor(tensor) else tensor


def clip_grad_norm_(params: Sequence[nn.Parameter], reduce: MeshReduce, device: torch.device,
                    max_norm: float, norm_type: float = 2.0, *,
                    error_if_nonfinite: bool = False,
                    elsewhere: AbstractSet[int] = frozenset()) -> Tensor:
    """Clip the gradients of ``params`` (this rank's, each once) so that the norm of the
    whole model's gradients is at most ``max_norm``; return that norm (float64, 0-dim, on
    ``device``, the same on every rank). ``elsewhere``: ids of parameters counted on another
    rank (tied copies). Collective over ``reduce``'s groups: call it on every rank."""
    norm_type = float(norm_type)
    grads = [p.grad for p in params if p.grad is not None]
    counted: List[Tensor] = [_local(p.grad).detach() for p in params
                             if p.grad is not None and id(p) not in elsewhere
                             and reduce.counted(p.grad)]
    total = torch.zeros((), dtype=torch.float64, device=device)
    if counted:
        local = torch.nn.utils.get_total_norm(counted, norm_type).to(device, torch.float64)
        total = local if math.isinf(norm_type) else local ** norm_type
    if math.isinf(norm_type):
        reduce.max_(total)
    else:
        reduce.sum_(total)
        total = total ** (1.0 / norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the pipeline's gradients is non-finite, "
            f"so it cannot be clipped; to disable this error and scale the gradients by the "
            f"non-finite norm anyway, set error_if_nonfinite=False")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        local_grad = _local(grad)
        local_grad.detach().mul_(coef.to(local_grad.device, local_grad.dtype))
    return total
