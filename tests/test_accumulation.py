"""Gradients over several ``train_step`` calls: accumulation without ``zero_grad()``
under every schedule, with and without tied weights, and ties following ``requires_grad``.

The docs let a user call ``train_step`` twice without ``zero_grad()`` in between to
accumulate. A tie's copies are summed over the ranks that hold them at the end of every
step, so only what the step added may be summed: summing the whole ``.grad`` would count
the earlier steps' (already summed) gradient once more per holder. Which ties are summed
must follow ``requires_grad`` at every step, as the data-parallel reducer does: a tie
frozen at construction and unfrozen later gets the sum of every use, one frozen later
keeps ``.grad`` at ``None`` as in the plain model (so AdamW leaves it alone), not a zero,
and one frozen on some of its ranks only is reported on every rank.

* The sweep: after two steps (the second ragged: 7 samples in 4 micro-batches) every
  gradient is the plain model's accumulated over the same two batches, under each of the
  nine built-in schedules (on 2 ranks; those with two stages per rank get four balance
  entries), for a model without ties and for one whose first weight is also used in
  stage 1 and in the last stage (a tie across both ranks under every placement, and
  within a rank too); the local ``Pipe`` (``train_step``, and ``forward`` + ``backward``)
  runs the same cases in-process.
* Ties over a script of steps, ``zero_grad()`` calls and freezing, against the plain
  model after every step: on 2 ranks an embedding tied to the LM head (a one-stage and a
  split-backward schedule, the fp16 loss scaler with a fused optimizer, a failed step,
  which leaves ``.grad`` as the earlier step did); on 4 ranks ties
  between non-adjacent stages and a submodule reused in stages 0 and 3, a pipeline on a
  hand-made group of 3 of the 4 ranks (where the stage without a copy takes part in the
  sums) and 2 stages x 2 data-parallel replicas.

One launch per world size runs all of its cases.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_tied_weights import TOL, language_model, many_ties, named, tokens, vectors
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

from distributed_harness import Failures, run_workers
from seqpipe import Pipe
from seqpipe.distributed import DistributedPipe, PeerError, PipeGradScaler, mesh_groups

WIDTH = 6
# Each built-in schedule (gpipe is fill_drain) with its balance over 8 layers.
ONE_STAGE = ("fill_drain", "1f1b", "zb_h1", "zb_h2")
TWO_STAGES = ("interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev")
BALANCE = {**{name: [4, 4] for name in ONE_STAGE}, **{name: [2, 2, 2, 2] for name in TWO_STAGES}}


def model(tied: bool) -> nn.Sequential:
    """Eight layers; ``tied``: layers 0, 2 and 7 share one weight (stages 0, 1 and 3 of
    four, or 0, 0 and 1 of two)."""
    torch.manual_seed(0)
    layers: List[nn.Module] = []
    for n in range(7):
        layers.append(nn.Linear(WIDTH, WIDTH) if n % 2 == 0 else nn.Tanh())
    layers.append(nn.Linear(WIDTH, WIDTH))
    if tied:
        layers[2].weight = layers[7].weight = layers[0].weight  # type: ignore[union-attr]
    return nn.Sequential(*layers).double()


def batches() -> List[Tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(n, WIDTH, generator=gen, dtype=torch.float64),
             torch.randn(n, WIDTH, generator=gen, dtype=torch.float64)) for n in (8, 7)]


def accumulated(tied: bool) -> Tuple[Dict[str, Tensor], List[Tensor]]:
    """The plain model's gradients after both batches, by every name, and its losses."""
    plain = model(tied)
    losses = []
    for x, y in batches():
        loss = F.mse_loss(plain(x), y)
        loss.backward()
        losses.append(loss.detach())
    grads = {n: p.grad for n, p in plain.named_parameters(remove_duplicate=False)}
    return grads, losses  # type: ignore[return-value]


def _sweep(failures: Failures) -> None:
    """Every schedule, with and without ties: two steps, then the accumulated gradients."""
    for tied in (False, True):
        expected, losses = accumulated(tied)
        for name, balance in BALANCE.items():
            what = f"{name}{' tied' if tied else ''}"
            pipe = DistributedPipe(model(tied), 4, schedule=name, balance=balance)
            for step, (x, y) in enumerate(batches()):
                loss = pipe.train_step(x if pipe.is_first else None,
                                       y if pipe.is_last else None, F.mse_loss)
                failures.close(loss, losses[step], f"{what}: loss of step {step}")
            mine = dict(pipe.named_parameters(remove_duplicate=False))
            failures.expect(len(mine) > 0, f"{what}: no parameters here")
            for key, param in mine.items():
                failures.close(param.grad, expected[key], f"{what}: grad of {key}")


Batch = Callable[[int], Tuple[Tensor, Tensor]]
# What the user does, in order: ("step", n) trains on batch n without zeroing first;
# ("zero",) is zero_grad() (to None); ("freeze", flag) sets requires_grad of the tied
# parameters to ``flag`` on every rank, and in the plain model.
Script = Sequence[Tuple[Any, ...]]

# Built with the ties trained: two steps accumulated (from None), zero_grad(), frozen
# later (.grad stays None), unfrozen, two steps accumulated.
TRAINED: Script = [("step", 0), ("step", 1), ("zero",), ("freeze", False), ("step", 2),
                   ("freeze", True), ("step", 3), ("step", 4)]
# Built with the ties frozen: a step (no sum, .grad None), unfrozen later, two steps.
FROZEN: Script = [("step", 0), ("freeze", True), ("step", 1), ("step", 2)]


def run_script(pipe: DistributedPipe, model: nn.Sequential, reference: nn.Sequential,
               script: Script, tied: Sequence[str], batch: Batch, loss_fn: Any,
               failures: Failures, what: str, replica: Optional[slice] = None) -> None:
    """Run ``script`` on ``pipe`` (built from ``model``) and on the plain ``reference``;
    after each step every local gradient equals the reference's (``None`` included).

    ``tied`` are the names the freezing acts on (in the original model, whose tied
    tensors on this rank are the pipe's own copies). With ``replica``, this replica
    trains on that slice of each batch and the reference on the whole batch.
    """
    theirs = named(reference)
    for entry in script:
        if entry[0] == "zero":
            pipe.zero_grad()
            reference.zero_grad()
        elif entry[0] == "freeze":
            for name in tied:
                named(model)[name].requires_grad_(entry[1])
                theirs[name].requires_grad_(entry[1])
        else:
            x, y = batch(entry[1])
            part = replica if replica is not None else slice(None)
            loss = pipe.train_step(x[part] if pipe.is_first else None,
                                   y[part] if pipe.is_last else None, loss_fn)
            ref_loss = loss_fn(reference(x), y)
            ref_loss.backward()
            if replica is None:
                failures.close(loss, ref_loss.detach(), f"{what}: loss of step {entry[1]}")
            for name, param in named(pipe).items():
                failures.close(param.grad, theirs[name].grad,
                               f"{what}: grad of {name} after step {entry[1]}")
    pipe.check_ties()


def case(failures: Failures, build: Callable[[], nn.Sequential], tied: Sequence[str],
         batch: Batch, loss_fn: Any, what: str, frozen: bool = False,
         replica: Optional[slice] = None, **options: Any) -> None:
    """A fresh pipe and reference from ``build`` through ``TRAINED``, or with ``frozen``
    through ``FROZEN``, ``tied`` frozen in both before the pipe is built."""
    model, reference = build(), build()
    for name in tied if frozen else ():
        named(model)[name].requires_grad_(False)
        named(reference)[name].requires_grad_(False)
    pipe = DistributedPipe(model, **options)
    script = FROZEN if frozen else TRAINED
    what = f"{what}{' built frozen' if frozen else ''}"
    run_script(pipe, model, reference, script, tied, batch, loss_fn, failures, what, replica)


# ----------------------------------------------------------------------------- 2 ranks

LM_TIE = ("0.weight", "4.weight")


def _two(rank: int, world: int) -> None:
    failures = Failures(rank, TOL)
    _sweep(failures)
    for schedule, frozen in (("1f1b", False), ("1f1b", True), ("zb_h1", False)):
        case(failures, language_model, LM_TIE, tokens, F.cross_entropy, schedule, frozen,
             chunks=3, balance=[2, 3], schedule=schedule)
    _scaled(failures)
    failures.finish()
    _frozen_on_one_rank(rank)
    _failed_step(rank)


def _scaled(failures: Failures) -> None:
    """The fp16 loss scaler over two accumulated steps, stepping a fused optimizer (which
    unscales inside): the tied copies' gradients are the plain model's times the scale,
    and the weights after the step are the plain model's."""
    pipe, reference = DistributedPipe(language_model(), chunks=3, balance=[2, 3]), language_model()
    scaler = PipeGradScaler(pipe, init_scale=2.0**10)
    opt = torch.optim.Adam(pipe.parameters(), lr=0.01, fused=True)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    for step in range(2):
        x, y = tokens(step)
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                        F.cross_entropy, scaler=scaler)
        F.cross_entropy(reference(x), y).backward()
    theirs = named(reference)
    for name, param in named(pipe).items():
        assert param.grad is not None
        failures.close(param.grad / 2.0**10, theirs[name].grad, f"scaled: grad of {name}")
    scaler.step(opt)
    scaler.update()
    ref_opt.step()
    for name, param in named(pipe).items():
        failures.close(param.detach(), theirs[name].detach(), f"scaled: {name} after the step")
    pipe.check_ties()


def _frozen_on_one_rank(rank: int) -> None:
    """A tie frozen on one holder only: every rank raises, naming the tie and the mend,
    instead of one rank waiting in a sum the other never starts."""
    model = language_model()
    pipe = DistributedPipe(model, chunks=2, balance=[2, 3])
    if rank == 1:
        model[4].weight.requires_grad_(False)
    x, y = tokens(0)
    with pytest.raises(RuntimeError, match=r"the tied parameter '0\.weight' \(also "
                                           r"'4\.weight'\) requires grad on stages \[0\] "
                                           r"but not on \[1\].*on every rank"):
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                        F.cross_entropy)


def _failed_step(rank: int) -> None:
    """A step that fails before any backward (``loss_fn`` raises) leaves each tied copy's
    ``.grad`` as the earlier step left it: what was set aside is put back."""
    pipe = DistributedPipe(language_model(), chunks=3, balance=[2, 3])
    x, y = tokens(0)
    pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, F.cross_entropy)
    copy = named(pipe)["0.weight" if pipe.is_first else "4.weight"]
    assert copy.grad is not None
    before = copy.grad.clone()

    def failing(output: Tensor, target: Tensor) -> Tensor:
        raise ValueError("loss_fn fails on purpose")

    with pytest.raises(ValueError if pipe.is_last else PeerError, match="on purpose"):
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, failing)
    assert copy.grad is not None and torch.equal(copy.grad, before), "the earlier gradient was lost"


def test_steps_accumulate_under_every_schedule_and_ties_follow_requires_grad_on_2_ranks(
) -> None:
    run_workers(_two, 2, timeout=300, pg_timeout=60)


# ----------------------------------------------------------------------------- 4 ranks

MANY_TIES = ("0.weight", "7.inner.weight", "7.inner.bias", "2.weight")


def _four(rank: int, world: int) -> None:
    failures = Failures(rank, TOL)
    for frozen in (False, True):
        case(failures, many_ties, MANY_TIES, vectors, F.mse_loss, "four stages", frozen,
             chunks=4, balance=[2, 2, 2, 3])
    trio = dist.new_group([0, 1, 2])  # rank 3 stays out; stage 1 holds no copy
    if rank < 3:
        case(failures, language_model, LM_TIE, tokens, F.cross_entropy, "trio", chunks=3,
             balance=[2, 2, 1], group=trio)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh_groups(mesh)
    half = dist.get_rank(dp) * 6
    case(failures, language_model, LM_TIE, tokens, F.cross_entropy, "pp x dp",
         replica=slice(half, half + 6), chunks=2, balance=[2, 3], group=pp,
         data_parallel_group=dp)
    failures.finish()


def test_ties_accumulate_and_follow_requires_grad_on_4_ranks() -> None:
    run_workers(_four, 4, timeout=300, pg_timeout=60)


# ------------------------------------------------------------------------ the local Pipe

@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("name", sorted(BALANCE))
def test_two_local_steps_accumulate_like_the_plain_model(name: str, tied: bool) -> None:
    expected, losses = accumulated(tied)
    balance = BALANCE[name]
    pipe = Pipe(model(tied), chunks=4, balance=balance, devices=["cpu"] * len(balance))
    for step, (x, y) in enumerate(batches()):
        loss = pipe.train_step(x, y, F.mse_loss, schedule=name)
        torch.testing.assert_close(loss, losses[step], rtol=1e-12, atol=0)
    for key, param in pipe.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(param.grad, expected[key], rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_two_local_backwards_accumulate_like_the_plain_model(tied: bool) -> None:
    expected, _ = accumulated(tied)
    pipe = Pipe(model(tied), chunks=4, balance=[2, 2, 2, 2],
                devices=["cpu"] * 4)
    for x, y in batches():
        F.mse_loss(pipe(x), y).backward()
    for key, param in pipe.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(param.grad, expected[key], rtol=1e-9, atol=1e-11)
