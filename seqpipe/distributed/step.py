"""One call of a distributed pipeline on one rank: its stages' actions, in schedule order.

A rank holds one stage, or several (interleaved and V-shaped schedules); ``Call.steps``
(``seqpipe.core.tasks.Tasks``, shared with the local engine) compiles the call's actions,
before the first runs, into one step each, of its phase (``F``, ``B``, ``I``, ``W``) on the
stage it names, so no schedule has code of its own here; ``Call`` supplies the transport
side, each stage's peers looked up once per pipeline (``plan.routes``). Data comes in
through ``Transport`` messages (between two stages of one rank, in memory); whatever
arrives before it is needed waits in an inbox. The rank of stage 0 opens every call by
telling the others how many micro-batches it has cut (those its first action sends to
before it, the others right after it: ``run_actions``); the rank of the last stage closes
it by sending the loss, and the rank that finishes last sends "done" to every other rank,
so a failure anywhere reaches every rank: a failing rank sends an ABORT to the ranks that
still expect a message from it, and a rank waiting on a peer that reports a failure, or
dies, raises and passes it on the same way (``Transport.abort``). A rank whose last actions
send nothing (weight gradients at the end of a zero-bubble schedule) reports "done" to the
finishing rank, so that a failure there is still heard.

The order in which a call sends its messages is the one ``seqpipe.distributed.plan``
lists (every rank derives it to receive ahead); the transport checks each send against it.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    ContextManager,
    Dict,
    Iterator,
    List,
    Optional,
    Sequence,
    Set,
    Tuple,
)

from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from seqpipe.core.microbatch import Batch
from seqpipe.core.sink import GradSink
from seqpipe.core.stage import Grads, Received, Sent, Stage, TaskState, moved
from seqpipe.core.tasks import LossFn, Step, Tasks
from seqpipe.distributed import traced
from seqpipe.distributed.accumulate import StepGrads
from seqpipe.distributed.auto import ActionTimer
from seqpipe.distributed.dtensor_wire import Crossing
from seqpipe.distributed.plan import Planned, Route, routes
from seqpipe.distributed.transport import Kind, Message, PeerError, Transport
from seqpipe.distributed.values import Values, check_values
from seqpipe.schedule import Action, Phase, Placement
from seqpipe.skip.layout import SkipLayout
from seqpipe.skip.tracker import SkipKey
from seqpipe.trace.hooks import OFF

if TYPE_CHECKING:
    from seqpipe.distributed.data_parallel import GradientReducer
    from seqpipe.distributed.fsdp import ShardedStep

__all__ = ["Call", "LossFn", "describe"]

_WHAT = traced.WHAT


@dataclass
class Call(Tasks):
    """The state of one ``train_step`` or ``forward`` on this rank.

    ``stages``: the stages this rank holds (several under interleaved and V-shaped
    schedules); ``placement`` says which rank holds every stage. Messages between stages
    on one rank are handed over in ``local``, without the transport.
    """

    stages: Dict[int, Stage]
    transport: Transport
    layout: SkipLayout
    placement: Placement
    grad: bool
    checkpoint_stop: int = 0
    microbatches: int = 0  # in this call, once it is open
    seed: Optional[Tensor] = None  # the last stage's backward starts from it (loss scale), else 1
    grads: Dict[int, StepGrads] = field(default_factory=dict)  # per stage (train_step)
    split: Set[Tuple[int, int]] = field(default_factory=set)  # (stage, i) run as I then W
    inbox: Dict[Tuple[Kind, int, int, int], Message] = field(default_factory=dict)
    local: Dict[Tuple[Kind, int, int, int], Message] = field(default_factory=dict)
    states: Dict[Tuple[int, int], TaskState] = field(default_factory=dict)
    outputs: List[Batch] = field(default_factory=list)
    losses: Dict[int, Tuple[Tensor, float]] = field(default_factory=dict)  # (``Tasks``)
    starts: Dict[Tuple[Any, Any, float], Tensor] = field(default_factory=dict)
    input_grads: List[Tuple[Optional[Tensor], ...]] = field(default_factory=list)  # stage
    # 0's input, per micro-batch: for the caller's graph (``seqpipe.core.caller_grads``)
    at: Any = "the start of the step"  # what runs now: a description, or an Action
    timer: Optional[ActionTimer] = None  # times each stage computation (schedule="auto")
    replica: Optional[int] = None  # this pipeline's index in the data-parallel group
    reducer: Optional["GradientReducer"] = None  # told of a failure, for the replicas
    sharded: Optional["ShardedStep"] = None  # told too, for FSDP2's replicas and shards
    routes: Dict[int, Route] = field(default_factory=dict)  # per stage (``plan.routes``)
    mesh: Optional[DeviceMesh] = None  # DistributedPipe(mesh=...): where a received
    # DTensor is rebuilt
    dtensors: Crossing = field(init=False)  # DTensors across stage boundaries
    # the rank of stage 0: the call kind it sends with STEP, and the ranks not yet told
    openings: Optional[Tuple[Tensor, List[int]]] = None

    def __post_init__(self) -> None:
        self.dtensors = Crossing(self.stages, self.mesh)
        self.watch()  # (its messages' spans, from the opening on)
        if not self.routes:
            self.routes = routes(self.layout, self.placement)

    @property
    def rank(self) -> int:
        return self.transport.index

    @property
    def action(self) -> str:
        """What this rank is at, as errors name it (an action is described only when an
        error asks, not each time one starts)."""
        at = self.at
        return f"{describe(at)} on stage {at.stage}" if isinstance(at, Action) else at

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    def name(self, rank: Optional[int] = None) -> str:
        """How messages name a rank: by its stage when it holds one."""
        rank = self.rank if rank is None else rank
        held = self.placement.stages_of(rank)
        if self.placement.num_stages == self.placement.num_ranks:
            return f"stage {held[0]}{self._of_replica}"
        return f"rank {rank} (stages {', '.join(map(str, held))}){self._of_replica}"

    @property
    def _of_replica(self) -> str:
        return "" if self.replica is None else f" of replica {self.replica}"

    def _sink(self, stage: int, i: int) -> Optional[GradSink]:
        grads = self.grads.get(stage)
        return grads.sink_for(i) if grads is not None else None

    @property
    def timing(self) -> bool:
        return self.timer is not None

    def _timed(self, phase: Phase, stage: int, i: int) -> ContextManager[None]:
        return self.timer.timed(phase, stage, i) if self.timer is not None else nullcontext()

    def _handing_over(self, stage: int, i: int) -> ContextManager[None]:
        grads = self.grads.get(stage)
        return grads.handing_over(i) if grads is not None else nullcontext()

    # -- receiving ---------------------------------------------------------------------
    def need(self, src: int, kind: Kind, microbatch: int = -1, key: int = -1,
             origin: int = -1) -> Message:
        """Wait for one message from rank ``src``, keeping others that arrive first."""
        wanted = (kind, microbatch, key, origin)
        if src == self.rank:  # from a stage of this rank: handed over already
            message = self.local.pop(wanted)
        else:
            message = self.inbox.pop(wanted, None) if self.inbox else None
            if message is None:
                with traced.receiving(self, src, wanted) if self.watched else OFF:
                    message = self._take(src, kind)
                    while (message.kind, message.microbatch, message.key,
                           message.origin) != wanted:  # (the plan's order: rarely)
                        self.inbox[(message.kind, message.microbatch, message.key,
                                    message.origin)] = message
                        message = self._take(src, kind)
        return self.dtensors.incoming(message, src, self.name)

    def _take(self, src: int, kind: Kind) -> Message:
        """Receive the next message from rank ``src`` (waiting for a ``kind``)."""
        try:
            return self.transport.recv(src)
        except PeerError as exc:
            raise PeerError(f"{exc}\n  {self.name()} was at {self.action}, waiting "
                            f"for the {_WHAT[kind]} from {self.name(src)}",
                            peer=src) from None
        except Exception as exc:
            raise PeerError(
                f"{self.name()} lost {self.name(src)} while at {self.action}, waiting "
                f"for the {_WHAT[kind]}: {type(exc).__name__}: {exc}", peer=src) from exc

    def expect(self, src: int, planned: Sequence[Planned]) -> None:
        """Tell the transport what rank ``src`` will send next. It posts their receives
        later (when this rank waits, or needs the message: ``need``, which names a lost
        peer), so this communicates nothing and cannot fail on a peer."""
        self.transport.expect(src, planned)

    def send(self, dst: int, kind: Kind, microbatch: int, tensors: Sequence[Optional[Tensor]],
             flags: Optional[Sequence[bool]] = None, *, key: int = -1, origin: int = -1,
             atomic: bool = True, values: Values = (), count: int = 0) -> None:
        """Queue a message to rank ``dst``; a failure to send is the peer's failure."""
        tensors, values = self.dtensors.outgoing(  # a DTensor as its shard; this stage's errors
            kind, microbatch, key, origin, tensors, flags, values, self.name)
        if dst == self.rank:  # to a stage of this rank: cut from the graph, as if sent
            kept = tuple(t.detach() if t is not None else None for t in tensors)
            check_values(values)  # what could not cross to another rank
            self.local[(kind, microbatch, key, origin)] = \
                Message(kind, microbatch, key, kept,
                        tuple(flags) if flags is not None else (False,) * len(kept),
                        atomic=atomic, origin=origin, values=values)
            return
        try:
            with traced.sending(self, dst, kind, microbatch, key, origin) if self.watched \
                    else OFF:
                self.transport.send(dst, kind, microbatch, tensors, flags, key=key,
                                    count=count, atomic=atomic, origin=origin, values=values)
        except (TypeError, ValueError):  # what cannot be sent at all: this stage's error
            raise
        except Exception as exc:
            raise PeerError(
                f"{self.name()} lost {self.name(dst)} while at {self.action}, sending the "
                f"{_WHAT[kind]}: {type(exc).__name__}: {exc}", peer=dst) from exc

    def flush(self) -> None:
        """Wait for this call's sends to go out."""
        try:
            self.transport.flush()
        except PeerError as exc:
            raise PeerError(f"{self.name()} {exc} (at {self.action})", peer=exc.peer) from exc

    def open_to(self, ranks: Sequence[int]) -> None:
        """Send the call's STEP message (the micro-batch count and the call kind) to
        ``ranks`` (the rank of stage 0, from ``openings``)."""
        assert self.openings is not None
        told, waiting = self.openings
        for r in ranks:
            self.send(r, Kind.STEP, -1, [told], count=self.microbatches)
        self.openings = (told, [r for r in waiting if r not in ranks])

    # -- the transport side of the actions (``Tasks`` runs them) -------------------------
    def receive_forward(self, s: int, i: int, inputs: Optional[Sequence[Batch]]) -> Received:
        route = self.routes[s]
        if s == 0:
            assert inputs is not None
            received_batch, flags = moved(inputs[i], self.stages[s].device)
        else:
            message = self.need(route.before, Kind.ACTIVATION, i, origin=s - 1)
            received_batch = Batch(message.tensors, message.atomic,  # type: ignore[arg-type]
                                   message.values)
            flags = message.flags
        skips: Dict[SkipKey, Optional[Tensor]] = {}
        for key, src, index, stage in route.popped:
            message = self.need(src, Kind.SKIP, i, index, stage)
            skips[key] = message.tensors[0]
            flags += message.flags
        return Received(received_batch, skips, flags)

    def send_forward(self, s: int, i: int, sent: Sent) -> None:
        route = self.routes[s]
        if sent.skips:
            for key, dst, index, _ in route.stashed:  # (layout order)
                if key in sent.skips:
                    tensor = sent.skips[key]
                    self.send(dst, Kind.SKIP, i, [tensor], [sent.wants_grad(tensor)],
                              key=index, origin=s)
        if route.after >= 0:
            outs = sent.outputs.tensors
            self.send(route.after, Kind.ACTIVATION, i, outs, [sent.wants_grad(t) for t in outs],
                      atomic=sent.outputs.atomic, origin=s, values=sent.outputs.constants)
        else:
            self.outputs.append(sent.outputs)

    def receive_backward(self, s: int, i: int
                         ) -> Tuple[Tuple[Optional[Tensor], ...], Dict[SkipKey, Optional[Tensor]]]:
        route = self.routes[s]
        grads = self.need(route.after, Kind.GRAD, i, origin=s + 1).tensors
        skip_grads = {key: self.need(dst, Kind.SKIP_GRAD, i, index, stage).tensors[0]
                      for key, dst, index, stage in route.stashed}
        return grads, skip_grads

    def send_backward(self, s: int, i: int, received: Grads) -> None:
        route = self.routes[s]
        if s > 0:
            self.send(route.before, Kind.GRAD, i, received.inputs, origin=s)
        elif any(g is not None for g in received.inputs):
            if not self.input_grads:
                self.input_grads = [()] * self.microbatches
            self.input_grads[i] = received.inputs
        if received.skips:
            to = {key: (src, index) for key, src, index, _ in route.popped}
            for key, grad in received.skips.items():
                src, index = to[key]
                self.send(src, Kind.SKIP_GRAD, i, [grad], key=index, origin=s)

    # -- failure handling --------------------------------------------------------------
    @contextmanager
    def guard(self, action: str, stage: Optional[int] = None) -> Iterator[None]:
        """Run a piece of the call (an action of ``stage``); on failure tell every other
        rank before raising."""
        self.at = action if stage is None else f"{action} on stage {stage}"
        try:
            yield
        except Exception as exc:
            self._failed(exc, action, stage)
            raise

    def run_actions(self, actions: Sequence[Action], steps: Sequence[Step]) -> None:
        """Run the ``n``-th of this rank's ``actions`` as ``steps[n]`` (``Tasks.steps``), in
        order, each guarded as ``guard`` guards a piece of the call, without a context (or
        its description) made per action: a step runs many."""
        n = 0
        try:
            for n, step in enumerate(steps):
                self.at = actions[n]
                step()
                if n == 0 and self.openings is not None and self.openings[1]:
                    self.open_to(self.openings[1])  # the ranks not told before (``open``)
                self.transport.post_due()  # after its sends: the next data flows meanwhile
        except Exception as exc:
            self._failed(exc, describe(actions[n]), actions[n].stage)
            raise

    def _failed(self, exc: Exception, action: str, stage: Optional[int]) -> None:
        """``exc`` ended ``action`` (of ``stage``): tell every other rank, and name where
        it happened in the error (which the caller raises)."""
        if isinstance(exc, PeerError):
            self.abort(str(exc), exc.peer)
            return
        who = self.name() if stage is None else f"stage {stage}"
        if stage is not None and self.placement.num_stages != self.placement.num_ranks:
            who += f" (rank {self.rank})"
        who += "" if stage is None else self._of_replica
        text = f"{who} failed in the {action}"
        self.abort(f"{text}: {type(exc).__name__}: {exc}")
        exc.add_note(f"seqpipe: {text}")

    def abort(self, text: str, heard_from: Optional[int] = None) -> None:
        """Pass the news on to the stages still expecting a message from this one, and
        to this stage's replicas (under data parallelism); returns at once."""
        self.transport.abort(text, heard_from)
        if self.reducer is not None:
            self.reducer.concede(text)
        if self.sharded is not None:
            self.sharded.concede(text)


def describe(action: Action) -> str:
    """``forward of micro-batch 3``: how errors name an action (``guard`` adds its stage)."""
    return f"{action.phase.value} of micro-batch {action.microbatch}"
