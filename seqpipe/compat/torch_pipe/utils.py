"""``torch.distributed.pipeline.sync.utils``: place a model's layers by ``balance``."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import nn

from seqpipe.core.partition import Device, check_balance, default_devices

__all__ = ["partition_model"]


def partition_model(module: nn.Sequential, balance: Sequence[int],
                    devices: Optional[Sequence[Device]] = None) -> nn.Sequential:
    """Group ``module``'s layers by ``balance`` and move each group to its device.

    Returns an ``nn.Sequential`` of ``nn.Sequential`` groups, ready for ``Pipe``, as torch's
    helper did (so its ``state_dict`` keys are ``"<group>.<index>.weight"``). ``devices``
    defaults to the visible GPUs, one per group, or the CPU for every group without a GPU;
    an ``int`` device means that CUDA device.
    """
    counts = check_balance(module, balance)
    targets: List[torch.device] = default_devices(len(counts)) if devices is None else [
        torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in devices]
    if len(targets) < len(counts):
        raise IndexError(f"{len(counts)} groups need {len(counts)} devices, got "
                         f"{len(targets)}; pass more devices or fewer balance entries")
    layers = list(module)
    groups, start = [], 0
    for count, device in zip(counts, targets):
        groups.append(nn.Sequential(*layers[start:start + count]).to(device))
        start += count
    return nn.Sequential(*groups)
