"""Refusing to move a pipeline the way the peers did: same test, same exception type.

seqpipe's ``Pipe`` raises ``RuntimeError`` on ``.cuda()``, ``.cpu()`` and ``.to(device)``;
torchgpipe and torch's ``Pipe`` raised ``TypeError("denied to move parameters and buffers,
...")``. The compat classes raise :class:`MovingDenied`, which is both, so an ``except``
written for either still catches it. What counts as a move is decided as the peers did —
from the arguments' types, before anything is parsed — so ``model.to(0)`` is refused the same
way on a machine without CUDA (where parsing ``0`` as a device would fail first).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["MovingDenied", "DenyMoving"]


class MovingDenied(TypeError, RuntimeError):
    """Raised on an attempt to move a pipeline whose partitions the pipeline placed."""


def _denied(pipe: nn.Module) -> MovingDenied:
    name = getattr(pipe, "peer_name", type(pipe).__name__)
    hint = getattr(pipe, "placement_hint", DenyMoving.placement_hint)
    return MovingDenied(
        f"denied to move parameters and buffers, because {name} should manage device "
        f"placement; {hint} (dtype changes with .to(dtype) are fine)")


def is_move(*args: Any, **kwargs: Any) -> bool:
    """Whether ``Module.to(*args, **kwargs)`` names a device (or a tensor to follow)."""
    if "device" in kwargs or "tensor" in kwargs:
        return True
    return bool(args) and (isinstance(args[0], (torch.device, int, str))
                           or torch.is_tensor(args[0]))


class DenyMoving(nn.Module):
    """Mixin, placed before ``seqpipe.Pipe`` in the bases, that refuses device moves.

    A class may set ``placement_hint`` to tell the user how devices are chosen for it, and
    ``peer_name`` to the class name the peer's message used.
    """

    placement_hint: str = "choose the devices when wrapping the model"

    def cuda(self, device: Any = None) -> Any:
        raise _denied(self)

    def cpu(self) -> Any:
        raise _denied(self)

    def to(self, *args: Any, **kwargs: Any) -> Any:
        if is_move(*args, **kwargs):
            raise _denied(self)
        return super().to(*args, **kwargs)
