"""``torch.distributed``'s classes (``DTensor``, ``FSDPModule``, ...) recognised without
importing them.

No instance of a class exists before the module defining it is imported, so a value is an
instance of ``module.name`` only if ``module`` is in ``sys.modules`` already. Looking the
class up there, rather than importing it, keeps the cost off users who never use it:
``torch.distributed.tensor`` and ``torch.distributed.fsdp`` pull in sympy (a second or
more). Both engines ask: the core (a recomputed tensor-parallel output) and the distributed
engine (sharded stages, checkpoints, clipping, ties).
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Optional, TypeGuard

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["is_dtensor", "is_instance", "loaded_class"]


def loaded_class(module: str, name: str) -> Optional[type]:
    """``module.name`` if ``module`` is imported, else ``None`` (then no instance exists)."""
    return getattr(sys.modules.get(module), name, None)


def is_instance(value: object, module: str, name: str) -> bool:
    """``isinstance(value, module.name)`` without importing ``module``."""
    cls = loaded_class(module, name)
    return cls is not None and isinstance(value, cls)


def is_dtensor(value: object) -> TypeGuard[DTensor]:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor`` (a sharded or replicated
    tensor over a ``DeviceMesh``: a tensor-parallel or FSDP2 parameter, its gradient, or
    an activation), without importing ``torch.distributed.tensor``."""
    return is_instance(value, "torch.distributed.tensor", "DTensor")
