"""Per-layer costs of an ``nn.Sequential``: parameter counts, training time, memory.

These are the numbers the ``balance_by_*`` helpers hand to :func:`~seqpipe.balance.solve`;
they are public so a user can inspect them or mix them. Time and memory are measured on
copies of the layers (see :mod:`seqpipe.balance.sandbox`), in model order in one thread, each
layer fed a fresh copy of the previous layer's output: the model, its gradients, the random
state and the skip tracker are as they were afterwards.
"""
from __future__ import annotations

import math
import statistics
import time
from itertools import chain

import torch
from torch import Tensor, nn

from seqpipe.balance.flow import backward, layer_input, prepare_sample, run_layer
from seqpipe.balance.sandbox import layer_copies, sandbox, skip_scope, synchronize
from seqpipe.core.microbatch import Batch, TensorOrTensors
from seqpipe.core.partition import verify_module

__all__ = ["param_counts", "profile_sizes", "profile_times"]

DeviceLike = str | int | torch.device


def param_counts(module: nn.Sequential) -> list[int]:
    """Number of parameters of each layer (trainable or not)."""
    verify_module(module)
    return [sum(p.numel() for p in layer.parameters()) for layer in module]


def profile_times(module: nn.Sequential, sample: TensorOrTensors, *, timeout: float = 1.0,
                  device: DeviceLike = "cpu") -> list[float]:
    """Median seconds each layer takes for forward plus backward on ``sample``.

    One untimed pass over the model warms up lazy initialisation (thread pools, kernel
    selection, allocator caches), which would otherwise be charged to the first layers.
    Timed passes then repeat until ``timeout`` seconds have gone by since the start (at
    least one); the median over them shrugs off the odd pass slowed by something else.
    """
    verify_module(module)
    if not timeout >= 0:
        raise ValueError(f"timeout must be a non-negative number of seconds, got {timeout}")
    device = torch.device(device)
    batch = prepare_sample(sample, device)
    passes: list[list[float]] = []
    deadline = time.perf_counter() + timeout
    with sandbox(device):
        _time_pass(module, batch, device)
        while not passes or time.perf_counter() < deadline:
            passes.append(_time_pass(module, batch, device))
    return [statistics.median(layer) for layer in zip(*passes, strict=True)]


def profile_sizes(module: nn.Sequential, input: TensorOrTensors, *, chunks: int = 1,
                  param_scale: float = 2.0, device: DeviceLike = "cpu") -> list[float]:
    """Bytes each layer keeps on its device while training with ``chunks`` micro-batches.

    That is the activations the layer saves for backward for one micro-batch, plus its
    trainable parameters' bytes times ``param_scale`` (weights, gradients and optimizer
    state), plus its frozen parameters and buffers once.
    """
    verify_module(module)
    if not (math.isfinite(param_scale) and param_scale >= 0):
        raise ValueError(f"param_scale must be a non-negative number, got {param_scale}")
    device = torch.device(device)
    batch = prepare_sample(input, device, chunks)
    sizes = []
    with sandbox(device), skip_scope():
        for index, layer in layer_copies(module, device):
            batch, saved = _saved_bytes(index, layer, layer_input(batch))
            sizes.append(saved + _state_bytes(layer, param_scale))
    return sizes


def _time_pass(module: nn.Sequential, batch: Batch, device: torch.device) -> list[float]:
    """One forward+backward pass over copies of the layers; seconds per layer."""
    seconds = []
    with skip_scope():
        for index, layer in layer_copies(module, device):
            batch = layer_input(batch)
            synchronize(device)
            start = time.perf_counter()
            batch = run_layer(index, layer, batch)
            backward(batch)
            synchronize(device)
            seconds.append(time.perf_counter() - start)
    return seconds


def _saved_bytes(index: int, layer: nn.Module, batch: Batch) -> tuple[Batch, int]:
    """Run ``layer`` and count the bytes of the activations autograd saves for backward.

    Storages are counted once each, by address; the layer's parameters and buffers, which
    autograd saves too, are left out (:func:`_state_bytes` counts them).
    """
    own = {_storage(t)[0] for t in chain(layer.parameters(), layer.buffers())}
    saved: dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        address, nbytes = _storage(tensor)
        if address not in own:
            saved[address] = nbytes
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = run_layer(index, layer, batch)
    return output, sum(saved.values())


def _state_bytes(layer: nn.Module, param_scale: float) -> float:
    """Parameter bytes (trainable ones times ``param_scale``) plus buffer bytes."""
    params = sum(p.nbytes * (param_scale if p.requires_grad else 1) for p in layer.parameters())
    return params + sum(b.nbytes for b in layer.buffers())


def _storage(tensor: Tensor) -> tuple[int, int]:
    """``(address, bytes)`` of the memory block behind ``tensor``."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # layouts without one storage (sparse, ...)
        return id(tensor), tensor.numel() * tensor.element_size()
    return storage.data_ptr(), storage.nbytes()
