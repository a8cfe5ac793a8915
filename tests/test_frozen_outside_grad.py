"""``pipe(x)`` on a frozen pipe records a graph exactly where the plain model does.

The plain model records a graph whenever a tensor its forward touches requires grad. A pipe
none of whose parameters requires grad, given an input that wants none, used to run as
inference: a tensor outside the pipe that a layer holds (an adapter beside a frozen base, a
learned prompt) got no gradient, and ``loss.backward()`` raised. Now such a call runs with
grad mode on, and joins the caller's graph exactly where its outputs require grad; with
nothing requiring grad its output requires none, as the plain model's.
"""
from __future__ import annotations

from typing import Tuple

import pytest
import torch
from torch import Tensor, nn

from seqpipe import Pipe


class Adapter(nn.Module):
    """Adds ``scale * x @ delta`` with ``delta`` held as a plain attribute (not registered:
    the user's adapter, trained outside the frozen base) and a prompt-like bias."""

    def __init__(self, delta: Tensor, bias: Tensor) -> None:
        super().__init__()
        self.__dict__["delta"] = delta
        self.__dict__["shift"] = bias

    def forward(self, x: Tensor) -> Tensor:
        return x + x @ self.delta + self.shift


def frozen(delta: Tensor, bias: Tensor) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), Adapter(delta, bias), nn.Linear(4, 3))
    return model.requires_grad_(False)


def outside() -> Tuple[Tensor, Tensor]:
    torch.manual_seed(1)
    return (torch.randn(4, 4, dtype=torch.float64) * 0.1).requires_grad_(), \
        torch.randn(4, dtype=torch.float64).requires_grad_()


CASES = {  # name: (chunks, balance, checkpoint)
    "direct": (1, [4], "except_last"),  # one partition, one micro-batch: the plain graph
    "one partition": (3, [4], "except_last"),
    "two partitions": (3, [2, 2], "except_last"),
    "checkpointed": (3, [3, 1], "always"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_tensor_a_frozen_pipe_holds_gets_the_plain_models_gradient(case: str) -> None:
    chunks, balance, checkpoint = CASES[case]
    delta, bias = outside()
    plain = frozen(delta, bias).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    plain(x).square().sum().backward()
    expected = delta.grad.clone(), bias.grad.clone()
    delta.grad = bias.grad = None
    pipe = Pipe(frozen(delta, bias).double(), chunks=chunks, balance=balance,
                devices=["cpu"] * len(balance), checkpoint=checkpoint)
    out = pipe(x)
    assert out.requires_grad
    torch.testing.assert_close(out, plain(x))
    out.square().sum().backward()
    torch.testing.assert_close(delta.grad, expected[0])
    torch.testing.assert_close(bias.grad, expected[1])
    assert all(p.grad is None for p in pipe.parameters())


@pytest.mark.parametrize("case", list(CASES))
def test_a_frozen_pipe_touching_nothing_that_wants_grad_records_no_graph(case: str) -> None:
    chunks, balance, checkpoint = CASES[case]
    delta, bias = (t.detach() for t in outside())
    plain = frozen(delta, bias).double()
    pipe = Pipe(frozen(delta, bias).double(), chunks=chunks, balance=balance,
                devices=["cpu"] * len(balance), checkpoint=checkpoint)
    x = torch.randn(6, 4, dtype=torch.float64)
    out = pipe(x)
    assert not out.requires_grad and not plain(x).requires_grad
    torch.testing.assert_close(out, plain(x))
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.sum().backward()  # as the plain model's output
    with torch.no_grad():  # inference: nothing recorded either way
        delta.requires_grad_()
        assert not pipe(x).requires_grad
