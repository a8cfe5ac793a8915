"""DistributedPipe stages split with tensor parallelism (``parallelize_module``, DTensor
parameters), on 4 gloo processes: pp=2 × tp=2 under three schedules; pp × dp × tp through
seqpipe's own reducer and FSDP2 over TP (pp=1, 4 processes); each three AdamW steps equal to
the single-process model. What is not combined with TP yet (``auto``, a DTensor crossing
a stage boundary) is refused, naming it."""
from __future__ import annotations

from typing import Any, Dict

import torch
from test_fsdp import _batch, _full  # the same data as the FSDP2 stages' test
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from distributed_harness import Failures, run_workers
from seqpipe.distributed import DistributedPipe, mesh_groups
from seqpipe.distributed.transport import PeerError

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
           what: str, hooked: bool = False) -> None:
    """Three AdamW steps on ``pipe`` (this replica's share of each batch) and on the
    single-process model (the whole batch): gradients and parameters equal. ``hooked``:
    a post-accumulate hook on every parameter fires once per step (the micro-batches
    accumulate into aliases of the DTensor parameters first)."""
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
        failures.expect(not hooked or set(fired.values()) == {1},
                        f"{what}: step {step}: the hooks fired {fired}, not once each")
        for name, param in mine.items():
            failures.close(_full(param.grad), theirs[name].grad,
                           f"{what}: step {step}: grad of {name}")
        opt.step()
        ref_opt.step()
        for name, param in mine.items():
            failures.close(_full(param.detach()), theirs[name].detach(),
                           f"{what}: step {step}: {name} after AdamW")


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
    pipe = DistributedPipe(_model(), chunks=2, balance=[3, 3], schedule="auto", group=pp)
    _split(pipe, mesh["tp"])
    x, y = _batch(0)
    try:
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                        nn.functional.mse_loss)
    except NotImplementedError as exc:
        failures.expect("tensor parallelism" in str(exc) and "schedule='auto'" in str(exc),
                        f"auto: {exc}")
    else:
        failures.expect(False, "schedule='auto' with a tensor-parallel stage trained")
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
    _dtensor_activation(failures)
    failures.finish()


def _dtensor_activation(failures: Failures) -> None:
    """Stage 0 ends in a Colwise layer with ``use_local_output=False``: its output, a
    DTensor, would cross the boundary. The sender raises, naming the mend; its peer hears
    that stage 0 failed (fresh groups: a failed step leaves its pipeline's unusable)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, _ = mesh_groups(mesh, data_dim="tp")
    pipe = DistributedPipe(_model(), chunks=2, balance=[3, 3], group=pp)
    if pipe.is_first:
        pipe.stage_modules[0].append(nn.Linear(16, 16))
        parallelize_module(pipe.stage_modules[0][-1], mesh["tp"],
                           ColwiseParallel(use_local_output=False))
    x, y = _batch(0)
    expected: Any = ((TypeError, "use_local_output=True") if pipe.is_first
                     else (PeerError, "stage 0 failed in the forward"))
    try:
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                        nn.functional.mse_loss)
    except expected[0] as exc:
        failures.expect(expected[1] in str(exc), f"DTensor activation: {exc}")
    else:
        failures.expect(False, f"a DTensor activation crossed instead of {expected}")


def test_tensor_parallel_stages() -> None:
    """pp=2 × tp=2 on 4 processes under 1f1b, zb_h1 (split backward) and interleaved_1f1b
    (two stages per rank), with each checkpointing mode: the gradients of three AdamW steps
    and the parameters after each equal the single-process model's (under zb_h1 with a
    hook on every parameter, which fires once per step); ``schedule='auto'``
    with a tensor-parallel stage raises, naming it. And dp=2 × tp=2 (a one-stage pipe):
    seqpipe's data-parallel reducer averages the DTensor parameters' local shards (it used
    to leave them out, unreduced), and FSDP2 over the tensor-parallel blocks trains exactly.
    A DTensor stage output is refused on the sending stage, naming the mend."""
    run_workers(_worker, 4, timeout=300)
