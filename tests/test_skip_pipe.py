"""Skip connections inside ``Pipe``: equal to the unpipelined model, routed directly, freed.

Every model here is built from ``@skippable`` layers and compared with a deep copy of itself
run as a plain ``nn.Sequential`` (skippable layers work standalone through the per-thread
default tracker): outputs, input gradients and parameter gradients must match for every
checkpoint mode. Models are in float64 so micro-batching changes nothing beyond rounding.

Other tests instrument the local engine (``Mailbox.put``, ``LocalStep.send_forward`` /
``send_backward``, ``Stage.forward``) to show where a skip tensor goes: straight from the
stashing partition to the popping one, and its gradient straight back. On CPU every device
is ``cpu`` and ``seqpipe.core.stream.move`` is a no-op alias, so *which stage's mailbox receives
what* is the observable route, not the device a copy lands on.
"""
from __future__ import annotations

import copy
import gc
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from seqpipe import Pipe
from seqpipe.core.stage import Stage
from seqpipe.local.step import LocalStep
from seqpipe.local.worker import Mailbox
from seqpipe.skip import (
    Namespace,
    SkipTracker,
    inspect_skip_layout,
    pop,
    skippable,
    stash,
    use_skip_tracker,
)

F = 6  # feature width of the toy models
MODES = ["always", "except_last", "never"]
CHUNKINGS = [pytest.param(1, 4, id="chunks1-batch4"), pytest.param(3, 7, id="chunks3-batch7")]


@pytest.fixture(autouse=True)
def fresh_tracker() -> Iterator[SkipTracker]:
    """The plain reference runs get their own tracker; a failing test leaves nothing behind."""
    tracker = SkipTracker()
    with use_skip_tracker(tracker):
        yield tracker


def seqpipe_threads() -> list[threading.Thread]:
    """Worker threads of the local engine still running a stage (idle pooled ones are not)."""
    return [t for t in threading.enumerate() if t.name.startswith("seqpipe-stage-")]


# --------------------------------------------------------------------------- model zoo


@skippable(stash=["a"])
class StashA(nn.Module):
    """Stashes its pre-activation ``lin(x)`` as ``a``; returns ``tanh`` of it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(F, F)

    def forward(self, x: Tensor) -> Any:
        h = self.lin(x)
        yield stash("a", h)
        return torch.tanh(h)


@skippable(pop=["a"])
class PopA(nn.Module):
    """Uses ``a`` non-linearly together with its input, so both gradients matter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(F, F)

    def forward(self, x: Tensor) -> Any:
        a = yield pop("a")
        return self.lin(x) * torch.sigmoid(a) + a


@skippable(stash=["skip"])
class Down(nn.Module):
    """U-Net encoder block: stashes its input for the matching :class:`Up`."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(F, F)

    def forward(self, x: Tensor) -> Any:
        yield stash("skip", x)
        return torch.tanh(self.lin(x))


@skippable(pop=["skip"])
class Up(nn.Module):
    """U-Net decoder block: concatenates the popped encoder feature."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2 * F, F)

    def forward(self, x: Tensor) -> Any:
        skip = yield pop("skip")
        return torch.tanh(self.lin(torch.cat([x, skip], dim=-1)))


def chain_model() -> nn.Sequential:
    """Seven layers; the skip ``a`` goes from layer 1 to layer 5."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(F, F), StashA(), nn.Linear(F, F), nn.Tanh(),
                         nn.Linear(F, F), PopA(), nn.Linear(F, F)).double()


# balance for chain_model whose skip crosses that many partition boundaries
CHAIN_BALANCES = {0: [1, 5, 1], 1: [2, 4, 1], 2: [2, 2, 2, 1], 3: [2, 1, 1, 2, 1]}


def unet_model() -> nn.Sequential:
    """Down/Up reused at three levels, each level in its own namespace."""
    torch.manual_seed(1)
    levels = [Namespace() for _ in range(3)]
    return nn.Sequential(
        nn.Linear(F, F),
        Down().isolate(levels[0]), Down().isolate(levels[1]), Down().isolate(levels[2]),
        nn.Linear(F, F),
        Up().isolate(levels[2]), Up().isolate(levels[1]), Up().isolate(levels[0]),
        nn.Linear(F, F),
    ).double()


# --------------------------------------------------------------------------- comparison


def clone_input(x: Tensor) -> Tensor:
    """A fresh leaf copy; floating inputs require grad so input gradients are compared."""
    x = x.detach().clone()
    return x.requires_grad_() if x.is_floating_point() else x


def loss_of(out: Tensor) -> Tensor:
    """A loss whose output gradient is not uniform (a plain ``sum`` hides mix-ups)."""
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7),
                          dtype=out.dtype)
    return (out * weights).sum()


def assert_matches_plain(model: nn.Sequential, x: Tensor, *, balance: list[int], chunks: int,
                         checkpoint: str) -> tuple[Pipe, nn.Sequential]:
    """Run ``model`` in a Pipe and a deep copy of it plainly; outputs and grads must match."""
    plain = copy.deepcopy(model)
    x_plain, x_pipe = clone_input(x), clone_input(x)
    out_plain = plain(x_plain)
    loss_of(out_plain).backward()

    pipe = Pipe(model, chunks=chunks, checkpoint=checkpoint, balance=balance)
    out_pipe = pipe(x_pipe)
    loss_of(out_pipe).backward()

    torch.testing.assert_close(out_pipe, out_plain)
    if x_plain.requires_grad:
        assert x_pipe.grad is not None
        torch.testing.assert_close(x_pipe.grad, x_plain.grad)
    named_plain = dict(plain.named_parameters())
    for name, param in pipe.named_parameters():
        expected = named_plain[name].grad
        if expected is None:
            assert param.grad is None, name
        else:
            assert param.grad is not None, f"{name} got no gradient in the pipeline"
            torch.testing.assert_close(param.grad, expected, msg=lambda m, n=name: f"{n}: {m}")
    assert not seqpipe_threads()
    return pipe, plain


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("crossings", sorted(CHAIN_BALANCES))
@pytest.mark.parametrize(("chunks", "batch"), CHUNKINGS)
def test_skip_across_boundaries_matches_plain(checkpoint: str, crossings: int, chunks: int,
                                              batch: int) -> None:
    """One skip crossing 0-3 partition boundaries: same outputs and gradients as plain."""
    model = chain_model()
    balance = CHAIN_BALANCES[crossings]
    (skip,) = inspect_skip_layout(model, balance)
    assert skip.pop_partition - skip.stash_partition == crossings
    x = torch.randn(batch, F, dtype=torch.float64)
    assert_matches_plain(model, x, balance=balance, chunks=chunks, checkpoint=checkpoint)


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("balance", [[3, 3, 3], [2, 4, 3]])
def test_nested_unet_namespaces_over_three_partitions(checkpoint: str,
                                                      balance: list[int]) -> None:
    """Down/Up reused at three levels via namespaces; some skips local, some crossing."""
    model = unet_model()
    layout = inspect_skip_layout(model, balance)
    routes = sorted((s.stash_partition, s.pop_partition) for s in layout)
    # [3,3,3]: levels 0 and 1 jump 0 -> 2, level 2 stays in 1.
    # [2,4,3]: level 0 jumps 0 -> 2, level 1 goes 1 -> 2, level 2 stays in 1.
    assert routes == ([(0, 2), (0, 2), (1, 1)] if balance == [3, 3, 3]
                      else [(0, 2), (1, 1), (1, 2)])
    x = torch.randn(7, F, dtype=torch.float64)
    assert_matches_plain(model, x, balance=balance, chunks=3, checkpoint=checkpoint)


def test_unet_in_eval_and_no_grad_matches_plain() -> None:
    """Without autograd (eval mode, no_grad) skips still route and match."""
    model = unet_model()
    plain = copy.deepcopy(model).eval()
    pipe = Pipe(model, chunks=3, balance=[3, 3, 3]).eval()
    x = torch.randn(7, F, dtype=torch.float64)
    torch.testing.assert_close(pipe(x), plain(x))
    with torch.no_grad():
        torch.testing.assert_close(pipe.train()(x), plain(x))


@skippable(stash=["a", "b", "c"])
class Fan(nn.Module):
    """Stashes three different tensors at once."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(F, F)
        self.out = nn.Linear(F, F)

    def forward(self, x: Tensor) -> Any:
        yield stash("a", x)
        yield stash("b", torch.tanh(x))
        yield stash("c", self.lin(x))
        return self.out(x)


@skippable(stash=["d"])
class StashD(nn.Module):
    """A second stasher, one partition later than :class:`Fan`."""

    def forward(self, x: Tensor) -> Any:
        yield stash("d", x * 3)
        return torch.tanh(x)


@skippable(pop=["a", "d"])
class PopAD(nn.Module):
    """Pops two skips from two different partitions."""

    def forward(self, x: Tensor) -> Any:
        a = yield pop("a")
        d = yield pop("d")
        return x * a + d


@skippable(pop=["b", "c"])
class PopBC(nn.Module):
    """Pops the two remaining skips of :class:`Fan`."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(F, F)

    def forward(self, x: Tensor) -> Any:
        c = yield pop("c")
        b = yield pop("b")
        return self.lin(x + b) * c


@pytest.mark.parametrize("checkpoint", MODES)
def test_several_skips_cross_the_same_boundary(checkpoint: str) -> None:
    """Four skips from two partitions all enter partition 2."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(F, F), Fan(), nn.Linear(F, F), StashD(), nn.Tanh(),
                          PopAD(), PopBC(), nn.Linear(F, F)).double()
    balance = [2, 3, 3]
    layout = inspect_skip_layout(model, balance)
    assert [s.name for s in layout.skips_popped_by(2)] == ["a", "b", "c", "d"]
    assert [s.name for s in layout.skips_stashed_by(0)] == ["a", "b", "c"]
    x = torch.randn(7, F, dtype=torch.float64)
    assert_matches_plain(model, x, balance=balance, chunks=3, checkpoint=checkpoint)


@pytest.mark.parametrize("checkpoint", MODES)
def test_skip_popped_in_the_stashing_partition_stays_local(
        checkpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A skip popped where it is stashed never touches a mailbox."""
    puts = record_mailbox_puts(monkeypatch)
    model = chain_model()
    balance = CHAIN_BALANCES[0]
    assert inspect_skip_layout(model, balance).is_local(*model[1].namespaced("a"))
    x = torch.randn(7, F, dtype=torch.float64)
    assert_matches_plain(model, x, balance=balance, chunks=3, checkpoint=checkpoint)
    kinds = {key[0] for key, _ in puts}
    assert kinds == {"act", "grad"}, "a local skip must never go through a mailbox"


# --------------------------------------------------------------------------- odd skip values


@skippable(stash=["maybe"])
class StashNone(nn.Module):
    """Stashes ``None``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(F, F)

    def forward(self, x: Tensor) -> Any:
        yield stash("maybe", None)
        return torch.tanh(self.lin(x))


@skippable(pop=["maybe"])
class PopNone(nn.Module):
    """Pops ``maybe`` and records what it got."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[object] = []

    def forward(self, x: Tensor) -> Any:
        maybe = yield pop("maybe")
        self.seen.append(maybe)
        return x if maybe is None else x + maybe


@pytest.mark.parametrize("checkpoint", MODES)
def test_none_skip_crosses_partitions(checkpoint: str) -> None:
    """``stash(name, None)`` arrives as ``None`` in a later partition."""
    torch.manual_seed(3)
    model = nn.Sequential(StashNone(), nn.Linear(F, F), nn.Tanh(), PopNone(),
                          nn.Linear(F, F)).double()
    x = torch.randn(7, F, dtype=torch.float64)
    pipe, plain = assert_matches_plain(model, x, balance=[1, 1, 2, 1], chunks=3,
                                       checkpoint=checkpoint)
    assert pipe[3].seen and all(seen is None for seen in pipe[3].seen)


VOCAB = 11


@skippable(stash=["ids"])
class EmbedStash(nn.Module):
    """Embeds token ids and stashes the (integer) ids themselves."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, F)

    def forward(self, ids: Tensor) -> Any:
        yield stash("ids", ids)
        return self.emb(ids)


@skippable(stash=["mask"])
class MaskStash(nn.Module):
    """Stashes a bool mask of its input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(F, F)

    def forward(self, x: Tensor) -> Any:
        yield stash("mask", x > 0)
        return self.lin(x)


@skippable(pop=["mask"])
class MaskPop(nn.Module):
    """Selects with the popped bool mask."""

    def forward(self, x: Tensor) -> Any:
        mask = yield pop("mask")
        assert mask.dtype == torch.bool and not mask.requires_grad
        return torch.where(mask, x, 0.5 * x)


@skippable(pop=["ids"])
class EmbedPop(nn.Module):
    """Embeds the popped ids with its own table (a position-free 'tied input' term)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, F)

    def forward(self, x: Tensor) -> Any:
        ids = yield pop("ids")
        assert ids.dtype == torch.int64 and not ids.requires_grad
        return x + self.emb(ids)


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize(("chunks", "batch"), CHUNKINGS)
def test_integer_and_bool_skips_get_no_gradient(checkpoint: str, chunks: int, batch: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Token ids (int64, 3 partitions on) and a bool mask: no gradient, no error."""
    puts = record_mailbox_puts(monkeypatch)
    torch.manual_seed(4)
    model = nn.Sequential(EmbedStash(), MaskStash(), nn.Tanh(), nn.Linear(F, F), MaskPop(),
                          EmbedPop(), nn.Linear(F, F)).double()
    balance = [1, 2, 1, 2, 1]
    layout = inspect_skip_layout(model, balance)
    assert layout.stash_partition(*model[0].namespaced("ids")) == 0
    assert layout.pop_partition(*model[0].namespaced("ids")) == 3  # three partitions later
    ids = torch.randint(0, VOCAB, (batch, 5))
    assert_matches_plain(model, ids, balance=balance, chunks=chunks, checkpoint=checkpoint)
    skip_grads = [(key[3][1], value) for key, value in puts if key[0] == "skipgrad"]
    assert sorted({name for name, _ in skip_grads}) == ["ids", "mask"]
    assert len(skip_grads) == 2 * chunks
    assert all(value is None for _, value in skip_grads)


@skippable(pop=["a"])
class PopDetached(nn.Module):
    """Pops ``a`` (which requires grad) but uses it only through non-differentiable ops."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(F, F)
        self.requires_grad_seen: list[bool] = []

    def forward(self, x: Tensor) -> Any:
        a = yield pop("a")
        self.requires_grad_seen.append(a.requires_grad)
        return self.lin(x) + (a > 0).to(x.dtype) * a.detach()


@pytest.mark.parametrize("checkpoint", MODES)
def test_skip_used_without_gradient(checkpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grad-requiring skip used only non-differentiably sends back ``None``."""
    puts = record_mailbox_puts(monkeypatch)
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(F, F), StashA(), nn.Linear(F, F), nn.Tanh(),
                          PopDetached(), nn.Linear(F, F)).double()
    x = torch.randn(7, F, dtype=torch.float64)
    pipe, _ = assert_matches_plain(model, x, balance=[2, 1, 2, 1], chunks=3,
                                   checkpoint=checkpoint)
    assert pipe[4].requires_grad_seen and all(pipe[4].requires_grad_seen)
    skip_grads = [value for key, value in puts if key[0] == "skipgrad"]
    assert len(skip_grads) == 3 and all(g is None for g in skip_grads)


# --------------------------------------------------------------------------- tricky stashes


@skippable(stash=["same"])
class StashOwnOutput(nn.Module):
    """Stashes exactly the tensor it returns (two graph roots on the same edge)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(F, F)

    def forward(self, x: Tensor) -> Any:
        h = self.lin(x)
        yield stash("same", h)
        return h


@skippable(pop=["same"])
class PopSame(nn.Module):
    """Multiplies by the popped tensor."""

    def forward(self, x: Tensor) -> Any:
        same = yield pop("same")
        return x * same


@skippable(stash=["param"])
class StashParam(nn.Module):
    """Stashes one of its own parameters (a leaf)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(F))

    def forward(self, x: Tensor) -> Any:
        yield stash("param", self.scale)
        return x * 2


@skippable(pop=["param"])
class PopParam(nn.Module):
    """Scales by the popped parameter."""

    def forward(self, x: Tensor) -> Any:
        scale = yield pop("param")
        return x * scale


@skippable(pop=["a"], stash=["b", "c"])
class Relay(nn.Module):
    """Pops a crossing skip and stashes it on, unchanged (``b``) and transformed (``c``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(F, F)

    def forward(self, x: Tensor) -> Any:
        a = yield pop("a")
        yield stash("b", a)
        yield stash("c", torch.tanh(self.lin(a)))
        return x + a


@skippable(pop=["b", "c"])
class PopBCPlain(nn.Module):
    """Pops what :class:`Relay` stashed."""

    def forward(self, x: Tensor) -> Any:
        b = yield pop("b")
        c = yield pop("c")
        return x * b + c


def relay_model() -> nn.Sequential:
    """A skip popped in partition 1 and re-stashed for partition 3."""
    torch.manual_seed(6)
    return nn.Sequential(StashA(), nn.Linear(F, F), Relay(), nn.Tanh(), nn.Linear(F, F),
                         PopBCPlain()).double()


def own_output_model() -> nn.Sequential:
    """The stash is also the partition's output; the input is stashed by a first layer."""
    torch.manual_seed(6)
    return nn.Sequential(Down(), StashOwnOutput(), nn.Tanh(), nn.Linear(F, F), PopSame(),
                         Up()).double()


def param_model() -> nn.Sequential:
    """A parameter travels as a skip."""
    torch.manual_seed(6)
    return nn.Sequential(nn.Linear(F, F), StashParam(), nn.Tanh(), PopParam(),
                         nn.Linear(F, F)).double()


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize(("build", "balance"), [
    pytest.param(own_output_model, [2, 2, 2], id="stash-is-output+stash-pipe-input"),
    pytest.param(param_model, [2, 1, 2], id="stash-a-parameter"),
    pytest.param(relay_model, [1, 2, 1, 2], id="pop-and-restash"),
])
def test_tricky_stashed_tensors(checkpoint: str, build: Callable[[], nn.Sequential],
                                balance: list[int]) -> None:
    """Stashing the partition output itself, the pipe input, a parameter, a popped skip."""
    x = torch.randn(7, F, dtype=torch.float64)
    assert_matches_plain(build(), x, balance=balance, chunks=3, checkpoint=checkpoint)


@skippable(stash=["view"])
class StashView(nn.Module):
    """Stashes a non-contiguous view of its (partition) input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(F, F)

    def forward(self, x: Tensor) -> Any:
        yield stash("view", x.t()[: F // 2].t())
        return torch.tanh(self.lin(x))


@skippable(pop=["view"])
class PopView(nn.Module):
    """Uses the popped view."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(F, F)

    def forward(self, x: Tensor) -> Any:
        view = yield pop("view")
        return self.lin(x) * view.repeat(1, 2)


@pytest.mark.parametrize("checkpoint", MODES)
def test_two_outstanding_forwards_keep_their_skips_apart(checkpoint: str) -> None:
    """Two forward calls before one backward (gradient accumulation): skips do not mix."""
    torch.manual_seed(13)
    model = nn.Sequential(nn.Linear(F, F), StashView(), nn.Linear(F, F), PopView()).double()
    plain = copy.deepcopy(model)
    x1, x2 = torch.randn(7, F, dtype=torch.float64), torch.randn(5, F, dtype=torch.float64)
    p1, p2, q1, q2 = (clone_input(x) for x in (x1, x2, x1, x2))
    (loss_of(plain(p1)) + 2 * plain(p2).sum()).backward()
    pipe = Pipe(model, chunks=3, checkpoint=checkpoint, balance=[1, 1, 1, 1])
    out1 = pipe(q1)
    out2 = pipe(q2)
    (loss_of(out1) + 2 * out2.sum()).backward()
    torch.testing.assert_close(q1.grad, p1.grad)
    torch.testing.assert_close(q2.grad, p2.grad)
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=lambda m, n=name: f"{n}: {m}")


@skippable(stash=["d"])
class DropStash(nn.Module):
    """Dropout both on the stashed tensor and on the output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(F, F)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: Tensor) -> Any:
        h = self.drop(self.lin(x))
        yield stash("d", h)
        return self.drop(torch.tanh(h))


@skippable(pop=["d"])
class DropPop(nn.Module):
    """Dropout on its input, times the popped tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x: Tensor) -> Any:
        d = yield pop("d")
        return self.drop(x) * d + d


def test_dropout_in_skippable_layers_is_replayed_by_checkpointing() -> None:
    """Dropout masks are replayed exactly: every checkpoint mode gives the same result."""
    torch.manual_seed(8)
    base = nn.Sequential(nn.Linear(F, F), DropStash(), nn.Linear(F, F), nn.Dropout(0.2),
                         DropPop(), nn.Linear(F, F)).double()
    x = torch.randn(7, F, dtype=torch.float64)
    results = {}
    for mode in MODES:
        model = copy.deepcopy(base)
        pipe = Pipe(model, chunks=3, checkpoint=mode, balance=[2, 2, 1, 1])
        xin = clone_input(x)
        torch.manual_seed(1234)
        out = pipe(xin)
        loss_of(out).backward()
        results[mode] = (out.detach(), xin.grad,
                         {n: p.grad for n, p in model.named_parameters()})
    never_out, never_xgrad, never_grads = results["never"]
    with torch.no_grad():
        assert not torch.allclose(never_out, copy.deepcopy(base).eval()(x)), "no dropout?"
    for mode in ("always", "except_last"):
        out, xgrad, grads = results[mode]
        torch.testing.assert_close(out, never_out, rtol=0, atol=0)
        torch.testing.assert_close(xgrad, never_xgrad, rtol=0, atol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, never_grads[name], rtol=0, atol=0,
                                       msg=lambda m, n=name: f"{n}: {m}")


@skippable(pop=["a"])
class PopInPlace(nn.Module):
    """Modifies the popped skip in place, which is legal in the plain model here.

    Nothing saved ``a`` for backward (``addmm`` does not save its output and ``tanh`` saves
    its own result), so the plain model's autograd accepts the in-place update.
    """

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(F, F)

    def forward(self, x: Tensor) -> Any:
        a = yield pop("a")
        a.mul_(2)
        return self.lin(x) * a


@pytest.mark.parametrize("checkpoint", MODES)
def test_popped_skip_modified_in_place(checkpoint: str) -> None:
    """The recomputation must see the skip as it was received, not as the layer left it."""
    torch.manual_seed(12)
    model = nn.Sequential(StashA(), nn.Linear(F, F), PopInPlace()).double()
    x = torch.randn(7, F, dtype=torch.float64)
    try:
        assert_matches_plain(model, x, balance=[1, 1, 1], chunks=3, checkpoint=checkpoint)
    except AssertionError as exc:
        raise AssertionError(
            "gradients differ from the plain model: the checkpoint's recomputation re-read "
            "the received skip after PopInPlace had modified it in place (StageSkipTracker "
            f"hands out the same tensor twice)\n{exc}") from exc


# --------------------------------------------------------------------------- routing


def record_mailbox_puts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, Any]]:
    """Record every ``(key, value)`` any engine mailbox receives."""
    puts: list[tuple[Any, Any]] = []
    lock = threading.Lock()
    original = Mailbox.put

    def put(self: Mailbox, key: Any, value: Any) -> None:
        with lock:
            puts.append((key, value))
        original(self, key, value)

    monkeypatch.setattr(Mailbox, "put", put)
    return puts


@skippable(stash=["far"])
class StashFar(nn.Module):
    """Stashes ``lin(x)`` and records the storage of what it stashed."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(F, F)
        self.storages: list[int] = []

    def forward(self, x: Tensor) -> Any:
        h = self.lin(x)
        self.storages.append(h.untyped_storage().data_ptr())
        yield stash("far", h)
        return torch.tanh(h) * 2


@skippable(pop=["far"])
class PopFar(nn.Module):
    """Uses the far skip."""

    def forward(self, x: Tensor) -> Any:
        far = yield pop("far")
        return x * far


def tensors_in(value: Any) -> Iterator[Tensor]:
    """Every tensor inside a mailbox value (nested tuples, ``Batch`` objects)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)
    elif hasattr(value, "tensors"):
        yield from tensors_in(value.tensors)


@pytest.mark.parametrize("checkpoint", MODES)
def test_skip_goes_directly_and_its_gradient_comes_directly_back(
        checkpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Partition 0 -> 3 only; partitions 1 and 2 never see the skip nor its gradient."""
    puts = record_mailbox_puts(monkeypatch)
    received: list[tuple[int, tuple[Any, ...]]] = []
    forwards: list[tuple[int, int, tuple[Any, ...]]] = []
    backwards: list[tuple[int, int, dict[str, bool]]] = []
    stage_forward = Stage.forward
    send_forward = LocalStep.send_forward
    send_backward = LocalStep.send_backward

    def spy_stage_forward(self: Stage, rec: Any, **kwargs: Any) -> Any:
        received.append((self.index, tuple(name for _, name in rec.skips)))
        return stage_forward(self, rec, **kwargs)

    def spy_send_forward(self: LocalStep, s: int, i: int, sent: Any) -> None:
        forwards.append((s, i, tuple(name for _, name in sent.skips)))
        send_forward(self, s, i, sent)

    def spy_send_backward(self: LocalStep, s: int, i: int, grads: Any) -> None:
        backwards.append((s, i, {name: g is not None for (_, name), g in grads.skips.items()}))
        send_backward(self, s, i, grads)

    monkeypatch.setattr(Stage, "forward", spy_stage_forward)
    monkeypatch.setattr(LocalStep, "send_forward", spy_send_forward)
    monkeypatch.setattr(LocalStep, "send_backward", spy_send_backward)

    torch.manual_seed(9)
    model = nn.Sequential(StashFar(), nn.Linear(F, F), nn.Linear(F, F), PopFar()).double()
    chunks = 3
    x = torch.randn(7, F, dtype=torch.float64)
    pipe, _ = assert_matches_plain(model, x, balance=[1, 1, 1, 1], chunks=chunks,
                                   checkpoint=checkpoint)

    # forward: the skip is sent once per micro-batch (recomputation never re-sends it),
    # by partition 0, into partition 3's mailbox and nowhere else
    skip_puts = [key for key, _ in puts if key[0] == "skip"]
    assert sorted((dest, i, name) for _, dest, i, (_, name) in skip_puts) == [
        (3, i, "far") for i in range(chunks)]
    assert sorted(forwards) == sorted(
        [(0, i, ("far",)) for i in range(chunks)]
        + [(s, i, ()) for s in (1, 2, 3) for i in range(chunks)])
    assert sorted(received) == sorted(
        [(s, ()) for s in (0, 1, 2) for _ in range(chunks)] + [(3, ("far",))] * chunks)
    # the activations partitions 1-3 receive never share storage with the skip
    stashed = set(pipe[0].storages[:chunks])
    assert len(stashed) == chunks
    for key, value in puts:
        if key[0] == "act":
            assert not stashed & {t.untyped_storage().data_ptr() for t in tensors_in(value)}

    # backward: partition 3 returns the skip's gradient straight to partition 0
    skipgrad_puts = [(key, value) for key, value in puts if key[0] == "skipgrad"]
    assert sorted((src, i, name) for (_, src, i, (_, name)), _ in skipgrad_puts) == [
        (0, i, "far") for i in range(chunks)]
    assert all(value is not None for _, value in skipgrad_puts)
    assert sorted(backwards) == sorted(
        [(3, i, {"far": True}) for i in range(chunks)]
        + [(s, i, {}) for s in (0, 1, 2) for i in range(chunks)])
    # the activation gradients 3 -> 2 -> 1 -> 0 carry one tensor each: no skip riding along
    for key, value in puts:
        if key[0] == "grad" and key[1] < 3:
            assert isinstance(value, tuple) and len(value) == 1


# --------------------------------------------------------------------------- memory


@skippable(stash=["m"])
class StashWeak(nn.Module):
    """Stashes ``lin(x)``; keeps only a weakref to it. Nothing here saves it for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(F, F)
        self.refs: list[weakref.ref[Tensor]] = []

    def forward(self, x: Tensor) -> Any:
        h = self.lin(x)  # addmm saves x and the weight, not its output
        self.refs.append(weakref.ref(h))
        yield stash("m", h)
        return h * 2  # multiplying by a Python number saves nothing


@skippable(pop=["m"])
class PopAdd(nn.Module):
    """Adds the popped skip: ``add`` saves neither operand for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref[Tensor]] = []

    def forward(self, x: Tensor) -> Any:
        m = yield pop("m")
        self.refs.append(weakref.ref(m))
        return x + m


@skippable(pop=["m"])
class PopMul(nn.Module):
    """Multiplies by the popped skip: ``mul`` saves it for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref[Tensor]] = []

    def forward(self, x: Tensor) -> Any:
        m = yield pop("m")
        self.refs.append(weakref.ref(m))
        return x * m


def alive(refs: list[weakref.ref[Tensor]]) -> list[bool]:
    """Which of the weakly referenced tensors are still alive (after a full collection)."""
    gc.collect()
    return [ref() is not None for ref in refs]


def memory_model(popper: type[nn.Module]) -> nn.Sequential:
    """Partition 0 stashes, partitions 1-2 are plain, partition 3 is only the popper."""
    torch.manual_seed(10)
    return nn.Sequential(StashWeak(), nn.Linear(F, F), nn.Tanh(), popper()).double()


def record_mailboxes(monkeypatch: pytest.MonkeyPatch) -> list[Mailbox]:
    """Keep every mailbox the engine creates, to inspect what is left in it."""
    boxes: list[Mailbox] = []
    original = Mailbox.__init__

    def init(self: Mailbox) -> None:
        original(self)
        boxes.append(self)

    monkeypatch.setattr(Mailbox, "__init__", init)
    return boxes


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("popper", [PopAdd, PopMul])
def test_no_skip_tensor_outlives_forward_backward(checkpoint: str, popper: type[nn.Module],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Mailboxes are drained by forward; every skip tensor is gone after backward + del.

    Right after ``forward`` a skip may legitimately still be alive, held by autograd: by
    ``mul`` (which saves it) or by the popping partition's checkpoint, which re-reads it when
    recomputing. So after forward we assert only that no mailbox still holds it; the tensors
    themselves (the stashed one, and the one the popping layer received) must be dead once
    backward has run and the output is dropped.
    """
    boxes = record_mailboxes(monkeypatch)
    model = memory_model(popper)
    pipe = Pipe(model, chunks=3, checkpoint=checkpoint, balance=[1, 1, 1, 1])
    out = pipe(torch.randn(7, F, dtype=torch.float64, requires_grad=True))
    assert len(boxes) == 1
    assert not [key for key in boxes[0]._items], "forward left values in its mailbox"
    out.sum().backward()
    assert len(boxes) == 2
    assert not [key for key in boxes[1]._items], "backward left values in its mailbox"
    del out
    refs = model[0].refs + model[3].refs
    assert len(refs) >= 6
    assert not any(alive(refs)), "a skip tensor is still referenced after backward"
    assert not seqpipe_threads()


@pytest.mark.parametrize("checkpoint", MODES)
def test_skip_nobody_saves_is_freed_by_forward(checkpoint: str) -> None:
    """With nothing saving it for backward, a skip dies as soon as forward returns.

    ``StashWeak`` and ``PopAdd`` save neither the stashed tensor nor the received one, and
    the popping partition holds only ``PopAdd``, so its checkpoint keeps nothing either. Any
    reference left after forward would then be the engine's own: a mailbox, a tracker or a
    task state. Under checkpointing the stashing partition's checkpoint *is* kept (``addmm``
    saved ``x``), and it must not keep the outgoing skip: recomputation never re-sends it.
    """
    model = memory_model(PopAdd)
    pipe = Pipe(model, chunks=3, checkpoint=checkpoint, balance=[1, 1, 1, 1])
    out = pipe(torch.randn(7, F, dtype=torch.float64, requires_grad=True))
    stashed, popped = alive(model[0].refs), alive(model[3].refs)
    assert not any(popped), f"received skips alive after forward: {popped}"
    assert not any(stashed), (
        f"outgoing skips alive after forward, per micro-batch: {stashed} (checkpoint="
        f"{checkpoint!r}); the stashing stage's StageSkipTracker.outgoing is held by the "
        f"checkpoint's recompute closure until backward")
    out.sum().backward()


# --------------------------------------------------------------------------- errors


@skippable(stash=["x"])
class SometimesStash(nn.Module):
    """Declares ``x`` but stashes it only for micro-batches of ``stash_sizes`` sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(F, F)
        self.stash_sizes: set[int] = {1, 2, 3, 4, 5, 6, 7}

    def forward(self, x: Tensor) -> Any:
        if x.shape[0] in self.stash_sizes:
            yield stash("x", x)
        return self.lin(x)


@skippable(pop=["x"])
class PopX(nn.Module):
    """Adds the popped ``x``."""

    def forward(self, h: Tensor) -> Any:
        x = yield pop("x")
        return h + x


@pytest.mark.parametrize("grad", [True, False])
def test_missing_stash_raises_and_leaves_no_thread(grad: bool) -> None:
    """A declared crossing skip that is not stashed: RuntimeError, no thread left."""
    torch.manual_seed(11)
    model = nn.Sequential(SometimesStash(), nn.Linear(F, F), nn.Tanh(), PopX()).double()
    pipe = Pipe(model, chunks=3, balance=[1, 1, 1, 1])
    x = torch.randn(7, F, dtype=torch.float64)  # micro-batches of 3, 2 and 2 samples
    model[0].stash_sizes = {3}
    with torch.set_grad_enabled(grad), pytest.raises(RuntimeError) as info:
        pipe(x)
    message = str(info.value)
    assert "'x'" in message and "not stashed" in message, message
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "micro-batch 1" in f"{message}\n{notes}", (message, notes)
    assert not seqpipe_threads()
    # the pipe is not wedged: once the layer stashes again, the same pipe works
    model[0].stash_sizes = {2, 3, 7}  # 7: the plain run's whole batch
    plain = copy.deepcopy(model)
    torch.testing.assert_close(pipe(x), plain(x))
    assert not seqpipe_threads()


def test_unmatched_pop_is_rejected_when_the_pipe_is_built() -> None:
    """``verify_skippables`` runs in ``Pipe.__init__``."""
    @skippable(pop=["ghost"])
    class Haunted(nn.Module):
        def forward(self, x: Tensor) -> Any:
            ghost = yield pop("ghost")
            return x + ghost

    model = nn.Sequential(nn.Linear(F, F), nn.Tanh(), Haunted())
    with pytest.raises(TypeError, match=r"'ghost' is popped by layer 2 \(Haunted\) but never "
                                        r"stashed"):
        Pipe(model, chunks=2, balance=[1, 2])
