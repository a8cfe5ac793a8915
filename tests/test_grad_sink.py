"""Parameter gradients of a local ``Pipe`` add up in a ``GradSink``, then reach autograd once.

The stages backpropagate each micro-batch into per-call aliases of the parameters, so the
real parameters see one gradient per backward (the micro-batch sum): their hooks fire
once, as in the unpipelined model, and tied or shared weights get every use's share.
"""
from __future__ import annotations

import copy
from typing import Dict, List

import pytest
import torch
from torch import Tensor, nn

from seqpipe import Pipe
from seqpipe.sink import GradSink

MODES = ("always", "except_last", "never")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(),
                         nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _plain_grads(model: nn.Sequential, x: Tensor) -> Dict[str, Tensor]:
    model.zero_grad()
    model(x).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _pipe_grads(pipe: Pipe, x: Tensor) -> Dict[str, Tensor]:
    pipe.zero_grad()
    pipe(x).square().mean().backward()
    return {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}


def _assert_same(got: Dict[str, Tensor], expected: Dict[str, Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("mode", MODES)
def test_hooks_on_parameters_fire_once_with_the_microbatch_sum(mode: str) -> None:
    model = _model()
    x = torch.randn(8, 6, dtype=torch.float64)
    expected = _plain_grads(copy.deepcopy(model), x)
    pipe = Pipe(model, chunks=4, balance=[3, 4], devices=["cpu", "cpu"], checkpoint=mode)
    seen: Dict[str, List[Tensor]] = {}
    accumulated: Dict[str, int] = {}
    for name, param in pipe.named_parameters():
        param.register_hook(lambda g, name=name: seen.setdefault(name, []).append(g.clone()))
        param.register_post_accumulate_grad_hook(
            lambda p, name=name: accumulated.__setitem__(name, accumulated.get(name, 0) + 1))
    for step in range(2):  # the second step accumulates onto the first one's .grad
        pipe(x).square().mean().backward()
        assert accumulated == {name: step + 1 for name in expected}
    for name, grads in seen.items():
        assert len(grads) == 2
        for grad in grads:
            torch.testing.assert_close(grad, expected[name], atol=1e-12, rtol=1e-10)
    for name, param in pipe.named_parameters():
        torch.testing.assert_close(param.grad, 2 * expected[name], atol=1e-12, rtol=1e-10)


def _real_parameters(model: nn.Module) -> bool:
    return all(isinstance(p, nn.Parameter) for m in model.modules()
               for p in m._parameters.values() if p is not None)


def test_modules_hold_their_own_parameters_after_a_call_and_after_a_failure() -> None:
    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8).double()

        def forward(self, x: Tensor) -> Tensor:
            if x.shape[0] == 3:
                raise ValueError("no batches of 3")
            return self.lin(x)

    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), Fails(), nn.Linear(8, 3)).double()
    params = {n: p for n, p in model.named_parameters()}
    pipe = Pipe(model, chunks=2, balance=[2, 2], devices=["cpu", "cpu"])
    pipe(torch.randn(4, 6, dtype=torch.float64)).sum().backward()
    assert _real_parameters(pipe)
    with pytest.raises(ValueError, match="no batches of 3"):
        pipe(torch.randn(6, 6, dtype=torch.float64))  # micro-batches of 3
    assert _real_parameters(pipe)
    assert all(p is params[n] for n, p in pipe.named_parameters())


@pytest.mark.parametrize("mode", MODES)
def test_a_weight_tied_across_partitions_gets_both_shares(mode: str) -> None:
    model = _model()
    model[6].weight = nn.Parameter(torch.randn(3, 8, dtype=torch.float64))
    model[4] = nn.Linear(8, 3).double()
    model[4].weight = model[6].weight  # the same Parameter in two layers...
    model.insert(5, nn.Linear(3, 8).double())  # ... of different partitions
    x = torch.randn(8, 6, dtype=torch.float64)
    expected = _plain_grads(copy.deepcopy(model), x)
    pipe = Pipe(model, chunks=4, balance=[4, 4], devices=["cpu", "cpu"], checkpoint=mode)
    counts: Dict[int, int] = {}
    tied = model[4].weight
    tied.register_post_accumulate_grad_hook(lambda p: counts.__setitem__(0, counts.get(0, 0) + 1))
    _assert_same(_pipe_grads(pipe, x), expected)
    assert counts == {0: 1}


@pytest.mark.parametrize("mode", MODES)
def test_a_module_shared_by_layers_of_two_partitions(mode: str) -> None:
    shared = nn.Linear(8, 8).double()

    class Uses(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = shared

        def forward(self, x: Tensor) -> Tensor:
            return torch.tanh(self.shared(x))

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 8), Uses(), nn.Linear(8, 8), Uses(),
                          nn.Linear(8, 3)).double()
    x = torch.randn(8, 6, dtype=torch.float64)
    expected = _plain_grads(copy.deepcopy(model), x)
    pipe = Pipe(model, chunks=4, balance=[2, 3], devices=["cpu", "cpu"], checkpoint=mode)
    _assert_same(_pipe_grads(pipe, x), expected)
    assert _real_parameters(pipe)


def test_the_sink_hands_each_sum_over_once() -> None:
    layer = nn.Linear(4, 4)
    sink = GradSink([nn.Sequential(layer)])
    for _ in range(3):  # three micro-batches accumulate in place into one alias
        out = sink.call(0, layer, torch.ones(2, 4))
        torch.autograd.backward([out.sum()], inputs=sink.leaves(0))
    assert layer.weight.grad is None and layer.bias.grad is None  # nothing reached .grad
    pairs = dict(sink.take())
    torch.testing.assert_close(pairs[layer.bias], torch.full((4,), 6.0))
    torch.testing.assert_close(pairs[layer.weight], torch.full((4, 4), 6.0))
    assert sink.take() == []  # handed over: nothing left


def test_a_parameter_reached_outside_its_module_entries_still_gets_its_gradient() -> None:
    class Side(nn.Module):
        """Uses another layer's weight through a plain list, not a registered entry."""

        def __init__(self, weight: nn.Parameter) -> None:
            super().__init__()
            self.refs = [weight]

        def forward(self, x: Tensor) -> Tensor:
            return x @ self.refs[0].t()

    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).double()
    model.append(Side(model[2].weight))  # in the partition that holds it
    x = torch.randn(8, 6, dtype=torch.float64)
    expected = _plain_grads(model, x)
    pipe = Pipe(model, chunks=4, balance=[2, 2], devices=["cpu", "cpu"])
    _assert_same(_pipe_grads(pipe, x), expected)
