"""BatchNorm whose running statistics see the whole mini-batch, not each micro-batch.

A plain BatchNorm inside a pipeline updates its running mean and variance once per
micro-batch, each time from a fraction of the batch, so the statistics drift from those
of the unpipelined model. A deferred one normalises each micro-batch with its own
statistics (as it must, having only that micro-batch) but only accumulates them, and
updates the running statistics once the mini-batch is over: the same values a plain
BatchNorm would reach on the whole mini-batch, with the unbiased variance PyTorch uses.
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Tuple, Type, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from seqpipe.core.flags import is_recomputing

__all__ = ["DeferredBatchNorm", "convert_deferred_batch_norm"]

# The deferred BatchNorms that accumulated statistics since their last commit or reset, so
# that the end of a mini-batch need not walk a partition's modules when there are none.
_pending: "weakref.WeakSet[DeferredBatchNorm]" = weakref.WeakSet()


class DeferredBatchNorm(_BatchNorm):
    """Mixed into a BatchNorm class by ``convert_deferred_batch_norm``; see the module doc."""

    _count: int
    _sum: Tensor
    _m2: Tensor

    def _reset_accumulators(self) -> None:
        self._count = 0
        _pending.discard(self)

    def forward(self, input: Tensor) -> Tensor:
        """Normalise with this micro-batch's statistics; remember them for ``commit``."""
        if not (self.training and self.track_running_stats):
            return super().forward(input)
        self._check_input_dim(input)
        if not is_recomputing():
            self._accumulate(input)
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @torch.no_grad()
    def _accumulate(self, input: Tensor) -> None:
        _pending.add(self)
        dims = [d for d in range(input.dim()) if d != 1]
        x = input.detach().to(torch.float64)
        count = x.numel() // x.shape[1]
        mean = x.mean(dims)
        m2 = (x - mean.view(1, -1, *([1] * (x.dim() - 2)))).square().sum(dims)
        if self._count:  # Chan et al.: merge two groups' means and squared deviations
            total = self._count + count
            delta = mean - self._sum / self._count
            self._m2 += m2 + delta.square() * self._count * count / total
            self._sum += mean * count
        else:
            self._m2, self._sum = m2, mean * count
        self._count += count

    @torch.no_grad()
    def commit(self) -> None:
        """Fold the accumulated mini-batch statistics into the running ones."""
        if self._count == 0:
            return
        mean = self._sum / self._count
        var = self._m2 / max(self._count - 1, 1)
        tracked = cast(Tensor, self.num_batches_tracked)
        tracked.add_(1)
        factor = 1.0 / float(tracked) if self.momentum is None else self.momentum
        for running, value in ((self.running_mean, mean), (self.running_var, var)):
            running = cast(Tensor, running)
            running.mul_(1 - factor).add_(value.to(running.dtype), alpha=factor)
        self._reset_accumulators()


def end_statistics(module: nn.Module, *, failed: bool = False) -> None:
    """At the end of a mini-batch: commit the statistics that ``module``'s deferred
    BatchNorms accumulated, or drop them after a failed call (so they cannot leak into the
    next mini-batch's update). Walks nothing while no deferred BatchNorm (of any model)
    holds statistics: a call's fixed cost."""
    if not _pending:
        return
    for layer in module.modules():
        if isinstance(layer, DeferredBatchNorm):
            if failed:
                layer._reset_accumulators()
            else:
                layer.commit()


_classes: Dict[Tuple[type, type], type] = {}

D = TypeVar("D", bound=DeferredBatchNorm)


def convert_in_place(module: nn.Module, mixin: Type[D]) -> List[D]:
    """Give every BatchNorm of ``module`` that keeps running statistics (not a
    SyncBatchNorm, not deferred yet) the class ``mixin`` mixed into its own, in place, and
    return those layers (their accumulators reset)."""
    converted: List[D] = []
    for layer in module.modules():
        if (isinstance(layer, _BatchNorm) and not isinstance(layer, DeferredBatchNorm)
                and not isinstance(layer, nn.SyncBatchNorm) and layer.track_running_stats):
            key = (mixin, type(layer))
            if key not in _classes:
                _classes[key] = type(f"Deferred{type(layer).__name__}", key, {})
            layer.__class__ = _classes[key]
            deferred = cast(D, layer)
            deferred._reset_accumulators()
            converted.append(deferred)
    return converted


def convert_deferred_batch_norm(module: nn.Module) -> nn.Module:
    """Turn every BatchNorm in ``module`` into a deferred one, in place.

    The layers stay the same objects (their class gains the deferred behaviour), so
    parameters, buffers, ``state_dict`` keys and ``isinstance`` checks are unchanged.
    SyncBatchNorm and BatchNorms without running statistics are left alone.
    """
    convert_in_place(module, DeferredBatchNorm)
    return module
