"""Forward-mode AD (``torch.autograd.forward_ad``) through a ``Pipe``: refused, by name.

A dual tensor's tangent does not cross a partition boundary (a stage receives its input
detached) nor the autograd Functions that join the pipeline to the caller's graph, which
have no ``jvp``. Unrefused, a dual input failed deep inside torch ("You must implement the
jvp function for custom autograd.Function"), and a dual parameter
(``fwAD.make_dual(weight, tangent)`` set on a layer) lost its tangent silently: the output
came back with none. Looked at only while a dual level is entered (one attribute read
otherwise).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch.autograd.forward_ad as forward_ad
from torch import Tensor, nn

__all__ = ["FORWARD_AD", "refuse_dual"]

FORWARD_AD = ("Pipe does not support forward-mode AD (torch.autograd.forward_ad): {what} is a "
              "dual tensor, and its tangent would be lost at the partition boundaries; "
              "compute Jacobian-vector products on the unwrapped model (or reverse-mode "
              "gradients through the pipe)")


def refuse_dual(inputs: Sequence[Tensor], module: nn.Module) -> None:
    """Inside a dual level: raise ``RuntimeError`` if an input tensor or a tensor of
    ``module`` (a parameter, a buffer or a tensor set in a parameter's place) carries a
    tangent; outside one, nothing."""
    if forward_ad._current_level < 0:
        return
    for i, tensor in enumerate(inputs):
        if forward_ad.unpack_dual(tensor).tangent is not None:
            raise RuntimeError(FORWARD_AD.format(what=f"input tensor {i}"))
    for name, tensor in _tensors(module):
        if forward_ad.unpack_dual(tensor).tangent is not None:
            raise RuntimeError(FORWARD_AD.format(what=repr(name)))


def _tensors(module: nn.Module) -> List[Tuple[str, Tensor]]:
    """Every tensor a layer holds as a parameter, a buffer or a plain attribute."""
    found: List[Tuple[str, Tensor]] = []
    for prefix, sub in module.named_modules():
        for key, value in vars(sub).items():
            if isinstance(value, Tensor):
                found.append((f"{prefix}.{key}" if prefix else key, value))
        for group in (sub._parameters, sub._buffers):
            for key, value in group.items():
                if value is not None:
                    found.append((f"{prefix}.{key}" if prefix else key, value))
    return found
