"""What recomputing a checkpointed micro-batch runs again, under every schedule, checkpoint
mode and both engines; a split backward (``I`` then ``W``) recomputes at ``I``.

* Not the user's ``loss_fn``: it runs once per micro-batch, and a ``loss_fn`` that draws
  random numbers is differentiated at the draw whose loss it returned.
* A layer that checkpoints itself (``torch.utils.checkpoint(..., use_reentrant=False)``
  inside its forward, as Hugging Face models do under ``gradient_checkpointing_enable()``)
  trains with the plain model's gradients; so does one with ``use_reentrant=True``, but
  in an ``I`` (which asks autograd for the input's gradient only), where the step raises
  ``ReentrantCheckpointError``, naming the fix.
"""
from __future__ import annotations

import copy
from typing import Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_outside_tensors import on_two_ranks
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


class RecordedDropout(nn.Module):
    """Dropout that keeps the mask of each micro-batch's first draw (its forward: any
    recomputation comes later), keyed by the micro-batch's first input value; with
    ``masks`` given, it applies those instead of drawing (the plain model, run on the same
    micro-batches with the masks the pipeline's forwards drew)."""

    def __init__(self, p: float, masks: Optional[Dict[float, Tensor]] = None) -> None:
        super().__init__()
        self.p, self.replaying = p, masks is not None
        self.masks: Dict[float, Tensor] = {} if masks is None else masks

    def forward(self, x: Tensor) -> Tensor:
        key = round(float(x.detach().flatten()[0]), 9)
        if self.replaying:
            return x * self.masks[key] / (1 - self.p)
        out = F.dropout(x, self.p, self.training)
        self.masks.setdefault(key, out.detach() != 0)
        return out


class SelfCheckpointed(nn.Module):
    """A block that checkpoints itself inside its forward, as Hugging Face layers do
    (``own=False``: the same block without its checkpoint)."""

    def __init__(self, reentrant: bool = False, dropout: float = 0.0, own: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = RecordedDropout(dropout)
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


def drawn(model: nn.Sequential) -> Dict[int, Dict[float, Tensor]]:
    """The masks each block of ``model`` recorded, by the block's index."""
    return {k: layer.drop.masks for k, layer in enumerate(model)
            if isinstance(layer, SelfCheckpointed) and layer.drop.masks}


def replaying(masks: Dict[int, Dict[float, Tensor]]) -> nn.Sequential:
    """The plain model (no checkpoints of its own) applying the dropout masks a pipeline's
    forwards drew (``drawn``), one per micro-batch and block."""
    plain = blocks()
    for k, block in enumerate(plain):
        if isinstance(block, SelfCheckpointed):
            assert len(masks[k]) == M, f"block {k} did not record one mask per micro-batch"
            block.own, block.drop = False, RecordedDropout(0.5, masks[k])
    return plain


def plain_loss(plain: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """The mini-batch loss of ``plain`` run on the pipeline's ``M`` micro-batches."""
    return sum(F.mse_loss(plain(a), b) for a, b in zip(x.chunk(M), y.chunk(M))) / M


def assert_trains_like_plain(model: nn.Sequential, loss: Tensor, x: Tensor, y: Tensor,
                             what: str) -> None:
    """The pipeline's loss and gradients are the plain model's on the same ``M``
    micro-batches, with the dropout masks the pipeline's forwards drew (a recomputation
    that drew others would differentiate another function than the forward computed)."""
    plain = replaying(drawn(model))
    expected = plain_loss(plain, x, y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), atol=1e-12, rtol=1e-10, msg=what)
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-12, rtol=1e-10,
                                   msg=f"{what}: {name}")


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_layer_that_checkpoints_itself_trains_like_the_plain_model(schedule: str) -> None:
    """With dropout inside the block's own checkpoint: its recomputation (in the stage's
    backward, or at ``I``) must draw the forward's mask from the task's private stream."""
    x, y = data()
    for mode in MODES:
        model = blocks(dropout=0.5)
        balance = BLOCKS[SCHEDULES[schedule]]
        pipe = Pipe(model, chunks=M, checkpoint=mode, balance=balance,
                    devices=["cpu"] * len(balance))
        loss = pipe.train_step(x, y, F.mse_loss, schedule=schedule)
        assert_trains_like_plain(model, loss, x, y, f"{schedule}/{mode}")


@pytest.mark.parametrize("every", [None, 1])
def test_a_layer_that_checkpoints_itself_under_forward_and_backward(every: Optional[int]) -> None:
    """``pipe(x)`` then ``loss.backward()``, the partitions checkpointed whole or layer by
    layer (``checkpoint_every=1``): the same masks in the forward and the recomputation."""
    x, y = data()
    for mode in MODES:
        model = blocks(dropout=0.5)
        pipe = Pipe(model, chunks=M, checkpoint=mode, balance=[3, 3], devices=["cpu"] * 2,
                    checkpoint_every=every)
        loss = F.mse_loss(pipe(x), y)
        loss.backward()
        assert_trains_like_plain(model, loss, x, y, f"{mode}, every {every}")


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
@pytest.mark.parametrize("stage", [0, 1])
def test_a_reentrant_checkpoint_inside_a_layer_trains_unless_an_i_must_stop_at_the_input(
        schedule: str, stage: int) -> None:
    """A stage's backward runs as the plain model's (``B``, and the ``W`` of stage 0,
    which has no input path): the layer trains as in the plain model, as in
    ``DistributedPipe``. Stage 1 of ``zb_h1`` meets it in an ``I``, which asks autograd
    for the input's gradient only: refused, naming the fix."""
    x, y = data()
    layers = [nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)]
    layers[1 + stage] = SelfCheckpointed(reentrant=True)
    model = nn.Sequential(*layers).to(DTYPE)
    plain = copy.deepcopy(model)
    pipe = Pipe(model, chunks=M, balance=[2, 2], devices=["cpu"] * 2)
    if schedule == "1f1b" or stage == 0:
        loss = pipe.train_step(x, y, F.mse_loss, schedule=schedule)
        expected = F.mse_loss(plain(x), y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), atol=1e-12, rtol=1e-10)
        for (name, a), b in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-12, rtol=1e-10, msg=name)
        return
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
    for schedule in ("1f1b", "zb_h1", "zbv"):  # one stage per process: global generators
        for mode in MODES:  # the blocks' own checkpoints replay their dropout masks
            model = blocks(0.5)
            pipe = DistributedPipe(model, M, schedule=schedule,
                                   balance=BLOCKS[SCHEDULES[schedule]], checkpoint=mode)
            loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                                   F.mse_loss)
            gathered: List[Dict[int, Dict[float, Tensor]]] = [{}] * world
            dist.all_gather_object(gathered, drawn(model))
            plain = replaying({k: v for held in gathered for k, v in held.items()})
            expected = plain_loss(plain, x, y)
            expected.backward()
            failures.close(loss, expected.detach(), f"dropout {schedule}/{mode}")
            failures.grads(pipe, plain, f"dropout {schedule}/{mode}")
    on_two_ranks(rank, failures)  # a tensor outside the pipe (tests/test_outside_tensors.py)
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
