"""``train_step`` needs gradients: refused under ``torch.no_grad()`` or ``inference_mode``.

Both engines check on the calling thread before anything runs. ``DistributedPipe`` did not:
its step ran to a stage's weight backward, failed there with "It is not possible to get
the gradient edge for a Tensor that does not require gradients", and left the pipeline
failed for every later call ("this pipeline failed in an earlier call").
"""
from __future__ import annotations

import torch

__all__ = ["NO_GRAD", "check_grad_enabled"]

NO_GRAD = ("train_step computes gradients, but gradients are disabled here (torch.no_grad() "
           "or inference_mode); for inference call the pipe itself")


def check_grad_enabled() -> None:
    """Raise ``RuntimeError`` (``NO_GRAD``) unless grad mode is on in this thread."""
    if not torch.is_grad_enabled():
        raise RuntimeError(NO_GRAD)
