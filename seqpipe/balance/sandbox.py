"""Profile a model's layers without leaving a trace on the model or the process.

Profiling runs forward and backward passes, which would update BatchNorm running stats,
accumulate ``.grad``, advance the random generators (dropout) and leave skip tensors in
the current skip tracker. Here every layer runs as a deep copy made just before it is
needed and dropped soon after (so only a layer or two are copied at a time, and the model
may be larger than the device), the random state is forked and restored, and skip tensors
go to a private tracker.
"""
from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from seqpipe.balance.flow import fresh
from seqpipe.skip.namespace import Namespace
from seqpipe.skip.tracker import SkipTracker, use_skip_tracker

__all__ = ["layer_copies", "sandbox", "skip_scope", "synchronize"]


class _ProfilingSkipTracker(SkipTracker):
    """Keeps stashed tensors cut off from the stashing layer's graph.

    Each layer is back-propagated on its own, and the stashing layer's graph is freed by
    then, so the popping layer must get a tensor of its own (see :func:`fresh`).
    """

    def stash(self, ns: Namespace, name: str, tensor: Tensor | None) -> None:
        super().stash(ns, name, None if tensor is None else fresh(tensor))


@contextmanager
def sandbox(device: torch.device) -> Iterator[None]:
    """Fork the random state of the CPU (and of ``device`` if CUDA) and enable autograd."""
    with torch.random.fork_rng(devices=_cuda_indices(device), device_type="cuda"):
        with torch.enable_grad():
            yield


@contextmanager
def skip_scope() -> Iterator[None]:
    """A private skip tracker for one pass over the model, in model order, in this thread."""
    with use_skip_tracker(_ProfilingSkipTracker()):
        yield


def layer_copies(module: nn.Sequential, device: torch.device) -> Iterator[tuple[int, nn.Module]]:
    """``(index, copy of layer index on device)``, one copy at a time, in training mode.

    A balance is chosen for training, so dropout and BatchNorm run as they will there,
    whatever mode the model is in now (the model itself is not touched).
    """
    for index, layer in enumerate(module):
        yield index, copy.deepcopy(layer).to(device).train()


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels on ``device``, so wall-clock time covers them; no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cuda_indices(device: torch.device) -> list[int]:
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]
