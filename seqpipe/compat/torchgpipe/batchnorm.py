"""``torchgpipe.batchnorm``: BatchNorm whose running statistics see the whole mini-batch.

As in torchgpipe, :class:`DeferredBatchNorm` can be built directly
(``DeferredBatchNorm(num_features, chunks=4)``) or made from the BatchNorms of a model
(``DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=4)``), and outside a pipeline
it folds its accumulated statistics into ``running_mean``/``running_var`` every ``chunks``
training forwards, so a plain training loop sees torchgpipe's statistics. Inside a
seqpipe pipeline the statistics are also committed when the mini-batch ends, so a last
mini-batch with fewer than ``chunks`` micro-batches still counts (torchgpipe carried it
over into the next one).

One difference, for the better: the conversion works in place — the BatchNorm layers stay
the same objects (their class gains the deferred behaviour), so an optimizer built before
it, and ``isinstance(layer, nn.BatchNorm2d)``, still hold. torchgpipe's extra ``sum`` and
``sum_squares`` buffers are not kept (checkpoints that have them still load, see
``seqpipe.compat._legacy``).
"""
from __future__ import annotations

from typing import TypeVar

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from seqpipe.core.batchnorm import DeferredBatchNorm as _Deferred
from seqpipe.core.batchnorm import convert_in_place
from seqpipe.core.flags import is_recomputing

__all__ = ["DeferredBatchNorm", "convert_deferred_batch_norm"]

ModuleT = TypeVar("ModuleT", bound=nn.Module)


class DeferredBatchNorm(_Deferred):
    """A BatchNorm that commits its running statistics once every ``chunks`` forwards."""

    chunks: int
    _calls: int

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 affine: bool = True, chunks: int = 1) -> None:
        _BatchNorm.__init__(self, num_features, eps, momentum, affine,
                            track_running_stats=True)
        self.chunks = chunks
        self._reset_accumulators()

    def _check_input_dim(self, input: Tensor) -> None:
        if type(self) is not DeferredBatchNorm:  # converted: its BatchNorm class checks
            super()._check_input_dim(input)
        elif input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _reset_accumulators(self) -> None:
        super()._reset_accumulators()
        self._calls = 0

    def forward(self, input: Tensor) -> Tensor:
        """Normalise ``input``; after the ``chunks``-th training forward, commit."""
        output = super().forward(input)
        if self.training and self.track_running_stats and not is_recomputing():
            self._calls += 1
            if self._calls >= self.chunks:
                self.commit()
        return output

    @classmethod
    def convert_deferred_batch_norm(cls, module: ModuleT, chunks: int = 1) -> ModuleT:
        """Make every BatchNorm in ``module`` deferred over ``chunks`` forwards, in place."""
        for layer in convert_in_place(module, cls):
            layer.chunks = chunks
        return module


def convert_deferred_batch_norm(module: ModuleT, chunks: int = 1) -> ModuleT:
    """``DeferredBatchNorm.convert_deferred_batch_norm(module, chunks)``, as a function."""
    return DeferredBatchNorm.convert_deferred_batch_norm(module, chunks)
