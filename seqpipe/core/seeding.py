"""Per-layer seeds: a layer's initial weights follow from a base seed and its index alone.

A model built whole draws every layer's weights from one random stream, so a layer's values
depend on everything built before it; a stage that materialises only its own layers (built
on ``meta``, see ``DistributedPipe``) cannot reproduce them. With per-layer seeds (DeepSpeed's
``seed_layers=True, base_seed=...``) layer ``i`` is initialised from seed ``base_seed + i``,
so it gets the same values however the model is split, built or placed.

Initialisation runs on the CPU (the generators of other device types draw other numbers from
the same seed) inside a forked random state, so the caller's random streams do not move.
"""
from __future__ import annotations

from typing import List, Set

import torch
from torch import nn

__all__ = ["init_layer", "reset_layer", "seed_layers", "uninitialisable"]


def _initialisers(layer: nn.Module) -> List[nn.Module]:
    return [m for m in layer.modules()
            if callable(getattr(m, "reset_parameters", None))
            or callable(getattr(m, "_reset_parameters", None))]


def reset_layer(layer: nn.Module) -> None:
    """Re-initialise ``layer`` in place with the current random state: every submodule's
    ``reset_parameters()`` (or, failing that, ``_reset_parameters()``, as
    ``nn.MultiheadAttention`` has), in module order."""
    for module in _initialisers(layer):
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            reset = module._reset_parameters
        reset()


def init_layer(layer: nn.Module, seed: int) -> None:
    """``reset_layer(layer)`` with the CPU generator seeded ``seed`` (``layer`` on the CPU),
    leaving the caller's random state as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        reset_layer(layer)


def seed_layers(module: nn.Sequential, base_seed: int) -> nn.Sequential:
    """Re-initialise every layer of ``module`` (on the CPU) from seed ``base_seed + index``.

    Returns ``module``. A tensor shared with an earlier layer (tied weights) keeps the values
    that layer gave it. A ``DistributedPipe(..., base_seed=base_seed)`` built from the same
    model on ``meta`` gives every stage exactly these weights.
    """
    seen: Set[int] = set()
    for index, layer in enumerate(module):
        tensors = [*layer.parameters(), *layer.buffers()]
        earlier = [(t, t.detach().clone()) for t in tensors if id(t) in seen]
        init_layer(layer, base_seed + index)
        with torch.no_grad():
            for tensor, value in earlier:  # tied to an earlier layer: its first holder's values
                tensor.copy_(value)
        seen.update(id(t) for t in tensors)
    return module


def uninitialisable(layer: nn.Module) -> List[str]:
    """Names of the parameters and buffers of ``layer`` that no submodule's
    ``reset_parameters()`` (or ``_reset_parameters()``) can reach: after ``to_empty`` they
    would hold whatever the memory held."""
    covered = {id(t) for m in _initialisers(layer)
               for t in (*m.parameters(), *m.buffers())}
    return [name for name, t in (*layer.named_parameters(), *layer.named_buffers())
            if id(t) not in covered]
