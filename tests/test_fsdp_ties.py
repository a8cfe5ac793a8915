"""Weights tied across ranks on sharded and tensor-parallel stages, and ``count_fn`` with
FSDP2 and a ``data_parallel_group``, on 4 gloo processes (one launch): a language model whose
embedding (stage 0) and head (stage 1) share a weight trains as the single-process model
under pp=2 × fsdp=2 (``1f1b``, ``zb_h1``) and pp=2 × tp=2 (the two copies split alike, and
differently), and with the copies on HSDP, ``replicate`` and FSDP2-over-TP stages; a
token-mean loss over FSDP2 stages and seqpipe's reducer is the global token
mean; FSDP2 and ``data_parallel_group`` over different ranks are refused."""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from test_fsdp import _full, _step_both  # the FSDP2 launch's checks
from torch import Tensor, nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from distributed_harness import Failures, run_workers
from seqpipe.distributed import DistributedPipe, PeerError, mesh_groups

TOL = dict(rtol=1e-6, atol=1e-9)
VOCAB, WIDTH, IGNORED = 16, 8, -100


class _Block(nn.Module):
    """A residual MLP, split Colwise then Rowwise under tensor parallelism."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


def _model(within: bool = False) -> nn.Sequential:
    """Embedding, 4 blocks, a head tied to the embedding (stage 0's and stage 1's); with
    ``within``, the last two blocks' first Linear share a weight too (both stage 1's)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, WIDTH), *(_Block() for _ in range(4)),
                          nn.Linear(WIDTH, VOCAB, bias=False)).double()
    model[5].weight = model[0].weight
    if within:
        model[4].fc1.weight = model[3].fc1.weight
    return model


def _batch(step: int) -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(10 + step)
    return (torch.randint(VOCAB, (8, 3), generator=gen),
            torch.randint(VOCAB, (8, 3), generator=gen))


def _mean_loss(logits: Tensor, labels: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _sum_loss(logits: Tensor, labels: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                       ignore_index=IGNORED, reduction="sum")


def _shard(pipe: DistributedPipe, mesh: DeviceMesh, reshard: bool = True,
           skip: Optional[str] = None) -> None:
    """torchtitan's recipe: each layer with parameters (but ``skip``), no stage root if
    ``skip`` is given (its layer stays seqpipe's reducer's)."""
    for stage in pipe.stage_modules:
        for layer in stage:
            if any(True for _ in layer.parameters()) and layer is not pipe._modules.get(skip):
                fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        if skip is None:
            fully_shard(stage, mesh=mesh, reshard_after_forward=reshard)


def _train(failures: Failures, pipe: DistributedPipe, part: slice, what: str,
           steps: int = 2, split: bool = True, within: bool = False) -> None:
    """``steps`` AdamW steps on ``pipe`` (this pipeline's ``part`` of each batch) and on the
    single-process model (``_model(within)``): gradients and parameters equal; the tied
    copies (``DTensor``s if ``split``) still equal."""
    reference = _model(within)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.05)
    theirs: Dict[str, Tensor] = dict(reference.named_parameters(remove_duplicate=False))
    mine = dict(pipe.named_parameters())
    copy = mine.get("0.weight", mine.get("5.weight"))  # None: no copy on this rank
    failures.expect(copy is None or isinstance(copy, DTensor) == split,
                    f"{what}: the tied copy is {'not ' if split else ''}a DTensor")
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        pipe.train_step(x[part] if pipe.is_first else None, y[part] if pipe.is_last else None,
                        _mean_loss)
        ref_opt.zero_grad()
        _mean_loss(reference(x), y).backward()
        _step_both(failures, mine, theirs, (opt, ref_opt), f"{what}: step {step}")
    pipe.check_ties()  # the copies, gathered whole, are equal


def _sharded(failures: Failures) -> None:
    """pp=2 × fsdp=2: the copies are FSDP2's (their unsharded gradients summed before
    FSDP2 reduce-scatters them), under 1f1b and zb_h1 (I and W split)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, _ = mesh_groups(mesh)
    replica = mesh["dp"].get_local_rank()
    for schedule, reshard in (("1f1b", True), ("zb_h1", False)):
        pipe = DistributedPipe(_model(), chunks=2, balance=[3, 3], schedule=schedule,
                               group=pp)
        _shard(pipe, mesh["dp"], reshard)
        _train(failures, pipe, slice(replica * 4, replica * 4 + 4),
               f"pp=2 x fsdp=2, {schedule}, reshard_after_forward={reshard}")


def _split(pipe: DistributedPipe, tp: DeviceMesh, alike: bool) -> None:
    """Tensor parallelism: the blocks Colwise then Rowwise; the head Colwise (its weight
    ``Shard(0)``); the embedding Rowwise (``Shard(0)``, ``alike``) or Colwise
    (``Shard(1)``: the copies split differently)."""
    plan = {"0": RowwiseParallel(input_layouts=Replicate()) if alike
            else ColwiseParallel(output_layouts=Replicate()),
            "5": ColwiseParallel(output_layouts=Replicate())}
    for name, layer in pipe.named_children():  # this rank's layers, by their model names
        if isinstance(layer, _Block):
            parallelize_module(layer, tp, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        elif name in plan:
            parallelize_module(layer, tp, plan[name])


def _tensor_parallel(failures: Failures) -> None:
    """pp=2 × tp=2: the copies summed by local shards (split alike) or whole (not)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, _ = mesh_groups(mesh, data_dim="tp")
    for alike, schedule in ((True, "1f1b"), (False, "zb_h1")):
        pipe = DistributedPipe(_model(), chunks=2, balance=[3, 3], schedule=schedule,
                               group=pp)
        _split(pipe, mesh["tp"], alike)
        placement = (Shard(0) if alike or pipe.is_last else Shard(1),)
        copy = pipe._modules["0" if pipe.is_first else "5"].weight
        failures.expect(copy.placements == placement,
                        f"tp: the copy is laid out {copy.placements}, not {placement}")
        _train(failures, pipe, slice(0, 8),
               f"pp=2 x tp=2, {'alike' if alike else 'Shard(1) and Shard(0)'}, {schedule}")


def _wrapped(pipe: DistributedPipe, wrap: Callable[[nn.Module], Any]) -> None:
    """``wrap`` (FSDP2's ``fully_shard`` or ``replicate`` on some mesh) each layer with
    parameters, then each stage as the root."""
    for stage in pipe.stage_modules:
        for layer in stage:
            if any(True for _ in layer.parameters()):
                wrap(layer)
        wrap(stage)


def _hybrid(failures: Failures) -> None:
    """pp=2 and the copies on HSDP (2 replicas × 1 shard, 1 × 2) or FSDP2-style
    ``replicate`` stages: three AdamW steps as the single-process model's."""
    for kind, schedule in (("hsdp 2x1", "1f1b"), ("hsdp 1x2", "zb_h1"),
                           ("replicate", "1f1b"), ("replicate", "zb_h1")):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        pp, _ = mesh_groups(mesh)
        replica = mesh["dp"].get_local_rank()
        pipe = DistributedPipe(_model(), chunks=2, balance=[3, 3], schedule=schedule,
                               group=pp)
        if kind == "replicate":
            _wrapped(pipe, partial(replicate, mesh=mesh["dp"]))
        else:
            replicas = int(kind[5])
            cube = init_device_mesh("cpu", (2, replicas, 2 // replicas),
                                    mesh_dim_names=("pp", "rep", "shard"))
            _wrapped(pipe, partial(fully_shard, mesh=cube["rep", "shard"]))
        _train(failures, pipe, slice(replica * 4, replica * 4 + 4),
               f"ties on {kind}, {schedule}", steps=3)


def _sharded_over_split(failures: Failures) -> None:
    """FSDP2 over tensor-parallel stages (the parameters 2-D DTensors on (dp, tp)), the
    copies split alike or not: pp=2 × dp=1 × tp=2 and pp=2 × dp=2 × tp=1 (4 processes
    hold one dimension of 2 besides the pipeline's), three AdamW steps as the model's."""
    for dp, alike, schedule in ((1, True, "1f1b"), (1, False, "zb_h1"), (2, True, "1f1b")):
        cube = init_device_mesh("cpu", (2, dp, 2 // dp), mesh_dim_names=("pp", "dp", "tp"))
        pp, _ = mesh_groups(cube)
        replica = cube["dp"].get_local_rank()
        pipe = DistributedPipe(_model(), chunks=2, balance=[3, 3], schedule=schedule,
                               group=pp)
        _split(pipe, cube["tp"], alike)
        _wrapped(pipe, partial(fully_shard, mesh=cube["dp"]))
        share = 8 // dp
        _train(failures, pipe, slice(replica * share, (replica + 1) * share),
               f"ties on fsdp={dp} over tp={2 // dp}, "
               f"{'alike' if alike else 'Shard(1) and Shard(0)'}, {schedule}", steps=3)


def _one_rank(failures: Failures) -> None:
    """Under ``zbv`` the embedding (stage 0) and the head (stage 3) are both on the first
    rank, one tensor there. ``replicate`` wrapping the two layers apart would give each its
    own copy (trained apart, silently); every rank refuses, naming the layers. The mend it
    names: the two layers left unwrapped (the stages without a root unit), averaged by
    ``data_parallel_group``, the others sharded: three AdamW steps as the model's."""
    _within_one_stage(failures)
    for mended in (False, True):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        pp, dp = mesh_groups(mesh)
        replica = mesh["dp"].get_local_rank()
        pipe = DistributedPipe(_model(), chunks=2, balance=[2, 1, 1, 2], schedule="zbv",
                               group=pp, data_parallel_group=dp if mended else None)
        if not mended:
            _wrapped(pipe, partial(replicate, mesh=mesh["dp"]))
            x, y = _batch(0)
            error: Optional[BaseException] = None
            try:
                pipe.train_step(x[:4] if pipe.is_first else None,
                                y[:4] if pipe.is_last else None, _mean_loss)
            except (ValueError, PeerError) as exc:
                error = exc
            expected = ValueError if pipe.is_first else PeerError
            failures.expect(type(error) is expected and "['0.weight', '5.weight']" in
                            str(error) and "data_parallel_group" in str(error),
                            f"ties apart on one rank: {error!r}, not a {expected.__name__}")
            continue
        tied = [pipe.get_submodule(n) for n in ("0", "5") if n in pipe.layer_names]
        for stage in pipe.stage_modules:
            for layer in stage:
                if layer not in tied:
                    fully_shard(layer, mesh=mesh["dp"])
            if not tied:
                fully_shard(stage, mesh=mesh["dp"])
        _train(failures, pipe, slice(replica * 4, replica * 4 + 4),
               "ties on one rank under zbv, left to data_parallel_group", steps=3,
               split=False)


def _within_one_stage(failures: Failures) -> None:
    """Two blocks of stage 1 share a weight: FSDP2 over the two as one unit
    (``fully_shard([a, b])``, the mend named for a stage) keeps it one parameter; three
    AdamW steps as the model's."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, _ = mesh_groups(mesh)
    replica = mesh["dp"].get_local_rank()
    pipe = DistributedPipe(_model(within=True), chunks=2, balance=[3, 3], group=pp)
    together = [pipe.get_submodule(n) for n in ("3", "4") if n in pipe.layer_names]
    if together:
        fully_shard(together, mesh=mesh["dp"])
    for stage in pipe.stage_modules:
        for layer in stage:
            if layer not in together:
                fully_shard(layer, mesh=mesh["dp"])
        fully_shard(stage, mesh=mesh["dp"])
    _train(failures, pipe, slice(replica * 4, replica * 4 + 4),
           "a weight shared within a stage, one FSDP2 unit", steps=3, within=True)


def _counted(failures: Failures) -> None:
    """count_fn on FSDP2 stages with a data_parallel_group over the same ranks (stage 0's
    first block left to seqpipe's reducer; the tie's copies FSDP2's): replicas counting 5
    and 9 of their 12 tokens give the gradient of the global sum over the global count."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh_groups(mesh)
    replica = mesh["dp"].get_local_rank()
    pipe = DistributedPipe(_model(), chunks=2, balance=[3, 3], group=pp,
                           data_parallel_group=dp)
    _shard(pipe, mesh["dp"], skip="1")
    x, y = _batch(0)
    y = y.clone()
    y[:4].view(-1)[5:] = IGNORED  # replica 0 counts 5 tokens
    y[4:].view(-1)[:-9] = IGNORED  # replica 1 counts 9
    part = slice(replica * 4, replica * 4 + 4)
    pipe.train_step(x[part] if pipe.is_first else None, y[part] if pipe.is_last else None,
                    _sum_loss, count_fn=lambda labels: (labels != IGNORED).sum())
    reference = _model()
    (_sum_loss(reference(x), y) / (y != IGNORED).sum()).backward()
    theirs = dict(reference.named_parameters(remove_duplicate=False))
    mine = dict(pipe.named_parameters())
    failures.expect(any(not isinstance(p, DTensor) for p in mine.values()) or pipe.is_last,
                    "count: stage 0's first block is sharded, not the reducer's")
    for name, param in mine.items():
        failures.close(_full(param.grad), theirs[name].grad, f"count: grad of {name}")


def _refused(failures: Failures) -> None:
    """FSDP2 over other ranks than data_parallel_group: the replicas would not be one set;
    every rank raises ValueError naming both (a failed call: the launch's last case)."""
    cube = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp", "one"))
    pp, dp = mesh_groups(init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp")))
    pipe = DistributedPipe(_model(), chunks=2, balance=[3, 3], group=pp,
                           data_parallel_group=dp)
    _shard(pipe, cube["one"])
    x, y = _batch(0)
    try:
        pipe.train_step(x[:4] if pipe.is_first else None, y[:4] if pipe.is_last else None,
                        _mean_loss)
    except ValueError as exc:
        failures.expect(f"over ranks [{dist.get_rank()}]" in str(exc) and
                        "data_parallel_group (ranks" in str(exc), f"refused: {exc}")
    else:
        failures.expect(False, "refused: trained with FSDP2 and data_parallel_group apart")


def _worker(rank: int, world: int) -> None:
    torch.set_default_dtype(torch.float64)
    failures = Failures(rank, TOL)
    _sharded(failures)
    _tensor_parallel(failures)
    _hybrid(failures)
    _sharded_over_split(failures)
    _one_rank(failures)
    _counted(failures)
    _refused(failures)
    failures.finish()


def test_fsdp_ties() -> None:
    """4 processes: a tied embedding/head trains two AdamW steps as the single-process
    model under pp=2 × fsdp=2 (1f1b, zb_h1) and pp=2 × tp=2 (copies split alike under 1f1b,
    differently under zb_h1), the copies equal after; three on HSDP (2×1, 1×2), on
    replicate stages (1f1b, zb_h1) and on FSDP2 over tensor parallelism; under zbv (both
    copies on one rank) replicate wrapping the two layers apart is refused on every rank,
    and the mend it names trains exactly, as does a weight shared within a stage under
    one FSDP2 unit; count_fn with FSDP2 and a
    data_parallel_group gives the global token mean's gradient; FSDP2 over other ranks than
    data_parallel_group raises ValueError."""
    run_workers(_worker, 4, timeout=300)

