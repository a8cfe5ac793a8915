"""``DistributedPipe``: a pipeline's stages spread over processes, over ``torch.distributed``."""
from __future__ import annotations

import functools
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from seqpipe.core.arguments import check_checkpoint_every, check_chunks
from seqpipe.core.batchnorm import convert_deferred_batch_norm
from seqpipe.core.checkpoint import check_mode
from seqpipe.core.fixed_layers import FixedLayers
from seqpipe.core.loss_weights import CountFn
from seqpipe.core.microbatch import TensorOrTensors
from seqpipe.core.partition import check_balance, check_devices, verify_module
from seqpipe.core.stage import Stage
from seqpipe.distributed.agreement import check_same_model
from seqpipe.distributed.auto import AutoRunner
from seqpipe.distributed.clip import clip_grad_norm_
from seqpipe.distributed.comm_hook import CommHook
from seqpipe.distributed.data_parallel import (
    GradientReducer,
    check_data_parallel_group,
    reducer_options,
)
from seqpipe.distributed.dtensor_wire import check_mesh
from seqpipe.distributed.grad_scaler import PipeGradScaler, backward_seed
from seqpipe.distributed.lifecycle import CallLifecycle
from seqpipe.distributed.materialize import materialize
from seqpipe.distributed.mesh import NOT_COPIED, held_group, kept, kept_mesh, resolved
from seqpipe.distributed.mesh_reduce import MeshReduce
from seqpipe.distributed.plan import pipeline_channels
from seqpipe.distributed.rebuild import failed, local_view, pipeline_transport
from seqpipe.distributed.step import LossFn
from seqpipe.distributed.tie_grads import TieGrads
from seqpipe.distributed.tie_local import one_rank_ties
from seqpipe.distributed.ties import Tie, TiedCopies, across_ranks, drop_layer, find_ties, ties_kept
from seqpipe.graph.origin import Origin, model_output
from seqpipe.schedule import (
    AnySchedule,
    Auto,
    AutoChoice,
    get_schedule,
    placement_of,
    validate_schedule,
)
from seqpipe.skip.layout import inspect_skip_layout

__all__ = ["DistributedPipe"]


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class DistributedPipe(FixedLayers):
    """This rank's stages of a pipeline that spans processes; every rank builds it the
    same way.

    The schedule's placement says which stages the rank (its index in ``group``, default
    the whole world) holds: stage ``r`` on rank ``r`` for one-stage-per-rank schedules;
    under interleaved schedules stage ``s`` on rank ``s mod K``, under V-shaped ones rank
    ``r`` holds stages ``r`` and ``2K-1-r``. It keeps only those stages' layers, on
    ``device``, registered under their names in the original ``nn.Sequential`` (so
    ``state_dict()`` keys are ``"4.weight"``, and the ranks' state dicts together are the
    unpipelined model's); the other layers are moved to the ``meta`` device, which frees
    them. A parameter that layers of stages on several ranks share (tied weights) has a
    copy on each of those ranks, whose gradients are summed after every step (see
    ``seqpipe.distributed.ties``; ``ties`` lists them with the ranks that hold them,
    ``check_ties`` compares the copies); stages on one rank share one copy (wrapped apart
    by FSDP2 or tensor parallelism, its copies there are summed too: ``tie_local``).

    Args:
        module: the whole model, the same on every rank (``meta`` tensors are fine).
        chunks: micro-batches per mini-batch (fewer if the batch is smaller).
        balance: layers per stage; one entry per stage: ``K`` (the size of ``group``) for
            a one-stage-per-rank schedule, ``K * V`` for a schedule that gives each rank
            ``V`` stages. Default: split by parameter count into that many stages.
        schedule: a built-in name (``"1f1b"``, ``"fill_drain"``, ``"zb_h1"``, ``"zb_h2"``,
            ``"interleaved_1f1b"``, ``"looped_bfs"``, ``"interleaved_zb"``, ``"zbv"``,
            ``"dualpipev"``), or any ``seqpipe.schedule.Schedule`` or ``StagedSchedule``;
            ``"auto"`` or a ``seqpipe.schedule.Auto``: the first ``train_step`` measures
            each stage's costs, and the candidate the simulator predicts fastest runs from
            the next call on (see ``auto_choice``).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        checkpoint_every: checkpoint each run of this many consecutive layers of a stage
            separately (DeepSpeed's ``activation_checkpoint_interval``); default None:
            the whole stage at once.
        deferred_batch_norm: BatchNorm running statistics once per mini-batch.
        group: the pipeline's process group (default: the world, kept as ``None``).
        device: where this stage runs (default: the current CUDA device, else CPU).
        base_seed: layers built on ``meta`` are initialised from seed ``base_seed + i``
            (layer ``i``), so their values do not depend on the split (see
            ``seqpipe.seeding``); default: ``reset_parameters()`` with this rank's RNG.
        data_parallel_group: replicas of this stage; gradients are averaged over it.
        broadcast_buffers: with ``data_parallel_group``, copy the stage's buffers (say,
            BatchNorm running statistics) from the group's first rank to the others at
            the end of every ``train_step``, as DDP's argument of that name does.
        bucket_cap_mb: with ``data_parallel_group``, the size of the buckets the gradients
            are averaged in, in MiB (DDP's argument; default 25): smaller buckets start
            sooner during the last backward, and are more collectives.
        reduce_dtype: with ``data_parallel_group``, average the gradients in this dtype
            (``torch.float32`` for bf16 parameters, or ``torch.bfloat16`` to send fp32
            gradients at half the bytes), cast back to each parameter's dtype; default:
            the parameters' own. See also ``register_comm_hook``.
        sharded_failure_checks: with stages sharded by FSDP2 (``fully_shard``, HSDP,
            ``replicate``), check before each of FSDP2's all-gathers and gradient
            reductions that no rank of its group has failed, so that a failure ends every
            rank of the mesh at once instead of at the process group's timeout. Off by
            default: each check is an 8-byte all-reduce read on the host (1.35x a
            pp=2 x fsdp=2 CPU step in ``benchmarks/dist_fsdp_verdicts.py``; on a GPU a
            host sync that also stops FSDP2's prefetching), so turn it on while
            developing, or set ``init_process_group(timeout=...)``.
        mesh: a ``DeviceMesh`` with the dimensions of the meshes of the ``DTensor``
            activations that stages send one another (say the ``("pp", "tp")`` mesh whose
            pipeline groups ``mesh_groups`` gave): a ``DTensor`` received from another
            stage is rebuilt on this rank's sub-mesh of the sender's dimension names (see
            "Sequence parallelism across stages" in docs/distributed.md). Default: the
            mesh of one of this rank's ``DTensor`` parameters that has those dimensions.
    """

    def __init__(self, module: nn.Sequential, chunks: int = 1, *,
                 balance: Optional[Sequence[int]] = None,
                 schedule: Union[str, AnySchedule] = "1f1b", checkpoint: str = "except_last",
                 deferred_batch_norm: bool = False, group: Optional[dist.ProcessGroup] = None,
                 device: Union[str, torch.device, None] = None,
                 data_parallel_group: Optional[dist.ProcessGroup] = None,
                 broadcast_buffers: bool = True, base_seed: Optional[int] = None,
                 checkpoint_every: Optional[int] = None,
                 bucket_cap_mb: Optional[float] = None,
                 reduce_dtype: Optional[torch.dtype] = None,
                 sharded_failure_checks: bool = False,
                 mesh: Optional[DeviceMesh] = None) -> None:
        super().__init__()
        verify_module(module)
        self.keep_hooks_of(module, calls=False)  # its call hooks refused (core/own_hooks)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedPipe needs torch.distributed: call "
                               "torch.distributed.init_process_group() first (or launch with "
                               "torchrun), or use seqpipe.Pipe for one process")
        self.group = group = kept(group)  # the default group, however named: None
        self.num_ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("this rank is not a member of the pipeline group")
        self.chunks = check_chunks(chunks)
        self.checkpoint = check_mode(checkpoint)
        self.checkpoint_every = check_checkpoint_every(checkpoint_every)
        self.schedule = get_schedule(schedule)
        self.placement = placement_of(self.schedule, self.num_ranks)
        self.num_stages = self.placement.num_stages
        self.stages: Tuple[int, ...] = self.placement.stages_of(self.rank)
        self.stage_index = self.stages[0]  # with one stage per rank, the stage
        self.device = torch.device(device) if device is not None else _default_device()
        if self.device.type == "meta":
            raise ValueError("device='meta' holds no values to train; give the stage a real "
                             "device (build the model on meta instead: each rank then "
                             "materialises its own layers on its device)")
        check_devices([self.device], what="device")
        self.base_seed = base_seed
        self.broadcast_buffers = bool(broadcast_buffers)
        if data_parallel_group is None and (bucket_cap_mb is not None
                                            or reduce_dtype is not None):
            raise ValueError("bucket_cap_mb and reduce_dtype tune the averaging of gradients "
                             "over data_parallel_group: pass data_parallel_group too (for "
                             "stages sharded with fully_shard, set FSDP2's own "
                             "MixedPrecisionPolicy(reduce_dtype=...) instead)")
        self._reducer_options = reducer_options(bucket_cap_mb, reduce_dtype)
        self.balance = self._resolve_balance(module, balance)
        validate_schedule(self.schedule, self.num_ranks, self.chunks)
        layout = inspect_skip_layout(module, self.balance)
        self.ties: Tuple[Tie, ...] = tuple(across_ranks(find_ties(module, self.balance),
                                                         self.placement))
        on_one_rank = one_rank_ties(module, self.balance, self.placement)  # (wrapped apart)
        fingerprint, views = self._check_same_everywhere(module)  # views: ``rebuild``
        named = list(module.named_children())
        bounds = [sum(self.balance[:s]) for s in range(self.num_stages + 1)]
        held = {n for s in self.stages for n in range(bounds[s], bounds[s + 1])}
        partitions = {s: nn.Sequential(*(layer for _, layer in named[bounds[s]:bounds[s + 1]]))
                      for s in self.stages}
        partition = nn.Sequential(*(layer for n, (_, layer) in enumerate(named) if n in held))
        for n, (name, layer) in enumerate(named):
            if n in held:
                self.add_module(name, layer)
            else:
                drop_layer(layer, keep=partition)  # not ours: free it (but not what we share)
        self.layer_names: Tuple[str, ...] = tuple(name for n, (name, _) in enumerate(named)
                                                  if n in held)
        self.origin: Optional[Origin] = getattr(module, "origin", None)  # see seqpipe.graph
        tied_on_meta = self._tied_on_meta()
        with ties_kept(partition):
            materialize([(n, name, layer) for n, (name, layer) in enumerate(named)
                         if n in held], self.device, base_seed)
        if deferred_batch_norm:
            convert_deferred_batch_norm(partition)
        object.__setattr__(self, "partition", partition)  # a view: its layers are registered
        self._stages = {s: Stage(s, partitions[s], self.device, layout,
                                 checkpoint_every=self.checkpoint_every) for s in self.stages}
        self._stage = self._stages[self.stage_index]
        self._layout = layout
        # its own tag (on NCCL after a failed call, a fresh group); NCCL makes a communicator
        # per pair on first use: open them all now, in one order (warns of a shared group)
        self._transport = pipeline_transport(group, self.device, views, pipeline_channels(
            self.schedule, self.num_ranks, self.chunks, layout))
        self._data_parallel = held_group(data_parallel_group)  # never the default group itself
        self._reducer: Optional[GradientReducer] = None
        if data_parallel_group is not None:
            check_data_parallel_group(self.stage_index, fingerprint, data_parallel_group,
                                      self.device)
            self._reducer = GradientReducer(data_parallel_group, self.device,
                                            *self._reducer_options)
        self._tied: Optional[TiedCopies] = None
        if self.ties or on_one_rank:
            self._tied = TiedCopies(self.ties, self, self.rank, group, data_parallel_group,
                                    self.device, on_one_rank)
            self._tied.verify(tied_on_meta, at_construction=True)
        self._auto = (AutoRunner(self.schedule, self.num_ranks, self.num_stages, group,
                                 functools.partial(MeshReduce.of, group, partition,
                                                   self._data_parallel), self.device)
                      if isinstance(self.schedule, Auto) else None)
        self._calls = CallLifecycle(self._stages, self._transport, layout, self.placement,
                                    self.schedule, chunks=self.chunks, group=group,
                                    device=self.device, auto=self._auto, reducer=self._reducer,
                                    tied=TieGrads(self._tied) if self._tied is not None else None,
                                    partition=partition,
                                    broadcast_buffers=self.broadcast_buffers)
        self._calls.sharded_failure_checks = bool(sharded_failure_checks)
        self._calls.mesh = kept_mesh(check_mesh(mesh))  # without the default group

    data_parallel_group = property(lambda self: resolved(self._data_parallel), doc="""The
        replicas' group (``None``: none); the default group is read when asked for.""")

    @property
    def stage_modules(self) -> Tuple[nn.Sequential, ...]:
        """This rank's stages, one ``nn.Sequential`` of their layers each, in ``stages``
        order: what to shard with FSDP2's ``fully_shard`` after building the pipe (see
        "Sharded stages" in docs/distributed.md). Their layers are the pipe's own, so
        wrapping them wraps the pipe's parameters in place."""
        return tuple(self._stages[s].partition for s in self.stages)

    @property
    def auto_choice(self) -> Optional[AutoChoice]:
        """Under ``schedule="auto"``: what it picked for ``chunks`` micro-batches, once the
        first ``train_step`` has measured the costs (``None`` before, or without auto)."""
        if self._auto is None or self._auto.costs is None:
            return None
        self._auto.schedule_for(self.chunks)
        return self._auto.choices[self.chunks]

    def _tied_on_meta(self) -> List[bool]:
        """Per tie, whether this stage's copy is on ``meta`` (to be freshly initialised)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        return [any(params[n].is_meta for n in tie.names if n in params) for tie in self.ties]

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Average the data-parallel buckets with ``hook(state, bucket)``, as
        ``DistributedDataParallel.register_comm_hook`` does: called once per bucket per
        ``train_step``, in bucket order, it returns a ``torch.futures.Future`` of the
        bucket's gradients averaged over the replicas (DDP's hooks, e.g.
        ``default_hooks.bf16_compress_hook`` with ``state=data_parallel_group``, work as
        they are). Register it once, before training, on every replica alike (see
        ``seqpipe.distributed.comm_hook``). ``RuntimeError`` without
        ``data_parallel_group``, or if a hook is registered already."""
        if self._reducer is None:
            raise RuntimeError("register_comm_hook needs a data_parallel_group: the hook "
                               "averages gradients over the replicas of this stage")
        self._reducer.register_comm_hook(state, hook)

    def check_ties(self) -> None:
        """Debug check, collective over the pipeline: raise ``RuntimeError`` (on every rank)
        if the copies of a parameter tied across stages differ (one small all-gather of
        checksums; each rank copies its tied parameters to the CPU to checksum them, whole:
        a sharded or tensor-parallel copy is gathered over its mesh, whose ranks call this
        too)."""
        if self._tied is not None:
            self._tied.verify()

    def _resolve_balance(self, module: nn.Sequential,
                         balance: Optional[Sequence[int]]) -> List[int]:
        if balance is None:
            from seqpipe.balance import balance_by_params

            return balance_by_params(self.num_stages, module)
        balance = check_balance(module, balance)
        if len(balance) != self.num_stages:
            per_rank = self.num_stages // self.num_ranks
            raise ValueError(
                f"balance has {len(balance)} entries but the pipeline has {self.num_stages} "
                f"stages ({self.num_ranks} ranks, {per_rank} stage(s) per rank under "
                f"{type(self.schedule).__name__}); give one entry per stage")
        return balance

    def _check_same_everywhere(self, module: nn.Sequential) -> Tuple[int, List[List[int]]]:
        schedule = (repr(self.schedule) if isinstance(self.schedule, Auto)  # its options too
                    else type(self.schedule).__qualname__)
        config = (self.balance, self.chunks, self.checkpoint, schedule,
                  self.placement.ranks, self.broadcast_buffers, [tie.names for tie in self.ties],
                  self.base_seed, self._reducer_options)
        return check_same_model(module, config, self.group, self.device,
                                "stages" if self.num_ranks == self.num_stages else "ranks",
                                extra=local_view(self.group))

    # -- running -----------------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        """Whether this rank holds stage 0, so reads the input batch."""
        return 0 in self.stages

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage, so reads the target (under V-shaped
        schedules rank 0 holds both)."""
        return self.num_stages - 1 in self.stages

    def train_step(self, input: Optional[TensorOrTensors], target: Any,
                   loss_fn: LossFn, *, count_fn: Optional[CountFn] = None,
                   scaler: Optional[PipeGradScaler] = None) -> Tensor:
        """Forward and backward one mini-batch through the whole pipeline.

        ``input`` is read on the rank that holds stage 0 (``is_first``) and ``target`` on
        the rank that holds the last stage (``is_last``; under V-shaped schedules both are
        rank 0); pass ``None`` elsewhere. Gradients are accumulated into this rank's
        parameters' ``.grad``; step your optimizer afterwards. Returns the mini-batch loss
        on every rank: the micro-batch losses weighted by micro-batch size, which for a
        mean-reduced ``loss_fn`` equals ``loss_fn`` on the whole batch.

        A loss averaged over counted items (tokens that are not padding) needs ``count_fn``
        (read on the last stage, like ``target``): ``loss_fn`` then returns each
        micro-batch's *sum*, ``count_fn(target)`` the whole mini-batch's count (e.g.
        ``(target != -100).sum()``), and the gradients are those of the sum over the
        mini-batch divided by the count, exactly; with ``data_parallel_group``, of the sum
        over every replica's mini-batch divided by the count summed over the replicas
        (give ``count_fn`` on every replica). The returned loss is this replica's sum over
        its own count.

        With ``scaler`` (a ``PipeGradScaler`` of this pipe, on every rank), the backward is
        that of the loss times the scaler's scale, for fp16 mixed precision: follow with
        ``scaler.step(optimizer)`` and ``scaler.update()``. The returned loss is unscaled.
        """
        seed = backward_seed(scaler, self)  # a wrong scaler: raised here, the pipe unharmed
        try:
            return self._calls.train_step(input, target, loss_fn, seed, chunks=self.chunks,
                                          checkpoint=self.checkpoint if self.training
                                          else "never", count_fn=count_fn)
        except BaseException:
            failed(self._transport, self.group)  # for a new pipe on the group (``rebuild``)
            raise

    def mesh_reduce(self) -> MeshReduce:
        """All-reduces over this pipe's whole mesh: the pipeline group, then every group its
        stages are copied over (``data_parallel_group``, the mesh dimensions of ``DTensor``
        parameters: FSDP2, HSDP, ``replicate``), read from the parameters now."""
        return MeshReduce.of(self.group, self, self._data_parallel)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model: the norm of every
        stage's gradients, each parameter once (summed over stages and shards, not over
        replicas or tied copies), the same on every rank and equal to the single-process
        model's; every rank's gradients are scaled by the same factor. Collective: call it
        on every rank of the mesh, after ``train_step`` (after ``scaler.unscale_`` under a
        ``PipeGradScaler``). Returns the total norm (a float64 0-dim tensor)."""
        elsewhere = self._tied.uncounted() if self._tied is not None else set()
        return clip_grad_norm_(list(self.parameters()), self.mesh_reduce(), self.device,
                               max_norm, norm_type, error_if_nonfinite=error_if_nonfinite,
                               elsewhere=elsewhere)

    @torch.no_grad()
    def forward(self, input: Optional[TensorOrTensors] = None) -> Optional[TensorOrTensors]:
        """Inference: the output on the rank of the last stage (``is_last``; in the model's
        own structure for a model converted by ``seqpipe.to_sequential``), ``None`` on the
        others."""
        try:
            return model_output(self.origin, self._calls.forward(input, self.chunks))
        except BaseException:
            failed(self._transport, self.group)
            raise

    def __getstate__(self) -> Any:
        """Refused (``copy.deepcopy``, ``pickle``, ``AveragedModel``): see ``NOT_COPIED``."""
        raise TypeError(NOT_COPIED)

    def extra_repr(self) -> str:
        stages = ", ".join(map(str, self.stages))
        return (f"rank={self.rank}/{self.num_ranks}, stages=[{stages}] of {self.num_stages}, "
                f"balance={self.balance}, chunks={self.chunks}, "
                f"schedule={type(self.schedule).__name__}, checkpoint={self.checkpoint!r}")
