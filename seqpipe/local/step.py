"""The local engine's side of a schedule's actions: the mailbox between stage threads.

``seqpipe.core.tasks.Tasks`` runs the actions (the part the distributed engine shares); a
``LocalStep`` supplies where their data comes from and goes: activations, skips and their
gradients are values in one ``Mailbox``, under keys ``("act", stage, i)``,
``("skip", stage, i, key)``, ``("grad", stage, i)`` and ``("skipgrad", stage, i, key)``, put
by the sender already on the receiver's device. An action is ready once its keys are
there; ``W`` follows its ``I`` on the same stage thread, so it is always ready.

One ``LocalStep`` serves one call: a forward (``Pipe.forward``), the backward autograd asks
of it (whose last stage gets the output gradients from autograd), or a whole training step
under a schedule (``Pipe.train_step``, whose last stage starts its backward from the loss).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Dict, List, Optional, Sequence, Tuple

from torch import Tensor

from seqpipe.core.microbatch import Batch
from seqpipe.core.sink import GradSink
from seqpipe.core.stage import Grads, Received, Sent, Stage, TaskState, moved
from seqpipe.core.stream import move
from seqpipe.core.tasks import LossFn, Optionals, Tasks
from seqpipe.local.worker import Mailbox, Program, device_context
from seqpipe.schedule import Action, Phase
from seqpipe.skip.layout import SkipLayout
from seqpipe.skip.tracker import SkipKey
from seqpipe.trace import hooks
from seqpipe.trace.events import EventKind, What

__all__ = ["LocalRun", "LocalStep"]

_SAME_DEVICE = nullcontext()  # reusable and reentrant: one for every such action


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
    recorded: bool = False  # with grad: some output of the last stage requires grad


class LocalStep(Tasks):
    """One call of a ``LocalPipeline`` (its ``stages`` and skip ``layout``, the call's
    state in ``run``): its tasks, exchanging data through a mailbox.

    ``from_loss``: the last stage's backward starts from the micro-batch's loss (a training
    step), else from the output gradients autograd puts in the mailbox. ``seeds``: the
    private RNG seed of every task, ``seeds[i * K + s]``, or ``None``.
    """

    def __init__(self, stages: Sequence[Stage], layout: SkipLayout, run: LocalRun, *,
                 checkpoint_stop: int = 0,
                 seeds: Optional[Sequence[int]] = None,
                 split: AbstractSet[Tuple[int, int]] = frozenset(),
                 from_loss: bool = False) -> None:
        self.layout = layout
        self.record = run
        self.stages = dict(enumerate(stages))
        self.devices = [stage.device for stage in stages]
        self.grad = run.grad
        self.checkpoint_stop = checkpoint_stop
        self.seed: Optional[Tensor] = None
        self.split = set(split)
        self.states = run.states
        self.losses: Dict[int, Tuple[Tensor, float]] = {}
        self.starts: Dict[Tuple[Any, Any, float], Tensor] = {}  # (``Tasks._start``)
        self.seeds = seeds
        self.from_loss = from_loss
        self.mailbox = Mailbox()

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    # -- the mailbox side of the actions -----------------------------------------------
    def receive_forward(self, s: int, i: int, inputs: Optional[Sequence[Batch]]) -> Received:
        popped = self.layout.skips_popped_by(s)
        batch, flags = self.mailbox.take(("act", s, i))
        skips = [self.mailbox.take(("skip", s, i, skip.key)) for skip in popped]
        return Received(batch, {skip.key: t for skip, (t, _) in zip(popped, skips)},
                        flags + tuple(f for _, f in skips))

    def send_forward(self, s: int, i: int, sent: Sent) -> None:
        outputs, wants = sent.outputs, sent.wants_grad
        if s + 1 < self.num_stages:
            with hooks.span(EventKind.SEND, s, i, peer=s + 1, what=What.ACTIVATION):
                batch, _ = moved(outputs, self.devices[s + 1])
                self.mailbox.put(("act", s + 1, i),
                                 (batch, tuple(wants(t) for t in outputs.tensors)))
        else:
            record = self.record
            if not record.recorded and record.grad:
                record.recorded = any(t.requires_grad for t in outputs.tensors)
            record.outputs[i] = outputs.like([t.detach() for t in outputs.tensors])
        for key, tensor in sent.skips.items():
            dest = self.layout.pop_partition(*key)
            with hooks.span(EventKind.SEND, s, i, peer=dest, what=What.SKIP):
                self.mailbox.put(("skip", dest, i, key), (move(tensor, self.devices[dest]),
                                                           wants(tensor)))

    def receive_backward(self, s: int, i: int) -> Tuple[Optionals, Dict[SkipKey, Optional[Tensor]]]:
        stashed = self.layout.skips_stashed_by(s)
        return self.mailbox.take(("grad", s, i)), {
            skip.key: self.mailbox.take(("skipgrad", s, i, skip.key)) for skip in stashed}

    def output_grads(self, s: int, i: int) -> Tuple[Optionals, Dict[SkipKey, Optional[Tensor]]]:
        if self.from_loss:
            return super().output_grads(s, i)
        return self.receive_backward(s, i)

    def send_backward(self, s: int, i: int, received: Grads) -> None:
        if s > 0:
            with hooks.span(EventKind.SEND, s, i, peer=s - 1, what=What.GRADIENT):
                self.mailbox.put(("grad", s - 1, i),
                                 tuple(move(g, self.devices[s - 1]) for g in received.inputs))
        else:
            self.record.input_grads[i] = received.inputs
        for key, grad in received.skips.items():
            src = self.layout.stash_partition(*key)
            with hooks.span(EventKind.SEND, s, i, peer=src, what=What.SKIP_GRAD):
                self.mailbox.put(("skipgrad", src, i, key), move(grad, self.devices[src]))

    def _sink(self, s: int, i: int) -> Optional[GradSink]:
        return self.record.sink

    def rng_seed(self, s: int, i: int) -> Optional[int]:
        return None if self.seeds is None else self.seeds[i * self.num_stages + s]

    # -- running on a stage thread ---------------------------------------------------------
    def awaits(self, action: Action) -> Optional[Tuple[int, str]]:
        """What ``action`` still waits for, as (stage, message); ``None`` once it can run."""
        s, i = action.stage, action.microbatch
        assert s is not None
        layout, has = self.layout, self.mailbox.has
        if action.phase is Phase.FORWARD:
            if not has(("act", s, i)):
                return s - 1, What.ACTIVATION
            return next(((skip.stash_partition, What.SKIP)
                         for skip in layout.skips_popped_by(s)
                         if not has(("skip", s, i, skip.key))), None)
        if action.phase is Phase.BACKWARD_WEIGHT or (
                self.from_loss and s == self.num_stages - 1):
            return None  # after the same stage's I (or F): earlier on this thread
        if not has(("grad", s, i)):
            return s + 1, What.GRADIENT
        return next(((skip.pop_partition, What.SKIP_GRAD) for skip in layout.skips_stashed_by(s)
                     if not has(("skipgrad", s, i, skip.key))), None)

    def program(self, actions: Sequence[Action], targets: Optional[Sequence[Any]] = None,
                loss_fn: Optional[LossFn] = None, weights: Sequence[float] = ()) -> Program:
        """A worker program of ``actions`` (each naming its stage; of one stage, or of the
        stages a schedule places on one rank). It is named after its first stage, and runs
        in that stage's device context; another stage's actions enter their own."""
        first = actions[0].stage
        assert first is not None
        device = self.stages[first].device
        steps = dict(zip(actions, self.steps(actions, None, targets, loss_fn, weights)))

        def execute(action: Action) -> None:
            assert action.stage is not None
            own = self.stages[action.stage].device
            with _SAME_DEVICE if own == device else device_context(own):
                steps[action]()

        return Program(first, actions, self.awaits, execute, device)
