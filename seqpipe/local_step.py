"""The local engine's side of a schedule's actions: the mailbox between stage threads.

``seqpipe.tasks.Tasks`` runs the actions (the part the distributed engine shares); a
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
from typing import TYPE_CHECKING, AbstractSet, Any, Dict, List, Optional, Sequence, Tuple

from torch import Tensor

from seqpipe.microbatch import Batch
from seqpipe.schedule import Action, Phase
from seqpipe.sink import GradSink
from seqpipe.skip.tracker import SkipKey
from seqpipe.stage import Grads, Received, Sent
from seqpipe.tasks import LossFn, Optionals, Tasks
from seqpipe.worker import Mailbox, Program, device_context

if TYPE_CHECKING:
    from seqpipe.pipeline import LocalPipeline, LocalRun

__all__ = ["LocalStep"]


class LocalStep(Tasks):
    """One call of a ``LocalPipeline``: its tasks, exchanging data through a mailbox.

    ``from_loss``: the last stage's backward starts from the micro-batch's loss (a training
    step), else from the output gradients autograd puts in the mailbox. ``seeds``: the
    private RNG seed of every task, ``seeds[i * K + s]``, or ``None``.
    """

    def __init__(self, pipeline: "LocalPipeline", run: "LocalRun", *, checkpoint_stop: int = 0,
                 seeds: Optional[Sequence[int]] = None,
                 split: AbstractSet[Tuple[int, int]] = frozenset(),
                 from_loss: bool = False) -> None:
        self.pipeline = pipeline
        self.record = run
        self.stages = dict(enumerate(pipeline.stages))
        self.grad = run.grad
        self.checkpoint_stop = checkpoint_stop
        self.seed: Optional[Tensor] = None
        self.split = set(split)
        self.states = run.states
        self.losses: List[Tensor] = []
        self.seeds = seeds
        self.from_loss = from_loss
        self.mailbox = Mailbox()

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    # -- the mailbox side of the actions -----------------------------------------------
    def receive_forward(self, s: int, i: int, inputs: Optional[Sequence[Batch]]) -> Received:
        popped = self.pipeline.layout.skips_popped_by(s)
        batch, flags = self.mailbox.take(("act", s, i))
        skips = [self.mailbox.take(("skip", s, i, skip.key)) for skip in popped]
        return Received(batch, {skip.key: t for skip, (t, _) in zip(popped, skips)},
                        flags + tuple(f for _, f in skips))

    def send_forward(self, s: int, i: int, sent: Sent) -> None:
        self.pipeline._send_forward(self.mailbox, self.record, s, i, sent.outputs, sent.skips,
                                    wants=sent.wants_grad)

    def receive_backward(self, s: int, i: int) -> Tuple[Optionals, Dict[SkipKey, Optional[Tensor]]]:
        stashed = self.pipeline.layout.skips_stashed_by(s)
        return self.mailbox.take(("grad", s, i)), {
            skip.key: self.mailbox.take(("skipgrad", s, i, skip.key)) for skip in stashed}

    def output_grads(self, s: int, i: int) -> Tuple[Optionals, Dict[SkipKey, Optional[Tensor]]]:
        if self.from_loss:
            return super().output_grads(s, i)
        return self.receive_backward(s, i)

    def send_backward(self, s: int, i: int, received: Grads) -> None:
        self.pipeline._send_backward(self.mailbox, self.record, s, i, received)

    def _sink(self, s: int, i: int) -> Optional[GradSink]:
        return self.record.sink

    def rng_seed(self, s: int, i: int) -> Optional[int]:
        return None if self.seeds is None else self.seeds[i * self.num_stages + s]

    # -- running on a stage thread ---------------------------------------------------------
    def awaits(self, action: Action) -> Optional[Tuple[int, str]]:
        """What ``action`` still waits for, as (stage, message); ``None`` once it can run."""
        s, i = action.stage, action.microbatch
        assert s is not None
        layout, has = self.pipeline.layout, self.mailbox.has
        if action.phase is Phase.FORWARD:
            if not has(("act", s, i)):
                return s - 1, "activation"
            return next(((skip.stash_partition, "skip tensor")
                         for skip in layout.skips_popped_by(s)
                         if not has(("skip", s, i, skip.key))), None)
        if action.phase is Phase.BACKWARD_WEIGHT or (
                self.from_loss and s == self.num_stages - 1):
            return None  # after the same stage's I (or F): earlier on this thread
        if not has(("grad", s, i)):
            return s + 1, "gradient"
        return next(((skip.pop_partition, "skip gradient") for skip in layout.skips_stashed_by(s)
                     if not has(("skipgrad", s, i, skip.key))), None)

    def program(self, actions: Sequence[Action], targets: Optional[Sequence[Any]] = None,
                loss_fn: Optional[LossFn] = None, weights: Sequence[float] = ()) -> Program:
        """A worker program of ``actions`` (each naming its stage; of one stage, or of the
        stages a schedule places on one rank). It is named after its first stage, and runs
        in that stage's device context; another stage's actions enter their own."""
        first = actions[0].stage
        assert first is not None
        device = self.stages[first].device

        def execute(action: Action) -> None:
            assert action.stage is not None
            own = self.stages[action.stage].device
            with nullcontext() if own == device else device_context(own):
                self.run(action, None, targets, loss_fn, weights)

        return Program(first, actions, self.awaits, execute, device)
