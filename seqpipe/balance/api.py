"""Choose ``balance`` for ``Pipe``: profile each layer, then split the costs optimally.

Three measures of a layer's cost, for three situations: parameter count (free, no data
needed), training time (for throughput), and training memory (to make a model fit). Two
more count layers, as DeepSpeed's ``partition_method="uniform"`` and ``"type:[regex]"`` do:
every layer, or only the layers of the repeated block (so an embedding or a head does not
count as a block).
"""
from __future__ import annotations

import re

from torch import nn

from seqpipe.balance.profile import DeviceLike, param_counts, profile_sizes, profile_times
from seqpipe.balance.solver import check_partitions, solve
from seqpipe.core.microbatch import TensorOrTensors
from seqpipe.core.partition import verify_module

__all__ = ["balance_by_params", "balance_by_size", "balance_by_time", "balance_by_type",
           "balance_uniform"]


def balance_by_params(partitions: int, module: nn.Sequential) -> list[int]:
    """Balance that evens out the parameter count per partition (DeepSpeed's default).

    Needs no sample and runs nothing; a good first guess when parameters dominate cost.
    """
    _check(partitions, module)
    return solve(param_counts(module), partitions)


def balance_by_time(partitions: int, module: nn.Sequential, sample: TensorOrTensors, *,
                    timeout: float = 1.0, device: DeviceLike = "cpu") -> list[int]:
    """Balance that evens out forward+backward time per partition, for throughput.

    ``sample`` is one mini-batch (or a micro-batch) of real input; layers are timed on
    ``device`` for about ``timeout`` seconds. The model is left untouched.
    """
    _check(partitions, module)
    return solve(profile_times(module, sample, timeout=timeout, device=device), partitions)


def balance_by_size(partitions: int, module: nn.Sequential, input: TensorOrTensors, *,
                    chunks: int = 1, param_scale: float = 2.0,
                    device: DeviceLike = "cpu") -> list[int]:
    """Balance that evens out training memory per partition, to fit a large model.

    ``input`` is one mini-batch; memory is measured for its largest micro-batch when cut
    into ``chunks``. ``param_scale`` is the bytes kept per parameter byte: 2 for plain SGD,
    3 with momentum, 4 for Adam (see docs/balance.md). The model is left untouched.
    """
    _check(partitions, module)
    costs = profile_sizes(module, input, chunks=chunks, param_scale=param_scale, device=device)
    return solve(costs, partitions)


def balance_uniform(partitions: int, module: nn.Sequential) -> list[int]:
    """Balance with the same number of layers in every partition (DeepSpeed's "uniform").

    Layers that do not divide evenly go to the earlier partitions, one each.
    """
    _check(partitions, module)
    return solve([1] * len(module), partitions)


def balance_by_type(partitions: int, module: nn.Sequential, pattern: str) -> list[int]:
    """Balance evening out the layers whose class name matches ``pattern`` (a regex).

    DeepSpeed's ``partition_method="type:[regex]"``: ``pattern`` is searched in each
    top-level layer's class name, ignoring case (``"TransformerBlock"``, ``"block|layer"``);
    only matching layers count, so each partition gets as even a share of them as possible
    and the other layers (embeddings, norms, heads) go where they cost nothing.
    """
    _check(partitions, module)
    regex = re.compile(pattern, re.IGNORECASE)
    names = [type(layer).__name__ for layer in module]
    counts = [1 if regex.search(name) else 0 for name in names]
    if not any(counts):
        raise ValueError(
            f"no layer's class name matches {pattern!r} (the classes are "
            f"{sorted(set(names))}); give a regex that matches the repeated block")
    return solve(counts, partitions)


def _check(partitions: int, module: nn.Sequential) -> None:
    """Fail before any profiling on a wrong module or partition count."""
    verify_module(module)
    check_partitions(partitions, len(module))
