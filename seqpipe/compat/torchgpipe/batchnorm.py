"""``torchgpipe.batchnorm``: BatchNorm whose running statistics see the whole mini-batch.

``GPipe(..., deferred_batch_norm=True)`` is the usual way in; this module is for code that
converted a model itself. seqpipe's conversion works in place (the BatchNorm layers stay the
same objects and gain the deferred behaviour) and needs no ``chunks``: it commits the
statistics when the mini-batch ends, however many micro-batches it had.
"""
from __future__ import annotations

from typing import TypeVar

from torch import nn

from seqpipe.batchnorm import DeferredBatchNorm
from seqpipe.batchnorm import convert_deferred_batch_norm as _convert

__all__ = ["DeferredBatchNorm", "convert_deferred_batch_norm"]

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def convert_deferred_batch_norm(module: ModuleT, chunks: int = 1) -> ModuleT:
    """Make every BatchNorm in ``module`` deferred, in place, and return ``module``.

    torchgpipe spelled this ``DeferredBatchNorm.convert_deferred_batch_norm(module, chunks)``.
    ``chunks`` is accepted for that signature and ignored: the statistics are committed at
    the end of each mini-batch rather than after counting ``chunks`` micro-batches, which also
    keeps them right for a last batch smaller than ``chunks``.
    """
    del chunks
    _convert(module)
    return module
