"""``Pipe.train_step``: one training step of the local pipeline under a schedule.

``Pipe.forward`` followed by ``loss.backward()`` runs fill-drain: autograd asks for the
backward only once every forward has run, so every micro-batch's activations are alive at
once. 1F1B and the zero-bubble schedules start a micro-batch's backward as soon as its
forward ends, which needs its loss there and then; so ``train_step`` takes the target and
the loss function and runs the whole step, forwards and backwards in the schedule's order
(``LocalPipeline.train_step``, each action run by ``seqpipe.core.tasks`` as on a rank of
``DistributedPipe``). The mini-batch loss is that of ``DistributedPipe.train_step``
(``seqpipe.core.loss_weights``): the micro-batch losses weighted by micro-batch size, so for
a mean-reduced ``loss_fn`` it and the gradients are those of ``loss_fn(model(input),
target)``; or, with ``count_fn``, the summed losses over the mini-batch's count (summed
over the ``DistributedDataParallel`` replicas under ``ddp``).

The gradients reach the parameters as they do after ``forward`` + ``backward``. Where a
parameter has hooks (or DDP runs the step), the stages accumulate into one ``AliasSink``,
and the sums are handed to autograd once, through an ``autograd.Function`` whose inputs
are the mini-batch's tensors and the trainable parameters (``_Handoff``); the hooks
therefore fire once per step, with the whole gradient. Otherwise (a ``DirectSink``) the
micro-batches accumulate straight into ``.grad`` and there is nothing to hand over
(``seqpipe/core/sink.py``). The step runs every backward itself, so each is one over the
whole graph, as the plain model's (``GradSink.plain``): a tensor outside the pipe that a
layer or ``loss_fn`` holds gets its gradient (docs/pipe.md, "The stage backward's
`inputs=`"). The step runs while that Function's output is made, as a forward
does; under ``DistributedDataParallel``, ``train_step(..., ddp=ddp)`` makes it inside DDP's
own forward (which prepares DDP's reducer), and the hand-off's backward is an ordinary
backward of DDP's output: the reducer averages the gradients once per mini-batch, as it does for
``ddp(x)`` + ``loss.backward()`` (and ``ddp.no_sync()`` works as it does there).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from seqpipe.core.caller_grads import input_grad
from seqpipe.core.checkpoint import checkpoint_stop
from seqpipe.core.grad_mode import check_grad_enabled
from seqpipe.core.loss_weights import CountFn, Replicas, loss_weights
from seqpipe.core.microbatch import Input, TensorOrTensors
from seqpipe.core.tasks import LossFn
from seqpipe.local.pipeline import LocalPipeline
from seqpipe.schedule import (
    Action,
    AnySchedule,
    Auto,
    ScheduleError,
    get_schedule,
    placement_of,
    validate_schedule,
)
from seqpipe.schedule.protocol import staged_orders
from seqpipe.schedule.registry import SCHEDULES, normalized

__all__ = ["TrainStep", "ddp_replicas", "local_actions"]

ONE_STAGE_SCHEDULES = ("fill_drain", "gpipe", "1f1b", "zb_h1", "zb_h2")


def _named(schedule: Union[str, AnySchedule]) -> str:
    return repr(schedule) if isinstance(schedule, str) else type(schedule).__name__


def _ranks_for(schedule: AnySchedule, num_stages: int) -> Optional[int]:
    """How many ranks (threads) run ``num_stages`` stages under ``schedule``: the most
    for which its placement has that many stages; ``None`` if no count does."""
    for ranks in range(num_stages, 0, -1):
        if num_stages % ranks:
            continue
        try:
            if placement_of(schedule, ranks).num_stages == num_stages:
                return ranks
        except ScheduleError:
            continue
    return None


def _per_rank(schedule: AnySchedule) -> str:
    try:
        return str(placement_of(schedule, 2).num_stages // 2)
    except ScheduleError:
        return "several"


# Built-in schedules' checked actions, by (their class, partitions, micro-batches): they
# are pure data, and resolving, placing and validating them again costs a step 50-370 µs.
_BUILT: Dict[Tuple[Any, int, int], Tuple[Tuple[Action, ...], ...]] = {}
_BUILT_MAX = 64  # (a loop whose batch size varies makes a few more keys; bounded anyway)


def local_actions(schedule: Union[str, AnySchedule], num_partitions: int,
                  num_microbatches: int) -> List[List[Action]]:
    """Per rank (worker thread), its actions under ``schedule``, checked, each naming its
    stage; every partition is a stage.

    A one-stage-per-rank schedule gives each partition its own thread; one that places
    ``V`` stages on a rank (interleaved, V-shaped) runs the ``num_partitions`` stages on
    ``num_partitions / V`` threads, stage ``s`` on the thread its placement names. A
    built-in named by a string is worked out once per count of partitions and
    micro-batches (``Action``s are frozen: the lists are new, the actions shared); a
    schedule object, which may change between calls, every time.
    """
    key = None
    if isinstance(schedule, str):
        key = (SCHEDULES.get(normalized(schedule)), num_partitions, num_microbatches)
        built = _BUILT.get(key) if key[0] is not None else None
        if built is not None:
            return [list(rank) for rank in built]
    actions = _local_actions(schedule, num_partitions, num_microbatches)
    if key is not None and key[0] is not None:
        if len(_BUILT) >= _BUILT_MAX:
            _BUILT.clear()
        _BUILT[key] = tuple(tuple(rank) for rank in actions)
    return actions


def _local_actions(schedule: Union[str, AnySchedule], num_partitions: int,
                   num_microbatches: int) -> List[List[Action]]:
    resolved = get_schedule(schedule)
    if isinstance(resolved, Auto):
        raise ValueError(
            "schedule='auto' is DistributedPipe's (it measures the first step on every rank "
            "and switches from the next); Pipe.train_step runs the schedule it is given: name "
            "one, e.g. '1f1b' or 'zb_h1', and compare them with seqpipe.trace.record() or "
            "seqpipe.schedule.simulate")
    ranks = _ranks_for(resolved, num_partitions)
    if ranks is None:
        raise ValueError(
            f"schedule {_named(schedule)} cannot place {num_partitions} partitions: it puts "
            f"{_per_rank(resolved)} stages on each device, and every partition is a stage; "
            f"give balance a multiple of that many entries, or use a one-stage-per-partition "
            f"schedule: {', '.join(map(repr, ONE_STAGE_SCHEDULES))}")
    validate_schedule(resolved, ranks, num_microbatches)
    return staged_orders(resolved, ranks, num_microbatches)


def ddp_replicas(ddp: nn.Module, device: torch.device) -> Replicas:
    """The replicas of a ``DistributedDataParallel`` (its process group), for summing a
    step's count over them; read through the group itself, so that the local engine
    does not import ``torch.distributed``."""
    group = ddp.process_group
    return Replicas(group.size(), lambda total: group.allreduce([total]).wait(), device)


class _Handoff(torch.autograd.Function):
    """Hands a finished step's gradients to autograd: one accumulation per parameter."""

    @staticmethod
    def forward(ctx: Any, step: "TrainStep", *tensors: Tensor) -> Tensor:  # type: ignore[override]
        ctx.step = step
        assert step.loss is not None
        return torch.zeros((), dtype=step.loss.dtype, device=step.loss.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        step, ctx.step = ctx.step, None
        return (None, *step.take_grads())


class TrainStep:
    """One ``Pipe.train_step``: the checked arguments, then the step and its results.

    ``chunks`` and ``num_partitions``: the pipe's; ``count_fn`` and ``replicas``: see
    ``seqpipe.core.loss_weights``.
    """

    def __init__(self, input: TensorOrTensors, target: Any, loss_fn: LossFn,
                 schedule: Union[str, AnySchedule], count_fn: Optional[CountFn] = None,
                 replicas: Optional[Replicas] = None, *, chunks: int,
                 num_partitions: int) -> None:
        check_grad_enabled()
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got "
                            f"{type(loss_fn).__name__}")
        self.input = Input.of(input)
        self.batch = self.input.batch
        self.microbatches = self.input.microbatches(chunks)
        m = len(self.microbatches)
        self.weights = loss_weights(target, m, count_fn, replicas)
        self.actions = local_actions(schedule, num_partitions, m)
        self.schedule = schedule
        self.loss_fn = loss_fn
        self.loss: Optional[Tensor] = None
        self.params: List[nn.Parameter] = []
        self._sums: Dict[nn.Parameter, Tensor] = {}
        self._input_grads: List[Tuple[Optional[Tensor], ...]] = []
        self._targets: List[Tuple[Tensor, Optional[Tensor]]] = []  # the target's, from
        # the caller's graph (``seqpipe.core.caller_grads``)

    def run(self, pipeline: LocalPipeline, mode: str) -> Tensor:
        """Run the step on the pipe's ``pipeline`` under checkpoint ``mode`` (``"never"``
        outside training); return what hands the gradients of the pipe's trainable
        parameters (and inputs) over when backpropagated."""
        run, weighted = pipeline.train_step(
            self.microbatches, self.weights.targets, self.weights.weights, self.loss_fn,
            self.actions, checkpoint_stop=checkpoint_stop(mode, len(self.microbatches)),
            schedule=self.schedule)
        self.loss = self.weights.report(weighted)
        assert run.sink is not None
        self._sums = dict(run.sink.take())
        self._input_grads = run.input_grads
        self._targets = self.weights.target_grads()
        self.params = run.sink.params  # the pipe's trainable parameters
        return _Handoff.apply(self, *self.batch.tensors, *[t for t, _ in self._targets],
                              *self.params)

    def take_grads(self) -> List[Optional[Tensor]]:
        """The inputs', the target's then the parameters' gradients, letting go of them
        here."""
        inputs = [input_grad(self.input, j, self.microbatches, self._input_grads)
                  for j in range(len(self.batch.tensors))]
        targets = [g for _, g in self._targets]
        sums, self._sums, self._input_grads, self._targets = self._sums, {}, [], []
        return inputs + targets + [sums.get(p) for p in self.params]
