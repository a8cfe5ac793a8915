"""``Pipe``: an ``nn.Sequential`` split over devices and run as a micro-batch pipeline."""
from __future__ import annotations

import warnings
from typing import Any, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from seqpipe.core.arguments import check_checkpoint_every, check_chunks
from seqpipe.core.batchnorm import convert_deferred_batch_norm
from seqpipe.core.caller_grads import input_grad
from seqpipe.core.checkpoint import check_mode, checkpoint_stop
from seqpipe.core.fixed_layers import FixedLayers
from seqpipe.core.loss_weights import CountFn
from seqpipe.core.microbatch import Batch, Input, TensorOrTensors, gather
from seqpipe.core.own_hooks import refuse_call_hooks
from seqpipe.core.partition import (
    Device,
    refuse_meta,
    split_by_balance,
    split_by_placement,
    verify_module,
)
from seqpipe.core.sink import GradSink
from seqpipe.core.stage import Stage
from seqpipe.core.tasks import LossFn
from seqpipe.graph.origin import Origin, model_output
from seqpipe.local.direct import (
    PHONY,
    DirectCall,
    pipeline_outputs,
    refuse_create_graph,
    whole_backward,
)
from seqpipe.local.forward_ad import refuse_dual
from seqpipe.local.outer_checkpoint import refuse_outer_checkpoint
from seqpipe.local.pipeline import LocalPipeline
from seqpipe.local.step import LocalRun
from seqpipe.local.train_step import TrainStep, ddp_replicas
from seqpipe.local.untraceable import refuse_tracing
from seqpipe.schedule import AnySchedule
from seqpipe.skip.layout import inspect_skip_layout

__all__ = ["Pipe"]


class _PipeFunction(torch.autograd.Function):
    """Joins the pipeline to the caller's autograd graph.

    Its inputs are the mini-batch tensors and every trainable parameter, so autograd
    hands it the output gradient once and accumulates each parameter's gradient once
    (the sum over micro-batches) — exactly one accumulation per parameter, as in the
    unpipelined model, which is what DistributedDataParallel's reducer expects. Where the
    caller's call is a backward over the whole graph (``whole_backward``, asked through
    the ``PHONY`` input) and no ``.grad`` existed, a ``DirectSink`` leaves the sums in
    ``.grad`` instead, where that call would have put them (``GradSink.hold``).
    """

    @staticmethod
    def forward(ctx: Any, call: "_Call", phony: Tensor,  # type: ignore[override]
                *tensors: Tensor) -> Tuple[Tensor, ...]:
        outputs = call.outputs if call.outputs is not None else call.forward()
        call.outputs = None  # they become this Function's outputs: no cycle through ``ctx``
        ctx.call = call
        return pipeline_outputs(ctx, outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        refuse_create_graph()
        return (None, None, *ctx.call.backward(grads, whole_backward()))


class _Call:
    """One call of a Pipe: micro-batches in, gathered output out, and its backward."""

    def __init__(self, pipe: "Pipe", given: Input, sink: Optional[GradSink], grad: bool) -> None:
        self.pipe, self.input, self.sink, self.grad = pipe, given, sink, grad
        self.params: List[nn.Parameter] = sink.params if sink is not None else []
        self.microbatches = given.microbatches(pipe.chunks)
        self.run: Optional[LocalRun] = None
        self.shape = Batch((), True)  # the output's, once known: its tensors come apart
        self.outputs: Optional[Tuple[Tensor, ...]] = None  # once run (``forward``)

    def forward(self) -> Tuple[Tensor, ...]:
        mode = self.pipe.checkpoint if self.pipe.training and self.grad else "never"
        stop = checkpoint_stop(mode, len(self.microbatches))
        self.run = self.pipe._pipeline.forward(self.microbatches, grad=self.grad,
                                               checkpoint_stop=stop, sink=self.sink)
        outputs = [b for b in self.run.outputs if b is not None]
        self.run.outputs = []
        gathered = Batch.of(gather(outputs))  # a constant: a list, a value per micro-batch
        self.shape = gathered.like(())
        self.outputs = gathered.tensors
        return gathered.tensors

    def backward(self, grads: Sequence[Optional[Tensor]],
                 whole: bool = False) -> List[Optional[Tensor]]:
        """The inputs' then the parameters' gradients (``whole``: the caller's autograd
        call is a backward over the whole graph; see ``LocalPipeline.backward``)."""
        assert self.run is not None
        sizes = self.input.sizes(self.microbatches)
        per_mb = [tuple(None if g is None else g.split(sizes)[i] for g in grads)
                  for i in range(len(sizes))]
        sums = self.pipe._pipeline.backward(self.run, per_mb, whole)
        input_grads = [self._input_grad(j) for j in range(len(self.input.batch.tensors))]
        return input_grads + [sums.get(p) for p in self.params]

    def recorded(self) -> bool:
        """Whether the forward (run with grad) gave an output that requires grad."""
        return self.run is not None and self.run.recorded

    def release(self) -> None:
        """After a forward with grad that recorded nothing: let its state go, as after an
        inference call."""
        assert self.run is not None
        self.pipe._pipeline.release(self.run)

    def _input_grad(self, j: int) -> Optional[Tensor]:
        assert self.run is not None
        return input_grad(self.input, j, self.microbatches, self.run.input_grads)


class Pipe(FixedLayers):
    """Wraps an ``nn.Sequential`` so it runs as a pipeline over one or more devices.

    The module is wrapped in place: its layers stay the same objects, registered under
    the same names, so ``state_dict()`` keys are exactly the Sequential's and an optimizer
    built before wrapping keeps working. With ``balance`` the layers are split into
    ``len(balance)`` partitions and moved to ``devices``; without it, partitions follow
    where the layers already are. Each mini-batch is cut into ``chunks`` micro-batches
    that flow through the partitions in a fill-drain (GPipe) pipeline.

    Args:
        module: the model; must be an ``nn.Sequential``.
        chunks: number of micro-batches per mini-batch (fewer if the batch is smaller).
        checkpoint: ``"always"``, ``"except_last"`` (all micro-batches but the last) or
            ``"never"``: which micro-batches drop their activations and recompute them in
            backward. Off in eval mode and under ``torch.no_grad()``.
        checkpoint_every: checkpoint each run of this many consecutive layers of a
            partition separately (DeepSpeed's ``activation_checkpoint_interval``), so the
            backward recomputes one run at a time; default None: the whole partition at
            once. The mode still says which micro-batches are checkpointed.
        deferred_batch_norm: update BatchNorm running statistics once per mini-batch,
            from all its micro-batches, instead of once per micro-batch.
        balance: number of layers in each partition.
        devices: a device per partition; defaults to the visible GPUs, or ``cpu``.
    """

    def __init__(self, module: nn.Sequential, chunks: int = 1, checkpoint: str = "except_last",
                 deferred_batch_norm: bool = False, *, balance: Optional[Sequence[int]] = None,
                 devices: Optional[Sequence[Device]] = None,
                 checkpoint_every: Optional[int] = None) -> None:
        super().__init__()
        verify_module(module)
        self.chunks = check_chunks(chunks)
        self.checkpoint = check_mode(checkpoint)
        self.checkpoint_every = check_checkpoint_every(checkpoint_every)
        if balance is None:
            if devices is not None:
                raise ValueError("devices is given without balance; give balance too, or "
                                 "place the layers yourself and pass neither")
            partitions, balance, placed = split_by_placement(module)  # moves nothing
            refuse_meta(module)
        else:
            refuse_meta(module)  # before any layer moves
            partitions, balance, placed = split_by_balance(module, balance, devices)
        layout = inspect_skip_layout(module, balance)
        if deferred_batch_norm:
            convert_deferred_batch_norm(module)
        for name, layer in module.named_children():
            self.add_module(name, layer)
        self.keep_hooks_of(module)  # the Sequential's own hooks (core/own_hooks)
        self.balance: List[int] = list(balance)
        self.devices: List[torch.device] = list(placed)
        self.partitions: List[nn.Sequential] = partitions  # views: not registered twice
        stages = [Stage(i, part, dev, layout, checkpoint_every=self.checkpoint_every)
                  for i, (part, dev) in enumerate(zip(partitions, placed))]
        self._pipeline = LocalPipeline(stages, layout)
        # One micro-batch of one cpu partition runs as the plain model (seqpipe.local.direct).
        self._direct = DirectCall(stages[0]) if len(stages) == 1 and \
            stages[0].device.type == "cpu" and not self._pipeline.isolate_rng else None
        self._pending: Optional[TrainStep] = None  # a train_step run by DDP's forward
        self.origin: Optional[Origin] = getattr(module, "origin", None)  # see seqpipe.graph

    # -- the Sequential face -----------------------------------------------------------
    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, index: int) -> nn.Module:
        layers = list(self._modules.values())
        return layers[index]  # type: ignore[return-value]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())  # type: ignore[arg-type]

    def cuda(self, device: Any = None) -> "Pipe":
        raise _moving_error()

    def cpu(self) -> "Pipe":
        raise _moving_error()

    def to(self, *args: Any, **kwargs: Any) -> "Pipe":
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None:
            raise _moving_error()
        return super().to(*args, **kwargs)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Compile every layer in place (``nn.Module.compile`` with these arguments).

        The pipeline itself — threads handing micro-batches between stages — is not
        something ``torch.compile`` can trace; its layers are, and compiling them in place
        keeps the layer objects and the ``state_dict`` keys.
        """
        for layer in self:
            layer.compile(*args, **kwargs)

    # -- running -----------------------------------------------------------------------
    def forward(self, input: TensorOrTensors) -> TensorOrTensors:  # type: ignore[override]
        """Run the mini-batch through the pipeline; the output is on the last device (in the
        model's own structure for a model converted by ``seqpipe.to_sequential``)."""
        compiling = _is_compiling()
        refuse_tracing(compiling)  # torch.jit.trace, torch.export: by name
        if compiling:
            warnings.warn(_COMPILE_WARNING, stacklevel=2)
        # Run it hidden from dynamo where dynamo traces it or has a frame callback set on
        # this thread (read without importing torch._dynamo; assumed set where it cannot be).
        if compiling or _get_callback is None or _get_callback() is not None:
            return model_output(self.origin, self._run_uncompiled(input))
        output = self._run(input)
        return output if self.origin is None else model_output(self.origin, output)

    def train_step(self, input: TensorOrTensors, target: Any, loss_fn: LossFn, *,
                   count_fn: Optional[CountFn] = None,
                   schedule: Union[str, AnySchedule] = "1f1b",
                   ddp: Optional[nn.Module] = None) -> Tensor:
        """Forward and backward one mini-batch under ``schedule``; return its loss.

        ``schedule``: ``"1f1b"`` (at most ``K - s`` micro-batches' activations alive on
        partition ``s``), ``"fill_drain"``/``"gpipe"`` (all of them, as ``forward`` +
        ``backward``), any other built-in name, or a ``seqpipe.schedule.Schedule`` /
        ``StagedSchedule``. Every partition is a stage; a schedule with ``V`` stages per
        device runs them on ``len(balance) / V`` threads, as its placement says.
        ``loss_fn(output, target)`` runs on each micro-batch's output and slice of
        ``target`` (cut like the input) on the last partition's device; the returned loss
        is their mean weighted by micro-batch size (``loss_fn`` on the whole batch, for a
        mean-reduced one), detached. A loss averaged over counted items (tokens that are not
        padding) needs ``count_fn``: then ``loss_fn`` returns each micro-batch's *sum*,
        ``count_fn(target)`` the whole mini-batch's count (``(target != -100).sum()``), and
        the loss and gradients are the sum over the mini-batch divided by that count (under
        ``ddp``, by the count summed over the replicas), exactly. The gradients are added
        to ``.grad`` exactly as ``loss_fn(pipe(input), target).backward()`` adds them
        (once per parameter, hooks included); step the optimizer afterwards. With ``ddp``,
        the ``DistributedDataParallel`` that wraps this pipe, the step runs through DDP's
        forward and its gradients are averaged over the replicas once: call
        ``ddp.module.train_step(x, y, loss_fn, ddp=ddp)``.
        """
        refuse_call_hooks(self, _STEP_HOOKS, _STEP_HOOKS_MEND)
        if ddp is None:
            step = TrainStep(input, target, loss_fn, schedule, count_fn, chunks=self.chunks,
                             num_partitions=len(self.partitions))
            handle = self._run_step(step)
        else:
            if getattr(ddp, "module", None) is not self:
                raise ValueError("ddp must be the DistributedDataParallel that wraps this "
                                 "pipe (ddp.module is the pipe): call "
                                 "ddp.module.train_step(..., ddp=ddp)")
            step = TrainStep(input, target, loss_fn, schedule, count_fn,
                             ddp_replicas(ddp, self.devices[-1]), chunks=self.chunks,
                             num_partitions=len(self.partitions))
            self._pending = step
            try:
                handle = ddp(input)
            finally:
                self._pending = None
        if handle.requires_grad:
            handle.backward()
        assert step.loss is not None
        return step.loss

    def _run_step(self, step: TrainStep) -> Tensor:
        return step.run(self._pipeline, self.checkpoint if self.training else "never")

    def _run(self, input: TensorOrTensors) -> TensorOrTensors:
        if self._pending is not None:  # train_step(..., ddp=...): DDP's forward runs it
            step, self._pending = self._pending, None
            return self._run_step(step)
        given = None if isinstance(input, Tensor) and input.dim() else Input.of(input)
        # (inside a forward-AD dual level only)
        refuse_dual((input,) if given is None else given.batch.tensors, self)
        direct = self._direct
        if direct is not None:  # one micro-batch: maybe the plain model's graph
            output = direct(self, input, given, self.chunks, self.checkpoint)
            if output is not None:
                return output
        if given is None:
            given = Input.of(input)
        batch = given.batch
        pipeline = self._pipeline
        sink = pipeline.open_sink() if torch.is_grad_enabled() else None
        if sink is not None and len(pipeline.stages) > 1:
            refuse_outer_checkpoint()  # torch.utils.checkpoint around the call, by name
        grad = sink is not None and (
            bool(sink.params) or any(t.requires_grad for t in batch.tensors))
        call = _Call(self, given, sink, sink is not None)
        if grad:
            outputs = _PipeFunction.apply(call, PHONY, *batch.tensors, *call.params)
        else:
            # Nothing of the pipe's or the input wants a gradient. Under grad mode the plain
            # model records a graph exactly where a tensor the layers hold does (an adapter
            # outside a frozen base): run with grad on (autograd records nothing where
            # nothing requires grad), and join the caller's graph only if it recorded.
            outputs = call.forward()
            if sink is not None:
                if call.recorded():
                    outputs = _PipeFunction.apply(call, PHONY, *batch.tensors)
                else:
                    call.release()
        return call.shape.like(outputs).value

    # ``_run`` with dynamo off inside (torch.compiler.disable, but torch._dynamo is imported
    # at the first call): for a call that dynamo traces, or whose frames it would compile.
    # Other calls skip its wrapper, a call's fixed cost (~40 µs after a backward).
    _run_uncompiled = torch._disable_dynamo(_run)

    def extra_repr(self) -> str:
        return f"balance={self.balance}, chunks={self.chunks}, checkpoint={self.checkpoint!r}"


_is_compiling = torch.compiler.is_compiling
# Dynamo's frame callback on this thread (None unless a compiled region is running).
_get_callback = getattr(getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None),
                        "get_eval_frame_callback", None)


_COMPILE_WARNING = (
    "torch.compile(pipe) runs the Pipe as it is, uncompiled: its stages run on worker "
    "threads, which torch.compile cannot trace. Call pipe.compile() instead (or compile the "
    "layers before wrapping, with layer.compile()): it compiles every layer in place and "
    "keeps the state_dict keys")


_STEP_HOOKS = ("Pipe.train_step, which hands each micro-batch's output to loss_fn on its "
               "own and never calls the pipe's forward on the whole batch,")
_STEP_HOOKS_MEND = ("register them on the layers instead (pipe[0] sees the input, pipe[-1] "
                    "the output, per micro-batch), or train with out = pipe(x); "
                    "loss_fn(out, y).backward(), which runs them as the model did")


def _moving_error() -> RuntimeError:
    return RuntimeError("a Pipe's partitions are placed on their devices; moving the whole "
                        "Pipe would undo that. Choose devices with Pipe(..., balance=..., "
                        "devices=...) instead (dtype changes with .to(dtype) are fine)")
