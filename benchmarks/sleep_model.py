"""A sleep-timed model: layers whose forward, input gradient and weight gradient *sleep*.

Real compute cannot show a 4-8 rank pipeline on a 2-core machine: the ranks would fight for
the cores and the measurement would be of the contention. Here every layer "computes" by
``time.sleep`` (which releases the GIL and the core), so a step's wall time is the schedule's
makespan plus what the runtime adds: scheduling, communication, bookkeeping. That isolates
exactly what differs between two pipeline runtimes running the same schedule.

One :class:`SleepLayer` on input ``x`` (a micro-batch of shape ``(n, width)``) computes::

    a = InputPath(x)            # a = c * x;  backward: sleeps I ms, returns c * grad
    y = a + WeightPath(w, a)    # w * a (a detached); backward: sleeps W ms, returns
                                #   (grad * a).sum(0) for w and nothing for a

after sleeping ``F`` ms in its forward. The two backward nodes are separate autograd nodes
and neither lies on the other's path: a backward with respect to the layer's input (the
``I`` of a split backward) runs only ``InputPath``'s node, a backward with respect to the
weights (``W``) only ``WeightPath``'s, and a full backward both. Both nodes save ``a`` (one
activation of the micro-batch, ``n * width`` floats, one storage): ``WeightPath`` as a real
layer keeps its input until its weight gradient is done, ``InputPath`` as a ReLU keeps its
output for its input gradient. So saved-tensor counting sees the memory pattern of a real
model, including what a split backward keeps alive between ``I`` and ``W``: autograd frees a
node's saved tensors after its backward only without ``retain_graph``. The ``w * a`` term is a
stop-gradient for the input path (its input gradient is not propagated); every runtime runs
the same autograd graph, so gradients stay comparable across runtimes, and against the
unpipelined model.

The first layer of the pipeline gets an input that does not require a gradient (the data),
so its ``InputPath`` node is not even recorded: stage 0 has no ``I`` work, as in a real
model. ``stage_costs`` returns per-stage costs that say so, for ``seqpipe.schedule.simulate``.

Sleeping can be switched off (:func:`sleeping`) to compute reference gradients quickly.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator, List, Tuple

import torch
from torch import Tensor, nn

__all__ = ["SleepLayer", "make_sleep_model", "overrun", "sleeping", "stage_costs"]

_ENABLED = [True]
_SLEPT = [0.0, 0.0]  # seconds asked for, seconds actually slept (since the last overrun())


@contextmanager
def sleeping(enabled: bool) -> Iterator[None]:
    """Within the block, layers sleep (``True``) or run at full speed (``False``)."""
    before = _ENABLED[0]
    _ENABLED[0] = enabled
    try:
        yield
    finally:
        _ENABLED[0] = before


def _sleep(seconds: float) -> None:
    if _ENABLED[0] and seconds > 0:
        start = time.perf_counter()
        time.sleep(seconds)
        _SLEPT[0] += seconds
        _SLEPT[1] += time.perf_counter() - start


def overrun() -> float:
    """How much longer the sleeps took than asked since the last call, as a ratio (1.0:
    exact; a loaded machine wakes sleepers late), and start counting afresh."""
    asked, slept = _SLEPT
    _SLEPT[:] = [0.0, 0.0]
    return slept / asked if asked else float("nan")


class _InputPath(torch.autograd.Function):
    """``c * x``; its backward is the layer's input gradient and sleeps ``I``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float, seconds: float) -> Tensor:
        out = x * scale
        ctx.save_for_backward(out)  # as ReLU keeps its output for its input gradient
        ctx.scale, ctx.seconds = scale, seconds
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None, None]:
        (out,) = ctx.saved_tensors
        _sleep(ctx.seconds)
        return grad * ctx.scale * (out == out), None, None  # the mask of a ReLU, all ones


class _WeightPath(torch.autograd.Function):
    """``w * a`` with ``a`` detached; its backward is the weight gradient and sleeps ``W``."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, activation: Tensor, seconds: float) -> Tensor:
        ctx.save_for_backward(activation)
        ctx.seconds = seconds
        return weight * activation

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None, None]:
        (activation,) = ctx.saved_tensors
        _sleep(ctx.seconds)
        return (grad * activation).sum(0), None, None


class SleepLayer(nn.Module):
    """One layer whose forward sleeps ``forward_ms`` and whose backward has an input node
    sleeping ``input_ms`` and a weight node sleeping ``weight_ms`` (see the module doc)."""

    def __init__(self, width: int, forward_ms: float, input_ms: float, weight_ms: float,
                 scale: float = 0.9) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width))
        self.scale = scale
        self.seconds = (forward_ms / 1e3, input_ms / 1e3, weight_ms / 1e3)
        nn.init.uniform_(self.weight, -0.5, 0.5)

    def forward(self, x: Tensor) -> Tensor:
        forward_s, input_s, weight_s = self.seconds
        _sleep(forward_s)
        a = _InputPath.apply(x, self.scale, input_s)
        return a + _WeightPath.apply(self.weight, a.detach(), weight_s)

    def extra_repr(self) -> str:
        f, i, w = (round(s * 1e3, 3) for s in self.seconds)
        return f"width={self.weight.numel()}, F={f} ms, I={i} ms, W={w} ms"


def make_sleep_model(num_stages: int, layers_per_stage: int, stage_ms: float,
                     width: int, seed: int = 0) -> nn.Sequential:
    """``num_stages * layers_per_stage`` sleep layers; a stage's ``F``, ``I`` and ``W`` each
    take ``stage_ms`` in all (split evenly over its layers). Same ``seed``, same weights."""
    torch.manual_seed(seed)
    ms = stage_ms / layers_per_stage
    return nn.Sequential(*(SleepLayer(width, ms, ms, ms)
                           for _ in range(num_stages * layers_per_stage)))


def stage_costs(num_stages: int, stage_ms: float) -> Tuple[float, List[float], float]:
    """``(forward_cost, input_cost per stage, weight_cost)`` of the model, in ms: stage 0
    has no input gradient to compute (its input is the data), every other stage ``I``."""
    return stage_ms, [0.0] + [stage_ms] * (num_stages - 1), stage_ms
