"""The local engine: stages of one process, each driven by its own thread.

A forward call runs every stage's forward actions of the fill-drain schedule; the
matching backward call (from autograd, when the user backpropagates through the
pipeline's output) runs their backward actions in reverse micro-batch order. A training
step (``train_step``) runs a schedule's forwards and backwards together, interleaved as the
schedule orders them, each micro-batch's backward starting from its loss. The actions
themselves are run by ``seqpipe.core.tasks`` (shared with the distributed engine), through a
``seqpipe.local.step.LocalStep``. Between stages a micro-batch is a device copy through the
mailbox; a skip tensor goes straight from the stashing stage to the popping one, and its
gradient straight back.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from seqpipe.core.draws import NO_DRAWS, draws_nothing
from seqpipe.core.held import held_ties
from seqpipe.core.microbatch import Batch
from seqpipe.core.rng import draw_seeds, needs_private_rng
from seqpipe.core.sink import GradSink, open_sink
from seqpipe.core.stage import Stage, moved
from seqpipe.core.tasks import LossFn
from seqpipe.local.direct import SECOND_BACKWARD
from seqpipe.local.step import LocalRun, LocalStep
from seqpipe.local.thread_state import ThreadState
from seqpipe.local.tie_order import TieOrder
from seqpipe.local.worker import Program, run_groups
from seqpipe.schedule import Action, FillDrain, Phase, Schedule, backward_phase, forward_phase
from seqpipe.skip.layout import SkipLayout
from seqpipe.trace import hooks

__all__ = ["LocalPipeline", "LocalRun"]

Optionals = Tuple[Optional[Tensor], ...]


class LocalPipeline:
    """Runs the stages of one process; see the module docstring."""

    def __init__(self, stages: Sequence[Stage], layout: SkipLayout,
                 schedule: Optional[Schedule] = None) -> None:
        self.stages = list(stages)
        self.layout = layout
        self.schedule = schedule or FillDrain()
        self.isolate_rng = needs_private_rng([s.device for s in self.stages])

    @property
    def devices(self) -> List[torch.device]:
        return [s.device for s in self.stages]

    def _cpu_stages(self) -> int:
        return sum(s.device.type == "cpu" for s in self.stages)

    def _actions(self, stage: int, m: int) -> List[Action]:
        return [Action(a.phase, a.microbatch, stage)
                for a in self.schedule.actions(stage, len(self.stages), m)]

    # -- forward ---------------------------------------------------------------------
    def forward(self, batches: Sequence[Batch], *, grad: bool, checkpoint_stop: int,
                sink: Optional[GradSink] = None) -> LocalRun:
        """Run every micro-batch through every stage; outputs land in ``run.outputs``.
        With ``grad``, the parameters' gradients will add up in ``sink`` (by default, a new
        ``open_sink``)."""
        m, k = len(batches), len(self.stages)
        run = self._open(m, grad, sink)
        run.trace_step = hooks.begin_step(self.schedule, k, k, m, backward=grad)
        step = LocalStep(self.stages, self.layout, run, checkpoint_stop=checkpoint_stop,
                         seeds=self._seeds(m, grad and checkpoint_stop > 0))
        self._put_inputs(step, batches)
        self._run_forwards(step, [[step.program(forward_phase(self._actions(s, m)))]
                                  for s in range(k)], concurrent=self._cpu_stages())
        if not grad:
            hooks.end_step(run.trace_step)
        return run

    def release(self, run: LocalRun) -> None:
        """After a forward with grad whose outputs require none (``Pipe``: a frozen pipe
        whose layers touched nothing that requires grad): nothing to backpropagate, so the
        call's state goes now, as after a forward without grad."""
        run.states.clear()
        hooks.end_step(run.trace_step)

    def open_sink(self) -> GradSink:
        """Where one call's parameter gradients add up (``seqpipe.core.sink.open_sink``)."""
        return open_sink([stage.partition for stage in self.stages])

    def _open(self, m: int, grad: bool, sink: Optional[GradSink] = None) -> LocalRun:
        run = LocalRun(m, grad, outputs=[None] * m)
        if grad:
            run.sink = sink if sink is not None else self.open_sink()
        return run

    def _seeds(self, m: int, checkpoint: bool) -> Optional[List[int]]:
        """Every task's private random seed (``None``: the global generators). Drawn from
        the global CPU generator, unless no partition can draw (``draws_nothing``; a model
        without dropout, or with it in ``eval()``): then the call leaves that generator as
        the plain model leaves it, so a validation pass between training steps, or a model
        that draws nothing, does not move the masks and the data order the script draws
        later. ``checkpoint``: whether some task of the call is checkpointed (a partition
        checkpointed in segments, ``checkpoint_every``, then keeps its stream)."""
        if not self.isolate_rng:
            return None
        count = m * len(self.stages)
        if all(not (checkpoint and s.segments) and draws_nothing(s.partition)
               for s in self.stages):
            return [NO_DRAWS] * count  # (the partitions as they are when the call starts)
        return draw_seeds(count)

    def _put_inputs(self, step: LocalStep, batches: Sequence[Batch]) -> None:
        for i, batch in enumerate(batches):
            step.mailbox.put(("act", 0, i), moved(batch, self.devices[0]))

    def _run_forwards(self, step: LocalStep, groups: Sequence[List[Program]], *,
                      concurrent: int) -> None:
        """Run ``groups`` (containing forwards) one thread each (``concurrent`` of them on
        CPU); then commit deferred BatchNorm statistics, or drop them if anything failed."""
        try:
            run_groups(groups, step.mailbox,
                       ThreadState(concurrent=concurrent, devices=self.devices))
        except BaseException:
            for stage in self.stages:
                stage.finish_forward(failed=True)
            raise
        for stage in self.stages:
            stage.finish_forward()

    # -- backward ----------------------------------------------------------------------
    def backward(self, run: LocalRun, grad_outputs: Sequence[Optionals],
                 whole: bool = False) -> Dict[nn.Parameter, Tensor]:
        """Backpropagate ``grad_outputs`` (per micro-batch) through every stage.

        Fills ``run.input_grads`` and returns the parameters' gradients summed over
        micro-batches, to be handed to autograd (none where they were left in ``.grad``:
        ``whole``, the caller's autograd call being a backward over the whole graph, lets
        the sink do that; ``GradSink.hold``). CPU stages run on their own threads;
        accelerator stages run on the calling thread, which owns their device's autograd
        queue during a backward.
        """
        if not run.states and run.grad:
            raise RuntimeError(SECOND_BACKWARD)
        m, k = run.num_microbatches, len(self.stages)
        run.input_grads = [()] * m
        hooks.resume_step(run.trace_step)
        step = LocalStep(self.stages, self.layout, run)
        for i, grads in enumerate(grad_outputs):
            step.mailbox.put(("grad", k - 1, i), grads)
        programs = [step.program(backward_phase(self._actions(s, m))) for s in range(k)]
        inline = [p for p in programs if p.device.type != "cpu"]
        threaded = [[p] for p in programs if p.device.type == "cpu"]
        sink = run.sink
        if sink is not None:
            sink.hold(whole)  # .grad put aside for the sums (or left to them: ``whole``)
        try:
            with _in_tie_order(sink, [stage.partition for stage in self.stages]):
                run_groups([inline, *threaded] if inline else threaded, step.mailbox,
                           ThreadState(concurrent=len(threaded), devices=self.devices))
        except BaseException:  # .grad as it was before the call
            if sink is not None:
                sink.drop()
            raise
        sums = dict(sink.take()) if sink is not None else {}  # .grad as before the call
        hooks.end_step(run.trace_step)
        return sums

    # -- a training step under a schedule ----------------------------------------------
    def train_step(self, batches: Sequence[Batch], targets: Sequence[Any], weights: Sequence[float],
                   loss_fn: LossFn, actions: Sequence[Sequence[Action]], *,
                   checkpoint_stop: int, schedule: Any = None) -> Tuple[LocalRun, Tensor]:
        """Forward and backward every micro-batch in the order ``actions`` gives, one list
        per worker thread (``actions[r]``: rank ``r``'s, each naming its stage; one stage
        per rank, or several under interleaved and V-shaped schedules).

        Returns the call (its ``sink`` holds the parameters' gradients, summed over
        micro-batches, unless they went to ``.grad`` directly; ``input_grads`` the
        inputs') and the mini-batch loss: the sum of the micro-batch losses, each times its
        ``weights`` entry, in micro-batch order (``Tasks.loss_sum``). ``schedule``: what
        the actions came from, for a trace to name and replay.
        """
        m = len(batches)
        run = self._open(m, True)
        assert run.sink is not None
        run.sink.plain = True  # it runs every backward itself: as loss.backward() would
        run.trace_step = hooks.begin_step(schedule, len(self.stages), len(actions), m)
        run.input_grads = [()] * m
        split = {(a.stage, a.microbatch) for stage in actions for a in stage
                 if a.phase is Phase.BACKWARD_INPUT}
        step = LocalStep(self.stages, self.layout, run, checkpoint_stop=checkpoint_stop,
                         seeds=self._seeds(m, checkpoint_stop > 0), split=split,
                         from_loss=True)
        self._put_inputs(step, batches)
        with _in_tie_order(run.sink, [stage.partition for stage in self.stages]):
            self._run_forwards(step, [[step.program(rank, targets, loss_fn, weights)]
                                      for rank in actions],
                               concurrent=sum(self.devices[rank[0].stage].type == "cpu"  # type: ignore[index]
                                              for rank in actions))
        hooks.end_step(run.trace_step)
        return run, step.loss_sum()


@contextlib.contextmanager
def _in_tie_order(sink: Optional[GradSink], partitions: Sequence[nn.Module]
                  ) -> Iterator[None]:
    """Run the call's backwards with a fixed order for the gradients of the tensors
    several partitions use (``seqpipe.local.tie_order``), if there are any: parameters
    registered in several, and tensors held outside registration (``seqpipe.core.held``).
    Their sums are accumulated when the call ends; a failed call drops them."""
    if sink is None:
        yield
        return
    leaves = sink.shared_leaves(held_ties(sink.own, partitions) if len(partitions) > 1 else ())
    leaves = list({id(leaf): leaf for leaf in leaves}.values())  # a tie held too: once
    if not leaves:
        yield
        return
    ties = TieOrder(leaves)
    try:
        yield
    except BaseException:
        ties.close()
        raise
    ties.flush()
