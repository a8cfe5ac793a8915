"""``PipeGradScaler``: one fp16 loss scale for a whole ``DistributedPipe``.

``torch.amp.GradScaler`` assumes one process owns the loss and every gradient. In a
pipeline the loss exists only on the last stage, and each stage holds only its own
gradients, so a plain scaler per rank goes wrong twice: ``scale(loss)`` cannot be called on
the other stages (their ``unscale_`` then fails), and an overflow on one stage backs off
only that stage's scale, after which the stages unscale by different factors.

This scaler keeps PyTorch's algorithm and changes two things:

* ``train_step(..., scaler=scaler)`` scales the loss: the last stage seeds its backward
  with the scale instead of 1, so every stage's gradients come out multiplied by the same
  factor, and every rank's scaler is initialised (the returned loss stays unscaled);
* whenever gradients are checked for inf/NaN (``unscale_``, ``step``, including the
  fused-optimizer path that skips ``unscale_``), the result is agreed, with a MAX
  all-reduce, over the pipeline group and then every group the stages are copied over
  (``DistributedPipe.mesh_reduce``: the data-parallel group, and the mesh dimensions of
  FSDP2-sharded, HSDP, replicated or tensor-parallel stages, so an inf on one rank skips
  the step on every rank; each rank checks its ``DTensor`` gradients' local shards). Every
  rank then
  skips or takes the step together, and ``update()`` computes the same new scale
  everywhere. The same all-reduce carries the scale itself, so a rank whose scale differs
  (``load_state_dict`` or ``update(new_scale)`` on some ranks only) is reported on every
  rank instead of silently unscaling by a wrong factor.

``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` is not the base: it
reduces over one group, only in ``unscale_`` (a fused optimizer's ``step`` checks
without reducing), and always allows fp16 gradients. ``GradScaler``'s own hook for
checking gradients, ``_unscale_grads_``, sees both paths.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Dict, Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from seqpipe.core.lazy_classes import is_dtensor
from seqpipe.distributed.mesh import held_group, resolved
from seqpipe.distributed.tensor_parallel import local

if TYPE_CHECKING:
    from seqpipe.distributed.mesh_reduce import MeshReduce

__all__ = ["PipeGradScaler", "backward_seed"]


class ScaledPipe(Protocol):
    """What a scaler reads of its pipe (a ``DistributedPipe``): its device and groups.
    Named here, not imported, because the pipe module imports this one."""

    @property
    def device(self) -> torch.device: ...

    @property
    def group(self) -> Optional[dist.ProcessGroup]: ...

    @property
    def data_parallel_group(self) -> Optional[dist.ProcessGroup]: ...

    def mesh_reduce(self) -> "MeshReduce": ...


class PipeGradScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` whose scale and skip decisions are shared by every rank
    of ``pipe``'s pipeline and data-parallel groups.

    Build one on every rank, after the pipe, with the same arguments (checked), pass it to
    ``pipe.train_step(..., scaler=scaler)``, then call ``scaler.step(optimizer)`` and
    ``scaler.update()`` on every rank, for the same number of optimizers, as with
    ``GradScaler``. The arguments after ``pipe`` are ``GradScaler``'s; the device is the
    pipe's.
    """

    def __init__(self, pipe: ScaledPipe, init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True) -> None:
        super().__init__(pipe.device.type, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)
        self.pipeline_group = pipe.group
        self._data_parallel = held_group(pipe.data_parallel_group)  # not the default group
        self.device = pipe.device
        self.mesh_reduce = pipe.mesh_reduce  # the groups, as the parameters are then
        settings = torch.tensor([float(self._enabled), init_scale, growth_factor,
                                 backoff_factor, float(growth_interval)],
                                dtype=torch.float64, device=pipe.device)
        _check_same(settings, self.pipeline_group, "stages")
        for group in self.mesh_reduce().groups:
            _check_same(settings, group, "replicas")

    @property
    def data_parallel_group(self) -> Optional[dist.ProcessGroup]:
        """The pipe's replicas' group (``None``: none); the default group is read when
        asked for, as ``DistributedPipe.data_parallel_group`` reads it."""
        return resolved(self._data_parallel)

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: Tensor,
                        found_inf: Tensor, allow_fp16: bool) -> Dict[torch.device, Tensor]:
        """Check (and unscale) this rank's gradients, then agree on ``found_inf`` with
        every other rank: one flag, on the scale's device, the same everywhere."""
        per_device = super()._unscale_grads_(_local_shards(optimizer),  # type: ignore[arg-type]
                                             inv_scale, found_inf, allow_fp16)
        flag = found_inf.clone()
        for found in per_device.values():
            flag += found.to(flag.device)
        scale, _ = self._check_scale_growth_tracker("_unscale_grads_")
        shared = torch.stack([flag.reshape(()), scale.reshape(()), -scale.reshape(())])
        self.mesh_reduce().max_(shared)
        largest, negated = shared[1:].tolist()
        smallest = -negated
        if largest != smallest:
            raise RuntimeError(
                f"the loss scale differs across the pipeline's ranks (from {smallest} to "
                f"{largest}), so stages would unscale by different factors; a "
                f"PipeGradScaler must change on every rank together: call load_state_dict "
                f"and update(new_scale) on every rank with the same value")
        return {flag.device: shared[0].reshape(found_inf.shape)}


def _local_shards(optimizer: torch.optim.Optimizer) -> SimpleNamespace:
    """``optimizer``'s parameter groups as ``GradScaler._unscale_grads_`` reads them, with
    each ``DTensor`` parameter (FSDP2, tensor parallelism) replaced by its local shard
    holding its gradient's local shard (storage shared: unscaling it unscales the
    gradient). One foreach call cannot take plain tensors and ``DTensor``s together, and
    ``found_inf`` is agreed over the whole mesh afterwards, so each rank checks its own
    shards."""
    groups = []
    for group in optimizer.param_groups:
        params = []
        for param in group["params"]:
            if is_dtensor(param) and param.grad is not None:
                shard = local(param)
                shard.grad = local(param.grad)
                param = shard
            params.append(param)
        groups.append({"params": params})
    return SimpleNamespace(param_groups=groups)


def backward_seed(scaler: Optional[PipeGradScaler], pipe: ScaledPipe) -> Optional[Tensor]:
    """The gradient ``pipe``'s last stage starts its backward from: the loss scale (or
    ``None``, meaning 1, without a scaler). Called on every rank, which initialises
    every rank's scale, as ``scaler.scale(loss)`` does for a single process."""
    if scaler is None:
        return None
    if not isinstance(scaler, PipeGradScaler):
        raise TypeError(
            f"scaler must be a seqpipe.distributed.PipeGradScaler, got "
            f"{type(scaler).__name__}: a plain torch.amp.GradScaler can neither scale a "
            f"loss that exists on the last stage only nor agree on overflows across "
            f"stages; build PipeGradScaler(pipe) on every rank")
    if scaler.pipeline_group is not pipe.group or \
            scaler._data_parallel is not held_group(pipe.data_parallel_group):
        raise ValueError("this PipeGradScaler was built for a pipe on other process groups; "
                         "build one per pipe with PipeGradScaler(pipe)")
    seed = scaler.scale(torch.ones((), device=pipe.device))
    assert isinstance(seed, Tensor)
    return seed.reshape(())


def _check_same(settings: Tensor, group: Optional[dist.ProcessGroup], who: str) -> None:
    everyone = [torch.zeros_like(settings) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, settings, group=group)
    odd = [r for r, s in enumerate(everyone) if not torch.equal(s, everyone[0])]
    if odd:
        raise ValueError(
            f"{who} {odd} built their PipeGradScaler with other settings (enabled, "
            f"init_scale, growth_factor, backoff_factor, growth_interval) than {who[:-1]} 0; "
            f"build it on every rank with the same arguments")
