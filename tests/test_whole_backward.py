"""A ``Pipe``'s stages backpropagate as the plain model does exactly where the caller's
autograd call is a backward over the whole graph.

``_PipeFunction.backward`` asks autograd (``seqpipe.local.direct.whole_backward``) whether
the running call executes every node (``loss.backward()``): then each stage's backward
runs without ``inputs=`` and, where no ``.grad`` existed, the sums stay in ``.grad``
(``DirectSink.hold``). Under ``torch.autograd.grad`` or a backward with
``inputs=`` nothing changes: ``inputs=`` and the hand-over stay, so ``.grad`` is untouched
where the call asks for no accumulation. With a parameter hook (an ``AliasSink``) the
stages backpropagate into the aliases, plainly under a whole backward too. Each case
checks which form the stages' backwards took and the gradients against the plain model's.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional

import pytest
import torch
from test_direct_sink import _FailsInBackward
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import seqpipe.core.stage
from seqpipe import Pipe, ReentrantCheckpointError
from seqpipe.local.pipeline import LocalPipeline

DTYPE = torch.float64


class Scaled(nn.Module):
    """Holds a tensor that requires grad but is no parameter of the pipe (``scale``)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.full((8,), 0.5, dtype=DTYPE, requires_grad=True)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), Scaled(), nn.Linear(8, 8), nn.ReLU(),
                         nn.Linear(8, 3)).to(DTYPE)


def _pipe(model: nn.Sequential, checkpoint: str = "never") -> Pipe:
    return Pipe(model, chunks=4, balance=[3, 3], devices=["cpu", "cpu"], checkpoint=checkpoint)


def _x() -> Tensor:
    return torch.randn(8, 6, dtype=DTYPE, generator=torch.Generator().manual_seed(1))


def _watched(monkeypatch: pytest.MonkeyPatch) -> List[Any]:
    """The ``inputs=`` of every stage backward from now on (``None``: none)."""
    seen: List[Any] = []
    run = seqpipe.core.stage.run_backward

    def watch(roots: Any, grads: Any, inputs: Any = ()) -> None:
        seen.append(inputs or None)
        run(roots, grads, inputs)
    monkeypatch.setattr(seqpipe.core.stage, "run_backward", watch)
    return seen


def _handed_over(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    """How many parameter sums each engine backward hands to autograd from now on."""
    counts: List[int] = []
    backward = LocalPipeline.backward

    def watch(self: LocalPipeline, *args: Any) -> Dict[nn.Parameter, Tensor]:
        sums = backward(self, *args)
        counts.append(len(sums))
        return sums
    monkeypatch.setattr(LocalPipeline, "backward", watch)
    return counts


def _grads(model: nn.Module) -> Dict[str, Optional[Tensor]]:
    return {n: p.grad for n, p in model.named_parameters()}


def _close(got: Optional[Tensor], expected: Optional[Tensor], what: str) -> None:
    assert got is not None and expected is not None, what
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10, msg=what)


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_a_whole_backward_runs_the_stages_plainly_and_leaves_the_sums_in_grad(
        checkpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``inputs=``; every parameter's ``.grad`` and the held tensor's are the plain
    model's (the held one was left out before); a second call adds on top (handed over)."""
    model = _model()
    plain = copy.deepcopy(model)
    x = _x()
    plain(x).square().mean().backward()
    pipe = _pipe(model, checkpoint)
    seen, handed = _watched(monkeypatch), _handed_over(monkeypatch)
    pipe(x).square().mean().backward()
    assert len(seen) == 8 and all(inputs is None for inputs in seen), seen
    assert handed == [0]  # left in .grad
    for name, param in plain.named_parameters():
        _close(_grads(pipe)[name], param.grad, name)
    _close(model[2].scale.grad, plain[2].scale.grad, "a held tensor")
    pipe(x).square().mean().backward()  # .grad exists: put aside, then handed over
    assert all(inputs is None for inputs in seen), seen
    assert handed == [0, 6]
    for name, param in plain.named_parameters():
        _close(_grads(pipe)[name], 2 * param.grad, name)


def test_autograd_grad_through_a_pipe_leaves_every_grad_none(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    plain = copy.deepcopy(model)
    x, y = _x().requires_grad_(), _x().requires_grad_()
    expected, = torch.autograd.grad(plain(y).square().mean(), y)
    seen, handed = _watched(monkeypatch), _handed_over(monkeypatch)
    got, = torch.autograd.grad(_pipe(model)(x).square().mean(), x)
    assert handed == [6]
    _close(got, expected, "the input's gradient")
    assert seen and all(inputs is not None for inputs in seen), seen
    assert all(grad is None for grad in _grads(model).values())
    assert model[2].scale.grad is None


def test_a_backward_with_inputs_fills_only_those(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    plain = copy.deepcopy(model)
    x = _x()
    plain(x).square().mean().backward()
    pipe = _pipe(model)
    seen = _watched(monkeypatch)
    pipe(x).square().mean().backward(inputs=[model[3].weight])
    assert seen and all(inputs is not None for inputs in seen), seen
    _close(model[3].weight.grad, plain[3].weight.grad, "3.weight")
    assert [n for n, g in _grads(model).items() if g is not None] == ["3.weight"]
    assert model[2].scale.grad is None


def test_a_hook_backpropagates_plainly_into_its_aliases_under_a_whole_backward(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``AliasSink``'s stages too run without ``inputs=`` under a whole backward: they
    reach the aliases, which hand their sums over once (the hook fires once)."""
    model = _model()
    plain = copy.deepcopy(model)
    x = _x()
    plain(x).square().mean().backward()
    fired: List[int] = []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    seen = _watched(monkeypatch)
    _pipe(model)(x).square().mean().backward()
    assert seen and all(inputs is None for inputs in seen), seen
    assert fired == [1]
    for name, param in plain.named_parameters():
        _close(_grads(model)[name], param.grad, name)


def test_a_failed_whole_backward_leaves_grads_none() -> None:
    """The sums were going to stay in ``.grad``: a failure drops the partial ones."""
    model = _model()
    model.insert(1, _FailsInBackward())
    model[1].armed = True  # raises at its third micro-batch, after two added to .grad
    pipe = Pipe(model, chunks=4, balance=[3, 4], devices=["cpu", "cpu"], checkpoint="never")
    with pytest.raises(ValueError, match="no gradient today"):
        pipe(_x()).square().mean().backward()
    assert all(grad is None for grad in _grads(model).values())


class _Reentrant(nn.Module):
    """A layer that checkpoints itself the reentrant way."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8).to(DTYPE)

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint(self.lin, x, use_reentrant=True)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_a_reentrant_checkpoint_trains_under_a_whole_backward_only() -> None:
    """As in the plain model; with ``inputs=`` the stage refuses it by name, as before."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), _Reentrant(), nn.Tanh(), nn.Linear(8, 3)).to(DTYPE)
    plain = copy.deepcopy(model)
    x = _x()
    plain(x).square().mean().backward()
    pipe = Pipe(model, chunks=4, balance=[2, 2], devices=["cpu", "cpu"])
    pipe(x).square().mean().backward()
    for name, param in plain.named_parameters():
        _close(_grads(model)[name], param.grad, name)
    with pytest.raises(ReentrantCheckpointError, match="use_reentrant=False"):
        pipe(x).square().mean().backward(inputs=[model[0].weight])


def test_two_calls_in_one_whole_backward_add_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first call's backward leaves its sums in ``.grad``; the second finds them there,
    puts them aside and hands its own over, so autograd adds both."""
    model = _model()
    plain = copy.deepcopy(model)
    a, b = _x(), 2 * _x()
    (plain(a).square().mean() + plain(b).sum()).backward()
    pipe = _pipe(model)
    handed = _handed_over(monkeypatch)
    (pipe(a).square().mean() + pipe(b).sum()).backward()
    assert handed == [0, 6]
    for name, param in plain.named_parameters():
        _close(_grads(model)[name], param.grad, name)
    _close(model[2].scale.grad, plain[2].scale.grad, "a held tensor")
