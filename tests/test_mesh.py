"""DistributedPipe over a whole mesh, on 4 gloo processes (one launch): stages wrapped with
the FSDP2-style ``replicate`` and HSDP train exactly as the single-process model; the
schedule ``auto`` picks, ``PipeGradScaler``'s ``found_inf`` and ``clip_grad_norm_`` agree over
every mesh dimension, ``count_fn``'s count over FSDP2's; what is not supported is
refused."""
from __future__ import annotations

import time
from functools import partial
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
from test_exit import pipes_on_whole_world_meshes
from test_fsdp import _full
from torch import Tensor, nn
from torch.distributed._composable import replicate as ddp_replicate
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from distributed_harness import Failures, run_workers
from seqpipe.distributed import DistributedPipe, PeerError, PipeGradScaler, mesh_groups

TOL = dict(rtol=1e-6, atol=1e-9)
PG_TIMEOUT = 30.0
"""The process group's timeout in this launch: a rank that raised sooner heard of the
failure, instead of waiting it out in an FSDP2 collective, whatever the machine's load."""
Wrap = Callable[[nn.Module], Any]


def _model(tied: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    layers: List[nn.Module] = [nn.Linear(6, 8)]
    for _ in range(6):
        layers += [nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.Tanh())]
    layers.append(nn.Linear(8, 6))
    model = nn.Sequential(*layers).double()
    if tied:  # a block of stage 0 and one of stage 1 share a weight
        model[6][1].weight = model[1][1].weight
    return model


def _batch(step: int) -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(10 + step)
    return (torch.randn(16, 6, generator=gen, dtype=torch.float64),
            torch.randn(16, 6, generator=gen, dtype=torch.float64))


def _wrap(pipe: DistributedPipe, wrap: Wrap) -> None:
    """torchtitan's recipe: each block, then the stage as the root."""
    for stage in pipe.stage_modules:
        for layer in stage:
            if any(True for _ in layer.parameters()):
                wrap(layer)
        wrap(stage)


class _Mesh:
    """pp=2 × dp=2, made anew for each case (a failed call leaves its groups unusable)."""

    def __init__(self) -> None:
        self.mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        self.pp, self.dp = mesh_groups(self.mesh)
        self.replica = self.mesh["dp"].get_local_rank()

    def hybrid(self, replicas: int) -> DeviceMesh:
        """The (replicate, shard) mesh of HSDP over the dp ranks."""
        mesh = init_device_mesh("cpu", (2, replicas, 2 // replicas),
                                mesh_dim_names=("pp", "rep", "shard"))
        return mesh["rep", "shard"]

    def half(self, tensor: Tensor) -> Tensor:
        return tensor[self.replica * 8:self.replica * 8 + 8]


def _step(pipe: DistributedPipe, mesh: _Mesh, step: int, **kwargs: Any) -> Tensor:
    x, y = _batch(step)
    return pipe.train_step(mesh.half(x) if pipe.is_first else None,
                           mesh.half(y) if pipe.is_last else None, nn.functional.mse_loss,
                           **kwargs)


def _reference_step(reference: nn.Sequential, step: int) -> None:
    x, y = _batch(step)
    reference.zero_grad()
    nn.functional.mse_loss(reference(x), y).backward()


def _grads(failures: Failures, pipe: DistributedPipe, reference: nn.Sequential,
           what: str) -> None:
    theirs = dict(reference.named_parameters(remove_duplicate=False))
    mine = dict(pipe.named_parameters())
    failures.expect(bool(mine), f"{what}: no parameters")
    for name, param in mine.items():
        failures.close(_full(param.grad), theirs[name].grad, f"{what}: grad of {name}")


def _exact(failures: Failures) -> None:
    """replicate and HSDP stages: three AdamW steps as the single-process model's."""
    cases = [("replicate", "1f1b"), ("replicate", "zb_h1"),
             ("replicate", "interleaved_1f1b"), ("hsdp 2x1", "zb_h1"),
             ("hsdp 1x2", "interleaved_1f1b")]
    for kind, schedule in cases:
        what = f"{kind}, {schedule}"
        mesh = _Mesh()
        wrap: Wrap = (partial(replicate, mesh=mesh.mesh["dp"]) if kind == "replicate"
                      else partial(fully_shard, mesh=mesh.hybrid(int(kind[5]))))
        reference = _model()
        balance = [2, 2, 2, 2] if schedule == "interleaved_1f1b" else [4, 4]
        # the failure checks (one case) change no value
        pipe = DistributedPipe(_model(), chunks=4, balance=balance, schedule=schedule,
                               group=mesh.pp, sharded_failure_checks=kind == "hsdp 1x2")
        _wrap(pipe, wrap)
        failures.expect(all(isinstance(p, DTensor) and p.device_mesh.ndim == (
            1 if kind == "replicate" else 2) for p in pipe.parameters()),
            f"{what}: the parameters are not DTensors on the {kind} mesh")
        opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
        for step in range(3):
            opt.zero_grad()
            _step(pipe, mesh, step)
            _reference_step(reference, step)
            _grads(failures, pipe, reference, f"{what}: step {step}")
            opt.step()
            ref_opt.step()
        theirs = dict(reference.named_parameters())
        for name, param in pipe.named_parameters():
            failures.close(_full(param.detach()), theirs[name].detach(),
                           f"{what}: {name} after 3 AdamW steps")


def _sharded_pipe(mesh: _Mesh, schedule: str = "1f1b") -> DistributedPipe:
    pipe = DistributedPipe(_model(), chunks=4, balance=[4, 4], schedule=schedule,
                           group=mesh.pp)
    _wrap(pipe, partial(fully_shard, mesh=mesh.mesh["dp"]))
    return pipe


def _auto(failures: Failures) -> None:
    """schedule='auto' on sharded stages: every rank of the mesh measures the same costs
    (so picks the same schedule), and the steps stay exact."""
    mesh = _Mesh()
    pipe = _sharded_pipe(mesh, "auto")
    reference = _model()
    for step in range(2):
        pipe.zero_grad()
        _step(pipe, mesh, step)
        _reference_step(reference, step)
        _grads(failures, pipe, reference, f"auto: step {step}")
    assert pipe._auto is not None and pipe._auto.costs is not None
    found = pipe._auto.costs
    costs = torch.tensor([*found.forward, *found.input, *found.weight], dtype=torch.float64)
    everyone = [torch.zeros_like(costs) for _ in range(4)]
    dist.all_gather(everyone, costs)
    failures.expect(all(torch.equal(c, everyone[0]) for c in everyone),
                    f"auto: the ranks measured different costs: {everyone}")


def _scaled(failures: Failures) -> None:
    """PipeGradScaler on replicated stages: unscaled gradients are the model's; an inf in
    one rank's gradient skips the step on every rank, which back off to one scale. (Under
    FSDP2, DTensor's own found_inf handler reduces over the shards; not over the replicas
    of a Replicate placement, so before the mesh reduction the other pipeline stepped.)"""
    mesh = _Mesh()
    pipe = DistributedPipe(_model(), chunks=4, balance=[4, 4], group=mesh.pp)
    _wrap(pipe, partial(replicate, mesh=mesh.mesh["dp"]))
    scaler = PipeGradScaler(pipe, init_scale=2.0**8)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    reference = _model()
    _step(pipe, mesh, 0, scaler=scaler)
    scaler.unscale_(opt)
    _reference_step(reference, 0)
    _grads(failures, pipe, reference, "scaler: unscaled")
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    _step(pipe, mesh, 1, scaler=scaler)
    if dist.get_rank() == 0:  # one element on one rank only
        next(pipe.parameters()).grad.to_local()[0, 0] = float("inf")
    before = [p.detach().to_local().clone() for p in pipe.parameters()]
    scaler.step(opt)
    scaler.update()
    after = [p.detach().to_local() for p in pipe.parameters()]
    failures.expect(all(torch.equal(a, b) for a, b in zip(after, before)),
                    "scaler: a rank stepped although another found an inf")
    scale = scaler.get_scale()
    failures.expect(scale == 2.0**7, f"scaler: scale {scale} after the inf, not 2**7")


def _clipped(failures: Failures) -> None:
    """clip_grad_norm_ over the mesh: the norm and the clipped gradients are the
    single-process model's, for sharded, HSDP, plain data-parallel and tied stages."""
    cases: List[Tuple[str, float]] = [("fsdp", 2.0), ("hsdp 2x1", 2.0), ("fsdp", float("inf")),
                                      ("data parallel, tied", 2.0)]
    for kind, norm_type in cases:
        what = f"clip {kind}, norm {norm_type}"
        mesh = _Mesh()
        tied = "tied" in kind
        kwargs: Dict[str, Any] = {"data_parallel_group": mesh.dp} if "data" in kind else {}
        pipe = DistributedPipe(_model(tied), chunks=4, balance=[4, 4], group=mesh.pp, **kwargs)
        if kind == "fsdp":
            _wrap(pipe, partial(fully_shard, mesh=mesh.mesh["dp"]))
        elif kind.startswith("hsdp"):
            _wrap(pipe, partial(fully_shard, mesh=mesh.hybrid(2)))
        reference = _model(tied)
        _step(pipe, mesh, 0)
        _reference_step(reference, 0)
        norm = pipe.clip_grad_norm_(0.05, norm_type)
        expected = nn.utils.clip_grad_norm_(reference.parameters(), 0.05, norm_type)
        failures.close(norm, expected.to(norm.dtype), f"{what}: the total norm")
        _grads(failures, pipe, reference, f"{what}: clipped")


def _masked_sum(output: Tensor, target: Tuple[Tensor, Tensor]) -> Tensor:
    y, mask = target
    return ((output - y) ** 2 * mask).sum()


def _counted(failures: Failures) -> None:
    """count_fn on FSDP2 stages: the count is summed over the FSDP2 mesh, so a token-mean
    loss whose replicas count different numbers of tokens (4 of 48 here, 44 of 48 there)
    gives the single-process model's global token-mean gradient (failure checks on: the
    count's sum goes behind a verdict)."""
    mesh = _Mesh()
    pipe = DistributedPipe(_model(), chunks=4, balance=[4, 4], group=mesh.pp,
                           sharded_failure_checks=True)
    _wrap(pipe, partial(fully_shard, mesh=mesh.mesh["dp"]))
    x, y = _batch(0)
    mask = torch.zeros(16, 6, dtype=torch.float64)
    mask[:8].view(-1)[:4] = 1  # replica 0 counts 4 tokens
    mask[8:].view(-1)[:44] = 1  # replica 1 counts 44
    pipe.train_step(mesh.half(x) if pipe.is_first else None,
                    (mesh.half(y), mesh.half(mask)) if pipe.is_last else None, _masked_sum,
                    count_fn=lambda target: target[1].sum())
    reference = _model()
    (_masked_sum(reference(x), (y, mask)) / mask.sum()).backward()
    _grads(failures, pipe, reference, "count_fn over fsdp=2")


def _refused(failures: Failures) -> None:
    """The DDP-based composable replicate raises, naming the replicate to use."""
    mesh = _Mesh()
    pipe = DistributedPipe(_model(), chunks=2, balance=[4, 4], group=mesh.pp)
    for stage in pipe.stage_modules:
        ddp_replicate(stage, device_mesh=mesh.mesh["dp"])
    try:
        _step(pipe, mesh, 0)
    except NotImplementedError as exc:
        failures.expect("replicate_with_fsdp" in str(exc), f"DDP replicate: {exc}")
    else:
        failures.expect(False, "DDP replicate: trained instead of raising")


class _Boom(nn.Module):
    """Raises in the forward (or the backward) of its ``at``-th call; never if 0."""

    def __init__(self, at: int, in_backward: bool) -> None:
        super().__init__()
        self.at, self.in_backward, self.calls = at, in_backward, 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls != self.at:
            return x
        if not self.in_backward:
            raise ZeroDivisionError("boom in a forward")
        x = x.clone()
        x.register_hook(_raise)
        return x


def _raise(grad: Tensor) -> None:
    raise ZeroDivisionError("boom in a backward")


def _failed(failures: Failures) -> None:
    """Stage 0 of replica 1 (rank 1) fails in a forward (its FSDP2 peer, rank 0, waits
    for its all-gather next) or in its last backward (rank 0 waits for the reduce-scatter):
    every rank raises within seconds, not at the process group's timeout; rank 0 names
    the failure and where it heard of it (with ``sharded_failure_checks=True``)."""
    for name, at, in_backward, heard in (("forward", 2, False, "FSDP2's all-gather"),
                                         ("last backward", 4, True,
                                          "FSDP2's gradient reduction")):
        mesh = _Mesh()
        model = _model()
        model.insert(2, _Boom(at if dist.get_rank() == 1 else 0, in_backward))
        pipe = DistributedPipe(model, chunks=4, balance=[5, 4], group=mesh.pp,
                               checkpoint="never", sharded_failure_checks=True)
        _wrap(pipe, partial(fully_shard, mesh=mesh.mesh["dp"]))
        dist.barrier()
        started = time.monotonic()
        try:
            _step(pipe, mesh, 0)
        except Exception as exc:  # noqa: BLE001 - which one is checked below
            error: BaseException = exc
        else:
            failures.expect(False, f"{name}: rank {dist.get_rank()} did not raise")
            continue
        elapsed = [0.0] * 4
        dist.all_gather_object(elapsed, time.monotonic() - started)
        failures.expect(max(elapsed) < PG_TIMEOUT, f"{name}: raised after {elapsed} s, at "
                        f"the group's timeout")
        action = "forward of micro-batch 1" if name == "forward" else \
            "backward of micro-batch 3"
        if dist.get_rank() == 1:
            failures.expect(isinstance(error, ZeroDivisionError), f"{name}: {error!r}")
            continue
        text = str(error)
        failures.expect(isinstance(error, PeerError) and
                        f"stage 0 failed in the {action}" in text, f"{name}: {error!r}")
        if mesh.replica == 0:  # heard over FSDP2's mesh, from rank 1
            failures.expect("[rank 1]" in text, f"{name}: {text}")
        if dist.get_rank() == 0:
            failures.expect(f"before {heard} over ranks [0, 1], and heard it from rank(s) 1"
                            in text, f"{name}: {text}")


def _worker(rank: int, world: int) -> None:
    torch.set_default_dtype(torch.float64)
    failures = Failures(rank, TOL)
    _exact(failures)
    _auto(failures)
    _scaled(failures)
    _clipped(failures)
    _counted(failures)
    _refused(failures)
    _failed(failures)
    failures.finish()
    # seqpipe imported before the process group (the workers fork from a server that
    # imported it); tests/test_exit.py has the other order
    pipes_on_whole_world_meshes(world)


def test_mesh() -> None:
    """pp=2 × dp=2 on 4 processes: FSDP2-style replicate (1f1b, zb_h1, interleaved_1f1b)
    and HSDP (2 replicas × 1 shard, 1 × 2) train three AdamW steps as the single-process
    model; under schedule='auto' the sharded ranks measure the same costs; an inf in one
    replica skips PipeGradScaler's step everywhere; clip_grad_norm_ gives the model's norm
    and gradients (FSDP2, HSDP, plain data parallel with tied weights, 2- and inf-norm);
    count_fn's count is summed over the FSDP2 mesh (the global token mean's gradient);
    the DDP-based replicate is refused; a rank failing in a forward or in its last
    backward makes every rank raise within seconds, its FSDP2 peer naming the failure;
    pipes on mesh dimensions that span every rank leave the default group free at exit."""
    run_workers(_worker, 4, timeout=300, pg_timeout=PG_TIMEOUT)
