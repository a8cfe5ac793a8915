"""What ``Pipe.forward`` returns: the output, behind the ``RRef`` methods torch's Pipe had.

torch's ``Pipe`` returned a ``torch.distributed.rpc.RRef`` so that outputs could one day live
on another host, which is why it needed ``init_rpc``. seqpipe's local pipeline always
holds its output in the calling process, so a plain local reference does: code calling
``.local_value()`` or ``.to_here()`` keeps working and no RPC agent is needed.

``LocalRRef`` is a dataclass and a registered pytree node, so
``DistributedDataParallel`` finds the tensors inside it (as it unwrapped torch's ``RRef``),
including with ``find_unused_parameters=True`` or ``static_graph=True``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Iterable, List, Tuple, TypeVar

import torch.utils._pytree as pytree
from torch import Tensor

__all__ = ["LocalRRef"]

T = TypeVar("T")


@dataclass(frozen=True)
class LocalRRef(Generic[T]):
    """A reference to a value owned by this process, with the ``RRef`` accessors Pipe users call.

    Not a ``torch.distributed.rpc.RRef``: it cannot be sent over RPC, and
    ``isinstance(out, RRef)`` is false. ``out.local_value()`` and ``out.to_here()`` return
    the value itself (no copy), so gradients flow through it as through the output.
    """

    value: T

    def local_value(self) -> T:
        """The referenced value (the pipeline's output)."""
        return self.value

    def to_here(self, timeout: float = 0.0) -> T:
        """The referenced value; it is already here, so ``timeout`` is never reached."""
        del timeout
        return self.value

    def is_owner(self) -> bool:
        """Always true: the value lives in this process."""
        return True

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Backpropagate from the referenced value, which must be a scalar tensor.

        As ``RRef.backward`` without a distributed autograd context: ordinary autograd.
        """
        if dist_autograd_ctx_id != -1:
            raise ValueError("LocalRRef.backward runs local autograd only (no "
                             "torch.distributed.autograd context is needed); call "
                             ".backward() without dist_autograd_ctx_id")
        value = self.value
        if not isinstance(value, Tensor):
            raise TypeError(f"backward() needs the referenced value to be a scalar tensor, "
                            f"got {type(value).__name__}")
        value.backward(retain_graph=retain_graph)


def _flatten(ref: LocalRRef[Any]) -> Tuple[List[Any], None]:
    return [ref.value], None


def _unflatten(values: Iterable[Any], context: None) -> LocalRRef[Any]:
    del context
    (value,) = values
    return LocalRRef(value)


try:
    pytree.register_pytree_node(LocalRRef, _flatten, _unflatten,
                                serialized_type_name="seqpipe.compat.torch_pipe.LocalRRef")
except ValueError:  # already registered: this module was imported again (importlib.reload)
    pass
