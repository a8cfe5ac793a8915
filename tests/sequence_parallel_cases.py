"""Sequence parallelism across a stage boundary (pp=2 × tp=2), run inside
``test_tensor_parallel``'s launch: stage 0 ends in ``RowwiseParallel(output_layouts=Shard(1),
use_local_output=False)``, so a ``DTensor`` sharded on the sequence dimension crosses to
stage 1 (as the activation, and as a skip tensor), and its gradient comes back as one."""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from test_fsdp import _step_both
from torch import Tensor, nn
from torch._C._distributed_c10d import _get_work_registry_size
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from distributed_harness import Failures
from seqpipe.distributed import DistributedPipe, mesh_groups
from seqpipe.distributed.transport import PeerError
from seqpipe.skip import pop, skippable, stash

__all__ = ["sequence_parallel_cases"]


class _Gather(torch.autograd.Function):
    """A sequence-sharded ``DTensor`` gathered whole, whose gradient goes back
    *replicated*: placements other than the input's, which the pipe redistributes."""

    @staticmethod
    def forward(ctx: Any, x: DTensor) -> Tensor:  # type: ignore[override]
        ctx.mesh = x.device_mesh
        return x.full_tensor()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> DTensor:  # type: ignore[override]
        return DTensor.from_local(grad, ctx.mesh, [Replicate()], run_check=False)


class Gather(nn.Module):
    """``_Gather`` on a ``DTensor``; the identity on a plain tensor (the reference)."""

    def forward(self, x: Tensor) -> Tensor:
        return _Gather.apply(x) if isinstance(x, DTensor) else x


@skippable(stash=["x"])
class _Stash(nn.Module):
    def forward(self, x: Tensor) -> Any:
        yield stash("x", x)
        return x


@skippable(pop=["x"])
class _Pop(nn.Module):
    def forward(self, x: Tensor) -> Any:
        skipped = yield pop("x")
        return x * skipped


def _model(gather: bool) -> nn.Sequential:
    """Stage 0 (layers 0-3, and with ``gather`` a stash of their output): an MLP whose
    Rowwise layer leaves the sequence sharded. Stage 1: with ``gather``, the skip popped
    and the sequence gathered (``Gather``); a LayerNorm (``SequenceParallel`` without
    ``gather``), an MLP."""
    torch.manual_seed(1)
    head = [_Stash(), _Pop(), Gather()] if gather else []
    return nn.Sequential(nn.Linear(6, 16), nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16),
                         *head, nn.LayerNorm(16), nn.Linear(16, 32), nn.Tanh(),
                         nn.Linear(32, 16), nn.Linear(16, 3)).double()


def _split(pipe: DistributedPipe, tp: DeviceMesh, gather: bool, stage1: bool = True) -> None:
    """Stage 0's MLP Colwise, then Rowwise into a sequence-sharded DTensor output; stage
    1's LayerNorm ``SequenceParallel`` (without ``gather``), its MLP Colwise from the
    sequence shards (or from the gathered whole) then Rowwise."""
    n = 7 if gather else 4  # stage 1's LayerNorm
    plan: Dict[str, Any] = {
        "1": ColwiseParallel(),
        "3": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}
    if stage1:
        plan.update({str(n + 1): ColwiseParallel(input_layouts=Replicate() if gather
                                                 else Shard(1)),
                     str(n + 3): RowwiseParallel()})
        if not gather:
            plan["4"] = SequenceParallel()
    for name in pipe.layer_names:
        if name in plan:
            parallelize_module(pipe.get_submodule(name), tp, plan[name])


def _batch(step: int) -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(20 + step)
    return (torch.randn(8, 4, 6, generator=gen, dtype=torch.float64),
            torch.randn(8, 4, 3, generator=gen, dtype=torch.float64))


def _trained(pipe: DistributedPipe, gather: bool, failures: Failures, what: str) -> None:
    """Two AdamW steps on the pipe and on the single-process model: losses, gradients, then
    parameters, equal; no collective left in flight (a split backward's recomputation of
    the Rowwise layer's reduce-scatter used to be, one more each micro-batch)."""
    reference = _model(gather)
    optimizers = (torch.optim.AdamW(pipe.parameters(), lr=0.01),
                  torch.optim.AdamW(reference.parameters(), lr=0.01))
    mine, theirs = dict(pipe.named_parameters()), dict(reference.named_parameters())
    for step in range(2):
        x, y = _batch(step)
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                               nn.functional.mse_loss)
        expected = nn.functional.mse_loss(reference(x), y)
        expected.backward()
        failures.close(loss, expected.detach(), f"{what}: step {step}: the loss")
        in_flight = _get_work_registry_size()  # a recomputed output's collective, unwaited
        failures.expect(in_flight == 0, f"{what}: step {step}: {in_flight} collectives left "
                                        f"in flight")
        _step_both(failures, mine, theirs, optimizers, f"{what}: step {step}")


def sequence_parallel_cases(failures: Failures) -> None:
    """pp=2 × tp=2, the sequence sharded across the boundary: under ``1f1b`` into a
    ``SequenceParallel`` LayerNorm (the mesh found from stage 1's DTensor parameters);
    under ``zb_h1``, checkpointed, with a skip tensor also sharded, into a layer whose
    gradient comes back replicated (the mesh given as ``DistributedPipe(mesh=...)``). Then a
    receiver with neither refuses."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, _ = mesh_groups(mesh, data_dim="tp")
    for schedule, gather, given, checkpoint in (("1f1b", False, None, "except_last"),
                                                ("zb_h1", True, mesh, "always")):
        first, model = (5 if gather else 4), _model(gather)  # stage 0's layers, and all
        pipe = DistributedPipe(model, chunks=2, balance=[first, len(model) - first],
                               schedule=schedule, checkpoint=checkpoint, group=pp, mesh=given)
        _split(pipe, mesh["tp"], gather)
        _trained(pipe, gather, failures, f"sequence parallel, {schedule}")
    _refused(failures)


def _refused(failures: Failures) -> None:
    """Stage 1 has no DTensor parameter and no ``mesh``: it cannot tell which mesh to
    rebuild the activation on, and says so, naming ``mesh=``; stage 0 hears that it failed
    (fresh groups: a failed step leaves its pipeline's unusable)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, _ = mesh_groups(mesh, data_dim="tp")
    pipe = DistributedPipe(_model(True), chunks=2, balance=[5, 7], group=pp)
    _split(pipe, mesh["tp"], True, stage1=False)
    x, y = _batch(0)
    expected: Tuple[type, str] = ((PeerError, "stage 1 failed in the forward") if pipe.is_first
                                  else (ValueError, "DistributedPipe(..., mesh=mesh)"))
    error: Optional[BaseException] = None
    try:
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                        nn.functional.mse_loss)
    except expected[0] as exc:
        error = exc
    failures.expect(error is not None and expected[1] in str(error),
                    f"an unplaceable DTensor activation: {error!r}, not {expected}")
