"""Pipeline × data parallelism: replicas of a stage average their gradients.

A stage's gradients are final only after its last backward of the mini-batch, so they are
synchronised once per mini-batch, never per micro-batch. To hide the all-reduce behind
that last backward, as DistributedDataParallel's reducer does, parameters are grouped into
buckets in reverse order (the order backward produces them); during the last backward a
post-accumulate hook marks each parameter ready, and the buckets' all-reduces start,
without blocking, **strictly in bucket order**: a ready bucket waits until every bucket
before it has started. Every replica therefore issues the same collectives in the same
order even when replicas use different parameters in a step (LayerDrop, an expert that got
no tokens, a branch taken on one replica only); started as each became ready, two replicas
would reduce different buckets against each other.

A parameter that got no gradient on a replica takes part with zeros, and with a flag that
says so: each bucket carries one count per parameter of the replicas that had a gradient
for it, so a parameter no replica used keeps ``.grad`` at ``None``, as with DDP.

A replica that fails in a step still joins the all-reduces the others wait in, and the
step's verdict (``seqpipe.distributed.verdict``) tells every replica that it failed.

The trainable parameters are followed at every step (``follow``): freezing or unfreezing
a parameter after construction rebuilds the buckets. The buckets are a function of the
model's parameters and their ``requires_grad``, so replicas that freeze the same
parameters build the same buckets without talking to each other.

What users tune in DDP is tunable here too: the bucket size (``bucket_cap_mb``), a
``reduce_dtype`` the buckets are reduced in (bf16 gradients averaged in fp32, or fp32 ones
sent as bf16), cast back to the parameters' dtype before they are written back, and a
communication hook with DDP's contract (``seqpipe.distributed.comm_hook``).

DDP itself is not used because its reducer expects one forward then one backward per
call, while a 1F1B stage interleaves the forwards and backwards of many micro-batches.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from seqpipe.core.loss_weights import Replicas
from seqpipe.core.sink import step_aware
from seqpipe.distributed import verdict
from seqpipe.distributed.agreement import gather_ints
from seqpipe.distributed.comm_hook import CommHook, GradBucket, HookWork
from seqpipe.distributed.mesh import held_group, resolved
from seqpipe.distributed.tensor_parallel import as_grad, local
from seqpipe.distributed.transport import PeerError

__all__ = ["GradientReducer", "broadcast_buffers", "check_data_parallel_group",
           "reducer_options"]

DEFAULT_BUCKET_BYTES = 25 * 2**20


def reducer_options(bucket_cap_mb: Optional[float],
                    reduce_dtype: Optional[torch.dtype]) -> Tuple[int, Optional[torch.dtype]]:
    """``(bucket_bytes, reduce_dtype)`` from ``DistributedPipe``'s arguments, checked:
    ``bucket_cap_mb`` (MiB, DDP's name; default 25) must be positive, ``reduce_dtype`` a
    floating-point dtype."""
    if bucket_cap_mb is not None and not (isinstance(bucket_cap_mb, (int, float))
                                          and bucket_cap_mb > 0):
        raise ValueError(f"bucket_cap_mb must be a positive number of MiB (DDP's default "
                         f"is 25), not {bucket_cap_mb!r}")
    if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype)
                                         and reduce_dtype.is_floating_point):
        raise ValueError(f"reduce_dtype must be a floating-point torch.dtype (e.g. "
                         f"torch.bfloat16 or torch.float32), not {reduce_dtype!r}")
    bucket_bytes = (DEFAULT_BUCKET_BYTES if bucket_cap_mb is None
                    else max(1, int(bucket_cap_mb * 2**20)))
    return bucket_bytes, reduce_dtype


def make_buckets(params: Sequence[nn.Parameter],
                 bucket_bytes: int) -> List[List[nn.Parameter]]:
    """Group ``params`` in reverse order into buckets of about ``bucket_bytes``, one dtype
    and device per bucket (a bucket is reduced as one flat tensor; a tensor-parallel
    parameter counts, and is reduced, by its local shard)."""
    buckets: List[List[nn.Parameter]] = []
    open_: Dict[Tuple[torch.dtype, torch.device], List[nn.Parameter]] = {}
    size: Dict[Tuple[torch.dtype, torch.device], int] = {}
    for param in reversed(params):
        key = (param.dtype, param.device)
        open_.setdefault(key, []).append(param)
        size[key] = size.get(key, 0) + local(param).numel() * param.element_size()
        if size[key] >= bucket_bytes:
            buckets.append(open_.pop(key))
            size[key] = 0
    buckets.extend(open_.values())
    return buckets


class GradientReducer:
    """Averages the trainable parameters' ``.grad`` over ``group``, overlapping with the
    stage's last backward of each step."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 reduce_dtype: Optional[torch.dtype] = None) -> None:
        self._group = held_group(group)  # not the default group itself: it would outlive its end
        self.device = device  # where the step's verdict is reduced
        self.replica = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.bucket_bytes = bucket_bytes
        self.reduce_dtype = reduce_dtype  # None: each bucket in its parameters' dtype
        self.hook: Optional[Tuple[Any, CommHook]] = None  # (state, hook)
        self.used: List[Tensor] = []  # with a hook: each started bucket's used flags
        self.params: List[nn.Parameter] = []
        self.buckets: List[List[nn.Parameter]] = []
        self.bucket_of: Dict[int, int] = {}  # id(parameter) -> its bucket
        self._hooked: Set[int] = set()
        self.armed = False
        self.ready: List[Set[int]] = []
        # Started buckets, in bucket order: the work (a HookWork with a hook), the flat
        # buffer, and whether some parameter of the bucket had no gradient here.
        self.works: List[Tuple[Any, Tensor, bool]] = []
        self.concluded = False  # this step's verdict started: the replicas hear no more
        self.counting = False  # this step sums a count over the replicas, not done yet

    @property
    def group(self) -> dist.ProcessGroup:
        """The data-parallel group (the default group, if it is that, of this moment)."""
        group = resolved(self._group)
        assert group is not None
        return group

    def replicas(self, device: torch.device) -> Replicas:
        """The replicas, for summing a step's count over them (``seqpipe.core.loss_weights``)."""
        def all_reduce(total: Tensor) -> None:
            self.counting = False
            dist.all_reduce(total, group=self.group)
        return Replicas(self.size, all_reduce, device)

    def follow(self, params: Sequence[nn.Parameter], counting: bool = False) -> None:
        """Reduce exactly ``params`` (the trainable ones, in model order) from now on;
        ``counting``: this step first sums a count over the replicas (``replicas``).

        Called at the start of every step; rebuilds the buckets when the list changed (a
        parameter was frozen or unfrozen). Every replica must pass the same list.
        """
        self.concluded, self.counting = False, counting
        if [id(p) for p in params] == [id(p) for p in self.params]:
            return
        self.params = list(params)
        self.buckets = make_buckets(self.params, self.bucket_bytes)
        self.bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        for param in self.params:
            if id(param) not in self._hooked:
                param.register_post_accumulate_grad_hook(_weak_hook(self))
                self._hooked.add(id(param))

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` (see ``comm_hook``), once."""
        if self.hook is not None:
            raise RuntimeError("register_comm_hook was already called on this pipe; a "
                               "communication hook can be registered only once (as with DDP)")
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), not "
                            f"{type(hook).__name__}")
        self.hook = (state, hook)

    def arm(self) -> None:
        """The next backward is the stage's last of the mini-batch: reduce as grads land."""
        self.armed = True
        self.ready = [set() for _ in self.buckets]
        self.works, self.used = [], []

    def _on_grad(self, param: Tensor) -> None:
        if not self.armed:
            return
        b = self.bucket_of.get(id(param))
        if b is None:  # frozen since the step started: not reduced in this step
            return
        self.ready[b].add(id(param))
        self._start_ready()

    def _start_ready(self) -> None:
        """Start every bucket that is ready and has all buckets before it started."""
        while len(self.works) < len(self.buckets) and \
                len(self.ready[len(self.works)]) == len(self.buckets[len(self.works)]):
            self._start(len(self.works))

    def _start(self, b: int) -> None:
        assert b == len(self.works), "buckets must start in order on every replica"
        bucket = self.buckets[b]
        missing = [p.grad is None for p in bucket]
        grads = [torch.zeros_like(local(p)) if m else local(p.grad)
                 for p, m in zip(bucket, missing)]
        if any(missing):
            used = torch.tensor([not m for m in missing], dtype=bucket[0].dtype,
                                device=bucket[0].device)
        else:  # the common case, without a host-to-device copy
            used = torch.ones(len(bucket), dtype=bucket[0].dtype, device=bucket[0].device)
        dtype = self.reduce_dtype or bucket[0].dtype
        if self.hook is None:  # the flags travel with the gradients
            flat = _flatten_dense_tensors([*grads, used]).to(dtype)
            work: Any = dist.all_reduce(flat, group=self.group, async_op=True)
        else:  # the hook sees the gradients alone; the flags go in one all-reduce later
            flat = _flatten_dense_tensors(grads).to(dtype)
            self.used.append(used.to(torch.float32))
            state, hook = self.hook
            work = HookWork(hook(state, GradBucket(b, flat, bucket,
                                                   b == len(self.buckets) - 1)), hook)
        self.works.append((work, flat, any(missing)))

    def _start_flags(self) -> Optional[Tuple[dist.Work, Tensor]]:
        """With a hook, after every bucket: which replicas used each parameter."""
        if self.hook is None:
            return None
        flags = (torch.cat(self.used) if self.used
                 else torch.zeros(0, dtype=torch.float32, device=self.device))
        return dist.all_reduce(flags, group=self.group, async_op=True), flags

    def finish(self, where: str) -> None:
        """Start the buckets still waiting (whose parameters did not all get a gradient in
        the last backward), in order, and the step's verdict; wait for all and write back
        the averages. ``PeerError`` if another replica failed in this step (or was lost),
        naming it; ``where`` names this rank in the message."""
        for b in range(len(self.works), len(self.buckets)):
            self._start(b)
        flags = self._start_flags()
        self.armed = False
        self.concluded = True
        try:
            news = verdict.Verdict(self.group, self.device)
            for work, _, _ in self.works:
                work.wait()
            if flags is not None:
                flags[0].wait()
            failures = news.failures()
        except RuntimeError as exc:
            raise PeerError(f"{where} lost a replica while averaging gradients over the "
                            f"data-parallel group: {type(exc).__name__}: {exc}") from exc
        if failures:
            raise PeerError("\n".join(text for _, text in failures) + (
                f"\n  {where} was at the end of the step, averaging gradients over the "
                f"data-parallel group, and heard it from replica "
                f"{', '.join(str(r) for r, _ in failures)}"))
        counts = flags[1].tolist() if flags is not None else []
        for bucket, (work, flat, missing) in zip(self.buckets, self.works):
            shapes = [local(p) for p in bucket]  # a tensor-parallel one: its local shard
            if flags is None:
                *synced, used = _unflatten_dense_tensors(flat, [*shapes, flat[:len(bucket)]])
                # Whether any replica had each gradient: only asked (a device-to-host
                # copy) when this replica lacked one; otherwise this replica had them all.
                users = used.tolist() if missing else [1] * len(bucket)
            else:  # the hook's result is the average already
                synced = _unflatten_dense_tensors(work.result(flat), shapes)
                users, counts = counts[:len(bucket)], counts[len(bucket):]
            for param, grad, count in zip(bucket, synced, users):
                if not count:  # no replica had a gradient: leave it None, as DDP does
                    continue
                grad = grad.to(param.dtype)  # back from reduce_dtype (a view if it is)
                if flags is None:
                    grad.div_(self.size)
                if param.grad is None:  # its own tensor, not a view of the bucket
                    param.grad = as_grad(param, grad.clone())
                else:
                    local(param.grad).copy_(grad)
        self.works, self.used = [], []

    def concede(self, text: str) -> None:
        """This replica failed in this step (``text`` says where): join the all-reduces
        the other replicas wait in, and tell them, without waiting (see
        ``seqpipe.distributed.verdict``). Nothing once the step's verdict has started."""
        if self.concluded:
            return
        self.concluded, self.armed = True, False
        started: List[Tuple[dist.Work, Tensor]] = []
        try:
            if self.counting:  # the replicas' last stages sum a count first: add nothing
                self.counting = False
                count = torch.zeros((), dtype=torch.float64, device=self.device)
                started.append((dist.all_reduce(count, group=self.group, async_op=True),
                                count))
            for b in range(len(self.works), len(self.buckets)):
                self._start(b)
            started += [(work, flat) for work, flat, _ in self.works]
            flags = self._start_flags()
            if flags is not None:
                started.append(flags)
            verdict.concede(text, started, self.group, self.device)
        except RuntimeError:  # the group itself failed: nobody to tell on it
            pass
        self.works, self.used = [], []


def broadcast_buffers(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Copy the buffers of ``module`` from the first rank of ``group`` to the others.

    What DistributedDataParallel does with ``broadcast_buffers=True``, through the same
    coalesced broadcast: BatchNorm running statistics and other buffers stay equal on
    every replica, so any replica's state dict (or checkpoint shard) is the model's.
    """
    buffers = [b for b in module.buffers() if not b.is_meta]
    if buffers:
        dist._broadcast_coalesced(group, buffers, DEFAULT_BUCKET_BYTES, 0)


def _weak_hook(reducer: "GradientReducer") -> Callable[[Tensor], None]:
    """``reducer._on_grad`` through a weak reference: a hook holding the reducer itself
    would make the parameters and the reducer (and its process group) a reference cycle,
    which outlives the pipe until a garbage collection, and can keep the default group
    past ``destroy_process_group()`` (see "Ending a script" in docs/distributed.md)."""
    ref = weakref.ref(reducer)

    def hook(param: Tensor) -> None:
        live = ref()
        if live is not None:
            live._on_grad(param)
    return step_aware(hook)  # does nothing until armed: may fire once per micro-batch


def check_data_parallel_group(stage: int, fingerprint: int, group: dist.ProcessGroup,
                              device: torch.device) -> None:
    """Reject a data-parallel group whose members are not replicas of the same stage."""
    everyone = gather_ints([stage, fingerprint], group, device)
    stages = sorted({t[0] for t in everyone})
    if len(stages) > 1:
        raise ValueError(
            f"the data_parallel_group mixes pipeline stages {stages}; it must hold the "
            f"replicas of one stage (same rank in each pipeline group) — e.g. build both "
            f"groups from a DeviceMesh with seqpipe.distributed.mesh_groups(mesh)")
    if len({t[1] for t in everyone}) > 1:
        raise ValueError("the replicas in data_parallel_group built different models or "
                         "pipeline settings; every replica must use the same model and arguments")

