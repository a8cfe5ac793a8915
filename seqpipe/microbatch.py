"""Micro-batches: cut a mini-batch along dim 0 and put the pieces back together.

A pipeline input is a tensor or a tuple of tensors sharing their first dimension; a
``Batch`` keeps which of the two it was, so each layer receives exactly what it would
have received in the unpipelined model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = ["Batch", "TensorOrTensors", "check_input", "scatter", "gather"]

TensorOrTensors = Union[Tensor, Tuple[Tensor, ...]]


@dataclass
class Batch:
    """The tensors of one micro-batch, and whether they form a single tensor or a tuple."""

    tensors: Tuple[Tensor, ...]
    atomic: bool

    @classmethod
    def of(cls, value: TensorOrTensors) -> "Batch":
        """Wrap a layer's output (a tensor or a tuple of tensors)."""
        if isinstance(value, Tensor):
            return cls((value,), True)
        if isinstance(value, (tuple, list)) and all(isinstance(t, Tensor) for t in value):
            return cls(tuple(value), False)
        raise TypeError(
            f"a pipeline carries a tensor or a tuple of tensors between partitions, "
            f"got {_describe(value)}; return tensors from the layer at the partition boundary")

    @property
    def value(self) -> TensorOrTensors:
        """What a layer receives: the tensor itself, or the tuple."""
        return self.tensors[0] if self.atomic else self.tensors

    def __len__(self) -> int:
        return len(self.tensors)


def _describe(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"


def check_input(input: object) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``input`` can be cut into micro-batches."""
    try:
        batch = Batch.of(input)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"a pipeline input must be a tensor or a tuple of tensors with the "
                        f"batch on dim 0, got {_describe(input)}") from None
    if not batch.tensors:
        raise TypeError("the input is an empty tuple; pass at least one tensor")
    if any(t.dim() == 0 for t in batch.tensors):
        raise ValueError("every input tensor needs a batch dimension (dim 0); got a 0-dim tensor")
    sizes = {t.shape[0] for t in batch.tensors}
    if len(sizes) != 1:
        raise ValueError(
            f"all input tensors must share the batch size on dim 0, got sizes {sorted(sizes)}")


def scatter(input: TensorOrTensors, chunks: int) -> List[Batch]:
    """Cut ``input`` into at most ``chunks`` micro-batches along dim 0.

    Sizes differ by at most one; a batch smaller than ``chunks`` gives one micro-batch
    per sample, and an empty batch gives none.
    """
    check_input(input)
    batch = Batch.of(input)
    size = batch.tensors[0].shape[0]
    n = min(chunks, size)
    if n == 0:
        return []
    pieces = [torch.tensor_split(t, n) for t in batch.tensors]
    return [Batch(tuple(p[i] for p in pieces), batch.atomic) for i in range(n)]


def gather(batches: Sequence[Batch]) -> TensorOrTensors:
    """Concatenate micro-batch outputs back into one mini-batch output."""
    first = batches[0]
    for tensor in first.tensors:
        if tensor.dim() == 0:
            raise ValueError(
                "the last layer returned a 0-dim tensor, which cannot be concatenated over "
                "micro-batches; return a tensor with a batch dimension (compute the loss "
                "outside the pipeline)")
    if len(batches) == 1:
        return first.value
    columns = zip(*(b.tensors for b in batches))
    outputs = tuple(torch.cat(column) for column in columns)
    return outputs[0] if first.atomic else outputs
