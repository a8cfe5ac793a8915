"""``torchgpipe.balance``: choose ``balance`` by profiling the model.

seqpipe's helpers under torchgpipe's signatures. Two differences, both deliberate:

* the default ``device`` is the current CUDA device when there is one (torchgpipe's
  default) and the CPU otherwise, where torchgpipe failed;
* the split minimises the largest partition's cost exactly (torchgpipe's block partition
  was a heuristic), so the balance found may differ from torchgpipe's, never for the worse.

The model and the sample are left untouched: layers are profiled on copies.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from seqpipe.balance import balance_by_size as _balance_by_size
from seqpipe.balance import balance_by_time as _balance_by_time
from seqpipe.balance.profile import DeviceLike
from seqpipe.core.microbatch import TensorOrTensors

__all__ = ["balance_by_time", "balance_by_size"]


def _device(device: Optional[DeviceLike]) -> DeviceLike:
    if device is not None:
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def balance_by_time(partitions: int, module: nn.Sequential, sample: TensorOrTensors, *,
                    timeout: float = 1.0, device: Optional[DeviceLike] = None) -> List[int]:
    """Balance evening out forward+backward time per partition (see ``seqpipe.balance``)."""
    return _balance_by_time(partitions, module, sample, timeout=timeout,
                            device=_device(device))


def balance_by_size(partitions: int, module: nn.Sequential, input: TensorOrTensors, *,
                    chunks: int = 1, param_scale: float = 2.0,
                    device: Optional[DeviceLike] = None) -> List[int]:
    """Balance evening out training memory per partition (see ``seqpipe.balance``)."""
    return _balance_by_size(partitions, module, input, chunks=chunks,
                            param_scale=param_scale, device=_device(device))
