"""The state of sharded stages (pp=2 × dp=2 on 4 gloo processes): ``base_seed`` on layers
sharded or split on ``meta`` gives the seeded plain model's values, and DCP checkpoints of
FSDP2-sharded stages load, exactly, into a plain model and into another sharded layout."""
from __future__ import annotations

from typing import Any, Dict

import torch
from test_fsdp import _batch, _full, _model
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from distributed_harness import Failures, run_workers
from seqpipe.distributed import DistributedPipe, mesh_groups
from seqpipe.distributed.checkpoint import gather_full_state_dict, load, load_into_plain, save
from seqpipe.seeding import seed_layers

TOL = dict(rtol=1e-6, atol=1e-9)


def _build() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 16), nn.Linear(16, 3))


def _shard_layers(model: nn.Module, mesh: DeviceMesh) -> None:
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)


def _same(failures: Failures, actual: Any, expected: Any, what: str) -> None:
    """``actual`` equals ``expected`` exactly (a tensor's values, dtype and shape)."""
    if not isinstance(expected, Tensor):  # a hyperparameter
        failures.expect(actual == expected, f"{what}: {actual!r} != {expected!r}")
        return
    same = (isinstance(actual, Tensor) and actual.shape == expected.shape
            and torch.equal(actual, expected))
    failures.expect(same, f"{what}: differs" + (
        f" by {(actual - expected).abs().max().item():.3g}" if not same and
        isinstance(actual, Tensor) and actual.shape == expected.shape else ""))


def _full_params(pipe: nn.Module) -> Dict[str, Tensor]:
    return {name: _full(p.detach()) for name, p in pipe.named_parameters()}


def _train(pipe: DistributedPipe, opt: torch.optim.Optimizer, replica: int, steps: int,
           reference: nn.Module = None, ref_opt: torch.optim.Optimizer = None) -> None:
    for step in range(steps):
        x, y = _batch(step)
        half = slice(replica * 8, replica * 8 + 8)
        opt.zero_grad()
        pipe.train_step(x[half] if pipe.is_first else None, y[half] if pipe.is_last else None,
                        nn.functional.mse_loss)
        opt.step()
        if reference is not None:
            ref_opt.zero_grad()
            nn.functional.mse_loss(reference(x), y).backward()
            ref_opt.step()


def _worker(rank: int, world: int, path: str) -> None:
    torch.set_default_dtype(torch.float64)
    failures = Failures(rank, TOL)
    _seeded(failures)
    _checkpoint(rank, failures, path)
    failures.finish()


def _seeded(failures: Failures) -> None:
    """Layers sharded (FSDP2) or split (tensor parallelism) on meta, then materialised by
    the pipe with base_seed: the seeded plain model's values, and FSDP2 trains from them."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, _ = mesh_groups(mesh)
    replica = mesh["dp"].get_local_rank()
    with torch.device("meta"):
        model = _build()
    _shard_layers(model, mesh["dp"])
    pipe = DistributedPipe(model, chunks=4, balance=[3, 3], group=pp, base_seed=7)
    reference = seed_layers(_build(), 7)
    theirs = dict(reference.named_parameters())
    mine = _full_params(pipe)
    failures.expect(bool(mine) and all(isinstance(p, DTensor) for p in pipe.parameters()),
                    "fully_shard on meta: the stage's parameters are not all DTensors")
    for name, value in mine.items():
        _same(failures, value, theirs[name].detach(), f"fully_shard on meta: {name}")
    for stage in pipe.stage_modules:
        fully_shard(stage, mesh=mesh["dp"])
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    _train(pipe, opt, replica, 2, reference, ref_opt)
    for name, value in _full_params(pipe).items():
        failures.close(value, theirs[name].detach(), f"fully_shard on meta: {name} trained")

    with torch.device("meta"):  # tensor parallelism: column- then row-wise split Linears
        model = _build()
    for index, style in ((0, ColwiseParallel()), (2, ColwiseParallel()),
                         (4, RowwiseParallel()), (5, RowwiseParallel())):
        parallelize_module(model[index], mesh["dp"], style)
    pipe = DistributedPipe(model, chunks=4, balance=[3, 3], group=pp, base_seed=7)
    theirs = dict(seed_layers(_build(), 7).named_parameters())  # untrained
    split = [name for name, p in pipe.named_parameters() if isinstance(p, DTensor)]
    failures.expect(len(split) == 4, f"tensor parallel on meta: DTensors {split}")
    for name, value in _full_params(pipe).items():
        _same(failures, value, theirs[name].detach(), f"tensor parallel on meta: {name}")


def _optim_state(module: nn.Module, opt: torch.optim.Optimizer) -> Dict[str, Any]:
    """The optimizer state by parameter name, full tensors (DCP's own helper)."""
    options = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    return get_optimizer_state_dict(module, opt, options=options)


def _checkpoint(rank: int, failures: Failures, path: str) -> None:
    """Save pp=2 × dp=2 FSDP2 stages with their AdamW state; load into a plain model and
    into pp=2 × dp=2 with another balance: the same values and optimizer state, exactly."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, _ = mesh_groups(mesh)
    replica = mesh["dp"].get_local_rank()
    pipe = DistributedPipe(_model(), chunks=4, balance=[4, 4], group=pp)
    for stage in pipe.stage_modules:
        _shard_layers(stage, mesh["dp"])
        fully_shard(stage, mesh=mesh["dp"])
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    _train(pipe, opt, replica, 2)
    save(pipe, opt, path)
    saved, saved_state = _full_params(pipe), _optim_state(pipe, opt)

    plain = _model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.5)
    load_into_plain(plain, plain_opt, path)
    plain_params = dict(plain.named_parameters())
    for name, value in saved.items():
        _same(failures, plain_params[name].detach(), value, f"plain model: {name}")
    plain_state = _optim_state(plain, plain_opt)
    failures.expect(len(saved_state) > 2 * len(saved), "no optimizer state saved")
    for key, value in saved_state.items():
        _same(failures, plain_state[key], value, f"plain optimizer: {key}")

    full = gather_full_state_dict(pipe)
    if full is not None:  # stage 0 of each pipeline: the whole model, full tensors
        expected = plain.state_dict()
        failures.expect(list(full) == list(expected),
                        f"gather_full_state_dict keys {list(full)}")
        for key, value in full.items():
            _same(failures, value, expected[key], f"gather_full_state_dict: {key}")

    torch.manual_seed(99)  # other values, to be overwritten by the load
    other = DistributedPipe(nn.Sequential(*_model()).apply(_reset), chunks=4,
                            balance=[3, 5], group=pp)
    for stage in other.stage_modules:
        _shard_layers(stage, mesh["dp"])
        fully_shard(stage, mesh=mesh["dp"])
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5)
    load(other, other_opt, path)
    for name, value in _full_params(other).items():
        _same(failures, value, plain_params[name].detach(), f"balance [3, 5]: {name}")
    other_state = _optim_state(other, other_opt)
    failures.expect(bool(other_state), "balance [3, 5]: no optimizer state")
    for key, value in other_state.items():
        _same(failures, value, plain_state[key], f"balance [3, 5] optimizer: {key}")
    # and they train on alike: one more step of each, from the loaded state
    _train(other, other_opt, replica, 1)
    _train(pipe, opt, replica, 1)
    resumed, kept_on = _full_params(other), _full_params(pipe)
    for name, value in resumed.items():
        if name in kept_on:
            failures.close(value, kept_on[name], f"balance [3, 5]: {name} trained on")


def _reset(module: nn.Module) -> None:
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def test_sharded_state(tmp_path: Any) -> None:
    """pp=2 × dp=2, one launch. base_seed: layers sharded with fully_shard, and split with
    ColwiseParallel/RowwiseParallel, on meta before the pipe materialises them get exactly
    seed_layers' values (DTensor's own random ops drew others, 0.6 apart), and FSDP2 trains
    from them as the plain model does. DCP: FSDP2 stages with AdamW state, saved, load into
    a plain model (load_into_plain) and into pp=2 × dp=2 with balance [3, 5] (load) with the
    same values and optimizer state, exactly; gather_full_state_dict gives the full
    tensors; the reloaded pipe trains on as the one that saved."""
    run_workers(_worker, 4, str(tmp_path / "ckpt"), timeout=200, pg_timeout=60)
