"""A one-partition call with one micro-batch runs as the plain model (``seqpipe.local.direct``).

With nothing to pipeline and nothing to add up, ``Pipe.forward`` runs the partition in the
caller's autograd graph, skipping the engine (its worker machinery, gradient sink and
nested backward cost a fifth of a small transformer's step). These tests pin that it does,
that its gradients and hooks are the plain model's, and that what a caller can see of the
engine's call stays: each behaviour is checked on the direct call and, where the engine
runs (two micro-batches of one partition), on the engine too.
"""
from __future__ import annotations

import copy
import os
import sys
from typing import Any, List, Tuple

import pytest
import torch
from torch import Tensor, nn

import seqpipe
from seqpipe import Pipe, is_checkpointing
from seqpipe.local.pipeline import LocalPipeline
from seqpipe.skip import pop, skippable, stash
from seqpipe.skip.tracker import current_skip_tracker
from seqpipe.trace import record

PATHS = ("direct", "engine")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(),
                         nn.Linear(8, 3)).double()


def _pipe(model: nn.Sequential, path: str = "direct", **kwargs: Any) -> Pipe:
    """One ``cpu`` partition: one micro-batch (direct) or two (the engine)."""
    return Pipe(model, chunks=1 if path == "direct" else 2, balance=[len(model)],
                devices=["cpu"], **kwargs)


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any use of the engine fails the test."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the engine ran")
    for name in ("forward", "backward", "open_sink"):
        monkeypatch.setattr(LocalPipeline, name, refuse)


@pytest.mark.parametrize("batch", [4, 1])  # chunks=1, or chunks=4 with one sample
def test_one_microbatch_runs_in_the_callers_graph_with_the_plain_gradients(
        batch: int, no_engine: None) -> None:
    plain = _model()
    pipe = Pipe(copy.deepcopy(plain), chunks=1 if batch == 4 else 4, balance=[5],
                devices=["cpu"])
    fired: List[str] = []
    for name, p in pipe.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    x = torch.randn(batch, 6, dtype=torch.float64, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    for _ in range(2):  # .grad accumulates across calls as in the plain model
        pipe(x).pow(2).sum().backward()
        plain(x_plain).pow(2).sum().backward()
    for (name, a), b in zip(pipe.named_parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad), name
    assert torch.equal(x.grad, x_plain.grad)
    assert sorted(fired) == sorted(2 * [n for n, _ in pipe.named_parameters()])


@pytest.mark.parametrize("path", PATHS)
def test_a_second_backward_is_refused_with_the_engines_message(path: str) -> None:
    pipe = _pipe(_model(), path)
    loss = pipe(torch.randn(4, 6, dtype=torch.float64)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already backpropagated"):
        loss.backward()
    out = pipe(torch.randn(4, 6, dtype=torch.float64))
    out.sum().backward()
    with pytest.raises(RuntimeError, match="already backpropagated"):
        out.sum().backward()


@pytest.mark.parametrize("path", PATHS)
def test_higher_order_gradients_are_refused(path: str) -> None:
    pipe = _pipe(_model(), path)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(pipe(x).sum(), x, create_graph=True)


class Constant(nn.Module):
    """Returns a value that depends on nothing that requires grad, and integer labels."""

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        return torch.ones_like(x), torch.arange(len(x))


@pytest.mark.parametrize("path", PATHS)
def test_outputs_are_new_tensors_requiring_grad_as_the_engines(path: str) -> None:
    x = torch.randn(4, 6, dtype=torch.float64)
    same = _pipe(nn.Sequential(nn.Identity()), path)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            out = same(x)
        assert out is not x and torch.equal(out, x) and not out.requires_grad
    const = _pipe(nn.Sequential(nn.Linear(6, 6).double(), Constant()), path)
    ones, labels = const(x)
    assert ones.requires_grad and not labels.requires_grad  # as the engine's Function's
    ones.sum().backward()
    assert all(p.grad is None for p in const.parameters())
    with torch.no_grad():
        ones, labels = const(x)
    assert ones.grad_fn is None and not ones.requires_grad


def test_a_first_layer_may_write_its_input_in_place() -> None:
    """A leaf that requires grad enters as a non-leaf (as the engine's ``_Receive`` makes
    it), so the plain model's in-place first layer works on it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(6, 3)).double()
    plain = nn.Sequential(nn.ReLU(), copy.deepcopy(model[1]))
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(plain(x).pow(2).sum(), [x, *plain.parameters()])
    pipe = _pipe(model)
    x_pipe = x.detach().clone().requires_grad_()
    got = torch.autograd.grad(pipe(x_pipe).pow(2).sum(), [x_pipe, *pipe.parameters()])
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


class Fail(nn.Module):
    """Raises while ``armed``."""

    armed = True

    def forward(self, x: Tensor) -> Tensor:
        if self.armed:
            raise ArithmeticError("failed in forward")
        return x


@pytest.mark.parametrize("path", PATHS)
def test_an_exception_names_the_stage_and_deferred_statistics_are_dropped(path: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), Fail()).double()
    pipe = _pipe(model, path, deferred_batch_norm=True)
    with pytest.raises(ArithmeticError, match="failed in forward") as info:
        pipe(torch.randn(4, 6, dtype=torch.float64))
    assert "seqpipe: raised by stage 0 in the forward of micro-batch 0" in info.value.__notes__
    pipe[2].armed = False  # the failed call's statistics are not in the next update
    x = torch.randn(4, 6, dtype=torch.float64)
    pipe(x)
    plain = nn.BatchNorm1d(4).double()
    plain(pipe[0](x))
    torch.testing.assert_close(pipe[1].running_mean, plain.running_mean)


def test_a_checkpointed_or_traced_call_still_runs_the_engine() -> None:
    seen: List[bool] = []

    class Probe(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            seen.append(is_checkpointing())
            return x

    pipe = Pipe(nn.Sequential(nn.Linear(6, 6), Probe()), chunks=1, checkpoint="always")
    pipe(torch.randn(4, 6)).sum().backward()
    assert seen[0] is True  # checkpointed: the engine's run
    pipe = Pipe(nn.Sequential(nn.Linear(6, 6)), chunks=1)
    with record() as rec:
        pipe(torch.randn(4, 6)).sum().backward()
    assert rec.recording.events, "a recorded call is traced, through the engine"


def test_a_direct_call_makes_few_python_calls() -> None:
    """The call's fixed cost is mostly Python calls, each several µs when it follows a
    backward (docs/benchmark-history.md, "Session 11: fwd"): the direct call is made of at most
    ``BUDGET`` calls of seqpipe's own functions (44 before session 11: a ``Batch`` or
    ``Input`` object made six times, nested closures around the partition, a skip tracker
    for a model without skips; 17 after, and 20 with session 11's three refusals' checks:
    tracing, forward AD, the parametrize cache)."""
    budget = 21
    root = os.path.dirname(seqpipe.__file__)
    pipe = _pipe(_model())
    x = torch.randn(4, 6, dtype=torch.float64)
    for _ in range(2):  # the first call of a training mode copies the input (caller_input)
        pipe(x).sum().backward()
    calls: List[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(root):
            calls.append(frame.f_code.co_name)
    sys.setprofile(profile)
    try:
        out = pipe(x)
    finally:
        sys.setprofile(None)
    assert len(calls) <= budget, calls
    assert type(out.grad_fn).__name__ == "_ExitOneBackward"  # the direct call ran


@skippable(stash=["h"])
class _Stash(nn.Module):
    def forward(self, x: Tensor) -> Any:
        yield stash("h", x)
        return torch.tanh(x)


@skippable(pop=["h"])
class _Pop(nn.Module):
    trackers: List[Any] = []  # the tracker each pop found

    def forward(self, x: Tensor) -> Any:
        self.trackers.append(current_skip_tracker())
        h = yield pop("h")
        return x * h


@pytest.mark.parametrize("depth", ["top", "nested"])
def test_a_model_with_skips_runs_direct_with_a_tracker_of_its_own(
        depth: str, no_engine: None) -> None:
    """A partition with skippable layers (at its top level, or nested in a layer) gets a
    tracker per call (one without gets none, as no layer asks): the plain model's outputs
    and gradients, the thread's tracker untouched."""
    torch.manual_seed(0)
    layers = [nn.Linear(6, 6), _Stash(), nn.Linear(6, 6), _Pop()]
    plain = (nn.Sequential(*layers) if depth == "top" else
             nn.Sequential(layers[0], nn.Sequential(*layers[1:]))).double()
    pipe = _pipe(copy.deepcopy(plain))
    x = torch.randn(4, 6, dtype=torch.float64)
    outside = current_skip_tracker()
    held = list(outside.tensors.items())  # (what an earlier failed plain forward left)
    _Pop.trackers.clear()
    pipe(x).pow(2).sum().backward()
    assert _Pop.trackers[-1] is not outside
    plain(x).pow(2).sum().backward()
    for (name, a), b in zip(pipe.named_parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad), name
    now = list(outside.tensors.items())
    assert [k for k, _ in now] == [k for k, _ in held], "the thread's tracker changed"
    assert all(a is b for (_, a), (_, b) in zip(now, held))
    assert current_skip_tracker() is outside


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_module("absent", None)
        self.inner = nn.Sequential(nn.Linear(6, 6), nn.Tanh())

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x)


@pytest.mark.parametrize("trainable", ["none", "nested", "input"])
def test_the_output_requires_grad_as_the_engines(trainable: str) -> None:
    """Whether a call builds a graph: some parameter (at any depth, found past a module
    registered as ``None``) or input requires grad, as ``parameters()`` would say."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), _Block()).double()
    for p in model.parameters():
        p.requires_grad_(trainable == "nested" and p is model[1].inner[0].bias)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=trainable == "input")
    for path in PATHS:
        out = _pipe(copy.deepcopy(model), path)(x)
        assert out.requires_grad == (trainable != "none"), path
