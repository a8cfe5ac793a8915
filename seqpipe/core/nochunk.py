"""``NoChunk``: a pipeline input tensor given whole to every micro-batch.

A pipeline cuts each tensor of its input along dim 0. Some inputs have no batch dimension
to cut: a lookup table, an attention bias shared by all samples, a tensor of settings.
Wrapped in ``NoChunk`` such a tensor reaches every micro-batch as it is, and its gradient
is the sum of the micro-batches' (what the unpipelined model computes). Values that are not
tensors (``int``, ``bool``, ``str``, ``None``...) need no wrapper: they are never cut, and
reach every micro-batch unchanged. torch's ``Pipe`` offered both since 1.9.
"""
from __future__ import annotations

from torch import Tensor

__all__ = ["NoChunk", "holds_tensor"]


class NoChunk:
    """Marks an input tensor that is not cut into micro-batches: each gets all of it.

    ``pipe((x, NoChunk(table), 3))`` gives every micro-batch ``(x_i, table, 3)``. The
    layers must not modify the tensor in place: every micro-batch shares it.
    """

    def __init__(self, tensor: Tensor) -> None:
        if not isinstance(tensor, Tensor):
            raise TypeError(
                f"NoChunk only supported for tensors, found: {tensor!r}; pass a non-tensor "
                f"argument as it is, unwrapped: it reaches every micro-batch unchanged")
        self._tensor = tensor

    @property
    def tensor(self) -> Tensor:
        """The wrapped tensor."""
        return self._tensor

    def __repr__(self) -> str:
        return f"NoChunk(tensor of shape {tuple(self._tensor.shape)})"


def holds_tensor(value: object) -> bool:
    """Whether ``value`` is, wraps or contains (in a tuple, list, set or dict) a tensor.

    Such a value cannot ride along unchanged: a tensor nested in it would be neither
    moved between devices nor given a gradient.
    """
    if isinstance(value, (Tensor, NoChunk)):
        return True
    if isinstance(value, dict):
        return any(holds_tensor(k) or holds_tensor(v) for k, v in value.items())
    if isinstance(value, (tuple, list, set, frozenset)):
        return any(holds_tensor(item) for item in value)
    return False
