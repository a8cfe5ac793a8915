"""Initial values for a layer whose parameters are ``DTensor``s: the whole layer's, sharded.

A layer sharded (``fully_shard``) or split (``parallelize_module``) on ``meta``, before
``DistributedPipe`` materialises it, has ``DTensor`` parameters. Its ``reset_parameters()``
run on them would draw through DTensor's random ops, which give each rank its shard's
numbers from an offset of its own stream, not the slice of the tensor that the same seed
draws for the plain layer: the values differ from ``seed_layers`` (by 0.6 on a Linear).

So the layer is initialised as the plain layer is: each ``DTensor`` parameter or buffer is
replaced, for the duration of the initialisation, by a plain CPU tensor of its global
shape (and so is a plain tensor of the layer that is not on the CPU); the initialiser
draws those (the whole layer, one layer at a time, on the CPU as ``seed_layers`` does);
then each ``DTensor`` gets its own shard of the drawn tensor
(``distribute_tensor(..., src_data_rank=None)``: every rank drew the same tensor, so no
communication) and is put back. The layer's full size is held on the CPU for a moment,
never the stage's.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch
from torch import Tensor, nn

from seqpipe.core.lazy_classes import is_dtensor

__all__ = ["has_dtensors", "init_through_full"]

_Slot = Tuple[Dict[str, Tensor], str, Tensor]  # (module._parameters or _buffers, name, tensor)


def has_dtensors(layer: nn.Module) -> bool:
    """Whether any parameter or buffer of ``layer`` is a ``DTensor``."""
    return any(is_dtensor(t) for t in (*layer.parameters(), *layer.buffers()))


def _slots(layer: nn.Module) -> List[_Slot]:
    """The entries to stand in for: ``DTensor``s, and plain tensors off the CPU (drawn on
    the CPU too, so the values do not depend on the device type)."""
    slots: List[_Slot] = []
    for module in layer.modules():
        for table in (module._parameters, module._buffers):
            slots += [(table, name, t) for name, t in table.items()
                      if t is not None and (is_dtensor(t) or t.device.type != "cpu")]
    return slots


def init_through_full(layer: nn.Module, init: Callable[[nn.Module], None]) -> None:
    """Run ``init(layer)`` on full-size plain CPU stand-ins of ``layer``'s ``DTensor``
    parameters and buffers (and of its plain ones off the CPU), then copy into each
    ``DTensor`` its shard of its stand-in (into a plain tensor, all of it).

    ``layer`` must already have storage (``to_empty``). A tensor shared by two entries
    (tied inside the layer) gets one stand-in. The tensor objects stay the layer's (an
    optimizer or FSDP2 holding them sees the values).
    """
    from torch.distributed.tensor import distribute_tensor

    slots = _slots(layer)
    stand_ins: Dict[int, Tensor] = {}
    for table, name, tensor in slots:
        if id(tensor) not in stand_ins:
            plain = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            stand_ins[id(tensor)] = (nn.Parameter(plain, tensor.requires_grad)
                                     if isinstance(tensor, nn.Parameter) else plain)
        table[name] = stand_ins[id(tensor)]
    try:
        init(layer)
    finally:
        for table, name, tensor in slots:
            table[name] = tensor
    with torch.no_grad():
        for tensor in {id(t): t for _, _, t in slots}.values():
            value = stand_ins[id(tensor)].detach()
            if is_dtensor(tensor):  # every rank drew the same: its shard, no communication
                shard = distribute_tensor(value, tensor.device_mesh, tensor.placements,
                                          src_data_rank=None)
                tensor.to_local().copy_(shard.to_local())
            else:
                tensor.copy_(value)
