"""Micro-batches: cut a mini-batch along dim 0 and put the pieces back together.

A pipeline input is a tensor, or a tuple whose items are tensors sharing their first
dimension (cut into micro-batches), tensors wrapped in ``NoChunk`` (given whole to every
micro-batch) and values that are not tensors (``int``, ``bool``, ``str``, ``None``...:
*constants*, given unchanged to every micro-batch). Between partitions a micro-batch is a
tensor or a tuple of tensors and constants. A ``Batch`` keeps the tensors apart from the
constants — engines move, send and differentiate ``Batch.tensors`` only — and knows where
each constant sits, so each layer receives exactly what it would have received in the
unpipelined model.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from seqpipe.core.nochunk import NoChunk, holds_tensor

__all__ = ["Batch", "Input", "TensorOrTensors", "check_input", "scatter", "gather",
           "gather_grad"]

TensorOrTensors = Union[Tensor, Tuple[Any, ...]]
Constants = Tuple[Tuple[int, Any], ...]  # (position in the tuple, value), by position


@dataclass
class Batch:
    """One micro-batch: its tensors, whether it is a single tensor or a tuple, and the
    tuple's constants (non-tensor items) with their positions."""

    tensors: Tuple[Tensor, ...]
    atomic: bool
    constants: Constants = ()

    @classmethod
    def of(cls, value: TensorOrTensors, *, layer: Optional[str] = None,
           last: bool = False) -> "Batch":
        """Wrap a layer's output (a tensor, or a tuple of tensors and constants).

        ``layer`` names the layer that returned ``value`` and ``last`` says it ends the
        model (so ``value`` is the pipeline's output): the errors then say whose output is
        wrong and how to mend it there.
        """
        if isinstance(value, Tensor):
            return cls((value,), True)
        what, mend = _where(layer, last)
        if not isinstance(value, (tuple, list)):
            raise TypeError(
                f"{what} must be a tensor or a tuple of tensors (the tuple may also hold "
                f"non-tensor values), got {_describe(value)}; {mend}")
        for i, item in enumerate(value):
            if not isinstance(item, Tensor) and holds_tensor(item):
                raise TypeError(
                    f"{what} must be a tensor or a tuple of tensors, got {_describe(value)} "
                    f"whose item {i} {_nested(item)}; return each tensor as an item of the "
                    f"tuple")
        if not any(isinstance(item, Tensor) for item in value):
            raise TypeError(
                f"{what} must be a tensor or a tuple of tensors (the tuple may also hold "
                f"non-tensor values), got {_describe(value)} with no tensor; {mend}")
        return cls._split(value, False)

    @classmethod
    def _split(cls, items: Sequence[Any], atomic: bool) -> "Batch":
        tensors = tuple(t for t in items if isinstance(t, Tensor))
        constants = tuple((i, v) for i, v in enumerate(items) if not isinstance(v, Tensor))
        return cls(tensors, atomic, constants)

    @property
    def value(self) -> TensorOrTensors:
        """What a layer receives: the tensor itself, or the tuple."""
        if self.atomic:
            return self.tensors[0]
        items: List[Any] = list(self.tensors)
        for position, constant in self.constants:
            items.insert(position, constant)
        return tuple(items)

    def like(self, tensors: Sequence[Tensor]) -> "Batch":
        """This batch with other tensors in the same places (moved, detached, cut)."""
        return Batch(tuple(tensors), self.atomic, self.constants)

    def __len__(self) -> int:
        return len(self.tensors)


def _describe(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of ({', '.join(type(v).__name__ for v in value)})"
    if isinstance(value, Mapping):  # a dict, or a Hugging Face ModelOutput
        return f"a {type(value).__name__} with keys ({', '.join(map(str, value))})"
    return f"a {type(value).__name__}"


def _where(layer: Optional[str], last: bool) -> Tuple[str, str]:
    """Whose output a micro-batch is, and how to make it one a pipeline can carry."""
    named = f" ({layer})" if layer else ""
    if last:
        return (f"the pipeline's output (what the model's last layer{named} returns)",
                "end the nn.Sequential with a layer that returns the tensors you need (say "
                "out.logits or out['logits'] of a ModelOutput or dict), and build anything "
                "else from them outside the pipeline")
    return (f"what passes between partitions (the output of the layer{named} before the "
            f"partition boundary)",
            "return tensors from that layer, or move the boundary (balance) to a layer that "
            "does")


def _nested(item: object) -> str:
    if isinstance(item, NoChunk):
        return "is a NoChunk, which marks a pipeline input only"
    return (f"holds tensors inside a {type(item).__name__}, where they would be neither "
            f"moved between devices nor given a gradient")


@dataclass
class Input:
    """A mini-batch as the caller passed it: its tensors (``NoChunk`` unwrapped) and
    constants, and which tensors are given whole to every micro-batch."""

    batch: Batch
    whole: Tuple[bool, ...]  # per tensor of ``batch``: wrapped in NoChunk

    @classmethod
    def of(cls, input: object) -> "Input":
        """Read and check a pipeline input; ``TypeError``/``ValueError`` say what to mend."""
        if isinstance(input, Tensor) and input.dim():  # the common case, per call: no walks
            return cls(Batch((input,), True), (False,))
        if isinstance(input, (Tensor, NoChunk)):
            items: Sequence[Any] = (input,)
        elif isinstance(input, (tuple, list)):
            items = input
        else:
            raise TypeError(f"a pipeline input must be a tensor or a tuple of tensors with the "
                            f"batch on dim 0, got {_describe(input)}")
        for i, item in enumerate(items):
            if not isinstance(item, (Tensor, NoChunk)) and holds_tensor(item):
                raise TypeError(f"item {i} of the pipeline input {_nested(item)}; pass each "
                                f"tensor as an item of the input tuple")
        unwrapped = [v.tensor if isinstance(v, NoChunk) else v for v in items]
        batch = Batch._split(unwrapped, isinstance(input, Tensor))
        whole = tuple(isinstance(v, NoChunk) for v in items if isinstance(v, (Tensor, NoChunk)))
        given = cls(batch, whole)
        given._check(input)
        return given

    def _check(self, input: object) -> None:
        cut = self.cut
        if not self.batch.tensors and not self.batch.constants:
            raise TypeError("the input is an empty tuple; pass at least one tensor")
        if not cut:
            raise TypeError(
                f"a pipeline input needs a tensor to cut into micro-batches (the batch on dim "
                f"0), got {_describe(input)} with none; pass at least one tensor unwrapped "
                f"(NoChunk tensors and non-tensor values are given whole to every "
                f"micro-batch, so they cannot set the micro-batches)")
        if any(t.dim() == 0 for t in cut):
            raise ValueError("every input tensor needs a batch dimension (dim 0); got a 0-dim "
                             "tensor (wrap a tensor without one in NoChunk to give it whole "
                             "to every micro-batch)")
        sizes = {t.shape[0] for t in cut}
        if len(sizes) != 1:
            raise ValueError(f"all input tensors must share the batch size on dim 0, got "
                             f"sizes {sorted(sizes)} (wrap a tensor in NoChunk to give it "
                             f"whole to every micro-batch)")

    @property
    def cut(self) -> List[Tensor]:
        """The tensors cut into micro-batches."""
        return [t for t, w in zip(self.batch.tensors, self.whole) if not w]

    @property
    def size(self) -> int:
        """The batch size: dim 0 of the tensors that are cut."""
        return self.cut[0].shape[0]

    def scatter(self, chunks: int) -> List[Batch]:
        """Cut into at most ``chunks`` micro-batches along dim 0.

        Sizes differ by at most one; a batch smaller than ``chunks`` gives one micro-batch
        per sample, and an empty batch gives none.
        """
        n = min(chunks, self.size)
        if n == 0:
            return []
        pieces = [None if w else torch.tensor_split(t, n)
                  for t, w in zip(self.batch.tensors, self.whole)]
        return [self.batch.like([t if p is None else p[i]
                                 for t, p in zip(self.batch.tensors, pieces)])
                for i in range(n)]

    def microbatches(self, chunks: int) -> List[Batch]:
        """``scatter(chunks)`` for a pipeline call, which needs at least one sample."""
        batches = self.scatter(chunks)
        if not batches:
            raise ValueError("the input batch is empty (size 0 on dim 0); a pipeline needs "
                             "at least one sample")
        return batches

    def sizes(self, batches: Sequence[Batch]) -> List[int]:
        """The micro-batch sizes of ``batches`` (from ``scatter``)."""
        j = self.whole.index(False)
        return [b.tensors[j].shape[0] for b in batches]


def check_input(input: object) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``input`` can be cut into micro-batches."""
    Input.of(input)


def scatter(input: TensorOrTensors, chunks: int) -> List[Batch]:
    """Cut ``input`` into at most ``chunks`` micro-batches along dim 0 (see ``Input``)."""
    return Input.of(input).scatter(chunks)


def gather_grad(pieces: Sequence[Optional[Tensor]], inputs: Sequence[Tensor], whole: bool,
                device: torch.device) -> Optional[Tensor]:
    """An input tensor's gradient from its micro-batches' (``None`` where none came back):
    concatenated for a tensor that was cut (zeros stand in for a missing piece), summed for
    one given whole (``NoChunk``); ``None`` if no micro-batch has one."""
    if all(p is None for p in pieces):
        return None
    if whole:
        return functools.reduce(operator.add, (p.to(device) for p in pieces if p is not None))
    return torch.cat([torch.zeros_like(t) if p is None else p.to(device)
                      for p, t in zip(pieces, inputs)])


def gather(batches: Sequence[Batch]) -> TensorOrTensors:
    """Concatenate micro-batch outputs back into one mini-batch output.

    A tensor is concatenated along dim 0; a constant becomes the list of its micro-batches'
    values (as torch's ``Pipe`` returned them).
    """
    first = batches[0]
    _check_alike(batches)
    for tensor in first.tensors:
        if tensor.dim() == 0:
            raise ValueError(
                "the last layer returned a 0-dim tensor, which cannot be concatenated over "
                "micro-batches; return a tensor with a batch dimension (compute the loss "
                "outside the pipeline)")
    if len(batches) == 1 and not first.constants:
        return first.value
    columns = zip(*(b.tensors for b in batches))
    tensors = [torch.cat(column) for column in columns]
    constants = tuple((position, [dict(b.constants)[position] for b in batches])
                      for position, _ in first.constants)
    return Batch(tuple(tensors), first.atomic, constants).value


def _check_alike(batches: Sequence[Batch]) -> None:
    def places(b: Batch) -> Tuple[Any, ...]:
        return b.atomic, len(b.tensors), tuple(p for p, _ in b.constants)

    other = next((b for b in batches if places(b) != places(batches[0])), None)
    if other is not None:
        raise TypeError(f"the micro-batches' outputs differ in kind: "
                        f"{_describe(batches[0].value)} and {_describe(other.value)}; the last "
                        f"layer must return the same kinds of values in the same places for "
                        f"every micro-batch")
