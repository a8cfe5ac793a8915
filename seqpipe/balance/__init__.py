"""Helpers that choose ``balance`` (layers per partition) for ``Pipe``.

``balance_by_params``, ``balance_uniform`` and ``balance_by_type`` need nothing but the
model; ``balance_by_time`` and ``balance_by_size`` profile copies of its layers on a sample.
All of them hand per-layer costs to ``solve``, which splits them optimally. The per-layer
costs themselves are in :mod:`seqpipe.balance.profile`.
"""
from __future__ import annotations

from seqpipe.balance.api import (
    balance_by_params,
    balance_by_size,
    balance_by_time,
    balance_by_type,
    balance_uniform,
)
from seqpipe.balance.solver import solve

__all__ = ["balance_by_params", "balance_by_size", "balance_by_time", "balance_by_type",
           "balance_uniform", "solve"]
