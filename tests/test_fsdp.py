"""DistributedPipe stages sharded with FSDP2 (``fully_shard``): pp=2 × fsdp=2 on 4 gloo
processes, trained exactly as the single-process model; what is not supported is refused."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.tensor import DTensor, Replicate

from distributed_harness import Failures, run_workers
from seqpipe.distributed import DistributedPipe, mesh_groups
from seqpipe.distributed.transport import PeerError

TOL = dict(rtol=1e-6, atol=1e-9)


def _block() -> nn.Sequential:
    return nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.Tanh())


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), *(_block() for _ in range(6)),
                         nn.Linear(16, 3)).double()


def _batch(step: int) -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(10 + step)
    return (torch.randn(16, 6, generator=gen, dtype=torch.float64),
            torch.randn(16, 3, generator=gen, dtype=torch.float64))


def _shard(pipe: DistributedPipe, mesh: DeviceMesh, reshard: bool) -> None:
    """The torchtitan recipe: each block, then the stage as the root."""
    for stage in pipe.stage_modules:
        for layer in stage:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(stage, mesh=mesh, reshard_after_forward=reshard)


class _CountReductions:
    """Counts FSDP2's gradient reductions (one reduce-scatter of a parameter group each)."""

    def __init__(self) -> None:
        self.count = 0
        self.reduce = _fsdp_param_group.foreach_reduce
        _fsdp_param_group.foreach_reduce = self  # type: ignore[assignment]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.count += 1
        return self.reduce(*args, **kwargs)


def _full(tensor: Any) -> Any:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _step_both(failures: Failures, mine: Dict[str, Tensor], theirs: Dict[str, Tensor],
               optimizers: Tuple[Any, Any], what: str) -> None:
    """The pipe's (possibly sharded) gradients equal the plain model's; then both
    optimizers step, and the parameters are equal again."""
    for name, param in mine.items():
        failures.close(_full(param.grad), theirs[name].grad, f"{what}: grad of {name}")
    for optimizer in optimizers:
        optimizer.step()
    for name, param in mine.items():
        failures.close(_full(param.detach()), theirs[name].detach(),
                       f"{what}: {name} after AdamW")


def _worker(rank: int, world: int) -> None:
    torch.set_default_dtype(torch.float64)
    failures = Failures(rank, TOL)
    _exact(rank, failures)
    _refused(rank, failures)
    failures.finish()


def _exact(rank: int, failures: Failures) -> None:
    """Sharded stages train as the single-process model does."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, _ = mesh_groups(mesh)
    replica = mesh["dp"].get_local_rank()
    reductions = _CountReductions()
    cases = [("1f1b", True, "except_last"), ("1f1b", False, "never"),
             ("zb_h1", True, "except_last"), ("zb_h1", False, "always"),
             ("interleaved_1f1b", True, "except_last"), ("interleaved_1f1b", False, "never")]
    for schedule, reshard, checkpoint in cases:
        what = f"{schedule}, reshard_after_forward={reshard}, checkpoint={checkpoint}"
        reference = _model()
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
        balance = [2, 2, 2, 2] if schedule == "interleaved_1f1b" else [4, 4]
        pipe = DistributedPipe(_model(), chunks=4, balance=balance, schedule=schedule,
                               checkpoint=checkpoint, group=pp)
        _shard(pipe, mesh["dp"], reshard)
        opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
        theirs = dict(reference.named_parameters())
        for step in range(3):
            x, y = _batch(step)
            half = slice(replica * 8, replica * 8 + 8)
            opt.zero_grad()
            reductions.count = 0
            loss = pipe.train_step(x[half] if pipe.is_first else None,
                                   y[half] if pipe.is_last else None, nn.functional.mse_loss)
            groups = sum(1 for stage in pipe.stage_modules for layer in stage
                         if any(True for _ in layer.parameters()))
            failures.expect(reductions.count == groups,
                            f"{what}: step {step}: {reductions.count} reductions for "
                            f"{groups} parameter groups, not one each per step")
            ref_opt.zero_grad()
            ref_loss = nn.functional.mse_loss(reference(x), y)
            ref_loss.backward()
            losses = [torch.zeros_like(loss) for _ in range(2)]
            dist.all_gather(losses, loss, group=mesh["dp"].get_group())
            failures.close(sum(losses) / 2, ref_loss.detach(), f"{what}: loss of step {step}")
            mine = dict(pipe.named_parameters())
            failures.expect(bool(mine) and all(isinstance(p, DTensor) for p in mine.values()),
                            f"{what}: the stage's parameters are not all sharded")
            # memory: this rank holds half of each parameter and gradient (dim 0 of 16 or
            # 3 rows over 2 ranks: 8 each, or 2 and 1)
            held = sum(p.to_local().numel() + p.grad.to_local().numel()
                       for p in mine.values())
            whole = sum(2 * theirs[name].numel() for name in mine)
            failures.expect(held <= whole // 2 + 2 * 16,
                            f"{what}: this rank holds {held} of {whole} values, not half")
            _step_both(failures, mine, theirs, (opt, ref_opt), f"{what}: step {step}")


class _ToDTensor(nn.Module):
    """Makes its input a (replicated) DTensor."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh

    def forward(self, x: Tensor) -> Tensor:
        return DTensor.from_local(x, self.mesh, [Replicate()])


def _refused(rank: int, failures: Failures) -> None:
    """What is not supported yet raises, naming it, on the rank that has it."""
    for case in ("dtensor activation",):
        # fresh groups per case: a failed call leaves its pipeline's groups unusable
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        pp, _ = mesh_groups(mesh)
        pipe = DistributedPipe(_model(), chunks=2, balance=[4, 4], group=pp)
        pipe.stage_modules[0].append(_ToDTensor(mesh["dp"]))  # stage 0 sends a DTensor,
        expected: Any = ((PeerError, "stage 1 failed in the forward") if pipe.is_first
                         else (ValueError, "DistributedPipe(..., mesh=mesh)"))  # no "dp" mesh
        x, y = _batch(0)
        try:
            pipe.train_step(x[:8] if pipe.is_first else None, y[:8] if pipe.is_last else None,
                            nn.functional.mse_loss)
        except expected[0] as exc:
            failures.expect(expected[1] in str(exc), f"{case}: {exc}")
        else:
            failures.expect(False, f"{case}: trained instead of raising {expected}")


def test_fsdp_stages() -> None:
    """pp=2 × fsdp=2 on 4 processes. 1f1b, zb_h1 and interleaved_1f1b, either
    reshard_after_forward, with and without checkpointing, three AdamW steps: the gradients
    of every step and the parameters after it equal the single-process model's, reduced
    once per parameter group and step (not per micro-batch). And what
    is not supported raises, naming it, instead of training silently wrong: a DTensor
    activation that the receiving stage has no mesh to rebuild on (its ValueError names
    ``mesh=``; its peer hears that stage 1 failed)."""
    run_workers(_worker, 4, timeout=300)
