"""The data-parallel reducer's DDP knobs (pp=2 × dp=2 on 4 gloo processes, one launch):
``bucket_cap_mb``, ``reduce_dtype`` and ``register_comm_hook``, each against the plain
model."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh

from distributed_harness import Failures, run_workers
from seqpipe.distributed import DistributedPipe, mesh_groups

TOL = dict(rtol=1e-5, atol=1e-7)
BF16 = dict(rtol=2e-2, atol=2e-3)  # one bf16 rounding of each summand and of the sum
TINY = 64 / 2**20  # bucket_cap_mb of 64 bytes: a bias (16 floats) closes a bucket


class _Partly(nn.Module):
    """A Linear; a parameter no forward uses (its .grad stays None, as in DDP); and
    ``scale``, applied to the first ``first`` rows only: the whole model gives it rows 0-7
    of the batch, the first replica (rows 0-7) all of its own, the second none (so its
    ``scale.grad`` is None there: the average is written into a None ``.grad``)."""

    def __init__(self, first: int) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.unused = nn.Parameter(torch.ones(4))
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))
        self.first = first

    def forward(self, x: Tensor) -> Tensor:
        x = self.lin(x)
        if self.first == 0:
            return x
        return torch.cat([x[:self.first] * self.scale, x[self.first:]])


def _model(first: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), _Partly(first),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(step: int) -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(20 + step)
    return torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)


class _Collectives:
    """Records the floating-point all-reduces on ``group`` (the gradient buckets: the
    step's verdict is an int64 one) by dtype."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.dtypes: List[torch.dtype] = []
        self.all_reduce = dist.all_reduce
        dist.all_reduce = self  # type: ignore[assignment]

    def __call__(self, tensor: Tensor, *args: Any, group: Any = None, **kwargs: Any) -> Any:
        if group is self.group and tensor.is_floating_point():
            self.dtypes.append(tensor.dtype)
        return self.all_reduce(tensor, *args, group=group, **kwargs)


class _Hook:
    """Wraps a DDP communication hook; records (step, index, is_last, parameters)."""

    def __init__(self, hook: Any) -> None:
        self.hook, self.step = hook, 0
        self.calls: List[Tuple[int, int, bool, int]] = []

    def __call__(self, state: Any, bucket: Any) -> Any:
        self.calls.append((self.step, bucket.index(), bucket.is_last(),
                           len(bucket.parameters())))
        return self.hook(state, bucket)


def _case(failures: Failures, groups: Tuple[Any, Any], replica: int, what: str,
          collectives: _Collectives, buckets: List[int], tol: Dict[str, float],
          hook: Optional[_Hook] = None, reduced_in: torch.dtype = torch.float32,
          **knobs: Any) -> None:
    """Two SGD steps of pp=2 × dp=2 with ``knobs``: gradients (and which stay None) equal
    the plain model's, each step reduces ``buckets[stage]`` buckets in ``reduced_in``."""
    pp, dp = groups
    reference = _model()
    pipe = DistributedPipe(_model(10**6 if replica == 0 else 0), chunks=2, balance=[3, 4],
                           group=pp, data_parallel_group=dp, **knobs)
    if hook is not None:
        pipe.register_comm_hook(dp, hook)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    theirs = dict(reference.named_parameters())
    expected = buckets[pipe.stage_index]
    for step in range(2):
        x, y = _batch(step)
        half = slice(replica * 8, replica * 8 + 8)
        opt.zero_grad()
        collectives.dtypes.clear()
        if hook is not None:
            hook.step = step
        pipe.train_step(x[half] if pipe.is_first else None, y[half] if pipe.is_last else None,
                        nn.functional.mse_loss)
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        if hook is None:
            failures.expect(collectives.dtypes == [reduced_in] * expected,
                            f"{what}: step {step}: all-reduces {collectives.dtypes}, not "
                            f"{expected} in {reduced_in}")
        else:  # the hook's all-reduces (one per bucket) and the used flags' one
            calls = [c for c in hook.calls if c[0] == step]
            failures.expect([c[1:3] for c in calls] ==
                            [(b, b == expected - 1) for b in range(expected)],
                            f"{what}: step {step}: hook calls {calls}, not one per bucket "
                            f"of {expected}")
            failures.expect(len(collectives.dtypes) == expected + 1,
                            f"{what}: step {step}: all-reduces {collectives.dtypes}")
        for name, param in pipe.named_parameters():
            if theirs[name].grad is None or param.grad is None:
                failures.expect(param.grad is None and theirs[name].grad is None,
                                f"{what}: step {step}: grad of {name} is None on one side")
                continue
            failures.expect(param.grad.dtype == param.dtype,
                            f"{what}: grad of {name} is {param.grad.dtype}")
            try:
                torch.testing.assert_close(param.grad, theirs[name].grad, **tol)
            except AssertionError as exc:
                failures.expect(False, f"{what}: step {step}: grad of {name}: "
                                       f"{str(exc).splitlines()[-1]}")
        opt.step()
        ref_opt.step()


def _worker(rank: int, world: int) -> None:
    failures = Failures(rank, TOL)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    groups = mesh_groups(mesh)
    replica = mesh["dp"].get_local_rank()
    collectives = _Collectives(groups[1])
    # 64-byte buckets: stage 0: a bias or weight each; stage 1: the last Linear, then one
    # each, the unused parameter alone last
    _case(failures, groups, replica, "default buckets", collectives, [1, 1], TOL)
    _case(failures, groups, replica, "bucket_cap_mb=64 B", collectives, [4, 7], TOL,
          bucket_cap_mb=TINY)
    _case(failures, groups, replica, "reduce_dtype=bf16", collectives, [1, 1], BF16,
          reduced_in=torch.bfloat16, reduce_dtype=torch.bfloat16)
    _case(failures, groups, replica, "DDP's allreduce_hook", collectives, [4, 7], TOL,
          hook=_Hook(default_hooks.allreduce_hook), bucket_cap_mb=TINY)
    _case(failures, groups, replica, "DDP's bf16_compress_hook", collectives, [1, 1], BF16,
          hook=_Hook(default_hooks.bf16_compress_hook))
    pipe = DistributedPipe(_model(), chunks=2, balance=[3, 4], group=groups[0],
                           data_parallel_group=groups[1])
    pipe.register_comm_hook(groups[1], default_hooks.allreduce_hook)
    for call, error, text in (
            (lambda: pipe.register_comm_hook(None, default_hooks.allreduce_hook),
             RuntimeError, "can be registered only once"),
            (lambda: DistributedPipe(_model(), group=groups[0], bucket_cap_mb=1),
             ValueError, "pass data_parallel_group too"),
            (lambda: DistributedPipe(_model(), group=groups[0], data_parallel_group=groups[1],
                                     reduce_dtype=torch.int64),
             ValueError, "floating-point torch.dtype")):
        try:
            call()
        except error as exc:
            failures.expect(text in str(exc), f"{error.__name__}: {exc}")
        else:
            failures.expect(False, f"no {error.__name__} ({text})")
    dist.all_reduce = collectives.all_reduce
    failures.finish()


def test_data_parallel_knobs() -> None:
    """pp=2 × dp=2, two SGD steps per case against the plain model, counting the buckets'
    all-reduces: the default (one bucket per stage); bucket_cap_mb=64 bytes (4 and 7
    buckets); reduce_dtype=bf16 (every bucket reduced in bf16, the gradients back in fp32,
    equal to a bf16 tolerance); DDP's allreduce_hook registered with register_comm_hook
    (called once per bucket per step, in order, is_last on the last; gradients exact, a
    parameter no replica uses keeps grad None, one that a replica does not use gets the
    average) and bf16_compress_hook; and the errors: a
    second hook, the knobs without data_parallel_group, a reduce_dtype that is not
    floating-point."""
    run_workers(_worker, 4, timeout=200)
