"""A communication hook for the data-parallel reducer, with DistributedDataParallel's contract.

``DistributedPipe.register_comm_hook(state, hook)`` takes what DDP's ``register_comm_hook``
takes: ``hook(state, bucket)`` is called once per bucket per step, when the reducer would
start the bucket's all-reduce (in bucket order, on every replica), and returns a
``torch.futures.Future`` whose value is the bucket's reduced gradients, **averaged** over the
replicas (as DDP's ``allreduce_hook`` gives them): the reducer does not divide them again.
``bucket`` offers what DDP's ``GradBucket`` offers (``index()``, ``buffer()``,
``gradients()``, ``parameters()``, ``is_last()``, ``set_buffer()``), so DDP's own hooks
(``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``: ``allreduce_hook``,
``fp16_compress_hook``, ``bf16_compress_hook``) work unchanged, with the data-parallel
group as their state.

The bucket's buffer holds the gradients alone (in the reducer's ``reduce_dtype``, if set).
Which parameters no replica used (whose ``.grad`` stays ``None``, as with DDP) is then
learnt from one small all-reduce per step of a flag per parameter, after the buckets, as
DDP does with its ``local_used_map``.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import Tensor
from torch._utils import _unflatten_dense_tensors

__all__ = ["CommHook", "GradBucket", "HookWork"]

#: ``hook(state, bucket) -> Future[Tensor]``: the bucket's gradients averaged over replicas.
CommHook = Callable[[Any, "GradBucket"], "torch.futures.Future[Tensor]"]


class GradBucket:
    """One bucket of a step, as a communication hook sees it (``torch.distributed.
    GradBucket``'s methods): a flat ``buffer`` of the gradients of ``parameters``."""

    def __init__(self, index: int, buffer: Tensor, parameters: Sequence[Tensor],
                 last: bool) -> None:
        self._index, self._buffer, self._params, self._last = index, buffer, parameters, last

    def index(self) -> int:
        """The bucket's index: 0 for the first reduced (the model's last parameters)."""
        return self._index

    def buffer(self) -> Tensor:
        """The flat gradients, this replica's, in ``parameters()`` order."""
        return self._buffer

    def set_buffer(self, buffer: Tensor) -> None:
        """Replace the flat gradients (DDP's hooks that compress in place use it)."""
        self._buffer = buffer

    def parameters(self) -> List[Tensor]:
        """The bucket's parameters."""
        return list(self._params)

    def gradients(self) -> List[Tensor]:
        """Views of ``buffer()``, one per parameter, shaped like it."""
        return list(_unflatten_dense_tensors(self._buffer, list(self._params)))

    def is_last(self) -> bool:
        """Whether this is the step's last bucket."""
        return self._last


class HookWork:
    """A hook's future as a ``dist.Work`` to the reducer and to
    ``seqpipe.distributed.inflight`` (``wait``, ``is_completed``), and its result."""

    def __init__(self, future: "torch.futures.Future[Tensor]", hook: Any) -> None:
        if not isinstance(future, torch._C.Future):  # torch.futures.Future, or its then()
            raise TypeError(f"the communication hook {getattr(hook, '__name__', hook)!r} "
                            f"returned a {type(future).__name__}; it must return a "
                            f"torch.futures.Future of the bucket's averaged gradients (e.g. "
                            f"dist.all_reduce(..., async_op=True).get_future()), as a "
                            f"DistributedDataParallel communication hook does")
        self.future = future
        self.hook = hook

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        self.future.wait()
        return True

    def is_completed(self) -> bool:
        return self.future.done()

    def result(self, like: Tensor) -> Tensor:
        """The averaged flat gradients (waits); ``like``: the buffer given to the hook."""
        value = self.future.wait()
        if isinstance(value, (list, tuple)) and len(value) == 1:  # a raw all_reduce future
            value = value[0]
        if not isinstance(value, Tensor) or value.numel() != like.numel():
            raise TypeError(f"the communication hook {getattr(self.hook, '__name__', '')!r}"
                            f"'s future gave {type(value).__name__} "
                            f"{tuple(value.shape) if isinstance(value, Tensor) else ''}, not "
                            f"the bucket's {like.numel()} averaged gradients as one tensor")
        return value
