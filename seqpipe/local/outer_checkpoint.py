"""``torch.utils.checkpoint(pipe, x, use_reentrant=False)``: refused by name.

A non-reentrant checkpoint around a call records the tensors the forward saves, in the
order they are saved, and matches the recomputation's to them by that order. A ``Pipe``
of two or more partitions saves them on several worker threads at once, in an order that
changes from run to run: the match failed at random ("Recomputed values for the following
tensors have different metadata"), and where two tensors of the same shape swapped places
it would pass with the wrong values. The pipe checkpoints itself (``checkpoint=``); the
reentrant form, which recomputes the whole call, works too.
"""
from __future__ import annotations

import torch

__all__ = ["OUTER_CHECKPOINT", "refuse_outer_checkpoint"]

OUTER_CHECKPOINT = (
    "torch.utils.checkpoint.checkpoint(..., use_reentrant=False) around a Pipe of several "
    "partitions cannot recompute it: its stages save tensors on worker threads, in an order "
    "that differs between the forward and the recomputation. Let the pipe recompute itself "
    "(Pipe(..., checkpoint='always'), or checkpoint_every=N), or use use_reentrant=True")


def refuse_outer_checkpoint() -> None:
    """Raise ``RuntimeError`` inside a non-reentrant ``torch.utils.checkpoint`` (its
    saved-tensor hooks are the innermost ones)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is not None and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint":
        raise RuntimeError(OUTER_CHECKPOINT)
