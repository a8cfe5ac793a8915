"""The local engine: stages of one process, each driven by its own thread.

A forward call runs every stage's forward actions of the fill-drain schedule; the
matching backward call (from autograd, when the user backpropagates through the
pipeline's output) runs their backward actions in reverse micro-batch order. Between
stages a micro-batch is a device copy through the mailbox; a skip tensor goes straight
from the stashing stage to the popping one, and its gradient straight back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from seqpipe.microbatch import Batch
from seqpipe.rng import draw_seeds, needs_private_rng
from seqpipe.schedule import Action, FillDrain, Schedule, backward_phase, forward_phase
from seqpipe.sink import GradSink
from seqpipe.skip.layout import SkipLayout
from seqpipe.skip.tracker import SkipKey
from seqpipe.stage import Grads, Received, Stage, TaskState, moved, wants_grad
from seqpipe.stream import move
from seqpipe.thread_state import ThreadState
from seqpipe.trace import hooks
from seqpipe.trace.events import EventKind
from seqpipe.worker import Mailbox, Program, run_groups

__all__ = ["LocalPipeline", "LocalRun"]

Optionals = Tuple[Optional[Tensor], ...]


@dataclass
class LocalRun:
    """One forward call's state, kept until its backward: per-task states and results."""

    num_microbatches: int
    grad: bool
    states: Dict[Tuple[int, int], TaskState] = field(default_factory=dict)
    sink: Optional[GradSink] = None  # where parameter gradients add up, with grad
    outputs: List[Optional[Batch]] = field(default_factory=list)
    input_grads: List[Optionals] = field(default_factory=list)
    trace_step: Optional[int] = None  # its index in an open seqpipe.trace.record()


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
        return list(self.schedule.actions(stage, len(self.stages), m))

    # -- forward -----------------------------------------------------------------------
    def forward(self, batches: Sequence[Batch], *, grad: bool, checkpoint_stop: int) -> LocalRun:
        """Run every micro-batch through every stage; outputs land in ``run.outputs``."""
        m, k = len(batches), len(self.stages)
        run = LocalRun(m, grad, outputs=[None] * m,
                       trace_step=hooks.begin_step(self.schedule, k, k, m, backward=grad))
        if grad:
            run.sink = GradSink([stage.partition for stage in self.stages])
        seeds = draw_seeds(m * k) if self.isolate_rng else None
        mailbox = Mailbox()
        for i, batch in enumerate(batches):
            mailbox.put(("act", 0, i), moved(batch, self.devices[0]))

        def program(s: int) -> Program:
            popped = [skip.key for skip in self.layout.skips_popped_by(s)]

            def ready(a: Action) -> bool:
                i = a.microbatch
                return mailbox.has(("act", s, i)) and all(
                    mailbox.has(("skip", s, i, key)) for key in popped)

            def awaits(a: Action) -> Optional[Tuple[int, str]]:
                """What ``a`` still waits for, while tracing: (stage, message)."""
                i = a.microbatch
                if not mailbox.has(("act", s, i)):
                    return s - 1, "activation"
                for key in popped:
                    if not mailbox.has(("skip", s, i, key)):
                        return self.layout.stash_partition(*key), "skip tensor"
                return None

            def execute(a: Action) -> None:
                i = a.microbatch
                inputs, flags = mailbox.take(("act", s, i))
                skips = [mailbox.take(("skip", s, i, key)) for key in popped]
                received = Received(inputs, dict(zip(popped, (t for t, _ in skips))),
                                    flags + tuple(f for _, f in skips))
                with hooks.span(EventKind.FORWARD, s, i):
                    sent, state = self.stages[s].forward(
                        received, grad=grad, checkpoint=grad and i < checkpoint_stop,
                        seed=None if seeds is None else seeds[i * k + s],
                        sink=run.sink)
                if state is not None:
                    run.states[(s, i)] = state
                self._send_forward(mailbox, run, s, i, sent.outputs, sent.skips)

            return Program(s, forward_phase(self._actions(s, m)), ready, execute,
                           self.stages[s].device, awaits)

        try:
            run_groups([[program(s)] for s in range(k)], mailbox,
                       ThreadState(concurrent=self._cpu_stages(), devices=self.devices))
        except BaseException:
            for stage in self.stages:
                stage.finish_forward(failed=True)
            raise
        for stage in self.stages:
            stage.finish_forward()
        if not grad:
            hooks.end_step(run.trace_step)
        return run

    def _send_forward(self, mailbox: Mailbox, run: LocalRun, s: int, i: int, outputs: Batch,
                      skips: Dict[SkipKey, Optional[Tensor]]) -> None:
        if s + 1 < len(self.stages):
            with hooks.span(EventKind.SEND, s, i, peer=s + 1, what="activation"):
                mailbox.put(("act", s + 1, i), moved(outputs, self.devices[s + 1]))
        else:
            run.outputs[i] = Batch(tuple(t.detach() for t in outputs.tensors), outputs.atomic)
        for key, tensor in skips.items():
            dest = self.layout.pop_partition(*key)
            with hooks.span(EventKind.SEND, s, i, peer=dest, what="skip tensor"):
                mailbox.put(("skip", dest, i, key), (move(tensor, self.devices[dest]),
                                                      wants_grad(tensor)))

    # -- backward ----------------------------------------------------------------------
    def backward(self, run: LocalRun,
                 grad_outputs: Sequence[Optionals]) -> Dict[nn.Parameter, Tensor]:
        """Backpropagate ``grad_outputs`` (per micro-batch) through every stage.

        Fills ``run.input_grads`` and returns the parameters' gradients summed over
        micro-batches. CPU stages run on their own threads; accelerator stages run on the
        calling thread, which owns their device's autograd queue during a backward.
        """
        if not run.states and run.grad:
            raise RuntimeError(
                "this pipeline output was already backpropagated; its activations are freed. "
                "Run the forward again (there is no retain_graph for a Pipe)")
        m, k = run.num_microbatches, len(self.stages)
        run.input_grads = [()] * m
        hooks.resume_step(run.trace_step)
        mailbox = Mailbox()
        for i, grads in enumerate(grad_outputs):
            mailbox.put(("grad", k - 1, i), grads)

        def program(s: int) -> Program:
            stashed = [skip.key for skip in self.layout.skips_stashed_by(s)]

            def ready(a: Action) -> bool:
                i = a.microbatch
                return mailbox.has(("grad", s, i)) and all(
                    mailbox.has(("skipgrad", s, i, key)) for key in stashed)

            def awaits(a: Action) -> Optional[Tuple[int, str]]:
                """What ``a`` still waits for, while tracing: (stage, message)."""
                i = a.microbatch
                if not mailbox.has(("grad", s, i)):
                    return s + 1, "gradient"
                for key in stashed:
                    if not mailbox.has(("skipgrad", s, i, key)):
                        return self.layout.pop_partition(*key), "skip gradient"
                return None

            def execute(a: Action) -> None:
                i = a.microbatch
                grads = mailbox.take(("grad", s, i))
                skip_grads = {key: mailbox.take(("skipgrad", s, i, key)) for key in stashed}
                with hooks.span(EventKind.BACKWARD, s, i):
                    received = self.stages[s].backward(run.states.pop((s, i)), grads,
                                                       skip_grads, sink=run.sink)
                self._send_backward(mailbox, run, s, i, received)

            return Program(s, backward_phase(self._actions(s, m)), ready, execute,
                           self.stages[s].device, awaits)

        programs = [program(s) for s in range(k)]
        inline = [p for p in programs if p.device.type != "cpu"]
        threaded = [[p] for p in programs if p.device.type == "cpu"]
        run_groups([inline, *threaded] if inline else threaded, mailbox,
                   ThreadState(concurrent=len(threaded), devices=self.devices))
        hooks.end_step(run.trace_step)
        return dict(run.sink.take()) if run.sink is not None else {}

    def _send_backward(self, mailbox: Mailbox, run: LocalRun, s: int, i: int,
                       received: Grads) -> None:
        if s > 0:
            with hooks.span(EventKind.SEND, s, i, peer=s - 1, what="gradient"):
                mailbox.put(("grad", s - 1, i),
                            tuple(move(g, self.devices[s - 1]) for g in received.inputs))
        else:
            run.input_grads[i] = received.inputs
        for key, grad in received.skips.items():
            src = self.layout.stash_partition(*key)
            with hooks.span(EventKind.SEND, s, i, peer=src, what="skip gradient"):
                mailbox.put(("skipgrad", src, i, key), move(grad, self.devices[src]))
