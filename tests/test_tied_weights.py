"""Parameters shared across the stages of a ``DistributedPipe`` (tied weights).

Every copy of a tied parameter must get the unpipelined model's gradient (the sum of all
its uses), and identical optimizer steps must keep the copies identical. Worker runs
combine cases to keep the process count (at most 4) and the test time small:

* 2 and 3 ranks: a language model whose embedding (stage 0) is tied to its output
  projection (last stage), both schedules, every checkpoint mode, three SGD steps against
  the plain model; on 2 ranks also a model built on ``meta``, copies made unequal before
  construction (every rank raises), ``check_ties`` after a copy drifts, and a buffer
  shared across stages (every rank raises);
* 4 ranks: ties between non-adjacent stages (0-2 and 1-3; with at most 4 ranks no two
  middle stages are apart) and a submodule reused in stages 0 and 3, summed on groups
  of their holders; the language model on a hand-made group of 3 of the 4 ranks (the
  sum then runs over the pipeline group); 2 stages × 2 replicas from ``mesh_groups``
  with a tie (holders' groups made for both pipelines);
* 3 ranks: a DCP checkpoint that keeps the tie once and loads into another layout and
  into a plain model, with the tie intact.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

from distributed_harness import Failures, run_workers
from seqpipe.distributed import DistributedPipe, mesh_groups
from seqpipe.distributed.checkpoint import gather_full_state_dict, load, load_into_plain, save
from seqpipe.distributed.ties import SharedBufferError, Tie, drop_layer, find_ties, ties_kept

VOCAB, WIDTH = 20, 8
TOL = dict(atol=1e-12, rtol=1e-10)


def language_model() -> nn.Sequential:
    """Embedding tied to the output projection, as in the issue."""
    torch.manual_seed(0)
    emb = nn.Embedding(VOCAB, WIDTH)
    head = nn.Linear(WIDTH, VOCAB, bias=False)
    head.weight = emb.weight
    return nn.Sequential(emb, nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH),
                         head).double()


def tokens(step: int, n: int = 12) -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(10 + step)
    return torch.randint(VOCAB, (n,), generator=gen), torch.randint(VOCAB, (n,), generator=gen)


def named(model: nn.Module) -> Dict[str, nn.Parameter]:
    return dict(model.named_parameters(remove_duplicate=False))


def train_against_plain(pipe: DistributedPipe, reference: nn.Sequential, batch: Any,
                        loss_fn: Any, failures: Failures, what: str, steps: int = 3) -> None:
    """``steps`` SGD steps of ``pipe`` and of the plain ``reference`` on the same batches:
    every local gradient and, at the end, every local weight equal the reference's."""
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    theirs = named(reference)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                               loss_fn)
        ref_opt.zero_grad()
        ref_loss = loss_fn(reference(x), y)
        ref_loss.backward()
        failures.close(loss, ref_loss.detach(), f"{what}: loss of step {step}")
        for name, param in named(pipe).items():
            failures.close(param.grad, theirs[name].grad, f"{what}: grad of {name}, step {step}")
        opt.step()
        ref_opt.step()
    for name, param in named(pipe).items():
        failures.close(param.detach(), theirs[name].detach(), f"{what}: {name} after {steps} steps")


# ----------------------------------------------------------------- 2 and 3 ranks, the issue

def _language_model(rank: int, world: int) -> None:
    failures = Failures(rank, TOL)
    balance = [2, 3] if world == 2 else [2, 2, 1]
    for schedule in ("fill_drain", "1f1b"):
        for checkpoint in ("always", "except_last", "never"):
            pipe = DistributedPipe(language_model(), chunks=3, balance=balance,
                                   schedule=schedule, checkpoint=checkpoint)
            failures.expect([t.names for t in pipe.ties] == [("0.weight", "4.weight")],
                            f"ties found: {pipe.ties}")
            train_against_plain(pipe, language_model(), tokens, F.cross_entropy, failures,
                                f"{schedule}/{checkpoint}")
            pipe.check_ties()
    reference = language_model().state_dict()
    failures.expect(set(pipe.state_dict()) == {k for k in reference
                                               if int(k.split(".")[0]) in _layers(pipe)},
                    f"state_dict keys {sorted(pipe.state_dict())}")
    if world == 2:
        _meta_built(failures)
        _unequal_copies(rank)
        _drifted_copies(rank)
        _shared_buffer()
    failures.finish()


def _layers(pipe: DistributedPipe) -> range:
    start = sum(pipe.balance[:pipe.stage_index])
    return range(start, start + pipe.balance[pipe.stage_index])


def _meta_built(failures: Failures) -> None:
    """Copies built on meta are freshly initialised per rank: they take stage 0's values."""
    with torch.device("meta"):
        model = language_model()
    pipe = DistributedPipe(model, chunks=2, balance=[2, 3])
    copy = named(pipe)["0.weight" if pipe.is_first else "4.weight"]
    failures.expect(not copy.is_meta, "a tied copy was left on meta")
    everyone = [torch.empty_like(copy) for _ in range(2)]
    dist.all_gather(everyone, copy.detach().contiguous())
    failures.close(everyone[1], everyone[0], "meta-built copies after construction")
    train_against_plain(pipe, _plain_like(pipe, everyone[0]), tokens, F.cross_entropy,
                        failures, "meta-built", steps=1)


def _plain_like(pipe: DistributedPipe, tied: Tensor) -> nn.Sequential:
    """The plain model with this stage's values gathered from both stages."""
    plain = language_model()
    state = [None, None]
    dist.all_gather_object(state, {k: v.clone() for k, v in pipe.state_dict().items()})
    merged = {**state[0], **state[1]}  # type: ignore[dict-item]
    merged["0.weight"] = merged["4.weight"] = tied
    plain.load_state_dict(merged)
    return plain


def _unequal_copies(rank: int) -> None:
    model = language_model()
    if rank == 1:
        with torch.no_grad():
            model[4].weight.add_(1e-3)  # one rank seeded differently: its copy differs
    with pytest.raises(ValueError, match=r"tied parameter '0\.weight' \(also '4\.weight'\) "
                                         r"differs between stages \[0, 1\].*same values"):
        DistributedPipe(model, chunks=2, balance=[2, 3])


def _drifted_copies(rank: int) -> None:
    pipe = DistributedPipe(language_model(), chunks=2, balance=[2, 3])
    pipe.check_ties()
    if rank == 1:
        with torch.no_grad():
            named(pipe)["4.weight"].mul_(2)
    with pytest.raises(RuntimeError, match=r"the tied parameter '0\.weight' "
                                           r"\(also '4\.weight'\) differs between stages "
                                           r"\[0, 1\]: its copies drifted apart"):
        pipe.check_ties()


@pytest.mark.parametrize("world", [2, 3])
def test_tied_embedding_and_head_train_like_the_plain_model(world: int) -> None:
    run_workers(_language_model, world, timeout=240)


class Block(nn.Module):
    """A layer around a submodule that another layer may share."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.inner(x)) + x


def _shared_buffer() -> None:
    norm = nn.BatchNorm1d(WIDTH)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), Block(norm), nn.Linear(WIDTH, WIDTH),
                          Block(norm))
    with pytest.raises(SharedBufferError, match=r"the buffer '1\.inner\.running_mean' "
                                                r"\(also '3\.inner\.running_mean'\) is shared "
                                                r"by layers of stages \[0, 1\].*balance="):
        DistributedPipe(model, chunks=2, balance=[2, 2])


def test_find_ties_lists_every_name_and_stage() -> None:
    shared = nn.Linear(4, 4)
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    model = nn.Sequential(first, Block(shared), nn.Tanh(), Block(shared), last)
    ties = find_ties(model, [2, 1, 2])
    assert [(t.names, t.stages) for t in ties] == [
        (("0.weight", "4.weight"), (0, 2)),
        (("1.inner.weight", "3.inner.weight"), (0, 2)),
        (("1.inner.bias", "3.inner.bias"), (0, 2))]
    assert ties[0] == Tie(("0.weight", "4.weight"), (0, 2), (4, 4), torch.float32)
    assert find_ties(model, [5]) == []  # one stage: nothing to tie across


@pytest.mark.parametrize("swap", [False, True])
def test_dropping_a_layer_leaves_what_the_kept_layers_share(swap: bool) -> None:
    """A tied tensor and a reused submodule stay real for the layers that keep them, also
    where torch converts tensors in place (``layer.to("meta")`` would turn both to meta)."""
    shared = nn.Linear(4, 4)
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    kept = nn.Sequential(first, Block(shared))
    dropped = nn.Sequential(Block(shared), last)
    before = first.weight.detach().clone()
    old = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    unrelated = nn.Linear(4, 4)
    try:
        drop_layer(dropped, keep=kept)
        drop_layer(unrelated, keep=kept)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(old)
    assert last.bias.is_meta and not last.weight.is_meta  # its own tensor is freed
    assert last.weight is first.weight and torch.equal(first.weight, before)
    assert dropped[0].inner is shared and not shared.weight.is_meta
    assert unrelated.weight.is_meta and unrelated.bias.is_meta


def test_materialising_a_stage_keeps_the_ties_inside_it() -> None:
    """``to_empty`` gives every entry a new tensor; a tie inside one stage survives it."""
    with torch.device("meta"):
        first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight
    stage = nn.Sequential(first, second)
    with ties_kept(stage):
        stage.to_empty(device="cpu")
    assert second.weight is first.weight and not first.weight.is_meta
    assert second.bias is not first.bias


# ---------------------------------------------------------------------------- 4 ranks

def many_ties() -> nn.Sequential:
    """Four stages ``[2, 2, 2, 3]``: weight ties between stages 0-2 and 1-3, and a
    submodule (weight and bias) reused in stages 0 and 3."""
    torch.manual_seed(1)
    a, b, a2, b2 = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
    a2.weight, b2.weight = a.weight, b.weight
    shared = nn.Linear(WIDTH, WIDTH)
    return nn.Sequential(a, Block(shared), b, nn.Tanh(), a2, nn.Tanh(), b2, Block(shared),
                         nn.Linear(WIDTH, 3)).double()


def vectors(step: int) -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(30 + step)
    return (torch.randn(12, WIDTH, generator=gen, dtype=torch.float64),
            torch.randn(12, 3, generator=gen, dtype=torch.float64))


def _four(rank: int, world: int) -> None:
    failures = Failures(rank, TOL)
    for schedule in ("fill_drain", "1f1b"):
        pipe = DistributedPipe(many_ties(), chunks=4, balance=[2, 2, 2, 3], schedule=schedule)
        failures.expect([(t.names, t.stages) for t in pipe.ties] == [
            (("0.weight", "4.weight"), (0, 2)), (("1.inner.weight", "7.inner.weight"), (0, 3)),
            (("1.inner.bias", "7.inner.bias"), (0, 3)), (("2.weight", "6.weight"), (1, 3))],
            f"ties found: {[(t.names, t.stages) for t in pipe.ties]}")
        _expect_holder_groups(pipe, failures, schedule)
        train_against_plain(pipe, many_ties(), vectors, F.mse_loss, failures, schedule)
        pipe.check_ties()
    trio = dist.new_group([0, 1, 2])  # rank 3 stays out: the sums run over the trio
    if rank < 3:
        pipe = DistributedPipe(language_model(), chunks=3, balance=[2, 2, 1], group=trio)
        tied = pipe._tied
        assert tied is not None
        failures.expect(tied.sum_groups == [trio], "trio: the sum runs over the pipeline group")
        train_against_plain(pipe, language_model(), tokens, F.cross_entropy, failures, "trio")
        pipe.check_ties()
    _pipeline_by_data(rank, failures)
    failures.finish()


def _pipeline_by_data(rank: int, failures: Failures) -> None:
    """2 stages × 2 replicas, each replica on half the batch: the tie's gradient is the
    plain model's on the whole batch (mean over replicas, sum over the tie)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh_groups(mesh)
    replica = dist.get_rank(dp)
    pipe = DistributedPipe(language_model(), chunks=2, balance=[2, 3], schedule="1f1b",
                           group=pp, data_parallel_group=dp)
    _expect_holder_groups(pipe, failures, "pp x dp")
    reference = language_model()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    theirs = named(reference)
    for step in range(3):
        x, y = tokens(step)
        half = slice(replica * 6, replica * 6 + 6)
        opt.zero_grad()
        pipe.train_step(x[half] if pipe.is_first else None, y[half] if pipe.is_last else None,
                        F.cross_entropy)
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        for name, param in named(pipe).items():
            failures.close(param.grad, theirs[name].grad, f"pp x dp: grad of {name}, step {step}")
        opt.step()
        ref_opt.step()
    pipe.check_ties()


def _expect_holder_groups(pipe: DistributedPipe, failures: Failures, what: str) -> None:
    """Each tie's sum runs on a group of exactly its holders' ranks in this pipeline."""
    tied = pipe._tied
    assert tied is not None
    ranks = dist.get_process_group_ranks(pipe.group if pipe.group is not None
                                         else dist.group.WORLD)  # type: ignore[arg-type]
    for tie, group in zip(pipe.ties, tied.sum_groups):
        holders = [ranks[s] for s in tie.stages]
        if pipe.stage_index in tie.stages:
            failures.expect(group is not None and dist.get_process_group_ranks(group)
                            == holders, f"{what}: {tie.name} sums over {holders}")
        else:
            failures.expect(group is None, f"{what}: stage {pipe.stage_index} sums {tie.name}")


def test_ties_between_any_stages_and_with_data_parallelism() -> None:
    run_workers(_four, 4, timeout=300)


# ------------------------------------------------------------------------- checkpoints

def _trained_plain(steps: int) -> Tuple[nn.Sequential, torch.optim.Optimizer]:
    model = language_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = tokens(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def _momentum(opt: torch.optim.Optimizer, model: nn.Module) -> Dict[str, Tensor]:
    return {name: opt.state[p]["momentum_buffer"] for name, p in named(model).items()}


def _checkpoints(rank: int, world: int, folder: str) -> None:
    failures = Failures(rank, TOL)
    reference, ref_opt = _trained_plain(2)
    pipe = DistributedPipe(language_model(), chunks=3, balance=[2, 2, 1])
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        x, y = tokens(step)
        opt.zero_grad()
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                        F.cross_entropy)
        opt.step()
    save(pipe, opt, os.path.join(folder, "pipe"))
    full = gather_full_state_dict(pipe)  # every name, as the plain model's state_dict()
    if rank == 0:
        assert full is not None
        failures.expect(list(full) == list(reference.state_dict()), f"gathered {list(full)}")
        for key, value in reference.state_dict().items():
            failures.close(full.get(key), value, f"gathered {key}")
    expected = _momentum(ref_opt, reference)
    for path in ("pipe", "plain"):  # into another layout, from a pipeline and a plain model
        other = DistributedPipe(language_model(), chunks=3, balance=[3, 1, 1])
        other_opt = torch.optim.SGD(other.parameters(), lr=0.5, momentum=0.5)
        load(other, other_opt, os.path.join(folder, path))
        for name, param in named(other).items():
            failures.close(param.detach(), named(reference)[name].detach(),
                           f"{path} -> [3, 1, 1]: {name}")
            failures.close(other_opt.state[param]["momentum_buffer"], expected[name],
                           f"{path} -> [3, 1, 1]: momentum of {name}")
        other.check_ties()
    pair = dist.new_group([0, 1])
    if rank < 2:  # two stages on two of the ranks; the third loads a plain model meanwhile
        two = DistributedPipe(language_model(), chunks=3, balance=[2, 3], group=pair)
        two_opt = torch.optim.SGD(two.parameters(), lr=0.5, momentum=0.5)
        load(two, two_opt, os.path.join(folder, "pipe"), process_group=pair)
        train_against_plain_continued(two, two_opt, reference, ref_opt, failures)
    else:
        plain = language_model()
        plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.5)
        load_into_plain(plain, plain_opt, os.path.join(folder, "pipe"))
        failures.expect(plain[0].weight is plain[4].weight, "the plain model's tie is broken")
        failures.close(plain[0].weight.detach(), reference[0].weight.detach(), "plain: tie")
        failures.close(plain_opt.state[plain[0].weight]["momentum_buffer"],
                       expected["0.weight"], "plain: momentum of the tie")
    failures.finish()


def train_against_plain_continued(pipe: DistributedPipe, opt: torch.optim.Optimizer,
                                  reference: nn.Sequential, ref_opt: torch.optim.Optimizer,
                                  failures: Failures) -> None:
    """One more step after loading: the loaded momentum and lr act on every copy."""
    x, y = tokens(2)
    opt.zero_grad()
    pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, F.cross_entropy)
    opt.step()
    ref_opt.zero_grad()
    F.cross_entropy(reference(x), y).backward()
    ref_opt.step()
    for name, param in named(pipe).items():
        failures.close(param.detach(), named(reference)[name].detach(),
                       f"loaded [2, 3], one more step: {name}")
    pipe.check_ties()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoints_keep_a_tie_once_and_load_it_into_every_copy(tmp_path: Any) -> None:
    reference, ref_opt = _trained_plain(2)
    save(reference, ref_opt, tmp_path / "plain")
    run_workers(_checkpoints, 3, str(tmp_path), timeout=240)
    for path in ("pipe", "plain"):
        keys = set(dcp.FileSystemReader(tmp_path / path).read_metadata().state_dict_metadata)
        assert "model.0.weight" in keys and "model.4.weight" not in keys, sorted(keys)
        assert "optim.state.0.weight.momentum_buffer" in keys, sorted(keys)
        assert not any(k.startswith(("optim.state.4.", "optim.param_groups.4."))
                       for k in keys), sorted(keys)
    plain = language_model()
    opt = torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.5)
    load_into_plain(plain, opt, tmp_path / "pipe")
    assert plain[0].weight is plain[4].weight
    torch.testing.assert_close(plain.state_dict(), reference.state_dict(), **TOL)
    assert opt.param_groups[0]["lr"] == 0.1


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_with_both_names_of_a_tie_still_loads_strictly(tmp_path: Any) -> None:
    """``dcp.save`` of a plain state dict keeps every name; loading takes the first."""
    reference, _ = _trained_plain(1)
    dcp.save({"model": reference.state_dict()}, checkpoint_id=tmp_path, no_dist=True)
    plain = language_model()
    load_into_plain(plain, None, tmp_path)
    assert plain[0].weight is plain[4].weight
    torch.testing.assert_close(plain.state_dict(), reference.state_dict(), **TOL)

