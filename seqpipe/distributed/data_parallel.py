"""Replicas of a stage average their gradients over a data-parallel process group."""
from __future__ import annotations

from typing import Iterable

import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["average_gradients"]


def average_gradients(params: Iterable[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Average ``.grad`` over ``group``: one all-reduce of all gradients, once per step."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat.div_(dist.get_world_size(group))
    for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)
