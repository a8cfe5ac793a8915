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
from seqpipe.core.sink import GradSink

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


# -- layers see their own parameter objects (the aliases stay inside autograd) ----------


class Tagged(nn.Parameter):
    """A Parameter subclass, as libraries define them to carry metadata."""


class Scaled(nn.Parameter):
    """A Parameter subclass with its own ``__torch_function__``: doubled inside linear."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is nn.functional.linear:
            args = (args[0], args[1] * 2, *args[2:])
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


class Inspects(nn.Module):
    """Computes with what it finds on its parameter, and records what it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = Tagged(torch.randn(8, 8, dtype=torch.float64))
        self.weight.scale = 3.0  # type: ignore[attr-defined]
        self.original = [self.weight]  # the object, out of the module's entries
        self.factors = {self.weight: 0.5}  # a dict keyed by the parameter (hash)
        self.seen: List[tuple] = []

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        self.seen.append((isinstance(w, nn.Parameter), type(w), w is self.original[0],
                          getattr(w, "scale", None), w.to(w.dtype) is w,
                          None if w.grad is None else w.grad.clone()))
        scale = w.scale if isinstance(w, nn.Parameter) else 1.0  # type: ignore[attr-defined]
        return torch.tanh(x @ w.t()) * scale * self.factors[w]


def _inspecting_model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), Inspects(), nn.Linear(8, 8),
                         Inspects(), nn.Linear(8, 3)).double()


def _count_accumulations(model: nn.Module) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(
            lambda p, name=name: counts.__setitem__(name, counts.get(name, 0) + 1))
    return counts


@pytest.mark.parametrize("mode", MODES)
def test_layers_see_their_own_parameters_during_a_training_call(mode: str) -> None:
    model, plain = _inspecting_model(), _inspecting_model()  # (deepcopy drops attributes)
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = Pipe(model, chunks=4, balance=[3, 3], devices=["cpu", "cpu"], checkpoint=mode)
    counts = _count_accumulations(pipe)
    for step in range(2):  # the second step's layers read the first step's .grad
        expected = plain(x)
        expected.square().mean().backward()
        out = pipe(x)
        torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-10)
        out.square().mean().backward()
        assert counts == {name: step + 1 for name, _ in pipe.named_parameters()}
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-12, rtol=1e-10, msg=name)
    for layer in (model[2], model[4]):
        assert layer.seen  # forwards and recomputations alike
        for is_param, kind, same, scale, to_self, _ in layer.seen:
            assert (is_param, kind, same, scale, to_self) == (True, Tagged, True, 3.0, True)
        steps = [grad for *_, grad in layer.seen]
        assert steps[0] is None  # what the plain model's layer read: .grad before the step
        torch.testing.assert_close(steps[-1], plain[2 if layer is model[2] else 4].weight.grad / 2)


@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_subclass_keeps_its_own_torch_function(mode: str) -> None:
    model = _model()
    model[2].weight = Scaled(model[2].weight.detach().clone())
    x = torch.randn(8, 6, dtype=torch.float64)
    expected = _plain_grads(copy.deepcopy(model), x)
    pipe = Pipe(model, chunks=4, balance=[3, 4], devices=["cpu", "cpu"], checkpoint=mode)
    counts = _count_accumulations(pipe)
    _assert_same(_pipe_grads(pipe, x), expected)
    assert type(model[2].weight) is Scaled and set(counts.values()) == {1}


class Gathers(nn.Module):
    """Parameters reach torch inside a list (``torch.cat``, an RNN's flat weights) and as
    keyword arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, 8, dtype=torch.float64))
        self.b = nn.Parameter(torch.randn(4, 8, dtype=torch.float64))
        self.c = nn.Parameter(torch.randn(8, dtype=torch.float64))
        self.rnn = nn.GRU(8, 8, batch_first=True).double()

    def forward(self, x: Tensor) -> Tensor:
        w = torch.cat([self.a, self.b], dim=0)
        h = torch.add(x @ w.t(), other=self.c, alpha=2.0)
        return self.rnn(h.unsqueeze(1))[0].squeeze(1)


@pytest.mark.parametrize("mode", MODES)
def test_parameters_in_lists_and_keywords_reach_the_sums(mode: str) -> None:
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), Gathers(), nn.Linear(8, 3)).double()
    x = torch.randn(8, 6, dtype=torch.float64)
    expected = _plain_grads(copy.deepcopy(model), x)
    pipe = Pipe(model, chunks=4, balance=[2, 2], devices=["cpu", "cpu"], checkpoint=mode)
    counts = _count_accumulations(pipe)  # once each: every use went through an alias
    _assert_same(_pipe_grads(pipe, x), expected)
    assert counts == {name: 1 for name in expected}


class Symmetric(nn.Module):
    def forward(self, weight: Tensor) -> Tensor:
        return weight.triu() + weight.triu(1).t()


@pytest.mark.parametrize("mode", MODES)
def test_a_parametrized_weight(mode: str) -> None:
    model = _model()
    torch.nn.utils.parametrize.register_parametrization(model[2], "weight", Symmetric())
    x = torch.randn(8, 6, dtype=torch.float64)
    expected = _plain_grads(copy.deepcopy(model), x)
    pipe = Pipe(model, chunks=4, balance=[3, 4], devices=["cpu", "cpu"], checkpoint=mode)
    counts = _count_accumulations(pipe)
    _assert_same(_pipe_grads(pipe, x), expected)
    assert counts == {name: 1 for name in expected}


class _MatMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple:  # type: ignore[override]
        x, w = ctx.saved_tensors
        return grad @ w, grad.t() @ x


class CustomFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return _MatMul.apply(x, self.weight)


@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_handed_to_a_custom_autograd_function_gets_its_gradient(mode: str) -> None:
    # Function.apply does not go through __torch_function__: autograd records the real
    # parameter, whose gradient then lands in .grad once per micro-batch (documented).
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), CustomFunction(), nn.Tanh(),
                          nn.Linear(8, 3)).double()
    x = torch.randn(8, 6, dtype=torch.float64)
    expected = _plain_grads(copy.deepcopy(model), x)
    pipe = Pipe(model, chunks=4, balance=[2, 3], devices=["cpu", "cpu"], checkpoint=mode)
    counts = _count_accumulations(pipe)
    _assert_same(_pipe_grads(pipe, x), expected)
    assert counts.pop("2.weight") >= 4  # per micro-batch, unlike every other parameter
    assert set(counts.values()) == {1}


class _Side(nn.Module):
    """Uses another layer's weight through a plain list, not a registered entry."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.refs = [weight]

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.refs[0].t()


@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_of_another_partition_reached_through_a_plain_attribute(mode: str) -> None:
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).double()
    model.append(_Side(model[0].weight))  # partition 1 uses partition 0's weight
    x = torch.randn(8, 6, dtype=torch.float64)
    expected = _plain_grads(copy.deepcopy(model), x)
    pipe = Pipe(model, chunks=4, balance=[2, 2], devices=["cpu", "cpu"], checkpoint=mode)
    counts = _count_accumulations(pipe)
    _assert_same(_pipe_grads(pipe, x), expected)
    assert counts == {name: 1 for name in expected}  # both shares, summed, once


def _counting_backend(graphs: List[object]):  # type: ignore[no-untyped-def]
    def backend(gm, example_inputs):  # type: ignore[no-untyped-def]
        graphs.append(gm)
        return gm.forward
    return backend


@pytest.mark.parametrize("mode", ["always", "never"])
def test_a_compiled_layer_is_compiled_once_and_trains_like_the_plain_model(mode: str) -> None:
    # One CPU partition: with two, the private random streams keep dynamo from compiling.
    def build() -> nn.Sequential:
        torch.manual_seed(7)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                             nn.Linear(8, 3)).double()

    graphs: List[object] = []
    plain, model = build(), build()
    model[2] = torch.compile(model[2], backend=_counting_backend(graphs))
    pipe = Pipe(model, chunks=2, balance=[5], devices=["cpu"], checkpoint=mode)
    counts = _count_accumulations(pipe)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (plain, model)]
    for step in range(3):  # the weights change between calls: no stale alias is baked in
        x = torch.randn(4, 6, dtype=torch.float64)
        for opt in optimizers:
            opt.zero_grad()
        expected = plain(x)
        expected.square().sum().backward()
        out = pipe(x)
        torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-10)
        out.square().sum().backward()
        for a, b in zip(model.parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-12, rtol=1e-10)
        assert set(counts.values()) == {step + 1}  # through the alias: once per backward
        for opt in optimizers:
            opt.step()
    assert len(graphs) == 1  # not recompiled per micro-batch or per call


def test_a_compiled_layer_using_another_partitions_parameter() -> None:
    first = nn.Linear(4, 4)
    side = _Side(first.weight)
    compiled = torch.compile(side, backend="eager")
    sink = GradSink([nn.Sequential(first), nn.Sequential(side)])
    x = torch.randn(3, 4)
    for _ in range(2):  # two micro-batches into one alias
        out = sink.call(1, compiled, x)
        torch.autograd.backward([out.sum()], inputs=sink.leaves(1))
    assert first.weight.grad is None
    torch.testing.assert_close(dict(sink.take())[first.weight],
                               2 * torch.ones(4, 1) * x.sum(0, keepdim=True))
