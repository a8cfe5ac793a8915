"""A distributed stage's parameter gradients over one step: summed, then handed over once.

Hooks on a parameter (``register_post_accumulate_grad_hook``, which "optimizer step in
backward" recipes use, or ``register_hook``) must fire once per ``train_step`` with the
step's whole gradient, as they do for ``Pipe`` and for the unpipelined model, not once per
micro-batch with part of it. Without such hooks (``seqpipe.core.sink.needs_aliases``; the
data-parallel reducer's are ``step_aware``) there is nothing to keep: every micro-batch
accumulates straight into ``.grad``, at the plain model's speed. With them, as in ``Pipe``,
the micro-batches accumulate into an ``AliasSink``'s aliases, where no hook of the real
parameters fires; but one micro-batch, the one whose backward is the stage's last of the
step, runs its forward and backward with the real parameters. Just before that backward,
the sink's sums are added to ``.grad``; the backward then accumulates the last
micro-batch's share on top, layer by layer, and each parameter's post-accumulate hooks see
the full gradient, once, while the backward is still running (so a data-parallel
all-reduce still overlaps it).

A parameter with ``register_hook`` hooks, which see the gradient flowing *into* it before
it is accumulated (and may return another: scaling, clipping), is not preloaded: a hook put
first among them adds the other micro-batches' sum to what the last backward brings, so
those hooks see, and change, the whole gradient, as in the unpipelined model.

A parameter the last micro-batch does not reach (say, a layer skipped in that micro-batch
only) got no accumulation: it is handed its sum (zero if preloaded) through autograd
afterwards, so its hooks fire once too.

``train_step`` runs every backward of the step itself, so nothing outside asked for part
of the graph: the sink is ``plain`` (``GradSink.plain``), and the stage's ``B`` backwards,
the last micro-batch's with the real parameters included, run as the unpipelined model's
``loss.backward()`` does, ``torch.autograd.backward(roots, grads)`` without the
``inputs=`` (received tensors, parameters or their aliases or FSDP2's leaves) a stage's
backward passes otherwise, whatever autograd records for the parameters. What a stage's
graph reaches besides those is then treated as the plain model's backward treats it (a
tensor outside the pipe that a layer or ``loss_fn`` holds gets its gradient, a reentrant
``torch.utils.checkpoint`` runs), where ``inputs=`` left it out, silently, or refused it;
and autograd marks no paths first (~4 % of the backward of four small transformer layers,
``benchmarks/backward_inputs.py``). A split backward's ``W`` reaches every leaf behind the
weight path the same way (``SplitBackward.weight``); its ``I`` alone asks for part of the
graph (docs/pipe.md, "The stage backward's `inputs=`").
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from seqpipe.core.sink import AliasSink, GradSink, open_sink
from seqpipe.core.stage import Stage

__all__ = ["StepGrads"]

_NOTHING: ContextManager[None] = nullcontext()  # reentrant and reusable: one for every call


class StepGrads:
    """Where stage ``stage``'s micro-batch gradients go in one step; ``last`` is the
    micro-batch whose backward is the stage's last."""

    def __init__(self, stage: Stage, last: int) -> None:
        self.last = last
        # A sink numbers partitions by pipeline stage; this process holds one stage.
        partitions: List[nn.Module] = [nn.Module() for _ in range(stage.index)]
        self.sink = open_sink([*partitions, stage.partition])
        self.aliased = isinstance(self.sink, AliasSink)  # else all straight into .grad
        self.sink.plain = True  # train_step runs every backward itself (module docstring)
        self._recorded = _Recorded(stage, self.sink) if self.aliased else self.sink

    def sink_for(self, microbatch: int) -> GradSink:
        """Where ``microbatch``'s parameter gradients accumulate: the sink, or, for the last
        micro-batch with aliases, the parameters autograd records (``.grad``)."""
        return self._recorded if microbatch == self.last else self.sink

    def handing_over(self, microbatch: int) -> ContextManager[None]:
        """Around ``microbatch``'s backward. For the last one: add the other micro-batches'
        sums to ``.grad`` before it, and fire the hooks of the parameters it did not
        reach after it. For the others (and without aliases): nothing, and no generator
        made per micro-batch."""
        if microbatch != self.last or not self.aliased:
            return _NOTHING
        return self._handing_over_last()

    @contextmanager
    def _handing_over_last(self) -> Iterator[None]:
        preloaded: List[Tuple[nn.Parameter, Tensor, int]] = []
        firsts: List[_AddFirst] = []
        for param, grad in self.sink.take():
            if param._backward_hooks:  # register_hook hooks: they must see the sum
                firsts.append(_AddFirst(param, grad))
                continue
            if param.grad is None:
                param.grad = grad
            else:
                param.grad += grad
            preloaded.append((param, param.grad, param.grad._version))
        try:
            yield
        finally:
            for first in firsts:
                first.remove()
        # The last backward added to a preloaded .grad in place (a new version of it) or
        # a hook replaced it; an untouched one means autograd never reached the parameter.
        missed = [(p, torch.zeros_like(p)) for p, grad, version in preloaded
                  if p.grad is grad and grad._version == version]
        missed += [(first.param, first.total) for first in firsts if not first.fired]
        if missed:
            torch.autograd.backward([p for p, _ in missed], [g for _, g in missed])


class _Recorded(GradSink):
    """The last micro-batch's destination under aliases: the leaves autograd records for the
    stage's parameters (the parameters, or FSDP2's), their ``.grad`` and hooks; its
    backward runs as the step's others do (``plain``)."""

    def __init__(self, stage: Stage, sink: GradSink) -> None:
        self.stage, self.params = stage, sink.params
        self.plain = sink.plain

    def call(self, stage: int, partition: nn.Module, *args: Any) -> Any:
        """Run ``partition`` on ``args`` with its own parameters."""
        return partition(*args)

    def weights(self, stage: int) -> List[Tensor]:
        """The leaves the forward used for the parameters (``Stage.used_parameters``)."""
        return self.stage.used_parameters()


class _AddFirst:
    """Put first among ``param``'s ``register_hook`` hooks for the last backward: adds
    ``total`` (the other micro-batches' sum) to the gradient it brings, once."""

    def __init__(self, param: Tensor, total: Tensor) -> None:
        self.param, self.total, self.fired = param, total, False
        hooks = param._backward_hooks
        self._handle = RemovableHandle(hooks)
        # Autograd walks the dict in its insertion order (``PyDict_Next``), which
        # ``move_to_end`` does not change: insert again, this hook first, in the same dict
        # (the user's handles hold it and their keys).
        theirs = list(hooks.items())
        hooks.clear()
        hooks[self._handle.id] = self
        hooks.update(theirs)

    def __call__(self, grad: Tensor) -> Optional[Tensor]:
        if self.fired:
            return None
        self.fired = True
        return grad + self.total

    def remove(self) -> None:
        """Take the hook off again (after the last backward)."""
        self._handle.remove()
