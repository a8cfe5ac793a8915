"""Training runs of many steps on the local ``Pipe``, as a user's script runs them.

Session 14's hunt (docs/pipe.md, "Your objects and settings"): what a script does between and
around ``train_step``s over 5-10 steps, each compared, after every step, with the plain
model trained the same way (float64, two ``cpu`` partitions, 4 micro-batches):

* **The global generator** (bug, fixed in ``seqpipe/local/pipeline.py`` and
  ``seqpipe/core/draws.py``): every call drew ``M * K`` task seeds from the global CPU
  generator, even when no partition could draw a random number. So a validation pass in
  ``eval()`` between training steps changed the later dropout masks (the plain model's
  training does not depend on its validation), and a pipe without dropout moved the
  stream the script shuffles its data with (``torch.randperm``) away from the plain run's.
  Now a call whose partitions all draw nothing (dropout in ``eval()`` included) draws no
  seeds.
* **Already as in the plain model** (kept as guards): AdamW (``foreach`` on and off) with a
  warm-up ``LambdaLR``, SGD with Nesterov momentum and ``OneCycleLR``,
  ``zero_grad(set_to_none=False)``, ``clip_grad_norm_`` over ``pipe.parameters()``,
  ``train_step`` interleaved with ``pipe(x)`` + ``backward()``, ragged and small batches,
  accumulation over three ``train_step``s, parameter groups built from
  ``named_parameters()`` names with weight decay on a tied weight, an EMA
  (``AveragedModel``); and a run stopped and resumed from ``state_dict``s (pipe, optimizer,
  scheduler, RNG) continues bit for bit, dropout included.
"""
from __future__ import annotations

import io
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seqpipe import Pipe

TOL = dict(atol=1e-12, rtol=1e-10)


def mlp(dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(dropout), nn.Linear(8, 8),
                         nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 6)).double()


def piped(model: nn.Sequential, chunks: int = 4, **kwargs: Any) -> Pipe:
    half = len(model) // 2
    return Pipe(model, chunks=chunks, balance=[half, len(model) - half], devices=["cpu", "cpu"],
                **kwargs)


def batch(step: int, n: int = 8) -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(step)
    return (torch.randn(n, 6, generator=gen, dtype=torch.float64),
            torch.randn(n, 6, generator=gen, dtype=torch.float64))


def close_params(pipe: nn.Module, plain: nn.Module, what: str) -> None:
    theirs = dict(plain.named_parameters())
    for name, param in pipe.named_parameters():
        torch.testing.assert_close(param, theirs[name], **TOL, msg=f"{what}: {name}")


def close_grads(pipe: nn.Module, plain: nn.Module, what: str) -> None:
    theirs = dict(plain.named_parameters())
    for name, param in pipe.named_parameters():
        want = theirs[name].grad
        assert (param.grad is None) == (want is None), f"{what}: {name}'s grad is None"
        if want is not None:
            torch.testing.assert_close(param.grad, want, **TOL, msg=f"{what}: grad of {name}")


# -- the global generator ---------------------------------------------------------------------
def _dropout_run(validate: bool, every: Optional[int], steps: int = 4
                 ) -> Tuple[List[Tensor], List[Tensor]]:
    """A pipe with dropout trained from one seed; with ``validate``, an ``eval()`` +
    ``no_grad`` pass after every step, as a script's validation loop does."""
    pipe = piped(mlp(dropout=0.3), checkpoint_every=every)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    torch.manual_seed(7)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        losses.append(pipe.train_step(x, y, F.mse_loss) if step % 2 else
                      _backward(F.mse_loss(pipe(x), y)))
        opt.step()
        if validate:
            pipe.eval()
            with torch.no_grad():
                pipe(batch(100 + step)[0])
            pipe.train()
    return losses, [p.detach().clone() for p in pipe.parameters()]


def _backward(loss: Tensor) -> Tensor:
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("every", [None, 1])
def test_a_validation_pass_between_steps_does_not_change_the_training(every: Optional[int]
                                                                      ) -> None:
    """The plain model's training does not depend on whether it is validated in between:
    in ``eval()`` its dropout draws nothing. The pipe drew its task seeds from the global
    generator in that pass too, so every later mask changed (losses off by up to 0.06); also
    checkpointed one layer at a time (``checkpoint_every``)."""
    plain_losses, plain_params = _dropout_run(validate=False, every=every)
    losses, params = _dropout_run(validate=True, every=every)
    for step, (a, b) in enumerate(zip(losses, plain_losses)):
        assert torch.equal(a, b), f"step {step}: loss {a} with validation, {b} without"
    for a, b in zip(params, plain_params):
        assert torch.equal(a, b)


def test_a_pipe_that_draws_nothing_leaves_the_scripts_random_stream_alone() -> None:
    """A script that shuffles its data with the global generator (``torch.randperm``)
    gets the plain run's order, so the pipe trains on the same batches as the plain
    model: a pipe without dropout drew ``M * K`` seeds per call and reordered them (its
    ``Dropout(0.0)`` draws nothing, as in the plain model)."""
    data_x, data_y = batch(0, 32)
    nets = {"plain": mlp(), "pipe": piped(mlp())}
    seen: Dict[str, List[Tensor]] = {}
    for name, net in nets.items():
        opt = torch.optim.AdamW(net.parameters(), lr=0.01)
        torch.manual_seed(3)
        seen[name] = []
        for _epoch in range(2):
            order = torch.randperm(32)
            seen[name].append(order)
            for step in range(2):
                idx = order[step * 8:(step + 1) * 8]
                opt.zero_grad()
                if name == "pipe" and step % 2:
                    net.train_step(data_x[idx], data_y[idx], F.mse_loss)
                else:
                    F.mse_loss(net(data_x[idx]), data_y[idx]).backward()
                opt.step()
    for epoch, (a, b) in enumerate(zip(seen["pipe"], seen["plain"])):
        assert torch.equal(a, b), f"epoch {epoch}: the data order moved"
    close_params(nets["pipe"], nets["plain"], "after two shuffled epochs")


# -- optimizers, schedules and the loop around the step ---------------------------------------
Make = Callable[[nn.Module], Tuple[torch.optim.Optimizer, Optional[Any]]]
LOOPS: Dict[str, Make] = {
    "adamw, warm-up": lambda net: _with(
        torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1, foreach=False),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 4))),
    "adamw foreach": lambda net: _with(
        torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1, foreach=True), None),
    "sgd nesterov, one-cycle": lambda net: _with(
        torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                        weight_decay=1e-3),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10)),
}


def _with(opt: torch.optim.Optimizer, sched: Optional[Callable[[Any], Any]]
          ) -> Tuple[torch.optim.Optimizer, Optional[Any]]:
    return opt, None if sched is None else sched(opt)


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_a_ten_step_loop_matches_the_plain_model_after_every_step(name: str) -> None:
    """``zero_grad(set_to_none=False)``, clipping over ``pipe.parameters()``, ``train_step``
    and ``pipe(x)`` + ``backward()`` in turn, batches of 8, 7, 3, 1, 5 samples."""
    plain, pipe = mlp(), piped(mlp())
    runs = [LOOPS[name](net) for net in (plain, pipe)]
    for step in range(10):
        x, y = batch(step, [8, 7, 3, 1, 5][step % 5])
        for opt, _ in runs:
            opt.zero_grad(set_to_none=False)
        expected = _backward(F.mse_loss(plain(x), y))
        loss = pipe.train_step(x, y, F.mse_loss) if step % 2 else \
            _backward(F.mse_loss(pipe(x), y))
        torch.testing.assert_close(loss, expected, **TOL, msg=f"loss of step {step}")
        norms = [torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05) for net in (plain, pipe)]
        torch.testing.assert_close(norms[1], norms[0], **TOL, msg=f"norm of step {step}")
        close_grads(pipe, plain, f"step {step}")
        for opt, sched in runs:
            opt.step()
            if sched is not None:
                sched.step()
        close_params(pipe, plain, f"{name}, after step {step}")


class TiedOut(nn.Module):
    """The output projection that reuses the first layer's weight."""

    def __init__(self, first: nn.Linear) -> None:
        super().__init__()
        self.first = first

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.first.weight)


def tied() -> nn.Sequential:
    torch.manual_seed(0)
    first = nn.Linear(6, 6)
    return nn.Sequential(first, nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), TiedOut(first),
                         nn.Tanh()).double()


def test_accumulation_groups_by_name_a_tied_weight_and_an_ema() -> None:
    """Three ``train_step``s accumulated per optimizer step; weight decay only on the
    parameters whose name does not end in ``bias`` (groups from ``named_parameters()``),
    one of them tied across the partitions (decayed once); an EMA of the weights."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    plain, pipe = tied(), piped(tied())
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in plain.named_parameters()]

    def groups(net: nn.Module) -> List[Dict[str, Any]]:
        named = list(net.named_parameters())
        return [{"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": 0.5},
                {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]
    opts = [torch.optim.AdamW(groups(net), lr=0.01) for net in (plain, pipe)]
    emas = [AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9)) for net in (plain, pipe)]
    for step in range(9):
        x, y = batch(step, [8, 5, 3][step % 3])
        F.mse_loss(plain(x), y).div(3).backward()
        pipe.train_step(x, y, lambda out, target: F.mse_loss(out, target) / 3)
        close_grads(pipe, plain, f"accumulated to step {step}")
        if step % 3 == 2:
            for opt, net, ema in zip(opts, (plain, pipe), emas):
                opt.step()
                opt.zero_grad()
                ema.update_parameters(net)
            close_params(pipe, plain, f"after step {step}")
    close_params(emas[1], emas[0], "the EMA")


def _resumable_run(steps: int, stop: Optional[int]) -> Tuple[List[Tensor], Dict[str, Tensor]]:
    """AdamW + warm-up on a pipe with dropout, from one seed; with ``stop``, everything a
    script saves (pipe, optimizer, scheduler, RNG) goes through ``torch.save`` at that step
    and a fresh pipe, optimizer and scheduler load it."""
    def build() -> Tuple[Pipe, torch.optim.Optimizer, Any]:
        pipe = piped(mlp(dropout=0.3))
        opt = torch.optim.AdamW(pipe.parameters(), lr=0.01, weight_decay=0.1)
        return pipe, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    pipe, opt, sched = build()
    torch.manual_seed(7)
    losses = []
    for step in range(steps):
        if step == stop:
            saved = io.BytesIO()
            torch.save({"pipe": pipe.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "rng": torch.get_rng_state()}, saved)
            saved.seek(0)
            state = torch.load(saved)
            pipe, opt, sched = build()
            torch.manual_seed(123)  # a new process
            pipe.load_state_dict(state["pipe"])
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
            torch.set_rng_state(state["rng"])
        x, y = batch(step)
        opt.zero_grad()
        losses.append(pipe.train_step(x, y, F.mse_loss))
        opt.step()
        sched.step()
    return losses, {k: v.clone() for k, v in pipe.state_dict().items()}


def test_a_run_stopped_and_resumed_continues_bit_for_bit() -> None:
    """Dropout included: the masks follow the global generator's state, which the script
    saves and restores (docs/pipe.md, Randomness)."""
    losses, state = _resumable_run(8, stop=None)
    resumed_losses, resumed = _resumable_run(8, stop=4)
    for step, (a, b) in enumerate(zip(resumed_losses, losses)):
        assert torch.equal(a, b), f"step {step}: {a} resumed, {b} uninterrupted"
    for key, value in state.items():
        assert torch.equal(resumed[key], value), key


def test_dropout_draws_nothing_in_eval_or_at_p_zero() -> None:
    """What the fix relies on: ``draws_nothing`` counts a dropout (or ``RReLU``) in
    ``eval()`` and a dropout of ``p=0`` as quiet, and nothing else new."""
    from seqpipe.core.draws import draws_nothing

    class MyDropout(nn.Dropout):
        """A subclass: its forward may draw in any mode."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5), nn.RReLU(), nn.AlphaDropout(0.2))
    assert not draws_nothing(model)
    assert draws_nothing(model.eval())
    assert draws_nothing(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0), nn.Dropout2d(0.0)))
    assert not draws_nothing(nn.Sequential(nn.RReLU(), nn.Dropout(0.0)))
    assert not draws_nothing(nn.Sequential(MyDropout(0.5)).eval())


def test_fp16_loss_scaling_inside_loss_fn_is_the_plain_grad_scaler() -> None:
    """``Pipe.train_step`` takes no scaler: scaling the loss inside ``loss_fn`` with a
    ``torch.amp.GradScaler`` (docs/pipe.md) gives the plain model's scaled run, the scale's
    growth and an overflow's back-off included (fp16 autocast on the CPU)."""
    def small() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                             nn.Linear(8, 6))
    plain, pipe = small(), Pipe(small(), chunks=1, balance=[2, 3], devices=["cpu", "cpu"])
    opts = [torch.optim.SGD(net.parameters(), lr=0.1) for net in (plain, pipe)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=2)
               for _ in range(2)]
    for step in range(6):
        x, y = (t.float() for t in batch(step))
        with torch.autocast("cpu", dtype=torch.float16):
            expected = F.mse_loss(plain(x), y)
            loss = pipe.train_step(x, y, lambda out, target: scalers[1].scale(
                F.mse_loss(out, target)))
        scalers[0].scale(expected).backward()
        torch.testing.assert_close(loss / scalers[1].get_scale(), expected.detach())
        for scaler, opt, net in zip(scalers, opts, (plain, pipe)):
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert scalers[1].get_scale() == scalers[0].get_scale(), f"step {step}"
        close_params(pipe, plain, f"fp16, step {step}")


def test_a_run_saved_with_the_checkpoint_helpers_resumes_in_another_layout(
        tmp_path: Any) -> None:
    """``seqpipe.distributed.checkpoint.save``/``load`` in one process (no process group,
    as a ``Pipe`` user runs them), mid-run, into another balance and ``chunks`` with a
    fresh optimizer: the run goes on as the plain model's, tied weight included."""
    from seqpipe.distributed.checkpoint import load, save
    plain, pipe = tied(), piped(tied())
    opts = [torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)
            for net in (plain, pipe)]
    for step in range(6):
        if step == 3:
            with pytest.warns(UserWarning, match="single process"):  # DCP's, without a group
                save(pipe, opts[1], tmp_path / "ck")
            pipe = Pipe(tied(), chunks=2, balance=[2, 4], devices=["cpu", "cpu"])
            opts[1] = torch.optim.AdamW(pipe.parameters(), lr=0.5)
            with pytest.warns(UserWarning, match="single process"):
                load(pipe, opts[1], tmp_path / "ck")
        x, y = batch(step)
        for opt in opts:
            opt.zero_grad()
        F.mse_loss(plain(x), y).backward()
        pipe.train_step(x, y, F.mse_loss)
        for opt in opts:
            opt.step()
        close_params(pipe, plain, f"after step {step}")
