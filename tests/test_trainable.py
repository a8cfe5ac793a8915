"""Each call walks its parameters afresh, without ``nn.Module.parameters`` (a call's fixed cost).

``seqpipe.core.trainable`` lists what a call trains and checks the parameters' hooks at every
call, so whatever changed since the last call (a parameter frozen, unfrozen, replaced, added,
a hook registered or removed) is what the call sees, in the order ``parameters()`` gives.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List

import pytest
import torch
from torch import Tensor, nn

from seqpipe import Pipe
from seqpipe.core.sink import AliasSink, DirectSink, open_sink
from seqpipe.core.trainable import trainable


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(),
                         nn.Linear(8, 3)).double()


def _plain_grads(model: nn.Module, x: Tensor) -> Dict[str, Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_step(pipe: Pipe, plain: nn.Module, x: Tensor) -> None:
    """One call of ``pipe`` (several micro-batches: the engine and its sink) gives the plain
    model's gradients, on the same parameters."""
    expected = _plain_grads(plain, x)
    pipe.zero_grad(set_to_none=True)
    pipe(x).square().mean().backward()
    got = {n: p.grad for n, p in pipe.named_parameters() if p.grad is not None}
    assert sorted(got) == sorted(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-12, rtol=1e-10, msg=name)


def test_the_walk_lists_what_parameters_lists() -> None:
    shared = nn.Linear(4, 4)
    inner = nn.Sequential(nn.Linear(4, 4), shared, nn.Tanh(), shared)  # a module twice
    model = nn.Sequential(nn.Linear(4, 4), inner, nn.LayerNorm(4), nn.Linear(4, 4))
    model[3].weight = model[0].weight  # a parameter twice (tied)
    model[2].register_parameter("extra", None)  # a None entry
    inner.add_module("gone", None)  # a None child
    model[2].bias.requires_grad_(False)  # frozen
    partitions = [model, inner, nn.Sequential(model[2], model[3])]
    assert trainable(partitions) == [
        [p for p in part.parameters() if p.requires_grad] for part in partitions]


def test_the_walk_does_not_call_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("walked through nn.Module.parameters/named_modules")
    for name in ("parameters", "named_parameters", "named_modules", "modules"):
        monkeypatch.setattr(nn.Module, name, refuse)
    sink = open_sink([model[:2], model[2:]])
    assert isinstance(sink, DirectSink)
    assert sink.params == [model[0].weight, model[0].bias, model[2].weight, model[2].bias,
                           model[4].weight, model[4].bias]


def test_each_call_sees_what_changed_since_the_last() -> None:
    model = _model()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = Pipe(model, chunks=4, balance=[2, 3], devices=["cpu", "cpu"])
    _assert_step(pipe, plain, x)
    for m in (model, plain):  # frozen: no gradient, not in the call's sums
        m[2].weight.requires_grad_(False)
    _assert_step(pipe, plain, x)
    for m in (model, plain):  # unfrozen again
        m[2].weight.requires_grad_(True)
    _assert_step(pipe, plain, x)
    for m in (model, plain):  # replaced through the module (registration hooks run)
        m[4].weight = nn.Parameter(m[4].weight.detach() * 2)
    _assert_step(pipe, plain, x)
    for m in (model, plain):  # replaced in the dict itself (as Module._apply may)
        m[0]._parameters["bias"] = nn.Parameter(m[0].bias.detach() + 1)
    _assert_step(pipe, plain, x)
    for m in (model, plain):  # a new parameter on a layer, used by its forward
        m[1].register_parameter("scale", nn.Parameter(torch.full((8,), 0.5,
                                                                 dtype=torch.float64)))
        m[1].forward = (lambda layer: lambda v: torch.tanh(v) * layer.scale)(m[1])
    _assert_step(pipe, plain, x)
    assert model[1].scale.grad is not None


def test_a_hook_registered_or_removed_between_calls_changes_the_sink() -> None:
    model = _model()
    pipe = Pipe(model, chunks=4, balance=[2, 3], devices=["cpu", "cpu"])
    plain = copy.deepcopy(model)
    x = torch.randn(8, 6, dtype=torch.float64)
    partitions = list(pipe.partitions)
    assert isinstance(open_sink(partitions), DirectSink)
    fired: List[Tensor] = []
    handle = model[2].weight.register_post_accumulate_grad_hook(
        lambda p: fired.append(p.grad.clone()))
    assert isinstance(open_sink(partitions), AliasSink)
    _assert_step(pipe, plain, x)
    assert len(fired) == 1  # once per call, with the sum over the micro-batches
    torch.testing.assert_close(fired[0], plain[2].weight.grad, atol=1e-12, rtol=1e-10)
    handle.remove()
    assert isinstance(open_sink(partitions), DirectSink)
    _assert_step(pipe, plain, x)
    assert len(fired) == 1
