"""Without parameter hooks a ``Pipe`` runs its layers exactly as the plain model does.

No ``TorchFunctionMode`` stands between the layers and torch (``seqpipe.core.sink.DirectSink``):
autograd records the parameters themselves and every micro-batch accumulates into ``.grad``.
The gradients are still the plain model's, handed to autograd once per call, and ``.grad``
is as it was before the call wherever autograd does not accumulate (``autograd.grad``, a
failed backward). A hook on any parameter, or a DDP forward, brings the aliases back
(tests/test_grad_sink.py, tests/test_ddp.py hold what they keep exact).
"""
from __future__ import annotations

import copy
from typing import Dict, List

import pytest
import torch
from test_grad_sink import CustomFunction, _plain_grads, _Side
from torch import Tensor, nn

from seqpipe import Pipe

MODES = ("always", "except_last", "never")


class Probe(nn.Module):
    """Records how many TorchFunctionModes are active each time it runs (forward and
    recomputation alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.depths: List[int] = []

    def forward(self, x: Tensor) -> Tensor:
        self.depths.append(torch._C._len_torch_function_stack())
        return x


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), Probe(), nn.Tanh(), nn.Linear(8, 8), Probe(),
                         nn.ReLU(), nn.Linear(8, 3)).double()


def _probes(model: nn.Module) -> List[Probe]:
    return [m for m in model.modules() if isinstance(m, Probe)]


def _assert_grads(model: nn.Module, expected: Dict[str, Tensor], scale: float = 1.0) -> None:
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert sorted(got) == sorted(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], scale * grad, atol=1e-12, rtol=1e-10, msg=name)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("call", ["forward", "1f1b", "zb_h1"])
def test_without_hooks_no_mode_runs_while_the_layers_compute(mode: str, call: str) -> None:
    model = _model()
    x = torch.randn(8, 6, dtype=torch.float64)
    expected = _plain_grads(copy.deepcopy(model), x)
    pipe = Pipe(model, chunks=4, balance=[3, 4], devices=["cpu", "cpu"], checkpoint=mode)
    for step in range(2):  # the second step adds to the first one's .grad
        if call == "forward":
            pipe(x).square().mean().backward()
        else:
            pipe.train_step(x, torch.zeros(8, 3, dtype=torch.float64),
                            lambda out, _: out.square().mean(), schedule=call)
        _assert_grads(pipe, expected, step + 1)
    for probe in _probes(pipe):
        assert probe.depths and set(probe.depths) == {0}  # forwards and recomputations


@pytest.mark.parametrize("hook", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_hook_on_one_parameter_keeps_every_hook_once_per_call(hook: str) -> None:
    model = _model()
    x = torch.randn(8, 6, dtype=torch.float64)
    expected = _plain_grads(copy.deepcopy(model), x)
    pipe = Pipe(model, chunks=4, balance=[3, 4], devices=["cpu", "cpu"])
    fired: List[Tensor] = []
    weight = model[3].weight
    if hook == "register_hook":
        weight.register_hook(lambda g: fired.append(g.clone()))
    else:
        weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    pipe(x).square().mean().backward()
    assert len(fired) == 1  # once, with the sum over the four micro-batches
    torch.testing.assert_close(fired[0], expected["3.weight"], atol=1e-12, rtol=1e-10)
    _assert_grads(pipe, expected)
    assert all(depth >= 1 for probe in _probes(pipe) for depth in probe.depths)


def _tangled() -> nn.Sequential:
    """Partitions [0 1 2] [3 4 5] [6 7]: layer 6's weight is layer 0's (tied across
    partitions), layer 7 uses layer 2's through a plain attribute (another partition's),
    and layer 2 hands it to a custom autograd Function (no ``__torch_function__``)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), CustomFunction(), nn.Linear(8, 8),
                          _Side(nn.Parameter(torch.randn(8, 8))), nn.Tanh(),
                          nn.Linear(8, 8), nn.Tanh()).double()
    model[4].refs = [model[3].weight]  # its own partition's
    model[6].weight = model[0].weight
    model[7] = _Side(model[2].weight)
    return model


@pytest.mark.parametrize("mode", MODES)
def test_shared_parameters_get_every_use_once_per_call(mode: str) -> None:
    model = _tangled()
    x = torch.randn(8, 8, dtype=torch.float64)
    expected = _plain_grads(copy.deepcopy(model), x)
    pipe = Pipe(model, chunks=4, balance=[3, 3, 2], devices=["cpu"] * 3, checkpoint=mode)
    pipe(x).square().mean().backward()
    _assert_grads(pipe, expected)
    pipe.train_step(x, torch.zeros_like(x), lambda out, _: out.square().mean(), schedule="zb_h1")
    _assert_grads(pipe, expected, 2.0)


@pytest.mark.parametrize("mode", MODES)
def test_autograd_grad_leaves_existing_grads_as_they_were(mode: str) -> None:
    model = _model()
    x = torch.randn(8, 6, dtype=torch.float64)
    expected = _plain_grads(copy.deepcopy(model), x)
    pipe = Pipe(model, chunks=4, balance=[3, 4], devices=["cpu", "cpu"], checkpoint=mode)
    before = {p: torch.full_like(p, 7.0) for p in pipe.parameters()}
    for param, grad in before.items():
        param.grad = grad
    names = [n for n, _ in pipe.named_parameters()]
    grads = torch.autograd.grad(pipe(x).square().mean(), list(pipe.parameters()))
    for name, grad in zip(names, grads):
        torch.testing.assert_close(grad, expected[name], atol=1e-12, rtol=1e-10, msg=name)
    for param, grad in before.items():
        assert param.grad is grad and bool((grad == 7.0).all())


class _FailsInBackward(nn.Module):
    """Once armed, its backward raises at its third micro-batch (after two have added
    their share to the parameters before it)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.seen = 0

    def forward(self, x: Tensor) -> Tensor:
        if not self.armed:
            return x
        y = x * 1.0

        def hook(grad: Tensor) -> None:
            self.seen += 1
            if self.seen == 3:
                raise ValueError("no gradient today")
        y.register_hook(hook)
        return y


def test_a_failed_backward_leaves_grads_as_they_were_and_the_pipe_usable() -> None:
    model = _model()
    model.insert(1, _FailsInBackward())
    x = torch.randn(8, 6, dtype=torch.float64)
    expected = _plain_grads(copy.deepcopy(model), x)
    pipe = Pipe(model, chunks=4, balance=[3, 5], devices=["cpu", "cpu"], checkpoint="never")
    pipe(x).square().mean().backward()
    before = {p: p.grad.clone() for p in pipe.parameters()}
    model[1].armed = True
    with pytest.raises(ValueError, match="no gradient today"):
        pipe(x).square().mean().backward()
    for param, grad in before.items():  # the failed call's partial sums are dropped
        torch.testing.assert_close(param.grad, grad, atol=0, rtol=0)
    model[1].armed = False
    pipe(x).square().mean().backward()
    _assert_grads(pipe, expected, 2.0)
