"""Moving tensors between devices, on a side stream where the device has streams.

On CPU there are no streams and a move is at most a copy. On an accelerator the copy
runs on a per-device copy stream, so it does not queue behind the source device's
compute; the destination's compute stream waits for it, and both tensors are recorded
on the streams that use them so the caching allocator does not recycle them early.
Only the generic ``torch.accelerator``/``torch.Stream`` API is used.
"""
from __future__ import annotations

import threading
from typing import Dict, Optional

import torch
from torch import Tensor

__all__ = ["move"]

_streams = threading.local()


def _copy_stream(device: torch.device) -> torch.Stream:
    cache: Dict[torch.device, torch.Stream] = _streams.__dict__.setdefault("copy", {})
    if device not in cache:
        cache[device] = torch.Stream(device=device)
    return cache[device]


def move(tensor: Optional[Tensor], device: torch.device) -> Optional[Tensor]:
    """``tensor`` detached and on ``device``, ready for use on its current stream."""
    if tensor is None:
        return None
    tensor = tensor.detach()
    if tensor.device == device:
        return tensor
    if device.type == "cpu" and tensor.device.type == "cpu":
        return tensor
    if device.type == "cpu":
        return tensor.to(device)
    copy_stream = _copy_stream(device)
    compute = torch.accelerator.current_stream(device)
    copy_stream.wait_stream(compute)
    if tensor.device.type != "cpu":
        copy_stream.wait_stream(torch.accelerator.current_stream(tensor.device))
    with copy_stream:
        moved = tensor.to(device, non_blocking=True)
    compute.wait_stream(copy_stream)
    if tensor.device.type != "cpu":
        tensor.record_stream(copy_stream)
    moved.record_stream(compute)
    return moved
