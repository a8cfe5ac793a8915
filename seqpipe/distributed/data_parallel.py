"""Pipeline × data parallelism: replicas of a stage average their gradients.

A stage's gradients are final only after its last backward of the mini-batch, so they are
synchronised once per mini-batch, never per micro-batch. To hide the all-reduce behind
that last backward, as DistributedDataParallel's reducer does, parameters are grouped into
buckets in reverse order (the order backward produces them); during the last backward a
post-accumulate hook marks each parameter ready, and a bucket's all-reduce starts, without
blocking, as soon as all its parameters are. DDP itself is not used because its reducer
expects one forward then one backward per call, while a 1F1B stage interleaves the
forwards and backwards of many micro-batches.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["GradientReducer", "check_data_parallel_group"]


class GradientReducer:
    """Averages ``.grad`` of ``params`` over ``group``, overlapping with the last backward."""

    def __init__(self, params: List[nn.Parameter], group: dist.ProcessGroup,
                 bucket_bytes: int = 25 * 2**20) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.buckets: List[List[nn.Parameter]] = []
        current: List[nn.Parameter] = []
        for param in reversed(params):
            current.append(param)
            if sum(p.numel() * p.element_size() for p in current) >= bucket_bytes:
                self.buckets.append(current)
                current = []
        if current:
            self.buckets.append(current)
        self.bucket_of: Dict[nn.Parameter, int] = {
            p: b for b, bucket in enumerate(self.buckets) for p in bucket}
        self.armed = False
        self.ready: List[int] = [0] * len(self.buckets)
        self.works: List[Optional[tuple]] = [None] * len(self.buckets)
        for param in params:
            param.register_post_accumulate_grad_hook(self._on_grad)

    def arm(self) -> None:
        """The next backward is the stage's last of the mini-batch: reduce as grads land."""
        self.armed = True
        self.ready = [0] * len(self.buckets)
        self.works = [None] * len(self.buckets)

    def _on_grad(self, param: Tensor) -> None:
        if not self.armed:
            return
        b = self.bucket_of[param]  # type: ignore[index]
        self.ready[b] += 1
        if self.ready[b] == len(self.buckets[b]):
            self._launch(b)

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        for param in bucket:
            if param.grad is None:  # unused in this mini-batch: a zero gradient
                param.grad = torch.zeros_like(param)
        flat = _flatten_dense_tensors([p.grad for p in bucket])
        self.works[b] = (dist.all_reduce(flat, group=self.group, async_op=True), flat)

    def finish(self) -> None:
        """Wait for every bucket (starting any whose parameters got no gradient) and average."""
        for b in range(len(self.buckets)):
            if self.works[b] is None:
                self._launch(b)
        for b, bucket in enumerate(self.buckets):
            work, flat = self.works[b]  # type: ignore[misc]
            work.wait()
            flat.div_(self.size)
            for param, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                param.grad.copy_(synced)  # type: ignore[union-attr]
        self.armed = False


def check_data_parallel_group(stage: int, fingerprint: int, group: dist.ProcessGroup,
                              device: torch.device) -> None:
    """Reject a data-parallel group whose members are not replicas of the same stage."""
    mine = torch.tensor([stage, fingerprint], dtype=torch.int64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    stages = sorted({int(t[0]) for t in everyone})
    if len(stages) > 1:
        raise ValueError(
            f"the data_parallel_group mixes pipeline stages {stages}; it must hold the "
            f"replicas of one stage (same rank in each pipeline group) — e.g. build both "
            f"groups from a DeviceMesh with seqpipe.distributed.mesh_groups(mesh)")
    if len({int(t[1]) for t in everyone}) > 1:
        raise ValueError("the replicas in data_parallel_group built different models or "
                         "pipeline settings; every replica must use the same model and arguments")
