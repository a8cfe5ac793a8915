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
from typing import Any, Dict, List, Tuple, Type, TypeVar, cast

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
    """Mixed into a BatchNorm class by ``convert_deferred_batch_norm``; see the module doc.

    Each training micro-batch is normalised by the BatchNorm kernel with a scratch pair of
    per-channel "running" buffers and ``momentum=1.0``, so that the kernel, in its one pass
    over the activation, also writes that micro-batch's mean and unbiased variance into
    them (at the precision a plain BatchNorm's own statistics have). ``commit`` merges the
    micro-batches' small vectors exactly, in float64.
    """

    _stats: List[Tuple[int, Tensor]]  # per micro-batch: (count, [mean, unbiased var])

    def __setstate__(self, state: Dict[str, Any]) -> None:
        """Unpickled (``torch.load`` of a whole model): the accumulators start empty,
        whatever a pickle of this or an older version held (``_count``/``_sum``/``_m2``)."""
        super().__setstate__(state)
        for stale in ("_count", "_sum", "_m2"):
            self.__dict__.pop(stale, None)
        self._reset_accumulators()

    def _reset_accumulators(self) -> None:
        self._stats = []
        _pending.discard(self)

    def forward(self, input: Tensor) -> Tensor:
        """Normalise with this micro-batch's statistics; remember them for ``commit``."""
        if not (self.training and self.track_running_stats):
            return super().forward(input)
        self._check_input_dim(input)
        running = cast(Tensor, self.running_mean)
        # zeros, not empty: the kernel computes 1.0 * stat + 0.0 * old, and 0 * NaN is NaN.
        # A recomputation passes them too (its graph must save what the first forward's
        # saved) but keeps nothing: the first forward counted this micro-batch.
        stats = torch.zeros(2, running.shape[0], dtype=running.dtype, device=running.device)
        output = F.batch_norm(input, stats[0], stats[1], self.weight, self.bias, True, 1.0,
                              self.eps)
        if not is_recomputing():
            self._stats.append((input.numel() // input.shape[1], stats))
            _pending.add(self)
        return output

    @torch.no_grad()
    def commit(self) -> None:
        """Fold the accumulated mini-batch statistics into the running ones.

        Micro-batch ``i`` has ``n_i`` values per channel, mean ``m_i`` and unbiased
        variance ``v_i``; the mini-batch's mean is ``sum(n_i m_i) / N`` and its sum of
        squared deviations ``sum((n_i - 1) v_i) + sum(n_i (m_i - mean)^2)`` (Chan et al.),
        which ``N - 1`` divides into the unbiased variance a plain BatchNorm would record.
        """
        if not self._stats:
            return
        running_mean, running_var = cast(Tensor, self.running_mean), cast(Tensor, self.running_var)
        stats = torch.stack([s for _, s in self._stats]).to(torch.float64)  # M x 2 x C
        counts = torch.tensor([n for n, _ in self._stats], dtype=torch.float64,
                              device=stats.device).unsqueeze(1)  # M x 1
        total = sum(n for n, _ in self._stats)
        means, variances = stats[:, 0], stats[:, 1]
        mean = (counts * means).sum(0) / total
        m2 = ((counts - 1) * variances + counts * (means - mean).square()).sum(0)
        var = m2 / max(total - 1, 1)
        tracked = cast(Tensor, self.num_batches_tracked)
        tracked.add_(1)
        factor = 1.0 / float(tracked) if self.momentum is None else self.momentum
        for running, value in ((running_mean, mean), (running_var, var)):
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
