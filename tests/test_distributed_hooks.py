"""Parameter hooks in a DistributedPipe fire once per train_step, with the step's gradient
(a ``register_hook`` hook that returns a changed gradient changes all of it).

As for ``Pipe`` and the unpipelined model: micro-batches add up where no hook sees them,
and the stage's last backward hands the sum to the real parameters. "Optimizer step in
backward" recipes (``register_post_accumulate_grad_hook``) therefore step on full
gradients.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch
from test_direct_sink import Probe
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

from distributed_harness import run_workers
from seqpipe.distributed import DistributedPipe, mesh_groups

MODES = [("1f1b", "except_last"), ("1f1b", "always"), ("fill_drain", "never"),
         ("fill_drain", "always"), ("zb_h1", "always"), ("zb_h2", "never"),
         ("zbv", "except_last"), ("interleaved_1f1b", "never")]
BALANCE = {"zbv": [2, 1, 1, 1], "interleaved_1f1b": [1, 1, 2, 1]}  # two stages per rank


class _UnlessSingle(nn.Module):
    """Skips its layer on a micro-batch of one sample: a parameter that some micro-batches
    use and others (the last, under 1F1B) do not."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return x if x.shape[0] == 1 else self.inner(x)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), _UnlessSingle(nn.Linear(8, 8)), nn.Tanh(),
                         nn.Linear(8, 3)).double()


def _batch(step: int) -> tuple:
    gen = torch.Generator().manual_seed(step)
    return (torch.randn(7, 4, generator=gen, dtype=torch.float64),  # micro-batches 2, 2, 2, 1
            torch.randn(7, 3, generator=gen, dtype=torch.float64))


def _reference_backward(model: nn.Sequential, x: Tensor, y: Tensor) -> None:
    """The pipeline's loss: micro-batch losses weighted by their share of the batch."""
    loss = sum(nn.functional.mse_loss(model(xi), yi) * len(xi) / len(x)
               for xi, yi in zip(x.split(2), y.split(2)))
    loss.backward()  # type: ignore[union-attr]


def _step(pipe: DistributedPipe, step: int) -> None:
    x, y = _batch(step)
    pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                    nn.functional.mse_loss)


def _record_hooks(pipe: nn.Module) -> Tuple[Dict[str, List[Tensor]], Dict[str, int]]:
    """What each parameter's post-accumulate hooks saw in ``.grad``; how often a
    gradient flowed into it (``register_hook``)."""
    seen: Dict[str, List[Tensor]] = {}
    flowing: Dict[str, int] = {}
    for name, param in pipe.named_parameters():
        param.register_post_accumulate_grad_hook(
            lambda p, name=name: seen.setdefault(name, []).append(p.grad.clone()))
        param.register_hook(lambda g, name=name: flowing.__setitem__(
            name, flowing.get(name, 0) + 1))
    return seen, flowing


def _once_with_the_sum(rank: int, world: int) -> None:
    for schedule, checkpoint in MODES:
        reference = _model()
        _reference_backward(reference, *_batch(0))
        pipe = DistributedPipe(_model(), chunks=4, balance=BALANCE.get(schedule, [2, 3]),
                               schedule=schedule, checkpoint=checkpoint)
        seen, flowing = _record_hooks(pipe)
        _step(pipe, 0)
        expected = dict(reference.named_parameters())
        for name, param in pipe.named_parameters():
            what = (schedule, checkpoint, name)
            assert len(seen[name]) == 1, what  # once per step, not once per micro-batch
            assert torch.allclose(seen[name][0], expected[name].grad, atol=1e-12), what
            assert torch.allclose(param.grad, expected[name].grad, atol=1e-12), what
            assert flowing[name] == 1, what
    _changing_hooks()


def _halve(model: nn.Module) -> None:
    """A ``register_hook`` hook that changes the gradient flowing into each parameter."""
    for param in model.parameters():
        param.register_hook(lambda g: g * 0.5)


def _changing_hooks() -> None:
    """A ``register_hook`` hook that returns another gradient changes the step's whole
    gradient, as in the unpipelined model; not the last micro-batch's share only (the
    parameter of ``_UnlessSingle``, which that micro-batch skips under 1F1B, included)."""
    reference = _model()
    _halve(reference)
    _reference_backward(reference, *_batch(0))
    expected = dict(reference.named_parameters())
    for schedule, checkpoint in MODES:
        pipe = DistributedPipe(_model(), chunks=4, balance=BALANCE.get(schedule, [2, 3]),
                               schedule=schedule, checkpoint=checkpoint)
        _halve(pipe)
        _step(pipe, 0)
        for name, param in pipe.named_parameters():
            torch.testing.assert_close(param.grad, expected[name].grad, atol=1e-12, rtol=1e-10,
                                       msg=f"{schedule}/{checkpoint}: {name}")


def test_post_accumulate_hooks_fire_once_per_step_with_the_whole_gradient() -> None:
    run_workers(_once_with_the_sum, 2, timeout=120)


def _optimizer_in_backward(rank: int, world: int, schedule: str) -> None:
    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    pipe = DistributedPipe(_model(), chunks=4, balance=[2, 3], schedule=schedule)
    optimizers = {p: torch.optim.SGD([p], lr=0.5) for p in pipe.parameters()}

    def step_now(param: Tensor) -> None:  # the recipe: step each parameter as its grad lands
        optimizers[param].step()  # type: ignore[index]
        optimizers[param].zero_grad(set_to_none=True)  # type: ignore[index]

    for param in pipe.parameters():
        param.register_post_accumulate_grad_hook(step_now)
    for step in range(3):
        _step(pipe, step)
        ref_opt.zero_grad()
        _reference_backward(reference, *_batch(step))
        ref_opt.step()
    expected = dict(reference.named_parameters())
    for name, param in pipe.named_parameters():
        assert param.grad is None, name
        assert torch.allclose(param, expected[name], atol=1e-12), (schedule, name)


@pytest.mark.parametrize("schedule", ["1f1b", "fill_drain", "zb_h1"])
def test_an_optimizer_stepped_in_backward_sees_full_gradients(schedule: str) -> None:
    run_workers(_optimizer_in_backward, 2, schedule, timeout=120)


# -- without hooks: no mode between the layers and torch ------------------------------------
def _probed() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), Probe(), nn.Tanh(), nn.Linear(8, 8), Probe(),
                         nn.Tanh(), nn.Linear(8, 3)).double()


def _depths(pipe: DistributedPipe) -> set:
    seen = {d for m in pipe.partition.modules() if isinstance(m, Probe) for d in m.depths}
    for m in pipe.partition.modules():
        if isinstance(m, Probe):
            m.depths.clear()
    return seen


def _no_mode_without_hooks(rank: int, world: int) -> None:
    x, y = _batch(0)
    for schedule, checkpoint in [("1f1b", "except_last"), ("zb_h1", "always")]:
        reference = _probed()
        _reference_backward(reference, x, y)
        expected = dict(reference.named_parameters())
        pipe = DistributedPipe(_probed(), chunks=4, balance=[2, 5], schedule=schedule,
                               checkpoint=checkpoint)
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                        nn.functional.mse_loss)
        assert _depths(pipe) == {0}, schedule  # every micro-batch straight into .grad
        for name, param in pipe.named_parameters():
            assert torch.allclose(param.grad, expected[name].grad, atol=1e-12), (schedule, name)
        next(pipe.parameters()).register_post_accumulate_grad_hook(lambda p: None)
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                        nn.functional.mse_loss)
        assert 1 in _depths(pipe), schedule  # a hook: the aliases are back
    # Two replicas of one stage: the data-parallel reducer's hooks wait for the last
    # backward themselves, so they need no aliases either.
    pp, dp = mesh_groups(init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "dp")))
    reference = _probed()
    nn.functional.mse_loss(reference(x[:6]), y[:6]).backward()
    expected = dict(reference.named_parameters())
    pipe = DistributedPipe(_probed(), chunks=2, group=pp, data_parallel_group=dp)
    half = slice(3 * rank, 3 * rank + 3)
    pipe.train_step(x[half], y[half], nn.functional.mse_loss)
    assert _depths(pipe) == {0}
    for name, param in pipe.named_parameters():  # the replicas' mean: the whole batch's
        assert torch.allclose(param.grad, expected[name].grad, atol=1e-12), name


def test_without_hooks_a_stage_runs_no_mode_and_gets_the_plain_gradients() -> None:
    run_workers(_no_mode_without_hooks, 2, timeout=120)
