"""Sharded checkpoints of ``DistributedPipe`` load into any layout and into plain models.

One group of four gloo processes runs every scenario, for SGD with momentum and for Adam:

1. two pipelines of two stages, balance ``[2, 3]``, replicas of each other (data parallel,
   same data), train two steps and ``save`` over the world (replicas write each key once);
   ``gather_full_state_dict`` brings each pipeline's model to one rank (rank 0, and rank
   3 = stage 1 of the second pipeline); then one more step gives the reference loss;
2. every rank loads the checkpoint into a plain ``nn.Sequential`` with
   ``load_into_plain`` (no collective, though a process group exists): model state equal
   to the gathered one, optimizer state equal to the rank's own, and one more step of
   the plain model gives the reference loss;
3. at once, ranks 0-1 load into a fresh pipeline of the same layout (outputs and next
   loss bit-identical) and ranks 2-3 into balance ``[4, 1]``;
4. ranks 0-2 load into three stages ``[1, 1, 3]`` (the middle stage has no state and no
   optimizer), gather to its last stage, step, save again over their group, and rank 0
   loads that into a plain model.

The parent process then loads the first checkpoint into a plain model too. Error cases
run in the parent process, without workers. Model state and optimizer state that only
move through checkpoints must be bit-identical; results computed in another layout are
compared at float64 rounding tolerance.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import Tensor, nn

import distributed_harness as harness
from distributed_harness import run_workers
from seqpipe.distributed import DistributedPipe
from seqpipe.distributed.checkpoint import (
    CheckpointError,
    gather_full_state_dict,
    load,
    load_into_plain,
    save,
)

DTYPE = torch.float64
TOL = dict(atol=1e-10, rtol=1e-9)
SAVED_LR = 0.05
FRESH_LR = 0.5  # fresh optimizers start elsewhere: loading must restore the saved lr
CHUNKS = 2
OPTIMIZERS = ("sgd", "adam")


def model() -> nn.Sequential:
    """Five layers; a BatchNorm puts buffers (float and int64) into the state dict."""
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.BatchNorm1d(16),
                         nn.Linear(16, 4)).to(DTYPE)


def optimizer(kind: str, params: Any, lr: float) -> Optional[torch.optim.Optimizer]:
    params = list(params)
    if not params:
        return None  # a stage without parameters has no optimizer
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-3)
    return torch.optim.Adam(params, lr=lr)


def batch(step: int) -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randn(8, 6, generator=gen, dtype=DTYPE),
            torch.randn(8, 4, generator=gen, dtype=DTYPE))


PROBE = torch.linspace(-2, 2, 30, dtype=DTYPE).reshape(5, 6)


def pipe_step(pipe: DistributedPipe, opt: Optional[torch.optim.Optimizer], step: int) -> Tensor:
    x, y = batch(step)
    if opt is not None:
        opt.zero_grad()
    loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                           F.mse_loss)
    if opt is not None:
        opt.step()
    return loss


def plain_step(net: nn.Sequential, opt: torch.optim.Optimizer, step: int) -> Tensor:
    """What a pipeline with ``CHUNKS`` micro-batches computes (BatchNorm sees each one)."""
    x, y = batch(step)
    opt.zero_grad()
    xs, ys = torch.tensor_split(x, CHUNKS), torch.tensor_split(y, CHUNKS)
    loss = sum(F.mse_loss(net(a), b) * (len(a) / len(x)) for a, b in zip(xs, ys))
    loss.backward()
    opt.step()
    return loss.detach()


def probe_output(net: nn.Module) -> Optional[Tensor]:
    """Eval-mode output (BatchNorm uses its running statistics); None off the last stage."""
    net.eval()
    if isinstance(net, DistributedPipe):
        out = net(PROBE if net.is_first else None)
    else:
        with torch.no_grad():
            out = net(PROBE)
    net.train()
    return out


def optim_state(net: nn.Module, opt: Optional[torch.optim.Optimizer]
                ) -> Dict[str, Dict[str, Any]]:
    """The optimizer's per-parameter state and lr, by the parameter's original name."""
    if opt is None:
        return {}
    lrs = {p: g["lr"] for g in opt.param_groups for p in g["params"]}
    return {name: {"lr": lrs[p], **{k: v.clone() if isinstance(v, Tensor) else v
                                    for k, v in opt.state[p].items()}}
            for name, p in net.named_parameters()}


class Failures(harness.Failures):
    """``harness.Failures`` with bit-exact comparisons of values and state dicts."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank, TOL)

    def equal(self, actual: Any, expected: Any, what: str) -> None:
        if isinstance(expected, Tensor) and isinstance(actual, Tensor):
            ok = actual.dtype == expected.dtype and torch.equal(actual, expected)
        else:
            ok = actual == expected
        self.expect(ok, f"{what}: {actual!r} != {expected!r}" if not ok else what)

    def states(self, actual: Dict[str, Any], expected: Dict[str, Any], what: str) -> None:
        """Two state dicts (model or per-parameter optimizer) equal bit for bit, by key."""
        self.expect(list(actual) == list(expected),
                    f"{what}: keys {list(actual)} != {list(expected)}")
        for key in actual.keys() & expected.keys():
            a, e = actual[key], expected[key]
            if isinstance(e, dict):
                self.states(a, e, f"{what}[{key}]")
            else:
                self.equal(a, e, f"{what}[{key}]")


def subset(state: Dict[str, Any], keys: Any) -> Dict[str, Any]:
    return {k: v for k, v in state.items() if k in set(keys)}


def distcp_bytes(path: str) -> Tuple[int, int]:
    """Bytes in the checkpoint's data files, and bytes its metadata points at (once each)."""
    files = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                if f.endswith(".distcp"))
    metadata = dcp.FileSystemReader(path).read_metadata()
    return files, sum(info.length for info in metadata.storage_data.values())


# --------------------------------------------------------------------------- workers


def _scenarios(rank: int, kind: str, root: str, groups: Dict[str, Any],
               failures: Failures) -> None:
    path = os.path.join(root, kind)
    line = rank // 2  # which of the two replicated pipelines
    what = f"{kind}"

    # 1. train two steps on two replicated pipelines [2, 3], save, gather, continue
    torch.manual_seed(1)
    pipe = DistributedPipe(model(), CHUNKS, balance=[2, 3], group=groups["pp"][line],
                           data_parallel_group=groups["dp"][rank % 2])
    opt = optimizer(kind, pipe.parameters(), SAVED_LR)
    for step in range(2):
        pipe_step(pipe, opt, step)
    save(pipe, opt, path)
    full = gather_full_state_dict(pipe, dst=line)  # rank 0 (stage 0) and rank 3 (stage 1)
    saved_model = {k: v.clone() for k, v in pipe.state_dict().items()}
    saved_optim = optim_state(pipe, opt)
    saved_out = probe_output(pipe)
    loss3 = pipe_step(pipe, opt, 2)
    failures.expect((full is not None) == (rank in (0, 3)),
                    f"{what}: gather_full_state_dict returned on the wrong ranks")
    if rank == 0:
        files, referenced = distcp_bytes(path)
        failures.expect(files == referenced, f"{what}: replicas wrote {files} bytes, the "
                        f"checkpoint references {referenced}: duplicated keys")
        torch.save({"full": full, "loss3": loss3}, os.path.join(root, f"{kind}.pt"))

    # 2. into a plain model in this one process (a process group exists; it is not used)
    torch.manual_seed(2)
    plain = model()
    plain_opt = optimizer(kind, plain.parameters(), FRESH_LR)
    assert plain_opt is not None
    load_into_plain(plain, plain_opt, path)
    ref_model = {k: v.clone() for k, v in plain.state_dict().items()}
    ref_optim = optim_state(plain, plain_opt)
    ref_out = probe_output(plain)
    if full is not None:
        failures.states(full, ref_model, f"{what}: gathered vs plain-loaded state dict")
    failures.states(subset(ref_model, saved_model), saved_model, f"{what}: plain model")
    failures.states(subset(ref_optim, saved_optim), saved_optim, f"{what}: plain optimizer")
    if pipe.is_last:
        failures.close(ref_out, saved_out, f"{what}: plain output")
    failures.close(plain_step(plain, plain_opt, 2), loss3, f"{what}: plain step 3 loss")

    # 3. ranks 0-1: the same layout (bit-identical); ranks 2-3: balance [4, 1]
    same = line == 0
    balance = [2, 3] if same else [4, 1]
    torch.manual_seed(3)
    fresh = DistributedPipe(model(), CHUNKS, balance=balance, group=groups["pp"][line])
    fresh_opt = optimizer(kind, fresh.parameters(), FRESH_LR)
    load(fresh, fresh_opt, path, process_group=groups["pp"][line])
    where = f"{what}: {balance}"
    failures.states(fresh.state_dict(), subset(ref_model, fresh.state_dict()), f"{where} model")
    failures.states(optim_state(fresh, fresh_opt), subset(ref_optim, dict(
        fresh.named_parameters())), f"{where} optimizer")
    out = probe_output(fresh)
    if fresh.is_last:
        if same:
            failures.equal(out, saved_out, f"{where}: output")
        else:
            failures.close(out, ref_out, f"{where}: output")
    loss = pipe_step(fresh, fresh_opt, 2)
    if same:
        failures.equal(loss, loss3, f"{where}: step 3 loss")
    else:
        failures.close(loss, loss3, f"{where}: step 3 loss")

    # 4. ranks 0-2: three stages [1, 1, 3], the middle one without state or optimizer
    if rank == 3:
        return
    torch.manual_seed(4)
    three = DistributedPipe(model(), CHUNKS, balance=[1, 1, 3], group=groups["trio"])
    three_opt = optimizer(kind, three.parameters(), FRESH_LR)
    failures.expect((three_opt is None) == (rank == 1), f"{what}: stage 1 has parameters?")
    load(three, three_opt, path, process_group=groups["trio"])
    where = f"{what}: [1, 1, 3]"
    full3 = gather_full_state_dict(three, dst=2)
    if rank == 2:
        assert full3 is not None
        failures.states(full3, ref_model, f"{where} gathered")
    failures.states(optim_state(three, three_opt), subset(ref_optim, dict(
        three.named_parameters())), f"{where} optimizer")
    out = probe_output(three)
    if three.is_last:
        failures.close(out, ref_out, f"{where}: output")
    failures.close(pipe_step(three, three_opt, 2), loss3, f"{where}: step 3 loss")
    # ... and saved from there (an empty stage writes nothing) into a plain model
    path3 = os.path.join(root, f"{kind}-three")
    save(three, three_opt, path3, process_group=groups["trio"])
    full3 = gather_full_state_dict(three, dst=0)
    if rank == 0:
        assert full3 is not None
        again = model()
        again_opt = optimizer(kind, again.parameters(), FRESH_LR)
        load_into_plain(again, again_opt, path3)
        failures.states(again.state_dict(), full3, f"{where} saved, plain model")
        failures.states(subset(optim_state(again, again_opt), dict(three.named_parameters())),
                        optim_state(three, three_opt), f"{where} saved, plain optimizer")


def checkpoint_worker(rank: int, world: int, root: str) -> None:
    failures = Failures(rank)
    groups = {"pp": [dist.new_group([0, 1]), dist.new_group([2, 3])],
              "dp": [dist.new_group([0, 2]), dist.new_group([1, 3])],
              "trio": dist.new_group([0, 1, 2])}
    for kind in OPTIMIZERS:
        _scenarios(rank, kind, root, groups, failures)
    failures.finish()


def test_checkpoint_moves_between_layouts(tmp_path: Any) -> None:
    """Save from [2, 3] x 2 replicas; load into [2, 3], [4, 1], [1, 1, 3] and plain models."""
    run_workers(checkpoint_worker, 4, str(tmp_path), timeout=150, pg_timeout=60)
    # and in this process, which has no process group at all
    for kind in OPTIMIZERS:
        expected = torch.load(tmp_path / f"{kind}.pt")
        torch.manual_seed(5)
        plain = model()
        opt = optimizer(kind, plain.parameters(), FRESH_LR)
        assert opt is not None
        load_into_plain(plain, opt, tmp_path / kind)
        state = plain.state_dict()
        assert list(state) == list(expected["full"])
        for key, value in expected["full"].items():
            assert torch.equal(state[key], value), key
        assert all(g["lr"] == SAVED_LR for g in opt.param_groups)
        torch.testing.assert_close(plain_step(plain, opt, 2), expected["loss3"], **TOL)


# --------------------------------------------------------------------------- errors


def _plain_checkpoint(path: Any) -> Tuple[nn.Sequential, torch.optim.Optimizer]:
    net = model()
    opt = optimizer("sgd", net.parameters(), SAVED_LR)
    assert opt is not None
    plain_step(net, opt, 0)
    with pytest.warns(UserWarning):  # DCP: no process group, saving in one process
        save(net, opt, path)
    return net, opt


def test_missing_keys_are_named(tmp_path: Any) -> None:
    """A model with a layer the checkpoint lacks: DCP's error names the key."""
    _plain_checkpoint(tmp_path)
    bigger = nn.Sequential(*model(), nn.Linear(4, 4)).to(DTYPE)
    with pytest.raises(CheckpointError, match=r"loading the checkpoint at .* failed: rank 0: "
                                              r"RuntimeError: Missing key in checkpoint "
                                              r"state_dict: model\.5\.weight"):
        load_into_plain(bigger, None, tmp_path)


def test_unexpected_keys_need_strict_false(tmp_path: Any) -> None:
    """A smaller model: strict refuses (DCP alone would load it); strict=False loads it."""
    net, _ = _plain_checkpoint(tmp_path)
    smaller = nn.Sequential(*model()[:3]).to(DTYPE)
    with pytest.raises(ValueError, match=r"holds 11 model entries but this model has 4.*"
                                         r"3\.bias.*strict=False"):
        load_into_plain(smaller, None, tmp_path)
    load_into_plain(smaller, None, tmp_path, strict=False)
    for key, value in smaller.state_dict().items():
        assert torch.equal(value, net.state_dict()[key])


def test_missing_optimizer_state_is_named(tmp_path: Any) -> None:
    """Saved without the optimizer, loaded with one: the missing optimizer key is named."""
    net = model()
    with pytest.warns(UserWarning):
        save(net, None, tmp_path)
    fresh = model()
    opt = optimizer("sgd", fresh.parameters(), FRESH_LR)
    with pytest.raises(CheckpointError, match=r"Missing key in checkpoint state_dict: "
                                        r"optim\.state\.0\.weight\.momentum_buffer"):
        load_into_plain(fresh, opt, tmp_path)
    load_into_plain(fresh, None, tmp_path)  # the model alone loads
    assert torch.equal(fresh[0].weight, net[0].weight)


def test_fresh_optimizer_with_gradients_still_gets_its_state(tmp_path: Any) -> None:
    """Parameters that already hold gradients must not stop the momentum from loading."""
    net, opt = _plain_checkpoint(tmp_path)
    fresh = model()
    fresh_opt = optimizer("sgd", fresh.parameters(), FRESH_LR)
    assert fresh_opt is not None
    fresh(PROBE).sum().backward()  # gradients, but no optimizer state yet
    grads = [p.grad.clone() for p in fresh.parameters()]
    load_into_plain(fresh, fresh_opt, tmp_path)
    assert optim_state(fresh, fresh_opt).keys() == optim_state(net, opt).keys()
    for name, state in optim_state(net, opt).items():
        assert torch.equal(optim_state(fresh, fresh_opt)[name]["momentum_buffer"],
                           state["momentum_buffer"]), name
    assert all(torch.equal(p.grad, g) for p, g in zip(fresh.parameters(), grads))


def test_shape_mismatch_is_an_error(tmp_path: Any) -> None:
    _plain_checkpoint(tmp_path)
    wider = model()
    wider[4] = nn.Linear(16, 5).to(DTYPE)
    with pytest.raises(CheckpointError, match=r"4\.weight|[Ss]ize mismatch|shape"):
        load_into_plain(wider, None, tmp_path)


def test_gather_wants_a_distributed_pipe() -> None:
    with pytest.raises(TypeError, match="takes a DistributedPipe"):
        gather_full_state_dict(model())  # type: ignore[arg-type]
