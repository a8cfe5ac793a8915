"""Weights tied across ranks on sharded and tensor-parallel stages, and ``count_fn`` with
FSDP2 and a ``data_parallel_group``, on 4 gloo processes (one launch): a language model whose
embedding (stage 0) and head (stage 1) share a weight trains as the single-process model
under pp=2 × fsdp=2 (``1f1b``, ``zb_h1``) and pp=2 × tp=2 (the two copies split alike, and
differently), and with the copies on HSDP, ``replicate`` and FSDP2-over-TP stages; a weight
shared by layers of one rank (``zbv``, ``dualpipev``, one stage) that FSDP2, ``replicate`` or
tensor parallelism wrapped apart trains as the model's too (its copies summed on the rank),
is clipped and checkpointed once, and its copies frozen apart are refused; a token-mean loss
over FSDP2 stages and seqpipe's reducer is the global token mean; FSDP2 and
``data_parallel_group`` over different ranks are refused."""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from test_fsdp import _full, _step_both  # the FSDP2 launch's checks
from torch import Tensor, nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from distributed_harness import Failures, run_workers
from seqpipe.distributed import DistributedPipe, PeerError, mesh_groups
from seqpipe.distributed.checkpoint import load, load_into_plain, save

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


def _model(within: bool = False, triple: bool = False) -> nn.Sequential:
    """Embedding, 4 blocks, a head tied to the embedding (stage 0's and stage 1's); with
    ``within``, the last two blocks' first Linear share a weight too (both stage 1's); with
    ``triple``, the third block's first Linear uses the embedding's weight too (stage 2's
    under ``zbv``: one tie, two copies on rank 0 and one on rank 1)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, WIDTH), *(_Block() for _ in range(4)),
                          nn.Linear(WIDTH, VOCAB, bias=False)).double()
    model[5].weight = model[0].weight
    if within:
        model[4].fc1.weight = model[3].fc1.weight
    if triple:
        model[3].fc1.weight = model[0].weight
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
           steps: int = 2, split: Optional[bool] = True,
           model: Callable[[], nn.Sequential] = _model,
           clip: bool = False) -> Tuple[nn.Sequential, Any, Any]:
    """``steps`` AdamW steps on ``pipe`` (this pipeline's ``part`` of each batch) and on the
    single-process ``model()``: losses, gradients (clipped to norm 0.5 by
    ``pipe.clip_grad_norm_`` if ``clip``, with the same norm) and parameters equal; the tied
    copies (``DTensor``s if ``split``; either if ``None``) still equal. Returns the model
    and both optimizers."""
    reference = model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.05)
    theirs: Dict[str, Tensor] = dict(reference.named_parameters(remove_duplicate=False))
    mine = dict(pipe.named_parameters())
    copy = mine.get("0.weight", mine.get("5.weight"))  # None: no copy on this rank
    failures.expect(copy is None or split is None or isinstance(copy, DTensor) == split,
                    f"{what}: the tied copy is {'not ' if split else ''}a DTensor")
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        loss = pipe.train_step(x[part] if pipe.is_first else None,
                               y[part] if pipe.is_last else None, _mean_loss)
        with torch.no_grad():
            failures.close(loss, _mean_loss(reference(x[part]), y[part]),
                           f"{what}: loss, step {step}")
        ref_opt.zero_grad()
        _mean_loss(reference(x), y).backward()
        if clip:
            failures.close(pipe.clip_grad_norm_(0.5),
                           nn.utils.clip_grad_norm_(reference.parameters(), 0.5),
                           f"{what}: gradient norm, step {step}")
        _step_both(failures, mine, theirs, (opt, ref_opt), f"{what}: step {step}")
    pipe.check_ties()  # the copies, gathered whole, are equal
    return reference, opt, ref_opt


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


def _one_rank(failures: Failures, path: str) -> None:
    """Under ``zbv`` and ``dualpipev`` the embedding (stage 0) and the head (stage 3) are both
    on the first rank, one tensor there. Wrapped apart, each layer its own unit (FSDP2,
    ``replicate``, tensor parallelism split alike or ``Shard(1)`` against ``Shard(0)``), they
    are two copies, summed on the rank: three AdamW steps as the model's (clipped, and
    checkpointed under one key, for FSDP2). Copies of it set to ``requires_grad`` apart are
    refused, naming them. Left unwrapped and averaged by ``data_parallel_group``, the other
    layers sharded, it trains exactly too; and so does a tie (across ranks, or on one rank)
    whose embedding copy ``data_parallel_group`` averages and whose head copy FSDP2 does."""
    _within_one_stage(failures)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh_groups(mesh)
    replica = mesh["dp"].get_local_rank()
    part = slice(replica * 4, replica * 4 + 4)
    for kind, schedule in (("fully_shard", "zbv"), ("replicate", "dualpipev")):
        pipe = DistributedPipe(_model(), chunks=4, balance=[2, 1, 1, 2], schedule=schedule,
                               group=pp)
        wrap = fully_shard if kind == "fully_shard" else replicate
        _wrapped(pipe, partial(wrap, mesh=mesh["dp"]))
        apart = pipe.is_first and pipe.get_parameter("0.weight") is not pipe.get_parameter(
            "5.weight")
        failures.expect(apart == pipe.is_first, f"{kind}: the layers were not wrapped apart")
        trained = _train(failures, pipe, part, f"tie on one rank wrapped apart by {kind}, "
                         f"{schedule}", steps=3, clip=kind == "fully_shard")
        if kind == "fully_shard":
            _checkpointed(failures, pipe, mesh["dp"], trained, path)
    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    tp_pp, _ = mesh_groups(tp_mesh, data_dim="tp")
    for alike, schedule in ((True, "zbv"), (False, "dualpipev")):
        pipe = DistributedPipe(_model(), chunks=4, balance=[2, 1, 1, 2], schedule=schedule,
                               group=tp_pp)
        _split(pipe, tp_mesh["tp"], alike)
        _train(failures, pipe, slice(0, 8), f"tie on one rank split by tp, "
               f"{'alike' if alike else 'Shard(1) and Shard(0)'}, {schedule}", steps=3)
    _frozen_apart(failures, mesh)
    pipe = DistributedPipe(_model(), chunks=2, balance=[2, 1, 1, 2], schedule="zbv",
                           group=pp, data_parallel_group=dp)
    tied = [pipe.get_submodule(n) for n in ("0", "5") if n in pipe.layer_names]
    for stage in pipe.stage_modules:
        for layer in stage:
            if layer not in tied:
                fully_shard(layer, mesh=mesh["dp"])
        if not tied:
            fully_shard(stage, mesh=mesh["dp"])
    _train(failures, pipe, part, "ties on one rank under zbv, left to data_parallel_group",
           steps=3, split=False)
    for balance, schedule in (([3, 3], "1f1b"), ([2, 1, 1, 2], "zbv")):
        pipe = DistributedPipe(_model(), chunks=2, balance=balance, schedule=schedule,
                               group=pp, data_parallel_group=dp)
        _shard(pipe, mesh["dp"], skip="0")  # the embedding's copy: the reducer's
        _train(failures, pipe, part, f"a tie's copies averaged by the reducer and by FSDP2, "
               f"{schedule}", split=None)


def _checkpointed(failures: Failures, pipe: DistributedPipe, mesh: DeviceMesh,
                  trained: Tuple[nn.Sequential, Any, Any], path: str) -> None:
    """The two copies are one entry of a checkpoint, under the model's first key, model and
    optimizer state: loaded into the plain model, and into a pipe wrapped apart alike (on
    ``mesh``, both copies), they are the trained model's."""
    reference, opt, ref_opt = trained
    save(pipe, opt, path)
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    failures.expect("model.0.weight" in keys and not any(".5.weight" in k for k in keys)
                    and "optim.state.0.weight.exp_avg" in keys,
                    f"checkpoint: the tie's keys {sorted(k for k in keys if 'weight' in k)}")
    plain = _model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.05)
    load_into_plain(plain, plain_opt, path)
    for name, param in plain.named_parameters():
        failures.close(param, reference.get_parameter(name), f"checkpoint: {name}")
    failures.close(plain_opt.state[plain[0].weight]["exp_avg"],
                   ref_opt.state[reference[0].weight]["exp_avg"], "checkpoint: exp_avg")
    fresh = DistributedPipe(_model(), chunks=4, balance=[2, 1, 1, 2], schedule="zbv",
                            group=pipe.group)
    _wrapped(fresh, partial(fully_shard, mesh=mesh))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.05)
    load(fresh, fresh_opt, path)  # the one entry into both copies
    for name, param in fresh.named_parameters():
        failures.close(_full(param.detach()), reference.get_parameter(name),
                       f"checkpoint loaded into the pipe: {name}")
        if name in ("0.weight", "5.weight"):
            failures.close(_full(fresh_opt.state[param]["exp_avg"]),
                           ref_opt.state[reference[0].weight]["exp_avg"],
                           f"checkpoint loaded into the pipe: exp_avg of {name}")


def _frozen_apart(failures: Failures, mesh: DeviceMesh) -> None:
    """One copy of the tie frozen (through its layer) and the other not: ``ValueError`` on
    the rank that holds them, naming the trained copy and every name, a ``PeerError``
    elsewhere."""
    pp, _ = mesh_groups(mesh)
    pipe = DistributedPipe(_model(), chunks=2, balance=[2, 1, 1, 2], schedule="zbv", group=pp)
    _wrapped(pipe, partial(fully_shard, mesh=mesh["dp"]))
    if pipe.is_first:
        pipe.get_parameter("5.weight").requires_grad_(False)
    x, y = _batch(0)
    error: Optional[BaseException] = None
    try:
        pipe.train_step(x[:4] if pipe.is_first else None, y[:4] if pipe.is_last else None,
                        _mean_loss)
    except (ValueError, PeerError) as exc:
        error = exc
    expected = ValueError if pipe.is_first else PeerError
    failures.expect(type(error) is expected and "copies ['0.weight']" in str(error)
                    and "['0.weight', '5.weight']" in str(error),
                    f"frozen apart on one rank: {error!r}, not a {expected.__name__}")


def _within_one_stage(failures: Failures) -> None:
    """Two blocks of stage 1 share a weight: FSDP2 over the two as one unit
    (``fully_shard([a, b])``) keeps it one parameter; wrapped apart (each layer its own unit
    and root: under one root FSDP2 itself refuses units that share a parameter) it is two
    copies, summed on the rank, besides the embedding's tie across ranks. Under ``zbv``
    a weight that the embedding, the head (rank 0) and a block (rank 1) share, each wrapped
    apart: one tie across ranks, two copies of it on rank 0. Three AdamW steps as the
    model's."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, _ = mesh_groups(mesh)
    replica = mesh["dp"].get_local_rank()
    part = slice(replica * 4, replica * 4 + 4)
    within = partial(_model, within=True)
    pipe = DistributedPipe(within(), chunks=2, balance=[3, 3], group=pp)
    together = [pipe.get_submodule(n) for n in ("3", "4") if n in pipe.layer_names]
    if together:
        fully_shard(together, mesh=mesh["dp"])
    for stage in pipe.stage_modules:
        for layer in stage:
            if layer not in together:
                fully_shard(layer, mesh=mesh["dp"])
        fully_shard(stage, mesh=mesh["dp"])
    _train(failures, pipe, part, "a weight shared within a stage, one FSDP2 unit", steps=3,
           model=within)
    for model, balance, schedule in ((within, [3, 3], "1f1b"),
                                     (partial(_model, triple=True), [2, 1, 1, 2], "zbv")):
        pipe = DistributedPipe(model(), chunks=2, balance=balance, schedule=schedule, group=pp)
        if schedule == "zbv":
            _wrapped(pipe, partial(fully_shard, mesh=mesh["dp"]))
        else:  # each layer its own root: FSDP2 refuses two units of one root sharing one
            for layer in pipe.children():
                fully_shard(layer, mesh=mesh["dp"])
        pair = ("3.fc1.weight", "4.fc1.weight") if schedule == "1f1b" else ("0.weight", "5.weight")
        if pair[0] in dict(pipe.named_parameters(remove_duplicate=False)):
            failures.expect(pipe.get_parameter(pair[0]) is not pipe.get_parameter(pair[1]),
                            f"{schedule}: {pair} were not wrapped apart")
        _train(failures, pipe, part, f"a weight shared on one rank wrapped apart, {schedule}",
               steps=3, model=model)


def _counted(failures: Failures) -> None:
    """count_fn on FSDP2 stages with a data_parallel_group over the same ranks (``1f1b``:
    stage 0's first block left to seqpipe's reducer, the tie's copies FSDP2's; ``zbv``: the
    embedding's copy the reducer's and the head's, on the same rank, FSDP2's): replicas
    counting 5 and 9 of their 12 tokens give the gradient of the global sum over the global
    count."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh_groups(mesh)
    replica = mesh["dp"].get_local_rank()
    x, y = _batch(0)
    y = y.clone()
    y[:4].view(-1)[5:] = IGNORED  # replica 0 counts 5 tokens
    y[4:].view(-1)[:-9] = IGNORED  # replica 1 counts 9
    part = slice(replica * 4, replica * 4 + 4)
    reference = _model()
    (_sum_loss(reference(x), y) / (y != IGNORED).sum()).backward()
    theirs = dict(reference.named_parameters(remove_duplicate=False))
    for balance, schedule, skip in (([3, 3], "1f1b", "1"), ([2, 1, 1, 2], "zbv", "0")):
        pipe = DistributedPipe(_model(), chunks=2, balance=balance, schedule=schedule,
                               group=pp, data_parallel_group=dp)
        _shard(pipe, mesh["dp"], skip=skip)
        pipe.train_step(x[part] if pipe.is_first else None,
                        y[part] if pipe.is_last else None, _sum_loss,
                        count_fn=lambda labels: (labels != IGNORED).sum())
        mine = dict(pipe.named_parameters())
        failures.expect(any(not isinstance(p, DTensor) for p in mine.values())
                        or not pipe.is_first, f"count, {schedule}: layer {skip} is sharded")
        for name, param in mine.items():
            failures.close(_full(param.grad), theirs[name].grad,
                           f"count, {schedule}: grad of {name}")


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


def _worker(rank: int, world: int, path: str) -> None:
    torch.set_default_dtype(torch.float64)
    failures = Failures(rank, TOL)
    _sharded(failures)
    _tensor_parallel(failures)
    _hybrid(failures)
    _sharded_over_split(failures)
    _one_rank(failures, path)
    _counted(failures)
    _refused(failures)
    failures.finish()


def test_fsdp_ties(tmp_path: Any) -> None:
    """4 processes: a tied embedding/head trains two AdamW steps as the single-process
    model under pp=2 × fsdp=2 (1f1b, zb_h1) and pp=2 × tp=2 (copies split alike under 1f1b,
    differently under zb_h1), the copies equal after; three on HSDP (2×1, 1×2), on
    replicate stages (1f1b, zb_h1) and on FSDP2 over tensor parallelism; under zbv and
    dualpipev (both copies on one rank) the layers wrapped apart by fully_shard, replicate
    or tensor parallelism (alike, Shard(1) against Shard(0)) train three steps exactly, the
    clipped norm is the model's and a checkpoint keeps one entry that loads into the plain
    model; so do two layers of one stage wrapped apart, a tie with two copies on one rank
    and one on another, one FSDP2 unit over both, the layers left unwrapped, and a tie
    whose copies the reducer and FSDP2 average; copies frozen apart raise ValueError naming
    them; count_fn with FSDP2 and a
    data_parallel_group gives the global token mean's gradient; FSDP2 over other ranks than
    data_parallel_group raises ValueError."""
    run_workers(_worker, 4, str(tmp_path / "ckpt"), timeout=300)
