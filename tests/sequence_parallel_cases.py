"""Sequence parallelism across a stage boundary (pp=2 × tp=2), run inside
``test_tensor_parallel``'s launch: stage 0 ends in ``RowwiseParallel(output_layouts=Shard(1),
use_local_output=False)``, so a ``DTensor`` sharded on the sequence dimension crosses to
stage 1 (as the activation, and as a skip tensor), and its gradient comes back as one; also
with sequences that tp does not divide (uneven shards), under FSDP2, and refused where a
shard would land on the wrong rank."""
from __future__ import annotations

from typing import Any, Dict, Optional, Set, Tuple

import torch
import torch.distributed as dist
from test_fsdp import _step_both
from torch import Tensor, nn
from torch._C._distributed_c10d import _get_work_registry_size
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
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


def _batch(step: int, length: int = 4) -> Tuple[Tensor, Tensor]:
    """8 sequences of ``length`` positions: inputs and targets."""
    gen = torch.Generator().manual_seed(20 + step)
    return (torch.randn(8, length, 6, generator=gen, dtype=torch.float64),
            torch.randn(8, length, 3, generator=gen, dtype=torch.float64))


def _trained(pipe: DistributedPipe, gather: bool, failures: Failures, what: str,
             steps: int = 2, length: int = 4, part: slice = slice(None)) -> None:
    """``steps`` AdamW steps on the pipe (this pipeline's ``part`` of each batch of
    sequences of ``length``) and on the single-process model (the whole batch): losses
    (of a whole batch), gradients, then parameters, equal; no collective left in flight (a
    split backward's recomputation of the Rowwise layer's reduce-scatter used to be, one
    more each micro-batch)."""
    reference = _model(gather)
    optimizers = (torch.optim.AdamW(pipe.parameters(), lr=0.01),
                  torch.optim.AdamW(reference.parameters(), lr=0.01))
    mine, theirs = dict(pipe.named_parameters()), dict(reference.named_parameters())
    for step in range(steps):
        x, y = _batch(step, length)
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss = pipe.train_step(x[part] if pipe.is_first else None,
                               y[part] if pipe.is_last else None, nn.functional.mse_loss)
        expected = nn.functional.mse_loss(reference(x), y)
        expected.backward()
        if part == slice(None):
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
    _uneven(failures)
    _sharded_over_sequence_parallel(failures)
    _refused(failures)
    _mismatched(failures)


def _uneven(failures: Failures) -> None:
    """Sequences of 5 and of 1 position over tp=2: shards of 3 and 2, 1 and 0 (an empty
    one) positions cross the boundary (``DTensor.from_local`` with the global shape sent),
    under ``1f1b`` into the ``SequenceParallel`` LayerNorm and under ``zb_h1``,
    checkpointed, with the skip: three AdamW steps as the single-process model's."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, _ = mesh_groups(mesh, data_dim="tp")
    coordinate = mesh["tp"].get_local_rank()
    for length, schedule, gather in ((5, "1f1b", False), (1, "zb_h1", True)):
        first, model = (5 if gather else 4), _model(gather)
        pipe = DistributedPipe(model, chunks=2, balance=[first, len(model) - first],
                               schedule=schedule, checkpoint="always" if gather else
                               "except_last", group=pp, mesh=mesh if gather else None)
        _split(pipe, mesh["tp"], gather)
        shards: Set[Any] = set()  # stage 1's input: a DTensor's local shard lengths
        if not pipe.is_first:
            pipe.get_submodule(str(first)).register_forward_pre_hook(
                lambda _, args, shards=shards: shards.add(
                    args[0].to_local().shape[1] if isinstance(args[0], DTensor) else "plain"))
        what = f"uneven sequence shards, length {length}, {schedule}"
        _trained(pipe, gather, failures, what, steps=3, length=length)
        expected = {(length + 1 - coordinate) // 2}  # torch.chunk's: the first one longer
        failures.expect(pipe.is_first or shards == expected,
                        f"{what}: stage 1 took shards of {shards}, not {expected}")


def _sharded_over_sequence_parallel(failures: Failures) -> None:
    """FSDP2 over the sequence-parallel stages (each layer and each stage its unit on the
    dp mesh, the parameters 2-D DTensors): pp=2 × dp=1 × tp=2 (the sequence shards cross
    between ranks), and pp=1 × dp=2 × tp=2 (both stages on each rank under
    ``interleaved_1f1b``, the shards handed over in memory): three AdamW steps as the
    single-process model's."""
    for shape, schedule in (((2, 1, 2), "1f1b"), ((1, 2, 2), "interleaved_1f1b")):
        cube = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp", "tp"))
        pp, _ = mesh_groups(cube)
        model = _model(False)
        pipe = DistributedPipe(model, chunks=2, balance=[4, len(model) - 4],
                               schedule=schedule, group=pp)
        _split(pipe, cube["tp"], False)
        for stage in pipe.stage_modules:
            for layer in stage:
                if any(True for _ in layer.parameters()):
                    fully_shard(layer, mesh=cube["dp"])
            fully_shard(stage, mesh=cube["dp"])
        share, replica = 8 // shape[1], cube["dp"].get_local_rank()
        _trained(pipe, False, failures, f"fsdp={shape[1]} over sequence parallel, pp="
                 f"{shape[0]}, {schedule}", steps=3,
                 part=slice(replica * share, (replica + 1) * share))


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


def _mismatched(failures: Failures) -> None:
    """A shard that would land on the wrong rank is refused on every rank, naming the
    mend: pipeline groups made by hand across tensor-parallel coordinates (ranks 0 and 3,
    1 and 2 of the (pp, tp) mesh), and ``DistributedPipe(mesh=...)`` a mesh of other ranks
    on its ``tp`` dimension than the one the layers were split on. Stage 1 raises
    ``ValueError``, stage 0 hears it (``PeerError``), before any tensor-parallel
    collective of stage 1 that would wait for a peer which raised."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    transposed = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "pp"))
    crossed = [dist.new_group([0, 3]), dist.new_group([1, 2])]  # every rank makes both
    pp, _ = mesh_groups(mesh, data_dim="tp")
    rank = dist.get_rank()
    cases = (("crossed pipeline groups", crossed[0] if rank in (0, 3) else crossed[1],
              mesh, "this rank is at coordinate"),
             ("mesh= of another layout", pp, transposed,
              "DTensor parameters are split over ranks [2, 3]"))
    for what, group, given, text in cases:
        model = _model(False)
        pipe = DistributedPipe(model, chunks=2, balance=[4, len(model) - 4], group=group,
                               mesh=given)
        _split(pipe, mesh["tp"], False)
        x, y = _batch(0)
        expected = PeerError if pipe.is_first else ValueError
        error: Optional[BaseException] = None
        try:
            pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                            nn.functional.mse_loss)
        except (PeerError, ValueError, RuntimeError) as exc:
            error = exc
        failures.expect(type(error) is expected and text in str(error) and
                        "DistributedPipe(mesh=...)" in str(error),
                        f"{what}: {error!r}, not a {expected.__name__} saying {text!r}")
