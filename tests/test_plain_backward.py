"""A distributed stage's backward runs as the plain model's: ``train_step`` runs them all.

``seqpipe.distributed.accumulate.StepGrads`` marks its sink ``plain``: every ``B`` of the
stage calls ``torch.autograd.backward(roots, grads)`` without ``inputs=``, whatever
autograd records for the parameters (the parameters, their aliases where a hook needs
them, a parameter subclass, FSDP2's unsharded leaves), so that it reaches what the plain
model's ``loss.backward()`` reaches: a tensor outside the pipe that a layer holds gets its
gradient, and a layer may checkpoint itself the reentrant way. These tests drive a
stage the way ``DistributedPipe.train_step`` does (``sink_for``, ``handing_over``), in one
process, watch which form autograd is called with, and check the gradients (parameters and
received input) against the plain model's, micro-batch by micro-batch.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import seqpipe.core.entry
import seqpipe.core.stage
from seqpipe.core.microbatch import Batch
from seqpipe.core.sink import step_aware
from seqpipe.core.stage import Received, Stage
from seqpipe.distributed.accumulate import StepGrads
from seqpipe.skip.layout import inspect_skip_layout

M = 3


class Scaled(nn.Module):
    """A layer holding a tensor that requires grad but is not a parameter (``scale``)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.full((8,), 0.5, dtype=torch.float64, requires_grad=True)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


class Reentrant(nn.Module):
    """A layer that checkpoints itself the reentrant way."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8).double()

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint(self.lin, x, use_reentrant=True)


class Tagged(nn.Parameter):
    """A parameter subclass (as a tensor-parallel ``DTensor`` parameter is one)."""


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _stage(model: nn.Sequential) -> Stage:
    """``model`` as the middle stage of three (its input wants a gradient back)."""
    full = nn.Sequential(nn.Identity(), *model, nn.Identity())
    layout = inspect_skip_layout(full, [1, len(model), 1])
    return Stage(1, model, torch.device("cpu"), layout)


def _data() -> List[List[Tensor]]:
    torch.manual_seed(1)
    return [[torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)]
            for _ in range(M)]


def _plain(model: nn.Module, data: List[List[Tensor]]) -> List[Optional[Tensor]]:
    """The plain model's gradients over the micro-batches, and each input's."""
    inputs = []
    for x, g in data:
        x = x.clone().requires_grad_()
        model(x).backward(g)
        inputs.append(x.grad)
    return inputs


def _step(stage: Stage, data: List[List[Tensor]]) -> List[Optional[Tensor]]:
    """One step of the stage as ``train_step`` runs it (forwards, then backwards)."""
    grads = StepGrads(stage, M - 1)
    states = []
    for i, (x, _) in enumerate(data):
        received = Received(Batch((x.clone().requires_grad_(),), True, ()), {}, (True,))
        _, state = stage.forward(received, grad=True, sink=grads.sink_for(i))
        states.append(state)
    inputs = []
    for i, (_, g) in enumerate(data):
        with grads.handing_over(i):
            inputs.append(stage.backward(states[i], [g], {}, sink=grads.sink_for(i)).inputs[0])
    return inputs


def _watched(monkeypatch: pytest.MonkeyPatch) -> List[Any]:
    """The ``inputs=`` of every backward from now on (``None``: none), a stage's
    (``seqpipe.core.autograd_calls.run_backward``, whose ``()`` is none) and any other."""
    seen: List[Any] = []
    backward, run = torch.autograd.backward, seqpipe.core.stage.run_backward

    def watch(*args: Any, **kwargs: Any) -> None:
        seen.append(kwargs.get("inputs"))
        backward(*args, **kwargs)

    def watch_stage(roots: Any, grads: Any, inputs: Any = ()) -> None:
        seen.append(inputs or None)
        run(roots, grads, inputs)
    monkeypatch.setattr(torch.autograd, "backward", watch)
    monkeypatch.setattr(seqpipe.core.stage, "run_backward", watch_stage)
    return seen


def _same(pipe: nn.Module, plain: nn.Module, got: List[Optional[Tensor]],
          expected: List[Optional[Tensor]]) -> None:
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-12, rtol=1e-10, msg=name)
    for i, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10, msg=f"input {i}")


def _subclass(model: nn.Sequential) -> None:
    model[2].weight = Tagged(model[2].weight.detach().clone())


def _sharded(stage: Stage) -> None:  # FSDP2 sets leaves: the unsharded parameters
    stage.leaves = Stage.parameters


# name -> (change to the model, change to the stage)
CASES = {
    "no hooks": (None, None),
    "step-aware hook": (lambda m: m[0].weight.register_post_accumulate_grad_hook(
        step_aware(lambda p: None)), None),
    "post-accumulate hook": (lambda m: m[0].weight.register_post_accumulate_grad_hook(
        lambda p: None), None),
    "tensor hook": (lambda m: m[2].bias.register_hook(lambda g: g), None),
    "parameter subclass": (_subclass, None),
    "FSDP2 leaves": (None, _sharded),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_backward_of_a_step_is_plain(
        case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    change, sharded = CASES[case]
    model, plain = _model(), _model()
    for m in (model, plain):
        if change is not None:
            change(m)
    stage = _stage(model)
    if sharded is not None:
        sharded(stage)
    data = _data()
    expected = _plain(plain, data)
    seen = _watched(monkeypatch)
    got = _step(stage, data)
    assert len(seen) >= M, seen
    assert all(inputs is None for inputs in seen), f"{case}: {seen}"
    _same(model, plain, got, expected)


def test_a_post_accumulate_hook_still_sees_the_whole_gradient_once() -> None:
    model, plain = _model(), _model()
    seen: List[Tensor] = []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    data = _data()
    expected = _plain(plain, data)
    _same(model, plain, _step(_stage(model), data), expected)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], plain[0].weight.grad, atol=1e-12, rtol=1e-10)


def _trains_like_plain(case: str, make: Callable[[], nn.Sequential]
                       ) -> Tuple[nn.Sequential, nn.Sequential]:
    """``make()``'s model (``_model``'s with a third layer inserted), changed as ``case``
    says, steps as the plain model does; returns both."""
    change, sharded = CASES[case]
    model, plain = make(), make()
    for m in (model, plain):
        if change is not None:
            change(m[:2] + m[3:])  # (the indices of _model's layers)
    stage = _stage(model)
    if sharded is not None:
        sharded(stage)
    data = _data()
    expected = _plain(plain, data)
    _same(model, plain, _step(stage, data), expected)
    return model, plain


@pytest.mark.parametrize("case", list(CASES))
def test_every_backward_reaches_what_the_plain_model_does(case: str) -> None:
    """A tensor outside the pipe that a layer holds gets its gradient, as in the plain
    model (``inputs=`` left it out; docs/pipe.md)."""
    model, plain = _trains_like_plain(
        case, lambda: nn.Sequential(*_model()[:2], Scaled(), _model()[2]))
    torch.testing.assert_close(model[2].scale.grad, plain[2].scale.grad,
                               atol=1e-12, rtol=1e-10)


def _reentrant() -> nn.Sequential:
    torch.manual_seed(2)
    return nn.Sequential(*_model()[:2], Reentrant(), _model()[2])


@pytest.mark.parametrize("case", list(CASES))
def test_a_reentrant_checkpoint_trains_as_in_the_plain_model(case: str) -> None:
    """Where the backward named its inputs (before, or a split backward's ``I``: see
    ``tests/test_split_recompute.py``) it raises ``ReentrantCheckpointError``."""
    _trains_like_plain(case, _reentrant)


@pytest.mark.parametrize("case", ["no hooks", "post-accumulate hook"])
def test_a_stage_enters_autograd_without_torchs_python_layers(
        case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_Receive`` goes to autograd's C++ ``apply`` and each ``B`` to the engine as
    ``torch.autograd.backward`` does, without their Python layers
    (``seqpipe.core.autograd_calls``); the gradients stay the plain model's."""
    change = CASES[case][0]
    model, plain = _model(), _model()
    for m in (model, plain):
        if change is not None:
            change(m)
    data = _data()
    expected = _plain(plain, data)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("went through torch's Python layer")
    monkeypatch.setattr(seqpipe.core.entry._Receive, "apply", refuse)
    monkeypatch.setattr(torch.autograd, "backward", refuse)
    got = _step(_stage(model), data)
    _same(model, plain, got, expected)
