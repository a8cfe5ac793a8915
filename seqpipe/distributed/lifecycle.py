"""A call's lifecycle on one rank of a ``DistributedPipe``: planned, opened, run, closed.

``seqpipe.distributed.step.Call`` is one call's state and runs its actions one at a time,
exchanging their messages; ``CallLifecycle`` wraps a whole ``train_step`` or ``forward``
around it. It plans the rank's actions and the messages it receives and sends for a call of
``m`` micro-batches (once per shape of call), opens the call (the rank of stage 0 cuts the
batch and announces the micro-batch count with a STEP message, to the ranks its first action
feeds before that action and to the others after it, and every rank checks that all make
the same kind of call), runs the rank's actions in schedule order, and closes the
call on every rank together (the loss from the rank of the last stage, then DONE). A train
step ends with the reductions: gradients averaged over the data-parallel replicas (and the
stage's buffers broadcast), then what the step added to the gradients of weights tied
across ranks, or wrapped apart on one rank, summed (their earlier gradients set aside at the
start: ``tie_grads``; copies FSDP2 manages are summed before their stage's FSDP2 reduction,
which then runs here). Under ``schedule="auto"`` the first train step is timed, and the
schedule picked from it runs from the next call on.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterator, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from seqpipe.core.caller_grads import hand_over, input_grad
from seqpipe.core.checkpoint import checkpoint_stop
from seqpipe.core.grad_mode import check_grad_enabled
from seqpipe.core.loss_weights import CountFn, LossWeights, loss_weights
from seqpipe.core.microbatch import Batch, Input, TensorOrTensors, gather
from seqpipe.core.stage import Stage
from seqpipe.core.tasks import Step
from seqpipe.distributed import tensor_parallel
from seqpipe.distributed.accumulate import StepGrads
from seqpipe.distributed.agreement import call_kind, check_same_call, opened
from seqpipe.distributed.auto import AutoRunner
from seqpipe.distributed.data_parallel import GradientReducer, broadcast_buffers
from seqpipe.distributed.fsdp import ShardedStep
from seqpipe.distributed.plan import (
    OPENING,
    Planned,
    call_actions,
    closer,
    messages,
    routes,
)
from seqpipe.distributed.step import Call, LossFn
from seqpipe.distributed.tie_grads import TieGrads
from seqpipe.distributed.traced import end_step
from seqpipe.distributed.transport import Kind, Transport
from seqpipe.schedule import Action, AnySchedule, Phase, Placement, validate_schedule
from seqpipe.skip.layout import SkipLayout
from seqpipe.trace import hooks
from seqpipe.trace.events import EventKind, What

__all__ = ["CallLifecycle", "CallPlan"]

_LAST = (Phase.BACKWARD, Phase.BACKWARD_WEIGHT)  # a stage's gradients are final after these


@dataclass(frozen=True)
class CallPlan:
    """A rank's part of a call: its actions and the messages it receives and sends, and
    what a train step derives from its actions (made once per shape of call, not per
    step): where each stage's gradients are final (the index of its last ``B`` or ``W``)
    and which (stage, micro-batch) backwards are split into ``I`` and ``W``."""

    actions: List[Action]
    incoming: Dict[int, List[Planned]]
    outgoing: Dict[int, List[Planned]]
    last: Dict[Optional[int], int] = field(default_factory=dict)
    split: FrozenSet[Tuple[Optional[int], int]] = frozenset()

    @classmethod
    def of(cls, actions: List[Action], incoming: Dict[int, List[Planned]],
           outgoing: Dict[int, List[Planned]]) -> "CallPlan":
        return cls(actions, incoming, outgoing,
                   {a.stage: n for n, a in enumerate(actions) if a.phase in _LAST},
                   frozenset((a.stage, a.microbatch) for a in actions
                             if a.phase is Phase.BACKWARD_INPUT))


class CallLifecycle:
    """This rank's side of every call of a ``DistributedPipe``, from planning to closing.

    It holds the pipe's stages and transport (the same objects, not copies) and caches
    the plan of each shape of call in ``plans``, keyed by ``(micro-batches, grad)``.
    """

    def __init__(self, stages: Dict[int, Stage], transport: Transport, layout: SkipLayout,
                 placement: Placement, schedule: AnySchedule, *, chunks: int,
                 group: Optional[dist.ProcessGroup], device: torch.device,
                 auto: Optional[AutoRunner], reducer: Optional[GradientReducer],
                 tied: Optional[TieGrads], partition: nn.Sequential,
                 broadcast_buffers: bool) -> None:
        self.stages = stages
        self.transport = transport
        self.layout = layout
        self.placement = placement
        self.schedule = schedule
        self.group = group  # these five: what a traced step records (traced.end_step)
        self.device = device
        self.auto = auto
        self.reducer = reducer
        self.tied = tied
        self.partition = partition
        self.broadcast_buffers = broadcast_buffers
        # verdicts before FSDP2's collectives (DistributedPipe(sharded_failure_checks=...))
        self.sharded_failure_checks = False
        # where a DTensor received from another stage is rebuilt (DistributedPipe(mesh=...))
        self.mesh: Optional[DeviceMesh] = None
        self.rank = transport.index
        self.num_ranks = placement.num_ranks
        self.num_stages = placement.num_stages
        self.stage_index = next(iter(stages))  # with one stage per rank, the stage
        self.plans: Dict[Tuple[int, bool], CallPlan] = {}
        self.routes = routes(layout, placement)  # every call's (``Call.routes``)
        self.validated: Set[int] = {chunks}  # the pipe checked the schedule for ``chunks``

    @property
    def is_first(self) -> bool:
        return 0 in self.stages

    @property
    def is_last(self) -> bool:
        return self.num_stages - 1 in self.stages

    def plan(self, m: int, grad: bool) -> CallPlan:
        """This rank's actions in a call of ``m`` micro-batches, and its messages."""
        if (m, grad) not in self.plans:
            schedule = self.auto.schedule_for(m) if self.auto else self.schedule
            if m not in self.validated:
                validate_schedule(schedule, self.num_ranks, m)
                self.validated.add(m)
            k, me, where = self.num_ranks, self.rank, self.placement
            actions = call_actions(schedule, k, m, grad)
            self.plans[(m, grad)] = CallPlan.of(
                actions[me],
                {r: messages(r, me, actions, self.layout, grad, where) for r in range(k)
                 if r != me},
                {r: messages(me, r, actions, self.layout, grad, where) for r in range(k)
                 if r != me})
        return self.plans[(m, grad)]

    def open(self, call: Call, input: Optional[TensorOrTensors],
             chunks: int) -> Tuple[List[Batch], CallPlan]:
        """Start a call: the rank of stage 0 cuts the batch and tells every rank how many
        micro-batches there are; then every rank knows its actions and the messages it
        will exchange.

        The rank of stage 0 tells the ranks its first action sends to before that action,
        and the others after it (``Call.run_actions``): they cannot act before a message
        from a stage it feeds, so telling them first would only delay its first action
        (each STEP message ~0.1-0.3 ms of its time). A failure in that action still
        reaches them: the STEP they wait for is still to come, so it is an ABORT instead.
        """
        transport = self.transport
        opener = self.placement.rank_of(0)
        others = [r for r in range(self.num_ranks) if r != opener]
        if self.is_first:
            for r in others:  # so that a failure from here on tells them
                transport.will_send(r, [OPENING])
            if input is None:
                raise ValueError("the rank of stage 0 needs the input batch; pass it on "
                                 "that rank (pipe.is_first)")
            batches = Input.of(input).microbatches(chunks)
        else:
            call.expect(opener, [OPENING])
            opening = call.need(opener, Kind.STEP)
            batches = [Batch((), True)] * opening.count  # placeholders: only their number
        kind = call_kind(call.grad, call.seed is not None)
        theirs = kind if self.is_first else opened(opening)
        # On a mismatch, the plan of the call the others follow, so that the failure
        # reaches the ranks that wait for this one.
        plan = self.plan(len(batches), bool(theirs[0]))
        call.microbatches = len(batches)
        for r, planned in plan.incoming.items():
            call.expect(r, planned[1:] if r == opener else planned)  # STEP: taken above
        for r, planned in plan.outgoing.items():
            transport.will_send(r, planned[1:] if self.is_first else planned)  # STEP: above
        if self.is_first:
            call.openings = (torch.tensor(kind, device=self.device), others)
            if plan.actions and not any(p.taken_at == 0 for q in plan.incoming.values()
                                        for p in q):  # its first action needs no message:
                # only the ranks it sends to hear of the call before that action
                call.open_to([r for r in others if plan.outgoing[r][1:]
                              and plan.outgoing[r][1].sent_at == 0])
            else:
                call.open_to(others)
        check_same_call(theirs, kind)
        return batches, plan

    def close(self, call: Call, loss: Optional[Tensor]) -> Optional[Tensor]:
        """End the call on every rank together, so no rank returns while another fails.

        The rank of the last stage sends the loss to everyone; then the rank that finishes
        last (that of stage 0 after a backward, that of the last stage after a
        forward-only call) sends DONE to all.
        """
        k, rank_of = self.num_ranks, self.placement.rank_of
        plan = self.plans[(call.microbatches, call.grad)]
        last = rank_of(self.num_stages - 1)
        finisher = rank_of(closer(self.num_stages, call.grad))
        if call.grad and k > 1 and self.rank == last:
            for r in range(k):
                if r != last:
                    call.send(r, Kind.LOSS, -1, [loss])
        if any(p.kind is Kind.DONE for p in plan.outgoing.get(finisher, [])):
            call.send(finisher, Kind.DONE, -1, [])  # after a quiet tail (see plan.quiet_tail)
        if call.grad and k > 1 and self.rank != last:
            loss = call.need(last, Kind.LOSS).tensors[0]
        if self.rank == finisher:
            for r, planned in plan.incoming.items():
                if any(p.kind is Kind.DONE for p in planned):
                    call.need(r, Kind.DONE)
            for r in range(k):
                if r != finisher:
                    call.send(r, Kind.DONE, -1, [])
        else:
            call.need(finisher, Kind.DONE)
        call.flush()
        return loss

    def train_step(self, input: Optional[TensorOrTensors], target: Any, loss_fn: LossFn,
                   seed: Optional[Tensor], *, chunks: int, checkpoint: str,
                   count_fn: Optional[CountFn] = None) -> Tensor:
        """One ``DistributedPipe.train_step`` on this rank, ``seed`` its loss scale (or
        ``None``), ``checkpoint`` the mode in force (``"never"`` in eval mode) and
        ``count_fn`` what normalises a summed loss (``seqpipe.core.loss_weights``)."""
        check_grad_enabled()  # before anything runs: the pipe stays usable
        self.transport.begin()
        reducer = self.reducer
        call = Call(self.stages, self.transport, self.layout, self.placement, grad=True,
                    seed=seed, timer=self.auto.timer() if self.auto else None,
                    replica=reducer.replica if reducer else None, reducer=reducer,
                    routes=self.routes, mesh=self.mesh)
        step = hooks.begin_step(self.schedule, self.num_stages, self.num_ranks)
        with self._undoing_on_failure():
            loss = self._train_step(call, input, target, loss_fn, chunks, checkpoint,
                                    count_fn)
        end_step(step, self, call)
        if call.timer is not None and self.auto is not None:  # measured: pick from now on
            self.auto.decide(call.timer, call.microbatches)
            self.plans.clear()
            self.validated.clear()
            self.auto.schedule_for(chunks)  # logs the pick for `chunks` now
        return loss

    def forward(self, input: Optional[TensorOrTensors],
                chunks: int) -> Optional[TensorOrTensors]:
        """One ``DistributedPipe.forward`` on this rank (the caller turns off autograd)."""
        self.transport.begin()
        call = Call(self.stages, self.transport, self.layout, self.placement, grad=False,
                    replica=self.reducer.replica if self.reducer else None,
                    routes=self.routes, mesh=self.mesh)
        step = hooks.begin_step(self.schedule, self.num_stages, self.num_ranks, backward=False)
        with self._undoing_on_failure():
            output = self._forward(call, input, chunks)
        end_step(step, self, call)
        return output

    @contextmanager
    def _undoing_on_failure(self) -> Iterator[None]:
        """After a failed call: the stages drop the call's deferred statistics, and the
        tied copies' earlier gradients are back in ``.grad`` (see ``TieGrads``)."""
        try:
            yield
        except BaseException:
            for stage in self.stages.values():
                stage.finish_forward(failed=True)
            if self.tied is not None:
                self.tied.put_back()
            raise

    def _train_step(self, call: Call, input: Optional[TensorOrTensors], target: Any,
                    loss_fn: LossFn, chunks: int, checkpoint: str,
                    count_fn: Optional[CountFn]) -> Tensor:
        weights = LossWeights([], [])
        targets: Optional[List[Any]] = None
        # stages the user wrapped with fully_shard
        sharded = ShardedStep(self.stages, failure_checks=self.sharded_failure_checks)
        call.sharded = sharded  # a failure here is told to their replicas and shards
        managed = sharded.managed()  # FSDP2 reduces these itself
        with call.guard("start of the step"):
            if self.reducer is not None:
                self.reducer.follow(tensor_parallel.reducible(self.stages.values(), managed),
                                    counting=self.is_last and count_fn is not None)
            if self.tied is not None:  # sum only what this step adds, of what is trained now
                self.tied.set_aside(sharded)  # (FSDP2's copies: before FSDP2 reduces them)
            batches, plan = self.open(call, input, chunks)
            sharded.check(self.reducer.group if self.reducer is not None else None)
            if self.tied is not None:  # copies on this rank trained alike (after open: a
                self.tied.check()  # failure reaches every rank)
            call.checkpoint_stop = checkpoint_stop(checkpoint, len(batches))
            if self.is_last:
                replicas = (sharded.replicas(self.num_stages - 1, self.device)
                            if self.reducer is None else self.reducer.replicas(self.device))
                weights = loss_weights(target, len(batches), count_fn, replicas)
                targets = weights.targets
        actions, last = plan.actions, plan.last  # each stage's last B or W: grads final
        sharded.begin(last)
        for s, n in last.items():
            if s not in sharded:  # FSDP2 accumulates a sharded stage's gradients itself
                call.grads[s] = StepGrads(self.stages[s], actions[n].microbatch)
        final = max(last.values())
        call.split = plan.split  # type: ignore[assignment]
        steps = call.steps(actions, batches, targets, loss_fn, weights.weights)
        for n, action in enumerate(actions):  # what wraps a step: only where it applies
            if action.stage in sharded.stages:
                steps[n] = functools.partial(_around, sharded, n, action, steps[n])
        if self.reducer is not None:  # gradients final from here: reduce as they land
            steps[final] = functools.partial(_armed, self.reducer, steps[final])
        call.run_actions(actions, steps)
        with call.guard("end of the step"):
            for stage in self.stages.values():
                stage.finish_forward()
            if (self.is_first and call.input_grads) or weights.leaves is not None:
                hand_over(self._caller_grads(call, input, batches, weights))
            loss = self.close(call, weights.report(call.loss_sum())
                              if self.is_last else None)
            self._reduce(call.name())
            sharded.finish()  # the reductions of FSDP2's tied copies, summed by _reduce
            sharded.close()
        assert loss is not None
        return loss

    def _caller_grads(self, call: Call, input: Optional[TensorOrTensors],
                      batches: Sequence[Batch], weights: LossWeights
                      ) -> List[Tuple[Tensor, Optional[Tensor]]]:
        """The step's gradients of the caller's input (on stage 0's rank) and target (on
        the last stage's), for the caller's graph (``seqpipe.core.caller_grads``)."""
        pairs = weights.target_grads()
        if self.is_first and call.input_grads:
            given = Input.of(input)
            pairs += [(t, input_grad(given, j, batches, call.input_grads))
                      for j, t in enumerate(given.batch.tensors)]
        return pairs

    def _reduce(self, where: str) -> None:
        """The end of a train step: the data-parallel mean (and buffer broadcast; a
        ``PeerError`` naming it if a replica failed), then the sum of the copies of weights
        tied across ranks. ``where``: this rank, as errors name it."""
        if self.reducer is not None:
            with hooks.span(EventKind.REDUCE, self.stage_index, what=What.DATA_PARALLEL):
                self.reducer.finish(where)
            if self.broadcast_buffers:
                broadcast_buffers(self.partition, self.reducer.group)
        if self.tied is not None and self.tied.active:
            with hooks.span(EventKind.REDUCE, self.stage_index, what=What.TIES):
                self.tied.reduce()  # after the replicas' mean: the two commute

    def _forward(self, call: Call, input: Optional[TensorOrTensors],
                 chunks: int) -> Optional[TensorOrTensors]:
        with call.guard("start of the call"):
            batches, plan = self.open(call, input, chunks)
        call.run_actions(plan.actions, call.steps(plan.actions, batches, None, None, []))
        with call.guard("end of the call"):
            for stage in self.stages.values():
                stage.finish_forward()
            self.close(call, None)
        return gather(call.outputs) if self.is_last else None


def _around(sharded: ShardedStep, n: int, action: Action, step: Step) -> None:
    """``step`` (the ``n``-th, ``action``) of a stage wrapped with FSDP2."""
    with sharded.around(n, action):
        step()


def _armed(reducer: GradientReducer, step: Step) -> None:
    """The step after which a stage's gradients are final: the reducer reduces them as
    they land from then on."""
    reducer.arm()
    step()
