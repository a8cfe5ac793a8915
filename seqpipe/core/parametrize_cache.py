"""``torch.nn.utils.parametrize.cached()`` around a pipeline call: one cache per task.

Under ``cached()``, a parametrized tensor (``weight_norm``, ``orthogonal``, a user's
``register_parametrization``) is computed at its first use and the same tensor, with its
autograd graph, is handed out until the context exits. Around the unpipelined model that is
one graph per forward. Around a pipeline call it would make every micro-batch's graph share
the first micro-batch's computation of the weight: the first micro-batch's backward frees
it and the next one fails ("Trying to backward through the graph a second time"), and a
checkpoint's recomputation, given the cached tensor instead of computing it again, records
another graph than its forward did (torch.utils.checkpoint's "Recomputed values ... have
different metadata"). So each task (a stage's forward of one micro-batch, and its
recomputation) drops its own layers' entries first: within the task the cache works as
around the plain model's forward, and the values are the same.
"""
from __future__ import annotations

import torch.nn.utils.parametrize as parametrize
from torch import nn

__all__ = ["forget_cached"]


def forget_cached(module: nn.Module) -> None:
    """While ``parametrize.cached()`` is active, drop the cached tensors of ``module``'s
    parametrized submodules, so that this task computes its own; else nothing (one
    attribute read)."""
    if not parametrize._cache_enabled:
        return
    cache = parametrize._cache  # (rebound, not cleared, when the context exits)
    for sub in module.modules():
        if parametrize.is_parametrized(sub):
            for name in sub.parametrizations:  # type: ignore[union-attr]
                cache.pop((id(sub), name), None)
