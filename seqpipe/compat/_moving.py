"""Refusing to move a pipeline with the exception type the peers raised.

seqpipe's ``Pipe`` raises ``RuntimeError`` on ``.cuda()``, ``.cpu()`` and ``.to(device)``;
torchgpipe and torch's ``Pipe`` raised ``TypeError``. The compat classes raise
:class:`MovingDenied`, which is both, so an ``except`` written for either still catches it.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["MovingDenied", "DenyMoving"]


class MovingDenied(TypeError, RuntimeError):
    """Raised on an attempt to move a pipeline whose partitions the pipeline placed."""


def _denied(pipe: nn.Module) -> MovingDenied:
    hint = getattr(pipe, "placement_hint", DenyMoving.placement_hint)
    return MovingDenied(
        f"a {type(pipe).__name__} keeps each partition on its device; moving the whole "
        f"pipeline would undo that. Instead, {hint} (dtype changes with .to(dtype) are fine)")


class DenyMoving(nn.Module):
    """Mixin, placed before ``seqpipe.Pipe`` in the bases, that refuses device moves.

    A class may set ``placement_hint`` to tell the user how devices are chosen for it.
    """

    placement_hint: str = "choose the devices when wrapping the model"

    def cuda(self, device: Any = None) -> Any:
        raise _denied(self)

    def cpu(self) -> Any:
        raise _denied(self)

    def to(self, *args: Any, **kwargs: Any) -> Any:
        device, *_ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None:
            raise _denied(self)
        return super().to(*args, **kwargs)
