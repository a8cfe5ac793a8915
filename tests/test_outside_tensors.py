"""A tensor outside the pipe that the model differentiates: its gradient is the plain model's.

A layer may hold a leaf that requires grad without being a registered parameter (a
learnable temperature, a tensor shared with another model), and ``loss_fn`` may use one.
The plain model's ``loss.backward()`` accumulates into it; so must every path of the
pipe that runs a backward over the whole graph: ``pipe(x)`` + ``loss.backward()``,
``Pipe.train_step`` and ``DistributedPipe.train_step``, under a one-piece backward
(``fill_drain``, ``1f1b``) or a split one (``zb_h1``'s ``I`` and ``W``), with a parameter
hook (the ``AliasSink``'s aliases), a parameter subclass, and a weight used twice (whose
split ``W`` reruns the whole backward naming its targets in ``inputs=``). Before, every
``train_step`` path and the aliased call left the tensor's ``.grad`` ``None`` (or, where
``DistributedPipe`` splits a stage's last backward, short of one micro-batch's share),
silently (docs/pipe.md, "The stage backward's `inputs=`").

The ``DistributedPipe`` cases (``on_two_ranks``) run in ``test_split_recompute``'s launch.
"""
from __future__ import annotations

import itertools
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distributed_harness import Failures
from seqpipe import Pipe

DTYPE = torch.float64
M = 4
TOL = dict(atol=1e-12, rtol=1e-10)


class Scale(nn.Module):
    """Multiplies by a tensor it holds but does not register (``t``)."""

    def __init__(self, t: Tensor) -> None:
        super().__init__()
        self.t = t

    def forward(self, x: Tensor) -> Tensor:
        return x * self.t


class Tagged(nn.Parameter):
    """A parameter subclass (as a tensor-parallel ``DTensor`` is one)."""


class Both(nn.Module):
    """Uses its layer's weight twice: a node off the input path with two parents, so that a
    split backward's ``W`` reruns the whole backward, naming what it reaches in
    ``inputs=`` (``SplitBackward.whole``)."""

    def __init__(self, layer: nn.Linear) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x) + self.layer(x.flip(-1))


def _tag(model: nn.Sequential) -> None:
    model[0].weight = Tagged(model[0].weight.detach().clone())


def _hook(model: nn.Sequential) -> None:
    model[0].weight.register_post_accumulate_grad_hook(lambda p: None)


def _twice(model: nn.Sequential) -> None:
    model[-1] = Both(model[-1])


# name -> what is done to both models (the pipe's and the plain one)
KINDS: Dict[str, Optional[Callable[[nn.Sequential], None]]] = {
    "no hooks": None, "parameter hook": _hook, "parameter subclass": _tag,
    "weight used twice": _twice}


# Who holds the outside tensor: a layer of partition 0 or 1, or ``loss_fn`` (partition 1's).
WHERE = (("layer", 0), ("layer", 1), ("loss", 1))


def model(t: Optional[Tensor], stage: int) -> nn.Sequential:
    """Four layers, and ``Scale(t)`` (if any) in partition ``stage`` of two; the last two
    layers are partition 1. A split backward reaches ``t`` in ``W``: the product is on the
    input path (partition 1) or behind a parameter (partition 0)."""
    torch.manual_seed(0)
    layers: List[nn.Module] = [nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3)]
    if t is not None:
        layers.insert(1 + 2 * stage, Scale(t))
    return nn.Sequential(*layers).to(DTYPE)


def case(where: str, stage: int) -> Tuple[Tensor, nn.Sequential, nn.Sequential,
                                          Callable[[Tensor, Tensor], Tensor]]:
    """The outside tensor, the pipe's model, the plain one and the loss: ``where`` says who
    holds the tensor, a layer of partition ``stage`` or ``loss_fn``."""
    t = torch.linspace(0.5, 1.5, 8 if where == "layer" else 3, dtype=DTYPE,
                       requires_grad=True)
    if where == "layer":
        return t, model(t, stage), model(t, stage), F.mse_loss
    return t, model(None, stage), model(None, stage), lambda out, y: F.mse_loss(out * t, y)


def data() -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(8, 6, generator=gen, dtype=DTYPE),
            torch.randn(8, 3, generator=gen, dtype=DTYPE))


def same(t: Tensor, expected: Optional[Tensor], pipe_model: nn.Module, plain: nn.Module,
         what: str) -> None:
    assert t.grad is not None, f"{what}: the outside tensor got no gradient"
    torch.testing.assert_close(t.grad, expected, **TOL, msg=what)
    for (name, a), b in zip(pipe_model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, **TOL, msg=f"{what}: {name}")


PATHS = ["call", "fill_drain", "1f1b", "zb_h1"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_tensor_outside_the_pipe_gets_the_plain_models_gradient(path: str, kind: str) -> None:
    """Every path of ``Pipe`` (``call``: ``pipe(x)`` + ``loss.backward()``; else
    ``train_step`` under that schedule), for a tensor held by a layer of either partition
    or by ``loss_fn``, checkpointed or not."""
    x, y = data()
    change = KINDS[kind]
    for (where, stage), mode in itertools.product(WHERE, ("except_last", "never")):
        what = f"{path}/{kind}/{where} {stage}/{mode}"
        t, mine, plain, loss_fn = case(where, stage)
        for m in (mine, plain):
            if change is not None:
                change(m)
        loss_fn(plain(x), y).backward()
        expected, t.grad = t.grad, None
        pipe = Pipe(mine, chunks=M, checkpoint=mode, balance=[len(mine) - 2, 2],
                    devices=["cpu"] * 2)
        if path == "call":
            loss_fn(pipe(x), y).backward()
        else:
            pipe.train_step(x, y, loss_fn, schedule=path)
        same(t, expected, mine, plain, what)


def test_a_second_step_adds_to_the_outside_tensors_gradient() -> None:
    """As the plain model's: ``.grad`` accumulates over steps until zeroed."""
    x, y = data()
    t, mine, plain, loss_fn = case("layer", 1)
    for _ in range(2):
        loss_fn(plain(x), y).backward()
    expected, t.grad = t.grad, None
    pipe = Pipe(mine, chunks=M, balance=[3, 2], devices=["cpu"] * 2)
    for schedule in ("1f1b", "zb_h1"):
        pipe.train_step(x, y, loss_fn, schedule=schedule)
    same(t, expected, mine, plain, "two steps")


def test_autograd_grad_through_a_pipe_leaves_the_outside_tensor_alone() -> None:
    """``torch.autograd.grad(loss, params)`` accumulates into no leaf, in the plain model and
    through a pipe (whose stages then name what they backpropagate into)."""
    x, y = data()
    t, mine, plain, loss_fn = case("layer", 0)
    pipe = Pipe(mine, chunks=M, balance=[3, 2], devices=["cpu"] * 2)
    got = torch.autograd.grad(loss_fn(pipe(x), y), list(mine.parameters()))
    expected = torch.autograd.grad(loss_fn(plain(x), y), list(plain.parameters()))
    assert t.grad is None
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **TOL)


# ----------------------------------------------------------------------- DistributedPipe


def on_two_ranks(rank: int, failures: Failures) -> None:
    """The same cases on ``DistributedPipe``, two ranks (in a launch that has a process
    group up): a one-piece and a split backward (``fill_drain``'s ``B`` is ``1f1b``'s),
    the kinds that take another path there, a tensor in each stage and in ``loss_fn``."""
    from seqpipe.distributed import DistributedPipe
    x, y = data()
    kinds = ("no hooks", "parameter hook", "weight used twice")  # (a subclass: as no hooks)
    for path, kind, (where, stage) in itertools.product(
            ("1f1b", "zb_h1"), kinds, WHERE):
        what = f"outside: {path}/{kind}/{where} {stage}"
        t, mine, plain, loss_fn = case(where, stage)
        change = KINDS[kind]
        for m in (mine, plain):
            if change is not None:
                change(m)
        loss_fn(plain(x), y).backward()
        expected, t.grad = t.grad, None
        pipe = DistributedPipe(mine, M, balance=[len(mine) - 2, 2], schedule=path)
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, loss_fn)
        if rank == stage:  # (``loss_fn`` runs on the last)
            failures.close(t.grad, expected, f"{what}: the outside tensor")
        else:
            failures.expect(t.grad is None, f"{what}: a rank that does not use it")
        failures.grads(pipe, plain, what)
