"""What crosses a stage boundary for one micro-batch: the input a stage receives, the
gradients it hands back, and which tensors want one.

Both engines build these (the local one from its mailbox, the distributed one from the
wire) and a ``seqpipe.core.stage.Stage`` consumes them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from seqpipe.core.microbatch import Batch
from seqpipe.core.stream import move
from seqpipe.skip.tracker import SkipKey

__all__ = ["Grads", "Received", "moved", "wants_grad"]


def wants_grad(tensor: Optional[Tensor]) -> bool:
    """Whether a tensor crossing a stage boundary carries a gradient back."""
    return tensor is not None and tensor.requires_grad and (
        tensor.is_floating_point() or tensor.is_complex())


def moved(batch: Batch, device: torch.device) -> Tuple[Batch, Tuple[bool, ...]]:
    """``batch`` arriving on ``device``, and whether each of its tensors wants a gradient."""
    tensors = tuple(move(t, device) for t in batch.tensors)
    return batch.like(tensors), tuple(wants_grad(t) for t in batch.tensors)  # type: ignore[arg-type]


@dataclass
class Received:
    """What a stage gets for one micro-batch: its input and the skips popped in it.

    ``grad_flags`` says, for each input tensor then each skip (in ``skips`` order), whether
    the sender wants its gradient back.
    """

    inputs: Batch
    skips: Dict[SkipKey, Optional[Tensor]]
    grad_flags: Tuple[bool, ...]


@dataclass
class Grads:
    """Gradients flowing backward for one micro-batch: for a stage's inputs and skips."""

    inputs: Tuple[Optional[Tensor], ...]
    skips: Dict[SkipKey, Optional[Tensor]]
