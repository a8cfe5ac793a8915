"""``DistributedPipe`` runs every schedule the schedule package builds, exactly.

Split backward (``I``/``W``: ``zb_h1``, ``zb_h2``, ``interleaved_zb``, ``zbv``, ``dualpipev``)
and several stages per rank (interleaved, looped, V-shaped) must give the gradients of the
unpipelined model, in every checkpoint mode, with skips between two stages of one rank and
across ranks, and with a ragged last micro-batch. Also: a user-written interleaved schedule
runs; a failure inside an ``I`` or a ``W`` reaches every rank; a DCP checkpoint saved under
``zbv`` loads under ``1f1b`` with another balance and into a plain model; and each
schedule's peak of live activations per rank stays within its paper's bound.

Each test runs one process group and loops over its cases inside it (see
``test_distributed.py`` for why mismatches are gathered rather than raised at once).
"""
from __future__ import annotations

import os
import weakref
from collections import Counter
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from distributed_harness import Failures, run_workers
from op_count import OpCount
from seqpipe.core.microbatch import Batch
from seqpipe.core.saved import SavedTensors
from seqpipe.core.stage import Received, Stage
from seqpipe.distributed import DistributedPipe, PeerError
from seqpipe.distributed.checkpoint import gather_full_state_dict, load, load_into_plain, save
from seqpipe.schedule import (
    SCHEDULES,
    Action,
    Placement,
    backward_input,
    backward_weight,
    get_schedule,
    placement_of,
    simulate,
)
from seqpipe.schedule import F as Fwd
from seqpipe.skip import inspect_skip_layout, pop, skippable, stash

DTYPE = torch.float64
NAMES = sorted({name for name in SCHEDULES if name != "gpipe"})  # gpipe = fill_drain
MODES = ("always", "except_last", "never")


def deep(width: int = 8, blocks: int = 6) -> nn.Sequential:
    """``2 * blocks + 1`` layers: enough for 2K stages at K = 3."""
    layers: List[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 4)).to(DTYPE)


@skippable(stash=["a", "b"])
class StashAB(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Any:
        h = self.lin(x)
        yield stash("a", h)
        yield stash("b", h * 2)
        return torch.tanh(h)


@skippable(pop=["a"])
class PopA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Any:
        a = yield pop("a")
        return self.lin(x) * torch.sigmoid(a)


@skippable(pop=["b"])
class PopB(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Any:
        b = yield pop("b")
        return self.lin(x) + b


def skip_model() -> nn.Sequential:
    """Four stages of two layers: skip ``a`` goes 0 -> 2 (one rank under interleaved
    schedules at K = 2), skip ``b`` goes 0 -> 3 (one rank under V-shaped ones)."""
    return nn.Sequential(nn.Linear(6, 6), StashAB(), nn.Linear(6, 6), nn.Tanh(), PopA(),
                         nn.Tanh(), PopB(), nn.Linear(6, 3)).to(DTYPE)


def reference(build: Any, seed: int, x: Tensor, y: Tensor) -> Tuple[nn.Module, Tensor]:
    torch.manual_seed(seed)
    ref = build()
    loss = F.mse_loss(ref(x), y)
    loss.backward()
    return ref, loss.detach()


def run(pipe: DistributedPipe, x: Tensor, y: Tensor) -> Tensor:
    return pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                           F.mse_loss)


def _gradients(rank: int, world: int, failures: Failures) -> None:
    """Every built-in schedule x checkpoint mode, balance by parameters; ragged batch."""
    m = 2 * world  # enough for dualpipev, a multiple of interleaved's round size
    gen = torch.Generator().manual_seed(world)
    batch = 2 * m - 1  # the last micro-batch is smaller than the others
    x = torch.randn(batch, 8, generator=gen, dtype=DTYPE)
    y = torch.randn(batch, 4, generator=gen, dtype=DTYPE)
    ref, ref_loss = reference(deep, 1, x, y)
    for name in NAMES:
        for mode in MODES:
            what = f"K={world} {name}/{mode}"
            torch.manual_seed(1)
            pipe = DistributedPipe(deep(), m, schedule=name, checkpoint=mode)
            failures.expect(len(pipe.balance) == pipe.num_stages, f"{what}: balance "
                            f"{pipe.balance} for {pipe.num_stages} stages")
            failures.close(run(pipe, x, y), ref_loss, f"{what}: loss")
            failures.grads(pipe, ref, what, pipe.layer_names)


def _skips(rank: int, world: int, failures: Failures) -> None:
    """Skips across ranks and between two stages of one rank, every schedule and mode."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(7, 6, generator=gen, dtype=DTYPE)
    y = torch.randn(7, 3, generator=gen, dtype=DTYPE)
    ref, ref_loss = reference(skip_model, 3, x, y)
    for name in NAMES:
        for mode in MODES:
            stages = placement_of(get_schedule(name), world).num_stages
            balance = [4, 4] if stages == 2 else [2, 2, 2, 2]
            torch.manual_seed(3)
            pipe = DistributedPipe(skip_model(), 4, schedule=name, balance=balance,
                                   checkpoint=mode)
            what = f"skips {name}/{mode}"
            failures.close(run(pipe, x, y), ref_loss, f"{what}: loss")
            failures.grads(pipe, ref, what, pipe.layer_names)


class MyLooped:
    """A user's schedule: stage s on rank s mod K, all forwards stage by stage, then the
    backwards split into I (latest stage first) and every W at the very end."""

    def placement(self, num_ranks: int) -> Placement:
        return Placement.looped(num_ranks, 2)

    def rank_actions(self, rank: int, num_ranks: int, num_microbatches: int) -> List[Action]:
        mine = (rank, rank + num_ranks)
        m = range(num_microbatches)
        order = [Fwd(i, s) for s in mine for i in m]
        order += [backward_input(i, s) for s in reversed(mine) for i in m]
        return order + [backward_weight(i, s) for s in mine for i in m]


def _user_schedule(rank: int, world: int, failures: Failures) -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 8, generator=gen, dtype=DTYPE)
    y = torch.randn(6, 4, generator=gen, dtype=DTYPE)
    ref, ref_loss = reference(deep, 5, x, y)
    torch.manual_seed(5)
    pipe = DistributedPipe(deep(), 3, schedule=MyLooped(), checkpoint="except_last")
    failures.expect(pipe.stages == (rank, rank + world), f"user schedule: stages {pipe.stages}")
    failures.close(run(pipe, x, y), ref_loss, "user schedule: loss")
    failures.grads(pipe, ref, "user schedule", pipe.layer_names)


def _checkpoint(rank: int, world: int, root: str, failures: Failures) -> None:
    """Save under zbv (two stages per rank), load under 1f1b with another balance, and
    into a plain model: same outputs."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(8, 8, generator=gen, dtype=DTYPE)
    y = torch.randn(8, 4, generator=gen, dtype=DTYPE)
    torch.manual_seed(7)
    pipe = DistributedPipe(deep(), 4, schedule="zbv", balance=[4, 3, 3, 3])
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    run(pipe, x, y)
    opt.step()
    path = os.path.join(root, "zbv")
    save(pipe, None, path)
    torch.manual_seed(8)  # other initial values: the load must replace them all
    other = DistributedPipe(deep(), 4, schedule="1f1b", balance=[9, 4])
    load(other, None, path)
    torch.manual_seed(8)
    plain = deep()
    load_into_plain(plain, None, path)
    saved = {k: v for k, v in pipe.state_dict().items()}
    for name, value in other.state_dict().items():
        failures.close(value, plain.state_dict()[name], f"checkpoint: 1f1b {name} vs plain")
    for name, value in saved.items():
        failures.close(value, plain.state_dict()[name], f"checkpoint: zbv {name} vs plain")
    with torch.no_grad():
        expected = plain(x)
    out = other(x if other.is_first else None)
    if other.is_last:
        failures.close(out, expected, "checkpoint: 1f1b output after load vs plain")
    out = pipe(x if pipe.is_first else None)
    if pipe.is_last:
        failures.close(out, expected, "checkpoint: zbv output vs plain")
    full = gather_full_state_dict(pipe, dst=1)  # rank 1 holds stages 1 and 2
    if rank == 1:
        assert full is not None
        failures.expect(list(full) == list(plain.state_dict()),
                        f"checkpoint: gathered keys {list(full)} not in the model's order")
        for name, value in plain.state_dict().items():
            failures.close(full.get(name), value, f"checkpoint: gathered {name}")


def dropout_deep() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 8),
                         nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 4)).to(DTYPE)


def _dropout(rank: int, world: int, failures: Failures) -> None:
    """A checkpoint recomputed at I replays each micro-batch's dropout mask."""
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(12, 8, generator=gen, dtype=DTYPE)
    y = torch.randn(12, 4, generator=gen, dtype=DTYPE)
    for name in ("zb_h1", "zbv"):
        grads: Dict[str, Dict[str, Tensor]] = {}
        for mode in ("never", "always"):
            torch.manual_seed(15)
            pipe = DistributedPipe(dropout_deep(), 2 * world, schedule=name, checkpoint=mode)
            torch.manual_seed(16)
            run(pipe, x, y)
            grads[mode] = {k: p.grad.clone() for k, p in pipe.named_parameters()
                           if p.grad is not None}
        failures.expect(sorted(grads["never"]) == sorted(grads["always"]),
                        f"dropout {name}: gradients on {sorted(grads['always'])}")
        for key, grad in grads["never"].items():
            failures.close(grads["always"].get(key), grad, f"dropout {name}: {key}")


def tied_model() -> nn.Sequential:
    """The first and the last layer share their weight: stages 0 and 3, on one rank under
    V-shaped schedules at K = 2, on two ranks under interleaved ones."""
    first, last = nn.Linear(6, 6), nn.Linear(6, 6)
    last.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6),
                         nn.Tanh(), nn.Linear(6, 6), last).to(DTYPE)


def _ties(rank: int, world: int, failures: Failures) -> None:
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(8, 6, generator=gen, dtype=DTYPE)
    y = torch.randn(8, 6, generator=gen, dtype=DTYPE)
    ref, ref_loss = reference(tied_model, 13, x, y)
    theirs = dict(ref.named_parameters())
    for name in ("zbv", "dualpipev", "interleaved_1f1b", "interleaved_zb"):
        torch.manual_seed(13)
        pipe = DistributedPipe(tied_model(), 4, schedule=name, balance=[2, 2, 2, 2])
        what = f"ties {name}"
        failures.close(run(pipe, x, y), ref_loss, f"{what}: loss")
        for key, param in pipe.named_parameters():
            expected = theirs["0.weight" if key == "7.weight" else key]
            failures.close(param.grad, expected.grad, f"{what}: grad of {key}")
        pipe.check_ties()


def two_ranks(rank: int, world: int, root: str) -> None:
    failures = Failures(rank)
    _gradients(rank, world, failures)
    _skips(rank, world, failures)
    _user_schedule(rank, world, failures)
    _ties(rank, world, failures)
    _checkpoint(rank, world, root, failures)
    failures.finish()


def three_ranks(rank: int, world: int) -> None:
    failures = Failures(rank)
    _gradients(rank, world, failures)
    _dropout(rank, world, failures)
    failures.finish()


def test_every_schedule_matches_the_plain_model_on_two_ranks(tmp_path: Any) -> None:
    """K = 2 (V = 1 and 2): gradients, skips on one rank and across, a user schedule, a
    weight tied within a rank and across ranks, and a checkpoint saved under zbv loaded
    under 1f1b and into a plain model."""
    run_workers(two_ranks, 2, str(tmp_path), timeout=300, pg_timeout=120)


def test_every_schedule_matches_the_plain_model_on_three_ranks() -> None:
    """K = 3 (V = 1 and 2), and dropout replayed by a checkpoint recomputed at I."""
    run_workers(three_ranks, 3, timeout=300, pg_timeout=120)


# --------------------------------------------------------------------------- failures


class BoomIn(nn.Module):
    """A linear layer whose backward raises on micro-batch ``when``: on the input path
    (so inside an ``I``) or on the weight path (inside a ``W``)."""

    def __init__(self, when: int, path: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.when, self.path, self.calls = when, path, 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls != self.when or not torch.is_grad_enabled():
            return self.lin(x)
        if self.path == "input":
            y = self.lin(x)
            y.register_hook(_boom)  # the gradient of the output: the input path
            return y
        weight = self.lin.weight * 1.0
        weight.register_hook(_boom)  # only the weight's gradient passes here
        return F.linear(x, weight, self.lin.bias)


def _boom(grad: Tensor) -> Tensor:
    raise ZeroDivisionError("boom in backward")


def _failures(rank: int, world: int) -> None:
    for path, phase in (("input", "backward_input"), ("weight", "backward_weight")):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), BoomIn(3, path), nn.Linear(4, 4))
        pipe = DistributedPipe(model, 4, balance=[1, 1, 1], schedule="zb_h1",
                               checkpoint="never", group=dist.new_group(list(range(world))))
        with pytest.raises(Exception) as info:
            run(pipe, torch.randn(8, 4), torch.randn(8, 4))
        where = f"stage 1 failed in the {phase} of micro-batch 2"
        if rank == 1:
            assert isinstance(info.value, ZeroDivisionError), repr(info.value)
            assert where in " ".join(info.value.__notes__)
        else:
            assert isinstance(info.value, PeerError), repr(info.value)
            assert where in str(info.value) and "boom in backward" in str(info.value)


def test_failure_in_an_input_or_weight_backward_reaches_every_rank() -> None:
    run_workers(_failures, 3, timeout=150)


# --------------------------------------------------------------------------- memory


class LiveActivations:
    """Counts the bytes autograd keeps for backward (saved tensors, not parameters)."""

    def __init__(self, params: List[Tensor]) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.live = self.peak = 0

    def pack(self, tensor: Tensor) -> Any:
        if tensor.untyped_storage().data_ptr() in self.skip:
            return tensor
        holder = _Held(tensor)
        self.live += holder.size
        self.peak = max(self.peak, self.live)
        weakref.finalize(holder, self._freed, holder.size)
        return holder

    def _freed(self, size: int) -> None:
        self.live -= size

    @staticmethod
    def unpack(packed: Any) -> Tensor:
        return packed.tensor if isinstance(packed, _Held) else packed


class _Held:
    def __init__(self, tensor: Tensor) -> None:
        # Detached: a saved output kept with its grad_fn would make a cycle through the
        # node that saves it, which would never be freed (and never counted as freed).
        self.tensor = tensor.detach()
        self.size = tensor.numel() * tensor.element_size()


def _memory(rank: int, world: int, result: str) -> None:
    """Equal stages (one block each at V = 2, two at V = 1) and a loss that saves nothing,
    so that every rank's bytes count micro-batches as the papers do."""
    peaks: Dict[str, int] = {}
    x = torch.randn(32, 8, dtype=DTYPE)
    for name in ("1f1b", "zb_h1", "zb_h2", "zbv", "interleaved_1f1b"):
        torch.manual_seed(0)
        stages = placement_of(get_schedule(name), world).num_stages
        pipe = DistributedPipe(deep(blocks=8)[:-1], 8, schedule=name, checkpoint="never",
                               balance=[16 // stages] * stages)
        meter = LiveActivations(list(pipe.parameters()))
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            pipe.train_step(x if pipe.is_first else None, x if pipe.is_last else None,
                            lambda out, _: out.mean())
        everyone: List[Any] = [None] * world
        dist.all_gather_object(everyone, meter.peak)
        peaks[name] = max(everyone)
        if rank == 0:
            print(f"{name}: peak live activations per rank {everyone} bytes")
    if rank == 0:
        torch.save(peaks, result)


def test_peak_activations_stay_within_the_papers_bounds(tmp_path: Any) -> None:
    """ZB-H1 <= 1F1B, ZB-H2 <= 2 x 1F1B, ZB-V <= 1F1B (the most any rank holds)."""
    result = str(tmp_path / "peaks.pt")
    run_workers(_memory, 4, result, timeout=200)
    peaks = torch.load(result)
    assert peaks["zb_h1"] <= peaks["1f1b"], peaks
    assert peaks["zb_h2"] <= 2 * peaks["1f1b"], peaks
    assert peaks["zbv"] <= peaks["1f1b"], peaks
    assert peaks["zb_h2"] > peaks["zb_h1"], peaks  # the meter sees the extra warm-up


def _peak_per_rank(name: str, world: int, chunks: int) -> List[int]:
    """Every rank's peak of saved bytes in one step of ``deep`` (12 layers in equal stages)
    under ``name``, with an MSE loss (it saves the output and the target)."""
    torch.manual_seed(0)
    stages = placement_of(get_schedule(name), world).num_stages
    pipe = DistributedPipe(deep(blocks=6)[:-1], chunks, schedule=name, checkpoint="never",
                           balance=[12 // stages] * stages)
    x = torch.randn(4 * chunks, 8, dtype=DTYPE)
    meter = LiveActivations(list(pipe.parameters()))
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        run(pipe, x, x)
    everyone = [torch.zeros((), dtype=torch.long) for _ in range(world)]
    dist.all_gather(everyone, torch.tensor(meter.peak))
    return [int(t) for t in everyone]


def _split_memory(rank: int, world: int, result: str) -> None:
    peaks: Dict[Tuple[str, int], List[int]] = {}
    for name in ("1f1b", "zb_h1", "zb_h2", "zbv"):
        for chunks in (1, 6):
            peaks[(name, chunks)] = _peak_per_rank(name, world, chunks)
    if rank == 0:
        torch.save(peaks, result)


@pytest.mark.parametrize("world", [2, 3])
def test_split_backward_keeps_no_more_than_its_schedule_says(world: int, tmp_path: Any) -> None:
    """Each rank's peak of saved bytes is at most simulate's peak of live micro-batches
    (whole ones: a micro-batch through all the rank's layers) times what one micro-batch
    keeps (measured at M = 1); so the papers' bounds hold, in micro-batches of a rank's
    layers: ZB-H1 and ZB-V <= 1F1B, ZB-H2 <= 2 x 1F1B. (``I`` must free what only the
    input path saved, tanh outputs and the loss's input and target: kept until the graph
    died, they broke the bound.)"""
    result = str(tmp_path / "peaks.pt")
    run_workers(_split_memory, world, result, timeout=200)
    peaks = torch.load(result)
    for name in ("1f1b", "zb_h1", "zb_h2", "zbv"):
        live = simulate(name, world, 6).peak_activation_memory
        unit, peak = peaks[(name, 1)], peaks[(name, 6)]
        for r in range(world):
            assert peak[r] <= live[r] * unit[r], (name, r, peak, unit, live)
    held = {name: max(p / u for p, u in zip(peaks[(name, 6)], peaks[(name, 1)]))
            for name in ("1f1b", "zb_h1", "zb_h2", "zbv")}  # in micro-batches of a rank
    assert held["zb_h1"] <= held["1f1b"], held
    assert held["zbv"] <= held["1f1b"], held
    assert held["zb_h2"] <= 2 * held["1f1b"], held


# --------------------------------------------------------------------------- one stage


def _one_stage(model: nn.Sequential) -> Stage:
    layout = inspect_skip_layout(nn.Sequential(nn.Identity(), *model), [1, len(model)])
    return Stage(1, model, torch.device("cpu"), layout)


def _backward(stage: Stage, x: Tensor, g: Tensor, how: str) -> Tuple[Tensor, Counter]:
    """The input gradient of one micro-batch by ``B``, ``I + W`` or a checkpointed
    ``I + W``, and the operations the backward ran."""
    received = Received(Batch((x,), True), {}, (True,))
    _, state = stage.forward(received, grad=True, split=how != "B",
                             checkpoint=how == "checkpointed")
    assert state is not None
    with OpCount() as count:
        if how == "B":
            grads = stage.backward(state, [g], {})
        else:
            grads = stage.backward_input(state, [g], {})
            stage.backward_weight(state)
    assert grads.inputs[0] is not None
    return grads.inputs[0], count.counts


@pytest.mark.parametrize("shared", [False, True], ids=["plain", "weight used twice"])
def test_split_backward_runs_each_operation_once_and_matches_b(shared: bool) -> None:
    """I + W run exactly the operations of one B (a checkpointed micro-batch adds one
    recomputation, not one per half); gradients are B's. A parameter used twice takes the
    exact fallback (W re-runs the whole backward)."""
    torch.manual_seed(0)
    blocks = [m for _ in range(3) for m in (nn.Linear(16, 16), nn.Tanh())]
    if shared:
        blocks.append(blocks[0])
    model = nn.Sequential(*blocks).to(DTYPE)
    stage = _one_stage(model)
    x = torch.randn(4, 16, dtype=DTYPE)
    g = torch.randn(4, 16, dtype=DTYPE)
    results = {}
    for how in ("B", "split", "checkpointed"):
        model.zero_grad(set_to_none=True)
        dx, ops = _backward(stage, x, g, how)
        results[how] = (dx, [p.grad.clone() for p in model.parameters()], ops)
    for how in ("split", "checkpointed"):
        torch.testing.assert_close(results[how][0], results["B"][0])
        for got, want in zip(results[how][1], results["B"][1]):
            torch.testing.assert_close(got, want)
    b_ops, split_ops, ck_ops = (results[h][2] for h in ("B", "split", "checkpointed"))
    if not shared:
        assert split_ops["mm"] == b_ops["mm"] == 6, (b_ops, split_ops)
        assert split_ops["tanh_backward"] == b_ops["tanh_backward"] == 3
        assert ck_ops["mm"] == 6 and ck_ops["addmm"] == 3 and ck_ops["tanh"] == 3, ck_ops
    else:  # the fallback: W runs the input path again
        assert split_ops["tanh_backward"] == 2 * b_ops["tanh_backward"], (b_ops, split_ops)


class ParamsOnlyOutput(nn.Module):
    """Two outputs, the second computed from a parameter only (off the input path)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.p = nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        return torch.tanh(self.lin(x)), self.p * 3


def test_split_backward_frees_the_input_path_after_i_and_stays_exact() -> None:
    """After I, only what W needs stays saved (the Linear inputs, not the Tanh outputs);
    an output off the input path still gets its parameter's gradient at W; after W
    nothing is left."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), ParamsOnlyOutput()).to(DTYPE)
    stage = _one_stage(model)
    x = torch.randn(2, 4, dtype=DTYPE)
    g1, g2 = torch.randn(2, 4, dtype=DTYPE), torch.randn(4, dtype=DTYPE)
    meter = LiveActivations(list(model.parameters()))
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        _, state = stage.forward(Received(Batch((x,), True), {}, (True,)), grad=True,
                                 split=True)
    assert state is not None
    one = x.numel() * x.element_size()
    assert meter.live == 4 * one  # 2 Linear inputs, 2 Tanh outputs
    grads = stage.backward_input(state, [g1, g2], {})
    assert meter.live == 2 * one  # the Linear inputs, for W
    stage.backward_weight(state)
    assert meter.live == 0
    split = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_()
    torch.autograd.backward(list(model(xx)), [g1, g2])
    torch.testing.assert_close(grads.inputs[0], xx.grad)
    for got, param in zip(split, model.parameters()):
        torch.testing.assert_close(got, param.grad)


class ScalesSavedInPlace(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        y = torch.tanh(x)
        y.mul_(2)  # tanh saved y for its backward
        return y


def test_split_backward_still_refuses_a_saved_tensor_modified_in_place() -> None:
    """The forward records under saved-tensor hooks (which autograd does not version-check);
    the check is kept: the error is autograd's."""
    stage = _one_stage(nn.Sequential(nn.Linear(4, 4), ScalesSavedInPlace()).to(DTYPE))
    x = torch.randn(2, 4, dtype=DTYPE)
    _, state = stage.forward(Received(Batch((x,), True), {}, (True,)), grad=True, split=True)
    assert state is not None
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        stage.backward_input(state, [torch.ones(2, 4, dtype=DTYPE)], {})


def test_a_released_saved_tensor_read_again_raises_naming_the_split() -> None:
    """What ``I`` frees is gone: a backward that would still read it fails loudly, not with
    garbage; what ``kept`` nodes saved stays."""
    saved = SavedTensors()
    x = torch.randn(3, requires_grad=True)
    with saved.recording():
        y = torch.tanh(x)
        z = torch.exp(x)
    saved.release([y.grad_fn, z.grad_fn], [z.grad_fn])
    z.sum().backward()
    torch.testing.assert_close(x.grad, torch.exp(x.detach()))
    with pytest.raises(RuntimeError, match=r"freed this saved tensor after the input-gradient"):
        y.sum().backward()
