"""A distributed stage's parameter gradients over one step: summed, then handed over once.

Hooks on a parameter (``register_post_accumulate_grad_hook``, which "optimizer step in
backward" recipes use, and the data-parallel reducer's) must fire once per ``train_step``
with the step's whole gradient, as they do for ``Pipe`` and for the unpipelined model, not
once per micro-batch with part of it. So, as in ``Pipe``, the micro-batches accumulate
into a ``GradSink``'s aliases, where no hook of the real parameters fires; but one
micro-batch, the one whose backward is the stage's last of the step, runs its forward
and backward with the real parameters. Just before that backward, the sink's sums are
added to ``.grad``; the backward then accumulates the last micro-batch's share on top,
layer by layer, and each parameter's post-accumulate hooks see the full gradient, once,
while the backward is still running (so a data-parallel all-reduce still overlaps it).

A parameter the last micro-batch does not reach (say, a layer skipped in that micro-batch
only) got its sum in ``.grad`` but no accumulation: it is handed a zero gradient through
autograd afterwards, so its hooks fire once too.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn

from seqpipe.core.sink import GradSink
from seqpipe.core.stage import Stage

__all__ = ["StepGrads"]


class StepGrads:
    """Where stage ``stage``'s micro-batch gradients go in one step; ``last`` is the
    micro-batch whose backward is the stage's last."""

    def __init__(self, stage: Stage, last: int) -> None:
        self.last = last
        # A GradSink numbers partitions by pipeline stage; this process holds one stage.
        partitions: List[nn.Module] = [nn.Module() for _ in range(stage.index)]
        self.sink = GradSink([*partitions, stage.partition])

    def sink_for(self, microbatch: int) -> Optional[GradSink]:
        """Where ``microbatch``'s parameter gradients accumulate (``None``: ``.grad``)."""
        return None if microbatch == self.last else self.sink

    @contextmanager
    def handing_over(self, microbatch: int) -> Iterator[None]:
        """Around ``microbatch``'s backward. For the last one: add the other micro-batches'
        sums to ``.grad`` before it, and fire the hooks of the parameters it did not
        reach after it."""
        if microbatch != self.last:
            yield
            return
        preloaded: List[Tuple[nn.Parameter, Tensor, int]] = []
        for param, grad in self.sink.take():
            if param.grad is None:
                param.grad = grad
            else:
                param.grad += grad
            preloaded.append((param, param.grad, param.grad._version))
        yield
        # The last backward added to a preloaded .grad in place (a new version of it) or
        # a hook replaced it; an untouched one means autograd never reached the parameter.
        missed = [p for p, grad, version in preloaded
                  if p.grad is grad and grad._version == version]
        if missed:
            torch.autograd.backward(missed, [torch.zeros_like(p) for p in missed])
