"""Choose ``balance`` for ``Pipe``: profile each layer, then split the costs optimally.

Three measures of a layer's cost, for three situations: parameter count (free, no data
needed), training time (for throughput), and training memory (to make a model fit).
"""
from __future__ import annotations

from torch import nn

from seqpipe.balance.profile import DeviceLike, param_counts, profile_sizes, profile_times
from seqpipe.balance.solver import check_partitions, solve
from seqpipe.microbatch import TensorOrTensors
from seqpipe.partition import verify_module

__all__ = ["balance_by_params", "balance_by_size", "balance_by_time"]


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


def _check(partitions: int, module: nn.Sequential) -> None:
    """Fail before any profiling on a wrong module or partition count."""
    verify_module(module)
    check_partitions(partitions, len(module))
