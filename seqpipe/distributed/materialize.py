"""A stage's layers, moved to its device; those built on ``meta`` get storage and values.

A model too big for one device is built on ``meta`` and each rank materialises only its own
stage. Only layers that are on ``meta`` are initialised: a layer with real weights (a model
built normally, or one already materialised by an earlier pipe over the same model) is moved,
never re-initialised. A layer holding both real and ``meta`` tensors is refused, since
initialising it would overwrite its real part. A layer sharded on ``meta`` (``DTensor``
parameters: ``fully_shard`` or ``parallelize_module`` before the pipe) is initialised whole
with ``base_seed`` and keeps this rank's shards (``seqpipe.distributed.sharded_init``), so it
gets the seeded plain model's values; without, DTensor's own random ops initialise it.
"""
from __future__ import annotations

import functools
import warnings
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from seqpipe.core.seeding import init_layer, reset_layer, uninitialisable
from seqpipe.distributed.sharded_init import has_dtensors, init_through_full

__all__ = ["materialize"]

Layer = Tuple[int, str, nn.Module]  # index in the model, name, layer


def materialize(layers: Sequence[Layer], device: torch.device,
                base_seed: Optional[int] = None) -> List[str]:
    """Move ``layers`` to ``device``; give the ones on ``meta`` storage and initial values.

    With ``base_seed``, layer ``i`` is initialised from seed ``base_seed + i`` (see
    ``seqpipe.seeding``); without it, by its ``reset_parameters()`` with this rank's random
    state, and a warning says so. Returns the names of the layers initialised.
    """
    initialised: List[str] = []
    uncovered: List[str] = []
    for index, name, layer in layers:
        on_meta = [t.is_meta for t in (*layer.parameters(), *layer.buffers())]
        if not any(on_meta):
            layer.to(device)
            continue
        if not all(on_meta):
            raise ValueError(
                f"layer {name} ({type(layer).__name__}) has some parameters or buffers on the "
                f"meta device and others with real values; build it wholly on meta (to be "
                f"initialised here) or wholly real")
        uncovered += [f"{name}.{tensor}" for tensor in uninitialisable(layer)]
        if base_seed is None:  # DTensors (sharded on meta) draw through DTensor's RNG
            layer.to_empty(device=device)
            reset_layer(layer)
        elif has_dtensors(layer):  # sharded on meta: drawn whole, this rank keeps its shards
            layer.to_empty(device=device)
            init_through_full(layer, functools.partial(init_layer, seed=base_seed + index))
        else:  # on the CPU, so the values do not depend on the device type
            layer.to_empty(device="cpu")
            init_layer(layer, base_seed + index)
            layer.to(device)
        initialised.append(name)
    _warn(initialised, uncovered, base_seed)
    return initialised


def _warn(initialised: List[str], uncovered: List[str], base_seed: Optional[int]) -> None:
    if uncovered:
        warnings.warn(
            f"DistributedPipe materialised layers built on the meta device, but nothing "
            f"initialises {uncovered} (no reset_parameters() reaches them): they hold "
            f"arbitrary values until you load a checkpoint", stacklevel=3)
    if initialised and base_seed is None:
        warnings.warn(
            f"DistributedPipe initialised layers {initialised}, built on the meta device, "
            f"with reset_parameters() and this rank's random state, so their values depend on "
            f"how the model is split; pass base_seed=... for per-layer seeds (the values "
            f"seqpipe.seeding.seed_layers gives the whole model), or load a checkpoint",
            stacklevel=3)
