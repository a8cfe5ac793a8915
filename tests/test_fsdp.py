"""DistributedPipe stages sharded with FSDP2 (``fully_shard``): pp=2 × fsdp=2 on 4 gloo
processes, trained exactly as the single-process model, with FSDP2's options (either
``reshard_after_forward``, mixed-precision policies with and without a ``PipeGradScaler``,
CPU offload) and seqpipe's (checkpointing, ``checkpoint_every``); what is not supported is
refused."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.tensor import DTensor, Replicate

from distributed_harness import Failures, run_workers
from seqpipe.distributed import DistributedPipe, PipeGradScaler, mesh_groups
from seqpipe.distributed.transport import PeerError, Transport
from seqpipe.distributed.wire import Kind

TOL = dict(rtol=1e-6, atol=1e-9)


def _block() -> nn.Sequential:
    return nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.Tanh())


def _model(dtype: torch.dtype = torch.float64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), *(_block() for _ in range(6)),
                         nn.Linear(16, 3)).to(dtype)


def _batch(step: int) -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(10 + step)
    return (torch.randn(16, 6, generator=gen, dtype=torch.float64),
            torch.randn(16, 3, generator=gen, dtype=torch.float64))


def _shard(stages: Sequence[nn.Sequential], mesh: DeviceMesh, reshard: bool,
           units: str = "layers", **policies: Any) -> None:
    """The torchtitan recipe: each block its own FSDP unit (``units="layers"``: every
    layer with parameters; ``"blocks"``: the LayerNorm-Linear blocks, the first and last
    Linear left to the stage's own unit), then the stage as the root."""
    for stage in stages:
        for layer in stage:
            if (isinstance(layer, nn.Sequential) if units == "blocks"
                    else any(True for _ in layer.parameters())):
                fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, **policies)
        fully_shard(stage, mesh=mesh, reshard_after_forward=reshard, **policies)


def _groups(pipe: DistributedPipe) -> int:
    """How many FSDP2 parameter groups this rank's stages have (a module's own
    parameters, not its sharded children's)."""
    return sum(1 for stage in pipe.stage_modules for module in stage.modules()
               if isinstance(module, FSDPModule)
               and module._get_fsdp_state()._fsdp_param_groups)


class _CountReductions:
    """Counts FSDP2's gradient reductions (one reduce-scatter of a parameter group each)
    and the dtypes of the gradients reduced."""

    def __init__(self) -> None:
        self.count = 0
        self.dtypes: Set[torch.dtype] = set()
        self.reduce = _fsdp_param_group.foreach_reduce
        _fsdp_param_group.foreach_reduce = self  # type: ignore[assignment]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.count += 1
        self.dtypes.update(grad.dtype for grad in args[1])  # the unsharded gradients
        return self.reduce(*args, **kwargs)


def _spy_sends(sent: Set[Tuple[Kind, torch.dtype]]) -> None:
    """Record in ``sent`` the kind and dtype of every tensor this rank sends to a stage."""
    send = Transport.send

    def spy(self: Transport, stage: int, kind: Kind, microbatch: int,
            tensors: Sequence[Optional[Tensor]], *args: Any, **kwargs: Any) -> None:
        sent.update((kind, t.dtype) for t in tensors if t is not None)
        send(self, stage, kind, microbatch, tensors, *args, **kwargs)
    Transport.send = spy  # type: ignore[method-assign]


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
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    reductions = _CountReductions()
    _exact(failures, mesh, reductions)
    _mixed(failures, mesh, reductions)
    _refused(rank, failures)
    failures.finish()


def _exact(failures: Failures, mesh: DeviceMesh, reductions: _CountReductions) -> None:
    """Sharded stages train as the single-process model does, whatever FSDP2's and
    seqpipe's options: ``checkpoint_every`` on stages whose own unit holds the first or
    last Linear (their root's hooks must gather them around the segments), and CPU
    offload (``pin_memory=False``: pinning needs an accelerator)."""
    pp, _ = mesh_groups(mesh)
    replica = mesh["dp"].get_local_rank()
    offload = dict(offload_policy=CPUOffloadPolicy(pin_memory=False))
    # schedule, reshard_after_forward, checkpoint, checkpoint_every, FSDP units, policies
    cases: List[Tuple[str, bool, str, Optional[int], str, Dict[str, Any]]] = [
        ("1f1b", True, "except_last", None, "layers", {}),
        ("1f1b", True, "always", 2, "blocks", {}),
        ("zb_h1", False, "except_last", None, "layers", offload),
        ("zb_h1", True, "always", 2, "blocks", {}),
        ("interleaved_1f1b", True, "except_last", None, "layers", {}),
        ("interleaved_1f1b", False, "never", None, "layers", {})]
    for schedule, reshard, checkpoint, every, units, policies in cases:
        what = (f"{schedule}, reshard_after_forward={reshard}, checkpoint={checkpoint}, "
                f"checkpoint_every={every}, {units} sharded, {sorted(policies)}")
        reference = _model()
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
        balance = [2, 2, 2, 2] if schedule == "interleaved_1f1b" else [4, 4]
        pipe = DistributedPipe(_model(), chunks=4, balance=balance, schedule=schedule,
                               checkpoint=checkpoint, checkpoint_every=every, group=pp)
        _shard(pipe.stage_modules, mesh["dp"], reshard, units, **policies)
        opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
        theirs = dict(reference.named_parameters())
        for step in range(3):
            x, y = _batch(step)
            half = slice(replica * 8, replica * 8 + 8)
            opt.zero_grad()
            reductions.count = 0
            loss = pipe.train_step(x[half] if pipe.is_first else None,
                                   y[half] if pipe.is_last else None, nn.functional.mse_loss)
            failures.expect(reductions.count == _groups(pipe),
                            f"{what}: step {step}: {reductions.count} reductions for "
                            f"{_groups(pipe)} parameter groups, not one each per step")
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


def _accumulate(model: nn.Module, x: Tensor, y: Tensor, scale: float = 1.0) -> None:
    """What a pipe's step does, on the single-process model sharded on one rank: the two
    replicas' four micro-batches of two rows, each loss's gradient (times the loss
    ``scale``) accumulated unreduced, and reduced with the last."""
    for i in range(8):
        model.set_requires_gradient_sync(i == 7)  # type: ignore[operator]
        rows = slice(2 * i, 2 * i + 2)
        (nn.functional.mse_loss(model(x[rows]), y[rows]) * (scale / 8)).backward()


def _mixed(failures: Failures, mesh: DeviceMesh, reductions: _CountReductions) -> None:
    """Mixed-precision policies: bf16 (fp32 reduction) under zb_h1, and fp16 with a
    ``PipeGradScaler`` under 1f1b. The reference is the single-process model with the same
    policy (FSDP2 on a one-rank mesh), accumulating its gradients over the same
    micro-batches: the same low-precision forwards and backwards, so the gradients agree
    but for the order of the fp32 sums (to 1e-5). Against the whole batch in one backward
    (bf16), micro-batching moves each gradient by a few bf16 roundings: within 2^-5 of its
    largest element (bf16 keeps 8 significant bits; measured up to 1.1e-2), about as far as
    the fp32 model's gradients are from the bf16 model's. Activations and their gradients
    cross between stages in the policy's dtype; reduction is in fp32; the sharded
    gradients are fp32, as the parameters."""
    pp, _ = mesh_groups(mesh)
    replica = mesh["dp"].get_local_rank()
    # a one-rank mesh for the reference (not (4, 1): a dimension of the whole world holds
    # the default group, which must not outlive destroy_process_group())
    one = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("a", "b", "one"))["one"]
    sent: Set[Tuple[Kind, torch.dtype]] = set()
    _spy_sends(sent)
    tol, failures.tol = failures.tol, dict(rtol=1e-5, atol=1e-7)
    for schedule, low in (("zb_h1", torch.bfloat16), ("1f1b", torch.float16)):
        what = f"{schedule}, {low} policy"
        policy = dict(mp_policy=MixedPrecisionPolicy(param_dtype=low,
                                                     reduce_dtype=torch.float32))
        pipe = DistributedPipe(_model(torch.float32), chunks=4, balance=[4, 4],
                               schedule=schedule, group=pp)
        _shard(pipe.stage_modules, mesh["dp"], True, **policy)
        reference, whole = _model(torch.float32), _model(torch.float32)
        _shard([reference], one, True, **policy)
        _shard([whole], one, True, **policy)
        opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
        scaled = low is torch.float16  # 2^24 overflows fp16: skip, back off to 2^8
        scaler = PipeGradScaler(pipe, init_scale=2.0**24, backoff_factor=2.0**-16)
        mine, theirs = dict(pipe.named_parameters()), dict(reference.named_parameters())
        for step in range(2):
            x, y = (t.float() for t in _batch(step))
            half = slice(replica * 8, replica * 8 + 8)
            sent.clear()
            reductions.dtypes.clear()
            pipe.train_step(x[half] if pipe.is_first else None,
                            y[half] if pipe.is_last else None, nn.functional.mse_loss,
                            scaler=scaler if scaled else None)
            scale = 2.0**24 if scaled and step == 0 else 2.0**8 if scaled else 1.0
            _accumulate(reference, x, y, scale)
            kind = Kind.ACTIVATION if pipe.is_first else Kind.GRAD
            failures.expect({(k, d) for k, d in sent if k in (Kind.ACTIVATION, Kind.GRAD)}
                            == {(kind, low)},
                            f"{what}: sent {sorted(map(str, sent))}, not {low} activations "
                            f"(stage 0) and gradients (stage 1)")
            failures.expect(reductions.dtypes == {torch.float32},
                            f"{what}: reduced {reductions.dtypes}, not float32")
            grads = [_full(p.grad) for p in mine.values()]
            failures.expect(all(g.dtype == torch.float32 for g in grads),
                            f"{what}: gradients {[g.dtype for g in grads]}, not float32")
            if scaled:
                scaler.unscale_(opt)
                for param in reference.parameters():
                    param.grad.div_(scale)
            finite = all(bool(_full(p.grad).isfinite().all()) for p in reference.parameters())
            failures.expect(finite != (scaled and step == 0),
                            f"{what}: step {step}: the reference's gradients are "
                            f"{'finite' if finite else 'not finite'}")
            if finite:
                for name, param in mine.items():
                    failures.close(_full(param.grad), _full(theirs[name].grad),
                                   f"{what}: step {step}: grad of {name}")
            if not scaled and step == 0:  # the whole batch, on the same parameters
                nn.functional.mse_loss(whole(x), y).backward()
                for name, param in whole.named_parameters():
                    if name in mine:
                        full, grad = _full(mine[name].grad), _full(param.grad)
                        failures.expect(
                            bool((full - grad).abs().max() <= 2.0**-5 * grad.abs().max()),
                            f"{what}: step {step}: grad of {name} differs from the whole "
                            f"batch's by more than bf16 roundings")
            if scaled:  # skipped on every rank where the reference skips (an inf)
                scaler.step(opt)
                scaler.update()
                failures.expect(scaler.get_scale() == 2.0**8,
                                f"{what}: step {step}: scale {scaler.get_scale()}, not 2^8")
            else:
                opt.step()
            if finite:
                ref_opt.step()
            for name, param in mine.items():
                failures.close(_full(param.detach()), _full(theirs[name].detach()),
                               f"{what}: step {step}: {name} after the step")
            opt.zero_grad()
            ref_opt.zero_grad()
    failures.tol = tol


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
    reshard_after_forward, with and without checkpointing (and checkpoint_every), CPU
    offload, three AdamW steps: the gradients of every step and the parameters after it
    equal the single-process model's, reduced once per parameter group and step (not per
    micro-batch). bf16 and fp16 (with a PipeGradScaler) mixed-precision policies: equal to
    the single-process model with the policy, activations sent in its dtype. And what
    is not supported raises, naming it, instead of training silently wrong: a DTensor
    activation that the receiving stage has no mesh to rebuild on (its ValueError names
    ``mesh=``; its peer hears that stage 1 failed)."""
    run_workers(_worker, 4, timeout=300)
