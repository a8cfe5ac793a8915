"""How a batch moves from one profiled layer to the next.

Layers are profiled one at a time, so each one gets a fresh copy of what the previous layer
returned, cut off from the previous layer's autograd graph. What a layer receives follows
:class:`seqpipe.core.microbatch.Batch`, as in the pipeline itself: a tensor, or a tuple of
tensors passed as one argument. Keeping that in this one file lets it change in one place.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from seqpipe.core.microbatch import Batch, Input, TensorOrTensors

__all__ = ["backward", "fresh", "layer_input", "prepare_sample", "run_layer"]


def prepare_sample(sample: TensorOrTensors, device: torch.device,
                   chunks: int | None = None) -> Batch:
    """Validate a sample, keep its largest micro-batch if ``chunks`` is given, move it.

    The micro-batch is the first of ``scatter(sample, chunks)``, the largest one the
    pipeline will run.
    """
    given = Input.of(sample)
    batch = given.batch
    if given.size == 0:
        raise ValueError("the sample's batch is empty (dim 0 has size 0); "
                         "pass a sample with at least one row")
    if chunks is not None:
        if chunks < 1:
            raise ValueError(f"chunks must be at least 1, got {chunks}")
        batch = given.scatter(chunks)[0]
    return batch.like([t.to(device) for t in batch.tensors])


def fresh(tensor: Tensor) -> Tensor:
    """A copy cut off from autograd history that still requires grad if ``tensor`` did.

    A tensor requiring grad comes back as a non-leaf (a clone of a detached leaf), so a
    layer may modify it in place (``nn.ReLU(inplace=True)``), just as it may modify the
    output of the layer before it in the real model. The clone also keeps the caller's
    sample untouched by in-place layers.
    """
    detached = tensor.detach()
    if tensor.requires_grad:
        detached.requires_grad_()
    return detached.clone()


def layer_input(batch: Batch) -> Batch:
    """What the next layer receives: fresh copies of the previous layer's outputs."""
    return batch.like([fresh(t) for t in batch.tensors])


def run_layer(index: int, layer: nn.Module, batch: Batch) -> Batch:
    """Call ``layer`` the way the pipeline would, and wrap what it returns.

    An error the layer raises keeps its type and gains a note naming the layer.
    """
    try:
        output = layer(batch.value)
    except Exception as exc:
        exc.add_note(f"seqpipe: raised by layer {index} ({type(layer).__name__}) while "
                     f"profiling it for a balance")
        raise
    try:
        return Batch.of(output)
    except TypeError as exc:
        raise TypeError(f"layer {index} ({type(layer).__name__}) cannot be profiled: "
                        f"{exc}") from None


def backward(batch: Batch) -> None:
    """Back-propagate a gradient of ones from every output that requires grad."""
    outputs = [t for t in batch.tensors if t.requires_grad]
    if outputs:
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
