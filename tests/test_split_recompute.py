"""What recomputing a checkpointed micro-batch runs again, under every schedule, checkpoint
mode and both engines; a split backward (``I`` then ``W``) recomputes at ``I``.

* Not the user's ``loss_fn``: it runs once per micro-batch, and a ``loss_fn`` that draws
  random numbers is differentiated at the draw whose loss it returned.
* A layer that checkpoints itself (``torch.utils.checkpoint(..., use_reentrant=False)``
  inside its forward, as Hugging Face models do under ``gradient_checkpointing_enable()``)
  trains with the plain model's gradients; with ``use_reentrant=True`` the step raises
  ``ReentrantCheckpointError``, naming the fix.
"""
from __future__ import annotations

import copy
from typing import Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from distributed_harness import Failures, run_workers
from seqpipe import Pipe, ReentrantCheckpointError
from seqpipe.distributed import DistributedPipe, PeerError

DTYPE = torch.float64
MODES = ("always", "except_last", "never")
M = 4  # micro-batches
# Every built-in schedule: two partitions for one stage per device, four for two.
SCHEDULES: Dict[str, int] = {
    "fill_drain": 2, "1f1b": 2, "zb_h1": 2, "zb_h2": 2, "interleaved_1f1b": 4,
    "looped_bfs": 4, "interleaved_zb": 4, "zbv": 4, "dualpipev": 4}


def data() -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(8, 6, generator=gen, dtype=DTYPE), torch.randn(8, 3, generator=gen,
                                                                       dtype=DTYPE)


# --------------------------------------------------------------------------- loss_fn once


def deep() -> nn.Sequential:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).to(DTYPE)


BALANCE = {2: [3, 4], 4: [2, 2, 2, 1]}


class DroppingLoss:
    """``mse_loss`` of the output times a random mask (dropout in the loss): counts its calls
    and keeps the first mask drawn for each micro-batch, keyed by its first sample."""

    def __init__(self) -> None:
        self.calls = 0
        self.masks: Dict[int, Tensor] = {}

    def __call__(self, output: Tensor, target: Tuple[Tensor, Tensor]) -> Tensor:
        y, index = target
        self.calls += 1
        mask = (torch.rand_like(output) < 0.5).to(output.dtype) * 2
        self.masks.setdefault(int(index[0]), mask)
        return F.mse_loss(output * mask, y)

    def plain(self, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        """The plain model's loss with the masks the pipeline's calls drew first."""
        mask = torch.cat([self.masks[k] for k in sorted(self.masks)])
        return F.mse_loss(model(x) * mask, y)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_loss_fn_runs_once_per_microbatch_and_its_draw_is_differentiated(schedule: str) -> None:
    x, y = data()
    index = torch.arange(len(x))
    for mode in MODES:
        model = deep()
        plain = copy.deepcopy(model)
        balance = BALANCE[SCHEDULES[schedule]]
        pipe = Pipe(model, chunks=M, checkpoint=mode, balance=balance,
                    devices=["cpu"] * len(balance))
        loss_fn = DroppingLoss()
        loss = pipe.train_step(x, (y, index), loss_fn, schedule=schedule)
        assert loss_fn.calls == M, f"{mode}: loss_fn ran {loss_fn.calls} times for {M}"
        expected = loss_fn.plain(plain, x, y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), atol=1e-12, rtol=1e-10)
        for (name, a), b in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-12, rtol=1e-10,
                                       msg=f"{mode}: {name}")


# --------------------------------------------------------------------- self-checkpointing


class SelfCheckpointed(nn.Module):
    """A block that checkpoints itself inside its forward, as Hugging Face layers do
    (``own=False``: the same block without its checkpoint)."""

    def __init__(self, reentrant: bool = False, dropout: float = 0.0, own: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(dropout)
        self.reentrant, self.own = reentrant, own

    def forward(self, x: Tensor) -> Tensor:
        if not self.own:
            return self._body(x)
        return checkpoint(self._body, x, use_reentrant=self.reentrant)

    def _body(self, x: Tensor) -> Tensor:
        return self.drop(torch.tanh(self.lin(x))) * x


def blocks(dropout: float = 0.0, own: bool = True) -> nn.Sequential:
    """Self-checkpointing blocks in stages 1 and 3 of four, and in both of two (where stage 0
    receives no gradient, the block is on its weight path only)."""
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(6, 8), SelfCheckpointed(dropout=dropout, own=own),
                         nn.Linear(8, 8), nn.Tanh(), SelfCheckpointed(dropout=dropout, own=own),
                         nn.Linear(8, 3)).to(DTYPE)


BLOCKS = {2: [3, 3], 4: [1, 2, 1, 2]}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_layer_that_checkpoints_itself_trains_like_the_plain_model(schedule: str) -> None:
    x, y = data()
    plain = blocks()
    expected = F.mse_loss(plain(x), y)
    expected.backward()
    for mode in MODES:
        model = blocks()
        balance = BLOCKS[SCHEDULES[schedule]]
        pipe = Pipe(model, chunks=M, checkpoint=mode, balance=balance,
                    devices=["cpu"] * len(balance))
        loss = pipe.train_step(x, y, F.mse_loss, schedule=schedule)
        torch.testing.assert_close(loss, expected.detach(), atol=1e-12, rtol=1e-10)
        for (name, a), b in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-12, rtol=1e-10,
                                       msg=f"{mode}: {name}")


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
@pytest.mark.parametrize("stage", [0, 1])
def test_a_reentrant_checkpoint_inside_a_layer_is_refused_naming_the_fix(
        schedule: str, stage: int) -> None:
    """Stage 0 of ``zb_h1`` meets it in a ``W`` (it has no input path), stage 1 in an ``I``."""
    x, y = data()
    layers = [nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)]
    layers[1 + stage] = SelfCheckpointed(reentrant=True)
    pipe = Pipe(nn.Sequential(*layers).to(DTYPE), chunks=M, balance=[2, 2],
                devices=["cpu"] * 2)
    with pytest.raises(ReentrantCheckpointError, match="use_reentrant=False") as info:
        pipe.train_step(x, y, F.mse_loss, schedule=schedule)
    assert f"a layer of stage {stage} checkpoints itself" in str(info.value)
    assert isinstance(info.value, RuntimeError)


# --------------------------------------------------------------------------- distributed


def _distributed(rank: int, world: int) -> None:
    x, y = data()
    index = torch.arange(len(x))
    failures = Failures(rank, dict(atol=1e-12, rtol=1e-10))
    plain_blocks = blocks()
    F.mse_loss(plain_blocks(x), y).backward()
    for schedule in [*SCHEDULES, "auto"]:
        stages = SCHEDULES.get(schedule, 2)
        for mode in MODES:
            what = f"{schedule}/{mode}"
            model = deep()
            plain = copy.deepcopy(model)
            pipe = DistributedPipe(model, M, balance=BALANCE[stages], schedule=schedule,
                                   checkpoint=mode)
            loss_fn = DroppingLoss()
            loss = pipe.train_step(x if pipe.is_first else None,
                                   (y, index) if pipe.is_last else None, loss_fn)
            masks: List[Dict[int, Tensor]] = [{}] * world
            dist.all_gather_object(masks, loss_fn.masks)  # from the rank of the last stage
            loss_fn.masks = max(masks, key=len)
            failures.expect(loss_fn.calls == (M if pipe.is_last else 0),
                            f"{what}: loss_fn ran {loss_fn.calls} times")
            expected = loss_fn.plain(plain, x, y)
            expected.backward()
            failures.close(loss, expected.detach(), f"{what}: dropping loss")
            failures.grads(pipe, plain, f"{what}: dropping loss")

            pipe = DistributedPipe(blocks(), M, balance=BLOCKS[stages], schedule=schedule,
                                   checkpoint=mode)
            run = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                                  F.mse_loss)
            failures.close(run, F.mse_loss(plain_blocks(x), y).detach(), f"{what}: blocks")
            failures.grads(pipe, plain_blocks, f"{what}: self-checkpointing blocks")
    for schedule in ("zb_h1", "zbv"):  # one stage per process: the global generators
        for mode in ("always", "never"):
            grads = []
            for own in (True, False):  # a block's own checkpoint replays its dropout masks
                pipe = DistributedPipe(blocks(0.5, own), M, schedule=schedule,
                                       balance=BLOCKS[SCHEDULES[schedule]], checkpoint=mode)
                torch.manual_seed(6)
                pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                                F.mse_loss)
                grads.append({k: p.grad for k, p in pipe.named_parameters()})
            for key, grad in grads[1].items():
                failures.close(grads[0][key], grad, f"dropout {schedule}/{mode}: {key}")
    failures.finish()
    # Last: a failed step. Its own group, so that the abort leaves the default one usable.
    layers = [nn.Linear(6, 8), nn.Linear(8, 8), SelfCheckpointed(reentrant=True),
              nn.Linear(8, 3)]
    pipe = DistributedPipe(nn.Sequential(*layers).to(DTYPE), M, balance=[2, 2],
                           schedule="zb_h1", group=dist.new_group(list(range(world))))
    with pytest.raises(Exception) as info:
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, F.mse_loss)
    if rank == 1:
        assert isinstance(info.value, ReentrantCheckpointError), repr(info.value)
        assert "use_reentrant=False" in str(info.value)
    else:
        assert isinstance(info.value, PeerError), repr(info.value)
        assert "stage 1 failed in the backward_input" in str(info.value)


def test_loss_fn_once_and_self_checkpointing_layers_on_two_ranks() -> None:
    run_workers(_distributed, 2, timeout=300.0)
