"""``DistributedPipe``: one pipeline stage per process, over ``torch.distributed``."""
from __future__ import annotations

import warnings
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from seqpipe.batchnorm import convert_deferred_batch_norm
from seqpipe.checkpoint import check_mode, checkpoint_stop
from seqpipe.distributed.accumulate import StepGrads
from seqpipe.distributed.data_parallel import (
    GradientReducer,
    broadcast_buffers,
    check_data_parallel_group,
)
from seqpipe.distributed.grad_scaler import PipeGradScaler, backward_seed
from seqpipe.distributed.mesh import reverse_group
from seqpipe.distributed.plan import OPENING, Planned, call_actions, messages, pipeline_channels
from seqpipe.distributed.step import Call, LossFn, describe
from seqpipe.distributed.ties import Tie, TiedCopies, drop_layer, find_ties, ties_kept
from seqpipe.distributed.transport import Kind, Transport
from seqpipe.microbatch import Batch, TensorOrTensors, gather, scatter
from seqpipe.partition import check_balance, verify_module
from seqpipe.pipe import check_chunks
from seqpipe.schedule import Action, Phase, Schedule, get_schedule, validate_schedule
from seqpipe.skip.layout import inspect_skip_layout
from seqpipe.stage import Stage

__all__ = ["DistributedPipe"]

# What this engine runs of what schedules can express: one stage per rank.
# Several stages per rank are refused by validate_schedule.
_RUNS: Dict[str, Any] = {"stages_per_rank": 1}
_LAST = (Phase.BACKWARD, Phase.BACKWARD_WEIGHT)  # a stage's gradients are final after these


@dataclass(frozen=True)
class _CallPlan:
    """A stage's part of a call: its actions and the messages it receives and sends."""

    actions: List[Action]
    incoming: Dict[int, List[Planned]]
    outgoing: Dict[int, List[Planned]]


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _materialize(partition: nn.Module, device: torch.device) -> None:
    """Give layers built on the ``meta`` device real storage, freshly initialised."""
    if not any(t.is_meta for t in (*partition.parameters(), *partition.buffers())):
        partition.to(device)
        return
    partition.to_empty(device=device)
    for module in partition.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def _fingerprint(module: nn.Sequential, config: Tuple[Any, ...]) -> int:
    """A checksum of the model's structure and the pipeline's settings, equal on every rank."""
    parts = [repr(config)]
    for name, layer in module.named_children():
        shapes = [(n, tuple(t.shape), str(t.dtype))
                  for n, t in (*layer.named_parameters(), *layer.named_buffers())]
        parts.append(f"{name}:{type(layer).__qualname__}:{shapes}")
    return zlib.crc32("\n".join(parts).encode()) & 0x7FFFFFFF


class DistributedPipe(nn.Module):
    """One stage of a pipeline that spans processes; every rank builds it the same way.

    The rank's index in ``group`` (default: the whole world) is its stage. It keeps only
    its own layers, on ``device``, registered under their names in the original
    ``nn.Sequential`` (so ``state_dict()`` keys are ``"4.weight"``, and the ranks' state
    dicts together are the unpipelined model's); the other layers are moved to the
    ``meta`` device, which frees them. A parameter that layers of several stages share
    (tied weights) has a copy on each of them, whose gradients are summed after every
    step (see ``seqpipe.distributed.ties``; ``ties`` lists them, ``check_ties`` compares
    the copies).

    Args:
        module: the whole model, the same on every rank (``meta`` tensors are fine).
        chunks: micro-batches per mini-batch (fewer if the batch is smaller).
        balance: layers per stage; one entry per rank of ``group``. Default: split by
            parameter count.
        schedule: ``"1f1b"``, ``"fill_drain"``, or any ``seqpipe.schedule.Schedule``.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        deferred_batch_norm: BatchNorm running statistics once per mini-batch.
        group: the pipeline's process group.
        device: where this stage runs (default: the current CUDA device, else CPU).
        data_parallel_group: replicas of this stage; gradients are averaged over it.
        broadcast_buffers: with ``data_parallel_group``, copy the stage's buffers (say,
            BatchNorm running statistics) from the group's first rank to the others at
            the end of every ``train_step``, as DDP's argument of that name does.
    """

    def __init__(self, module: nn.Sequential, chunks: int = 1, *,
                 balance: Optional[Sequence[int]] = None,
                 schedule: Union[str, Schedule] = "1f1b", checkpoint: str = "except_last",
                 deferred_batch_norm: bool = False, group: Optional[dist.ProcessGroup] = None,
                 device: Union[str, torch.device, None] = None,
                 data_parallel_group: Optional[dist.ProcessGroup] = None,
                 broadcast_buffers: bool = True) -> None:
        super().__init__()
        verify_module(module)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedPipe needs torch.distributed: call "
                               "torch.distributed.init_process_group() first (or launch with "
                               "torchrun), or use seqpipe.Pipe for one process")
        self.group = group
        self.num_stages = dist.get_world_size(group)
        self.stage_index = dist.get_rank(group)
        if self.stage_index < 0:
            raise ValueError("this rank is not a member of the pipeline group")
        self.chunks = check_chunks(chunks)
        self.checkpoint = check_mode(checkpoint)
        self.schedule = get_schedule(schedule)
        self.device = torch.device(device) if device is not None else _default_device()
        self.broadcast_buffers = bool(broadcast_buffers)
        self.balance = self._resolve_balance(module, balance)
        validate_schedule(self.schedule, self.num_stages, self.chunks, **_RUNS)
        layout = inspect_skip_layout(module, self.balance)
        self.ties: Tuple[Tie, ...] = tuple(find_ties(module, self.balance))
        fingerprint = self._check_same_everywhere(module)
        start = sum(self.balance[:self.stage_index])
        stop = start + self.balance[self.stage_index]
        named = list(module.named_children())
        partition = nn.Sequential(*(layer for _, layer in named[start:stop]))
        for n, (name, layer) in enumerate(named):
            if start <= n < stop:
                self.add_module(name, layer)
            else:
                drop_layer(layer, keep=partition)  # not ours: free it (but not what we share)
        tied_on_meta = self._tied_on_meta()
        with ties_kept(partition):
            _materialize(partition, self.device)
        if deferred_batch_norm:
            convert_deferred_batch_norm(partition)
        object.__setattr__(self, "partition", partition)  # a view: its layers are registered
        self._stage = Stage(self.stage_index, partition, self.device, layout)
        self._layout = layout
        reverse = reverse_group(group)
        if reverse is None and dist.get_backend(group) == "nccl":
            warnings.warn("DistributedPipe on a process group made with dist.new_group: both "
                          "directions share it, so on NCCL receives are posted only when "
                          "needed, and 1F1B may deadlock once a message outgrows NCCL's "
                          "buffers. Use group=None or seqpipe.distributed.mesh_groups, "
                          "which give each direction its own group", stacklevel=2)
        self._transport = Transport(group, self.device, reverse=reverse)
        # NCCL makes a communicator per pair on first use: open them all now, in one order
        self._transport.connect(pipeline_channels(self.schedule, self.num_stages, self.chunks,
                                                  layout))
        self.data_parallel_group = data_parallel_group
        self._reducer: Optional[GradientReducer] = None
        if data_parallel_group is not None:
            check_data_parallel_group(self.stage_index, fingerprint, data_parallel_group,
                                      self.device)
            self._reducer = GradientReducer(data_parallel_group)
        self._tied: Optional[TiedCopies] = None
        if self.ties:
            self._tied = TiedCopies(self.ties, dict(self.named_parameters(remove_duplicate=False)),
                                    self.stage_index, group, data_parallel_group, self.device)
            self._tied.verify(tied_on_meta, at_construction=True)
        self._validated = {self.chunks}
        self._plans: Dict[Tuple[int, bool], _CallPlan] = {}

    def _tied_on_meta(self) -> List[bool]:
        """Per tie, whether this stage's copy is on ``meta`` (to be freshly initialised)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        return [any(params[n].is_meta for n in tie.names if n in params) for tie in self.ties]

    def check_ties(self) -> None:
        """Debug check, collective over the pipeline: raise ``RuntimeError`` (on every rank)
        if the copies of a parameter tied across stages differ (one small all-gather of
        checksums; each rank copies its tied parameters to the CPU to checksum them)."""
        if self._tied is not None:
            self._tied.verify()

    def _resolve_balance(self, module: nn.Sequential,
                         balance: Optional[Sequence[int]]) -> List[int]:
        if balance is None:
            from seqpipe.balance import balance_by_params

            return balance_by_params(self.num_stages, module)
        balance = check_balance(module, balance)
        if len(balance) != self.num_stages:
            raise ValueError(
                f"balance has {len(balance)} entries but the pipeline group has "
                f"{self.num_stages} ranks; give one entry per rank (stage)")
        return balance

    def _check_same_everywhere(self, module: nn.Sequential) -> int:
        config = (self.balance, self.chunks, self.checkpoint, type(self.schedule).__qualname__,
                  self.num_stages, self.broadcast_buffers, [tie.names for tie in self.ties])
        mine = torch.tensor([_fingerprint(module, config)], dtype=torch.int64,
                            device=self.device)
        everyone = [torch.zeros_like(mine) for _ in range(self.num_stages)]
        dist.all_gather(everyone, mine, group=self.group)
        values = [int(t.item()) for t in everyone]
        odd = [s for s, v in enumerate(values) if v != values[0]]
        if odd:
            raise ValueError(
                f"stages {odd} built a different model or pipeline settings than stage 0 "
                f"(layers, parameter shapes, balance, chunks, checkpoint or schedule differ); "
                f"every rank must construct DistributedPipe from the same model and arguments")
        return values[0]

    # -- running -----------------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def _plan(self, m: int, grad: bool) -> "_CallPlan":
        """This stage's actions in a call of ``m`` micro-batches, and its messages."""
        if (m, grad) not in self._plans:
            if m not in self._validated:
                validate_schedule(self.schedule, self.num_stages, m, **_RUNS)
                self._validated.add(m)
            k, me = self.num_stages, self.stage_index
            actions = call_actions(self.schedule, k, m, grad)
            self._plans[(m, grad)] = _CallPlan(
                actions[me],
                {s: messages(s, me, actions, self._layout, grad) for s in range(k) if s != me},
                {s: messages(me, s, actions, self._layout, grad) for s in range(k) if s != me})
        return self._plans[(m, grad)]

    def _open(self, call: Call,
              input: Optional[TensorOrTensors]) -> Tuple[List[Batch], List[Action]]:
        """Start a call: stage 0 cuts the batch and tells every stage how many micro-batches
        there are; then every stage knows its actions and the messages it will exchange."""
        transport = self._transport
        if self.is_first:
            for s in range(1, self.num_stages):  # so that a failure from here on tells them
                transport.will_send(s, [OPENING])
            if input is None:
                raise ValueError("stage 0 needs the input batch; pass it on the first rank")
            batches = scatter(input, self.chunks)
            if not batches:
                raise ValueError("the input batch is empty (size 0 on dim 0)")
        else:
            transport.expect(0, [OPENING])
            count = call.need(0, Kind.STEP).count
            batches = [Batch((), True)] * count  # placeholders: only their number matters
        plan = self._plan(len(batches), call.grad)
        for s, planned in plan.incoming.items():
            transport.expect(s, planned[1:] if s == 0 else planned)  # STEP: taken above
        for s, planned in plan.outgoing.items():
            transport.will_send(s, planned[1:] if self.is_first else planned)  # STEP: above
        if self.is_first:
            for s in range(1, self.num_stages):
                call.send(s, Kind.STEP, -1, [], count=len(batches))
        return batches, plan.actions

    def _close(self, call: Call, loss: Optional[Tensor]) -> Optional[Tensor]:
        """End the call on every stage together, so no rank returns while another fails.

        The last stage sends the loss to everyone; then the stage that finishes last (stage
        0 after a backward, the last stage after a forward-only call) sends DONE to all.
        """
        k = self.num_stages
        if call.grad and k > 1:
            if self.is_last:
                for s in range(k - 1):
                    call.send(s, Kind.LOSS, -1, [loss])
            else:
                loss = call.need(k - 1, Kind.LOSS).tensors[0]
        closer = 0 if call.grad else k - 1
        if self.stage_index == closer:
            for s in range(k):
                if s != closer:
                    call.send(s, Kind.DONE, -1, [])
        else:
            call.need(closer, Kind.DONE)
        call.flush()
        return loss

    def train_step(self, input: Optional[TensorOrTensors], target: Any,
                   loss_fn: LossFn, *, scaler: Optional[PipeGradScaler] = None) -> Tensor:
        """Forward and backward one mini-batch through the whole pipeline.

        ``input`` is read on the first stage and ``target`` on the last (pass ``None``
        elsewhere). Gradients are accumulated into this stage's parameters' ``.grad``;
        step your optimizer afterwards. Returns the mini-batch loss on every rank: the
        micro-batch losses weighted by micro-batch size, which for a mean-reduced
        ``loss_fn`` equals ``loss_fn`` on the whole batch.

        With ``scaler`` (a ``PipeGradScaler`` of this pipe, on every rank), the backward is
        that of the loss times the scaler's scale, for fp16 mixed precision: follow with
        ``scaler.step(optimizer)`` and ``scaler.update()``. The returned loss is unscaled.
        """
        seed = backward_seed(scaler, self)  # a wrong scaler: raised here, the pipe unharmed
        self._transport.begin()
        call = Call(self._stage, self._transport, self._layout, self.num_stages, grad=True,
                    seed=seed)
        with self._dropping_statistics_on_failure():
            return self._train_step(call, input, target, loss_fn)

    @contextmanager
    def _dropping_statistics_on_failure(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self._stage.finish_forward(failed=True)
            raise

    def _train_step(self, call: Call, input: Optional[TensorOrTensors], target: Any,
                    loss_fn: LossFn) -> Tensor:
        targets: Optional[List[Any]] = None
        weights: List[float] = []
        with call.guard("start of the step"):
            if self._reducer is not None:
                self._reducer.follow(self._stage.parameters())  # requires_grad as of now
            batches, actions = self._open(call, input)
            mode = self.checkpoint if self.training else "never"
            call.checkpoint_stop = checkpoint_stop(mode, len(batches))
            if self.is_last:
                targets, weights = self._split_target(target, len(batches))
        last_backward = max(n for n, a in enumerate(actions) if a.phase in _LAST)
        call.grads = StepGrads(self._stage, actions[last_backward].microbatch)
        split = {a.microbatch for a in actions if a.phase is Phase.BACKWARD_INPUT}
        for n, action in enumerate(actions):
            with call.guard(describe(action)):
                i = action.microbatch
                if action.phase is Phase.FORWARD:
                    call.forward(i, batches, targets, loss_fn, weights, split=i in split)
                    continue
                if n == last_backward and self._reducer is not None:
                    self._reducer.arm()  # gradients final from here: reduce as they land
                if action.phase is Phase.BACKWARD:
                    call.backward(i)
                elif action.phase is Phase.BACKWARD_INPUT:
                    call.backward_input(i)
                else:
                    call.backward_weight(i)
        with call.guard("end of the step"):
            self._stage.finish_forward()
            loss = self._close(call, torch.stack(call.losses).sum() if self.is_last else None)
            if self._reducer is not None:
                self._reducer.finish()
                if self.broadcast_buffers:
                    broadcast_buffers(self.partition, self._reducer.group)
            if self._tied is not None:
                self._tied.reduce_grads()  # after the replicas' mean: the two commute
        assert loss is not None
        return loss

    def _split_target(self, target: Any, m: int) -> Tuple[List[Any], List[float]]:
        if target is None:
            raise ValueError("the last stage needs the target; pass it on the last rank")
        pieces = scatter(target, m)
        if len(pieces) != m:
            raise ValueError(f"the target has {len(pieces)} samples but the input was cut into "
                             f"{m} micro-batches; input and target need the same batch size")
        sizes = [p.tensors[0].shape[0] for p in pieces]
        return [p.value for p in pieces], [n / sum(sizes) for n in sizes]

    @torch.no_grad()
    def forward(self, input: Optional[TensorOrTensors] = None) -> Optional[TensorOrTensors]:
        """Inference: the output on the last stage, ``None`` on the others."""
        self._transport.begin()
        call = Call(self._stage, self._transport, self._layout, self.num_stages, grad=False)
        with self._dropping_statistics_on_failure():
            return self._forward(call, input)

    def _forward(self, call: Call,
                 input: Optional[TensorOrTensors]) -> Optional[TensorOrTensors]:
        with call.guard("start of the call"):
            batches, actions = self._open(call, input)
        for action in actions:
            with call.guard(describe(action)):
                call.forward(action.microbatch, batches, None, None, [])
        with call.guard("end of the call"):
            self._stage.finish_forward()
            self._close(call, None)
        return gather(call.outputs) if self.is_last else None

    def extra_repr(self) -> str:
        return (f"stage={self.stage_index}/{self.num_stages}, balance={self.balance}, "
                f"chunks={self.chunks}, schedule={type(self.schedule).__name__}, "
                f"checkpoint={self.checkpoint!r}")

