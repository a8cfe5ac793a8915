"""DistributedPipe stages split with tensor parallelism (``parallelize_module``, DTensor
parameters), on 4 gloo processes: pp=2 × tp=2 under three schedules; pp × dp × tp through
seqpipe's own reducer and FSDP2 over TP (pp=1, 4 processes); each three AdamW steps equal to
the single-process model; pp=2 × tp=2 under ``auto`` (one pick everywhere) with
``clip_grad_norm_``, and a ``PipeGradScaler`` skipping a step for one tp rank's inf; the
sequence sharded across the stage boundary (a DTensor activation and gradient:
``sequence_parallel_cases``)."""
from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed as dist
from sequence_parallel_cases import sequence_parallel_cases
from test_fsdp import _batch, _full, _step_both  # the FSDP2 stages' data and checks
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from distributed_harness import Failures, run_workers
from seqpipe.distributed import DistributedPipe, PipeGradScaler, mesh_groups

TOL = dict(rtol=1e-6, atol=1e-9)


class _MLP(nn.Module):
    """A residual MLP block, the part torchtitan splits Colwise then Rowwise."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), *(_MLP() for _ in range(4)),
                         nn.Linear(16, 3)).double()


def _split(pipe: DistributedPipe, tp: DeviceMesh) -> None:
    """The torchtitan recipe's TP step: each block's MLP Colwise then Rowwise."""
    for stage in pipe.stage_modules:
        for layer in stage:
            if isinstance(layer, _MLP):
                parallelize_module(layer, tp, {"fc1": ColwiseParallel(),
                                               "fc2": RowwiseParallel()})


def _train(pipe: DistributedPipe, replica: int, replicas: int, failures: Failures,
           what: str, hooked: bool = False, clip: bool = False) -> None:
    """Three AdamW steps on ``pipe`` (this replica's share of each batch) and on the
    single-process model (the whole batch): gradients and parameters equal. ``hooked``:
    a post-accumulate hook on every parameter fires once per step (the micro-batches
    accumulate into aliases of the DTensor parameters first). ``clip``: the gradients
    clipped (``pipe.clip_grad_norm_``), the norm the model's ``clip_grad_norm_``."""
    reference = _model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    theirs: Dict[str, Tensor] = dict(reference.named_parameters())
    mine = dict(pipe.named_parameters())
    failures.expect(any(isinstance(p, DTensor) for p in mine.values()),
                    f"{what}: no parameter is split")
    fired: Dict[str, int] = {}
    if hooked:
        for name, param in mine.items():
            param.register_post_accumulate_grad_hook(
                lambda _, name=name, fired=fired: fired.update({name: fired[name] + 1}))
    share = 16 // replicas
    part = slice(replica * share, (replica + 1) * share)
    for step in range(3):
        x, y = _batch(step)
        opt.zero_grad()
        fired.update(dict.fromkeys(mine, 0))
        pipe.train_step(x[part] if pipe.is_first else None, y[part] if pipe.is_last else None,
                        nn.functional.mse_loss)
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        if clip:  # a norm below the gradients': every rank scales by the same factor
            norm = pipe.clip_grad_norm_(0.05)
            expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
            failures.close(norm, expected, f"{what}: step {step}: the clipped norm")
        failures.expect(not hooked or set(fired.values()) == {1},
                        f"{what}: step {step}: the hooks fired {fired}, not once each")
        _step_both(failures, mine, theirs, (opt, ref_opt), f"{what}: step {step}")


def _worker(rank: int, world: int) -> None:
    torch.set_default_dtype(torch.float64)
    failures = Failures(rank, TOL)
    # pp=2 × tp=2: each tp rank runs its own pipeline; the blocks are split over tp
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, _ = mesh_groups(mesh, data_dim="tp")
    for schedule, checkpoint in (("1f1b", "except_last"), ("zb_h1", "always"),
                                 ("interleaved_1f1b", "never")):
        balance = [2, 1, 1, 2] if schedule == "interleaved_1f1b" else [3, 3]
        pipe = DistributedPipe(_model(), chunks=4, balance=balance, schedule=schedule,
                               checkpoint=checkpoint, group=pp)
        _split(pipe, mesh["tp"])
        _train(pipe, 0, 1, failures, f"pp=2 x tp=2, {schedule}, checkpoint={checkpoint}",
               hooked=schedule == "zb_h1")
    # auto: the costs are summed over tp too, so every rank picks the same schedule
    pipe = DistributedPipe(_model(), chunks=4, balance=[3, 3], schedule="auto", group=pp)
    _split(pipe, mesh["tp"])
    _train(pipe, 0, 1, failures, "pp=2 x tp=2, auto, clipped", clip=True)
    picks: List[Any] = [None] * 4
    dist.all_gather_object(picks, str(pipe.auto_choice))
    failures.expect(len(set(picks)) == 1 and picks[0] != "None",
                    f"auto: the ranks picked {picks}")
    _scaled(mesh, pp, failures)
    # pp=1 × dp=2 × tp=2: the data-parallel dimension through seqpipe's own reducer (it
    # averages the local shards) or FSDP2 over the tensor-parallel parameters
    cube = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    pp, dp = mesh_groups(cube)
    replica = cube["dp"].get_local_rank()
    pipe = DistributedPipe(_model(), chunks=4, schedule="zb_h1", group=pp,
                           data_parallel_group=dp)
    _split(pipe, cube["tp"])
    _train(pipe, replica, 2, failures, "dp=2 x tp=2, own reducer")
    pipe = DistributedPipe(_model(), chunks=4, schedule="1f1b", group=pp)
    _split(pipe, cube["tp"])
    for stage in pipe.stage_modules:
        for layer in stage:
            fully_shard(layer, mesh=cube["dp"])
        fully_shard(stage, mesh=cube["dp"])
    _train(pipe, replica, 2, failures, "fsdp=2 x tp=2")
    sequence_parallel_cases(failures)
    failures.finish()


def _scaled(mesh: DeviceMesh, pp: Any, failures: Failures) -> None:
    """PipeGradScaler with tensor-parallel stages: an inf in one tp rank's shard skips the
    step on every rank, which all back off; the next step trains as the model's."""
    pipe = DistributedPipe(_model(), chunks=2, balance=[3, 3], group=pp)
    _split(pipe, mesh["tp"])
    scaler = PipeGradScaler(pipe, init_scale=2.0**8)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        x, y = _batch(step)
        opt.zero_grad()
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                        nn.functional.mse_loss, scaler=scaler)
        if step == 0 and dist.get_rank() == 3:  # stage 1, tp rank 1 only
            split = next(p for p in pipe.parameters() if isinstance(p, DTensor))
            split.grad.to_local().view(-1)[0] = float("inf")
        before = [_full(p.detach()) for p in pipe.parameters()]
        scaler.step(opt)
        scaler.update()
        expected = 2.0**7
        if step == 0:
            after = [_full(p.detach()) for p in pipe.parameters()]
            failures.expect(all(torch.equal(a, b) for a, b in zip(after, before)),
                            "scaler: a rank stepped although a tp rank found an inf")
        else:
            ref_opt.zero_grad()
            nn.functional.mse_loss(reference(x), y).backward()
            ref_opt.step()
            theirs = dict(reference.named_parameters())
            for name, param in pipe.named_parameters():
                failures.close(_full(param.detach()), theirs[name].detach(),
                               f"scaler: {name} after the step that was taken")
        failures.expect(scaler.get_scale() == expected,
                        f"scaler: step {step}: scale {scaler.get_scale()}, not {expected}")


def test_tensor_parallel_stages() -> None:
    """pp=2 × tp=2 on 4 processes under 1f1b, zb_h1 (split backward) and interleaved_1f1b
    (two stages per rank), with each checkpointing mode: the gradients of three AdamW steps
    and the parameters after each equal the single-process model's (under zb_h1 with a
    hook on every parameter, which fires once per step); under ``schedule='auto'`` every
    rank picks the same schedule and trains exactly, ``clip_grad_norm_`` giving the model's
    norm; an inf in one tp rank's gradient skips a ``PipeGradScaler``'s step on every rank
    (both used to be refused). And dp=2 × tp=2 (a one-stage pipe):
    seqpipe's data-parallel reducer averages the DTensor parameters' local shards (it used
    to leave them out, unreduced), and FSDP2 over the tensor-parallel blocks trains exactly.
    Sequence parallelism across the boundary (a DTensor activation sharded on the
    sequence, its gradient back as one; ``sequence_parallel_cases``) under 1f1b and zb_h1:
    losses, gradients and parameters after two AdamW steps equal the model's (it used to
    be refused); a receiver without a mesh to rebuild it on refuses, naming ``mesh=``."""
    run_workers(_worker, 4, timeout=300)
