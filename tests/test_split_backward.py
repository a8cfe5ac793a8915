"""How a split backward's ``W`` runs its boundary nodes (``seqpipe.core.split_backward``).

``W`` calls each boundary node (a node of the input path with an edge to the weights) inside
one graph task that needs only the nodes' edges off the input path, then backpropagates each
weight path alone. These tests pin what that rule must give: the gradients of one plain
backward, every operation once (none of the input path again, where chained layers would
make a single backward from all boundary nodes count a gradient twice), the same for nodes
side by side on the path, for a custom ``autograd.Function`` and under anomaly detection
(both run by the engine instead), and a hook on a boundary node's output applied once.
"""
from __future__ import annotations

import sys
from collections import Counter
from typing import Any, List, Tuple

import pytest
import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from op_count import OpCount
from seqpipe.core.entry import enter
from seqpipe.core.microbatch import Batch
from seqpipe.core.saved import SavedTensors
from seqpipe.core.split_backward import SplitBackward
from seqpipe.core.stage import Received, Stage
from seqpipe.skip.layout import inspect_skip_layout

DTYPE = torch.float64


def _split(model: nn.Module, x: Tensor, grad: Tensor) -> Tuple[Tensor, List[Tensor], Counter,
                                                                Counter]:
    """``model``'s backward on ``x`` split into I and W as a stage runs it: the input
    gradient, the parameters' gradients, and the operations of I and of W."""
    incoming = [x]
    entry = enter(incoming, [True], torch.device("cpu"))  # x as a stage receives it
    saved = SavedTensors()
    with saved.recording():
        out = model(incoming[0])
    split = SplitBackward([get_gradient_edge(out)], [grad], entry.phony, entry.node,
                          saved=saved)
    with OpCount() as i_ops:
        split.input()
    params = list(model.parameters())
    with OpCount() as w_ops:
        split.weight(params)
    grads = entry.grads(1)[0]
    assert grads is not None
    return grads, [p.grad for p in params], i_ops.counts, w_ops.counts  # type: ignore[misc]


def _plain(model: nn.Module, x: Tensor, grad: Tensor) -> Tuple[Tensor, List[Tensor], Counter]:
    model.zero_grad(set_to_none=True)
    given = x.clone().requires_grad_()
    out = model(given)
    with OpCount() as ops:
        torch.autograd.backward(out, grad)
    assert given.grad is not None
    return given.grad, [p.grad for p in model.parameters()], ops.counts  # type: ignore[misc]


def _assert_exact(model: nn.Module, x: Tensor) -> Tuple[Counter, Counter, Counter]:
    """The split's gradients are the plain backward's; returns the ops of I, W and B."""
    grad = torch.randn_like(model(x))
    dx, dparams, i_ops, w_ops = _split(model, x, grad)
    plain_dx, plain_dparams, b_ops = _plain(model, x, grad)
    torch.testing.assert_close(dx, plain_dx)
    for mine, plain in zip(dparams, plain_dparams):
        torch.testing.assert_close(mine, plain)
    return i_ops, w_ops, b_ops


def test_chained_linears_run_each_operation_once() -> None:
    """Each Linear reaches the next one's weights through the input path, so one backward
    from all boundary nodes together would run the path again and count twice. W runs the
    weight edges only: one ``mm`` per weight, no ``tanh_backward``; I the rest."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)))
    model = model.to(DTYPE)
    i_ops, w_ops, b_ops = _assert_exact(model, torch.randn(5, 6, dtype=DTYPE))
    assert w_ops["mm"] == 4 and w_ops["tanh_backward"] == 0, w_ops
    assert i_ops["mm"] == 4 and i_ops["tanh_backward"] == 4, i_ops
    for op in ("mm", "tanh_backward", "sum"):
        assert i_ops[op] + w_ops[op] == b_ops[op], (op, i_ops, w_ops, b_ops)


class SideBySide(nn.Module):
    """Three Linears on one input (no boundary node reaches another's weights), one after."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.out = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        return self.out(torch.tanh(self.q(h)) * self.k(h) + self.v(h))


def test_nodes_side_by_side_on_the_path() -> None:
    """Boundary nodes that do not reach one another (attention's q, k, v) and a LayerNorm:
    exact, and every operation once. The LayerNorm's backward runs once, in I, computing
    its weight and bias gradients too, as in a plain backward (issue 24, session 13: W ran
    it a second time for them, ~20 us a norm on the benchmark's transformer)."""
    torch.manual_seed(1)
    model = SideBySide().to(DTYPE)
    i_ops, w_ops, b_ops = _assert_exact(model, torch.randn(3, 5, 6, dtype=DTYPE))
    assert w_ops["mm"] == 4 and w_ops["native_layer_norm_backward"] == 0, w_ops
    assert i_ops["native_layer_norm_backward"] == 1, i_ops
    for op in ("mm", "tanh_backward", "mul", "native_layer_norm_backward"):
        assert i_ops[op] + w_ops[op] == b_ops[op], (op, i_ops, w_ops, b_ops)


class _Linear(torch.autograd.Function):
    """A custom linear: its node is a boundary node ``W`` cannot call directly."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, Tensor]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 6))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(_Linear.apply(x, self.weight))


@pytest.mark.parametrize("anomaly", [False, True])
def test_a_custom_function_and_anomaly_detection_run_by_the_engine(anomaly: bool) -> None:
    """A custom ``autograd.Function`` as a boundary node between built-in ones, and every
    boundary node under ``detect_anomaly``: run by the engine from their kept gradients."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 6), Custom(), nn.Linear(6, 6), Custom()).to(DTYPE)
    with torch.autograd.set_detect_anomaly(anomaly):
        _assert_exact(model, torch.randn(4, 6, dtype=DTYPE))


class Hooked(nn.Module):
    """A Linear whose output's gradient a hook changes (doubles): the gradient entering the
    boundary node, read by both halves."""

    def __init__(self, calls: List[int]) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.calls = calls

    def forward(self, x: Tensor) -> Tensor:
        y = self.lin(x)
        if y.requires_grad:
            y.register_hook(self._double)
        return torch.tanh(y)

    def _double(self, grad: Tensor) -> Tensor:
        self.calls.append(1)
        return grad * 2


def test_a_hook_on_a_boundary_output_changes_the_gradient_once() -> None:
    """The hook runs in I only and W starts from what it returned, so the weights'
    gradients are the plain model's (W once ran the node again through the engine, which
    applied the hook a second time: the weight's gradient was doubled twice)."""
    torch.manual_seed(3)
    calls: List[int] = []
    model = nn.Sequential(nn.Linear(6, 6), Hooked(calls), nn.Linear(6, 6)).to(DTYPE)
    x = torch.randn(4, 6, dtype=DTYPE)
    grad = torch.randn(4, 6, dtype=DTYPE)
    _, dparams, _, _ = _split(model, x, grad)
    assert len(calls) == 1, f"the hook ran {len(calls)} times"
    _, plain, _ = _plain(model, x, grad)
    for mine, expected in zip(dparams, plain):
        torch.testing.assert_close(mine, expected)


def test_a_stage_without_an_input_path_records_nothing_to_free() -> None:
    """Stage 0 of a model fed token ids: its input wants no gradient, so its ``I`` is empty
    and its ``W`` is the whole backward. Its split forward keeps no saved-tensor holders
    (nothing would be freed early: they were pure cost), and the gradients are a plain
    backward's."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 6), nn.Tanh()).to(DTYPE)
    stage = Stage(0, model, torch.device("cpu"),
                  inspect_skip_layout(nn.Sequential(*model, nn.Identity()), [3, 1]))
    tokens = torch.randint(10, (4, 3))
    _, state = stage.forward(Received(Batch((tokens,), True), {}, (False,)), grad=True,
                             split=True)
    assert state is not None and state.saved is None
    grad = torch.randn(4, 3, 6, dtype=DTYPE)
    stage.backward_input(state, [grad], {})
    assert all(p.grad is None for p in model.parameters()), "I must not reach the weights"
    stage.backward_weight(state)
    split = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    torch.autograd.backward(model(tokens), grad)
    for mine, plain in zip(split, model.parameters()):
        torch.testing.assert_close(mine, plain.grad)


def _python_calls(run: Any) -> int:
    """How many Python functions ``run()`` enters (``sys.setprofile``'s ``call`` events)."""
    calls = [0]

    def count(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            calls[0] += 1
    previous = sys.getprofile()
    sys.setprofile(count)
    try:
        run()
    finally:
        sys.setprofile(previous)
    return calls[0]


def _split_calls(depth: int) -> Tuple[int, int]:
    """Python calls of I and of W on ``depth`` × (Linear, Tanh) recorded as a stage does."""
    model = nn.Sequential(*(m for _ in range(depth) for m in (nn.Linear(8, 8), nn.Tanh())))
    incoming = [torch.randn(4, 8)]
    entry = enter(incoming, [True], torch.device("cpu"))
    saved = SavedTensors()
    with saved.recording():
        out = model(incoming[0])
    split = SplitBackward([get_gradient_edge(out)], [torch.ones(4, 8)], entry.phony, entry.node,
                          saved=saved)
    params = list(model.parameters())
    return _python_calls(split.input), _python_calls(lambda: split.weight(params))


def test_the_split_costs_few_python_calls_per_layer() -> None:
    """Issue 24 (session 12): what a split backward costs beyond one backward is mostly
    Python per node. Per layer (a Linear, its boundary node, and a Tanh), I makes its three
    saved-tensor unpacks, the boundary node's hook and a few calls more: one walk finds the
    path, the boundary nodes and the leaves behind their edges, and only the boundary
    nodes' saved tensors are read (before: a walk per weight edge and a read of every node
    of the path, 39 calls a layer); W calls the node (its two unpacks) and backpropagates
    its weight path (before: 21 calls a layer, sorting and re-listing every run)."""
    i4, w4 = _split_calls(4)
    i8, w8 = _split_calls(8)
    assert (i8 - i4) / 4 <= 12, f"I: {(i8 - i4) / 4} Python calls a layer"
    assert (w8 - w4) / 4 <= 6, f"W: {(w8 - w4) / 4} Python calls a layer"


class Norms(nn.Module):
    """Linear, LayerNorm, Tanh, LayerNorm, Linear: two norms on the input path."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Tanh(),
                                    nn.LayerNorm(6), nn.Linear(6, 6))

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


def test_norm_weight_gradients_from_i_reach_the_hooks_in_w_once_in_layer_order() -> None:
    """A norm's weight and bias gradients are computed in I (its one backward) but handed to
    the parameters in W: post-accumulate hooks fire in W, once each, layer by layer from the
    last; a parameter with a ``register_hook`` hook (which the engine would call in I where
    I takes the gradient) has its norm called in W instead, its hook seeing the gradient
    once. The gradients are bitwise the plain backward's."""
    torch.manual_seed(7)
    model = Norms()
    fired: List[Tuple[str, str]] = []
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(
            lambda p, name=name: fired.append(("acc", name)))
    seen: List[Tensor] = []
    model.layers[3].weight.register_hook(lambda g: seen.append(g.clone()))  # type: ignore
    x = torch.randn(5, 6)
    grad = torch.randn(5, 6)
    incoming = [x]
    entry = enter(incoming, [True], torch.device("cpu"))
    saved = SavedTensors()
    with saved.recording():
        out = model(incoming[0])
    split = SplitBackward([get_gradient_edge(out)], [grad], entry.phony, entry.node,
                          saved=saved)
    split.input()
    assert fired == [] and seen == [], "I must not hand the weights anything"
    params = list(model.parameters())
    split.weight(params)
    names = [n for n, _ in model.named_parameters()]
    layers = [n.split(".")[1] for _, n in fired]
    assert sorted(n for _, n in fired) == sorted(names), fired  # each once
    assert [k for k, n in enumerate(layers) if k == 0 or layers[k - 1] != n] == [0, 2, 4, 6], \
        layers  # grouped by layer
    assert [layers[0], layers[2], layers[4], layers[6]] == ["4", "3", "1", "0"], layers
    got = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    assert len(seen) == 1
    model.zero_grad(set_to_none=True)
    seen.clear()
    torch.autograd.backward(model(x), grad)
    assert len(seen) == 1 and torch.equal(seen[0], model.layers[3].weight.grad)  # type: ignore
    for mine, plain in zip(got, model.parameters()):
        assert torch.equal(mine, plain.grad), "not bitwise the plain backward's"


def test_an_input_gradient_is_sent_before_the_input_path_is_freed(monkeypatch: Any) -> None:
    """Issue 24 (session 13): after ``I``, the gradient for the stage before leaves first;
    reading ~100 nodes' holders to free what only the input path saved (~0.2 ms on the
    benchmark's transformer) comes after the send, not between ``I`` and it. The input
    path's saved tensors are still freed before ``W`` (here: before the next action)."""
    from seqpipe import Pipe
    from seqpipe.local.step import LocalStep

    events: List[Tuple[str, int]] = []
    send, free = LocalStep.send_backward, Stage.free_input_path

    def sending(self: Any, s: int, i: int, received: Any) -> None:
        events.append(("send", i))
        send(self, s, i, received)

    def freeing(state: Any) -> None:
        events.append(("free", -1))
        free(state)
    monkeypatch.setattr(LocalStep, "send_backward", sending)
    monkeypatch.setattr(Stage, "free_input_path", staticmethod(freeing))
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh())
    pipe = Pipe(model, chunks=4, balance=[2, 2], devices=["cpu", "cpu"], checkpoint="never")
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    pipe.train_step(x, y, nn.functional.mse_loss, schedule="zb_h1")
    frees = [k for k, (what, _) in enumerate(events) if what == "free"]
    assert len(frees) == 8, events  # every I of both stages
    for k in frees:
        assert events[k - 1][0] == "send", events  # each right after its gradient's send


def test_a_temporary_the_graph_never_reaches_is_not_kept_past_i() -> None:
    """The forward notes every saved-tensor holder (to free them all when W ends), but not
    to keep alive what would have died at once: a temporary computed and dropped inside a
    layer (its node unreachable from the outputs) is gone once I has run."""
    import weakref

    class Dead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            torch.exp(self.lin(x) * 3)  # saved for a backward nothing will run
            return torch.tanh(self.lin(x))

    model = nn.Sequential(nn.Linear(4, 4), Dead())
    incoming = [torch.randn(2, 4)]
    entry = enter(incoming, [True], torch.device("cpu"))
    saved = SavedTensors()
    with saved.recording():
        out = model(incoming[0])
    dead = [h for h in saved._all if sys.getrefcount(h) <= 3]
    assert len(dead) >= 1, "the temporary's nodes are gone"
    gone = [weakref.ref(h.value) for h in dead]  # type: ignore[union-attr]
    del dead
    split = SplitBackward([get_gradient_edge(out)], [torch.ones(2, 4)], entry.phony,
                          entry.node, saved=saved)
    split.input()
    split.free_input_path()
    assert all(ref() is None for ref in gone), "kept past I"
    split.weight(list(model.parameters()))
