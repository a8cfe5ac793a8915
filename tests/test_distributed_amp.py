"""Mixed precision with ``DistributedPipe``: ``PipeGradScaler`` and autocast, on gloo/CPU.

The scaler must make every stage's gradients come out scaled by one factor (the last
stage seeds its backward with the scale), keep the returned loss unscaled, and agree on
overflows across the pipeline (and data-parallel) group, so that an inf on a single stage
makes every rank skip its step and back off to the same scale. Models are float64 where
gradients are compared exactly: scaling by a power of two is then lossless.
"""
from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

from distributed_harness import Failures, run_workers
from seqpipe.distributed import DistributedPipe, PipeGradScaler, mesh_groups

BALANCE = [3, 4]
mse = nn.functional.mse_loss


class Probe(nn.Module):
    """Identity that records the dtype of what it receives (the head of stage 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: List[torch.dtype] = []

    def forward(self, x: Tensor) -> Tensor:
        self.dtypes.append(x.dtype)
        return x


def _model(dtype: torch.dtype = torch.float64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), Probe(),
                         nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)).to(dtype)


def _batch(step: int, dtype: torch.dtype = torch.float64) -> tuple:
    gen = torch.Generator().manual_seed(10 + step)
    return (torch.randn(16, 6, generator=gen, dtype=dtype),
            torch.randn(16, 3, generator=gen, dtype=dtype))


def _step(pipe: DistributedPipe, x: Tensor, y: Tensor, **kwargs: Any) -> Tensor:
    return pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, mse,
                           **kwargs)


def _optimizer(params: Any, fused: bool) -> torch.optim.Optimizer:
    if fused:  # takes GradScaler's other path: found_inf handed to the fused kernel
        return torch.optim.Adam(params, lr=0.01, fused=True)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _weights(module: nn.Module) -> Dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


# ------------------------------------------------------------- scaled gradients


def _scaled_gradients(rank: int, world: int) -> None:
    failures = Failures(rank)
    x, y = _batch(0)
    for schedule, checkpoint in [("1f1b", "except_last"), ("fill_drain", "always")]:
        what = f"{schedule}/{checkpoint}"
        ref = _model()
        ref_loss = mse(ref(x), y)
        ref_loss.backward()
        ref_opt = _optimizer(ref.parameters(), fused=False)
        pipe = DistributedPipe(_model(), chunks=4, balance=BALANCE, schedule=schedule,
                               checkpoint=checkpoint)
        opt = _optimizer(pipe.parameters(), fused=False)
        scaler = PipeGradScaler(pipe, init_scale=2.0**10)
        loss = _step(pipe, x, y, scaler=scaler)
        failures.close(loss, ref_loss.detach(), f"{what}: returned loss is unscaled")
        theirs = dict(ref.named_parameters())
        for name, param in pipe.named_parameters():
            failures.close(param.grad, theirs[name].grad * 2.0**10,  # type: ignore[operator]
                           f"{what}: scaled grad of {name}")
        scaler.unscale_(opt)
        failures.grads(pipe, ref, f"{what}: after unscale_")
        scaler.step(opt)
        scaler.update()
        ref_opt.step()
        failures.expect(scaler.get_scale() == 2.0**10, f"{what}: scale {scaler.get_scale()}")
        mine = _weights(pipe)
        for name, weight in mine.items():
            failures.close(weight, theirs[name].detach(), f"{what}: stepped {name}")
    failures.finish()


def test_scaled_gradients_unscale_to_the_plain_models() -> None:
    run_workers(_scaled_gradients, 2, timeout=120)


# ------------------------------------------------------------- overflow on one stage


def _overflow(rank: int, world: int) -> None:
    failures = Failures(rank)
    for where in (0, 1):
        for fused in (False, True):
            what = f"inf on stage {where}, {'fused Adam' if fused else 'SGD'}"
            ref = _model()
            ref_opt = _optimizer(ref.parameters(), fused)
            pipe = DistributedPipe(_model(), chunks=4, balance=BALANCE)
            opt = _optimizer(pipe.parameters(), fused)
            scaler = PipeGradScaler(pipe, init_scale=2.0**8, growth_interval=1)
            before = _weights(pipe)
            hook = None
            if rank == where:  # only this stage's first weight: nothing flows elsewhere
                first = next(pipe.parameters())
                hook = first.register_hook(lambda g: torch.full_like(g, float("inf")))
            _step(pipe, *_batch(0), scaler=scaler)
            if hook is not None:
                hook.remove()
            scaler.step(opt)
            scaler.update()
            for name, weight in _weights(pipe).items():
                failures.expect(torch.equal(weight, before[name]),
                                f"{what}: {name} changed by a skipped step")
            failures.expect(scaler.get_scale() == 2.0**7,
                            f"{what}: scale {scaler.get_scale()} after the overflow, not 128")
            opt.zero_grad()
            _step(pipe, *_batch(1), scaler=scaler)
            scaler.step(opt)
            scaler.update()
            failures.expect(scaler.get_scale() == 2.0**8,
                            f"{what}: scale {scaler.get_scale()} after a clean step, not 256")
            mse(ref(_batch(1)[0]), _batch(1)[1]).backward()
            ref_opt.step()  # the reference skipped nothing: it never saw the inf
            theirs = dict(ref.named_parameters())
            for name, weight in _weights(pipe).items():
                failures.close(weight, theirs[name].detach(), f"{what}: {name} after clean step")
    failures.finish()


def test_an_overflow_on_one_stage_skips_the_step_on_every_rank() -> None:
    run_workers(_overflow, 2, timeout=120)


# ------------------------------------------------------------- autocast


def _autocast(rank: int, world: int) -> None:
    failures = Failures(rank)
    x, y = _batch(0, torch.float32)
    ref = _model(torch.float32)
    ref_loss = mse(ref(x), y)
    ref_loss.backward()
    # the largest gradient is about 0.2; a plain model under autocast is off by < 5e-3 in
    # bf16 and < 1e-4 in fp16
    for dtype, atol in ((torch.bfloat16, 1e-2), (torch.float16, 5e-4)):
        failures.tol = dict(atol=atol, rtol=0.0)
        pipe = DistributedPipe(_model(torch.float32), chunks=4, balance=BALANCE)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        scaler = PipeGradScaler(pipe, enabled=dtype is torch.float16)
        with torch.autocast("cpu", dtype=dtype):
            loss = _step(pipe, x, y, scaler=scaler)
        scaler.unscale_(opt)
        if rank == 1:
            probe = pipe.partition[0]
            failures.expect(set(probe.dtypes) == {dtype},  # forwards and recomputations
                            f"{dtype}: stage 1 received {probe.dtypes}, not autocast's dtype")
        failures.expect(all(torch.isfinite(p.grad).all() for p in pipe.parameters()),
                        f"{dtype}: a gradient is not finite")
        failures.expect(all(p.grad.dtype is torch.float32 for p in pipe.parameters()),
                        f"{dtype}: gradients are not float32 like their parameters")
        failures.close(loss.float(), ref_loss.detach(), f"{dtype}: loss")
        failures.grads(pipe, ref, f"{dtype}: gradients close to float32's")
    failures.finish()


def test_bf16_and_fp16_autocast_give_gradients_close_to_fp32() -> None:
    run_workers(_autocast, 2, timeout=120)


# ------------------------------------------------------------- misuse


def _errors(rank: int, world: int) -> None:
    x, y = _batch(0)
    pipe = DistributedPipe(_model(), chunks=2, balance=BALANCE)
    with pytest.raises(TypeError, match="must be a seqpipe.distributed.PipeGradScaler"):
        _step(pipe, x, y, scaler=torch.amp.GradScaler("cpu"))
    other = DistributedPipe(_model(), chunks=2, balance=BALANCE, group=dist.new_group([0, 1]))
    with pytest.raises(ValueError, match="built for a pipe on other process groups"):
        _step(pipe, x, y, scaler=PipeGradScaler(other))
    with pytest.raises(ValueError, match=r"stages \[1\] built their PipeGradScaler with other"):
        PipeGradScaler(pipe, init_scale=2.0**8 if rank == 1 else 2.0**10)
    # the refused calls left the pipe usable
    scaler = PipeGradScaler(pipe)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    loss = _step(pipe, x, y, scaler=scaler)
    assert torch.allclose(loss, mse(_model()(x), y))
    scaler.step(opt)
    scaler.update(2.0**4 if rank == 1 else None)  # a scale changed on one rank only
    _step(pipe, x, y, scaler=scaler)
    with pytest.raises(RuntimeError, match=r"loss scale differs .* \(from 16.0 to 65536.0\)"):
        scaler.step(opt)


def test_a_wrong_or_diverging_scaler_is_refused_on_every_rank() -> None:
    run_workers(_errors, 2, timeout=120)


# ------------------------------------------------------------- pipeline x data parallel


def _two_by_two(rank: int, world: int) -> None:
    failures = Failures(rank)
    pp, dp = mesh_groups(init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp")))
    replica = dist.get_rank(dp)
    ref = _model()
    ref_opt = _optimizer(ref.parameters(), fused=False)
    pipe = DistributedPipe(_model(), chunks=2, balance=BALANCE, group=pp,
                           data_parallel_group=dp)
    opt = _optimizer(pipe.parameters(), fused=False)
    scaler = PipeGradScaler(pipe, init_scale=2.0**8, growth_interval=1)
    half = slice(replica * 8, replica * 8 + 8)
    x, y = _batch(0)
    before = _weights(pipe)
    _step(pipe, x[half], y[half], scaler=scaler)
    if rank == 3:  # stage 1 of replica 1, after the gradients were averaged: only here
        next(pipe.parameters()).grad[0, 0] = float("inf")  # type: ignore[index]
    scaler.step(opt)
    scaler.update()
    for name, weight in _weights(pipe).items():
        failures.expect(torch.equal(weight, before[name]), f"{name} changed by a skipped step")
    failures.expect(scaler.get_scale() == 2.0**7, f"scale {scaler.get_scale()}, not 128")
    opt.zero_grad()
    x, y = _batch(1)
    _step(pipe, x[half], y[half], scaler=scaler)
    scaler.unscale_(opt)
    theirs = dict(ref.named_parameters())
    mse(ref(x), y).backward()
    failures.grads(pipe, ref, "averaged, unscaled gradients of the clean step")
    scaler.step(opt)
    scaler.update()
    ref_opt.step()
    failures.expect(scaler.get_scale() == 2.0**8, f"scale {scaler.get_scale()}, not 256")
    for name, weight in _weights(pipe).items():
        failures.close(weight, theirs[name].detach(), f"{name} after the clean step")
    failures.finish()


def test_two_stages_by_two_replicas_agree_on_an_overflow_of_one_rank() -> None:
    run_workers(_two_by_two, 4, timeout=180)
