"""The user-facing skip API: @skippable, stash/pop, namespaces, verification and layouts."""
from __future__ import annotations

import copy
import inspect
import os
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import FrozenInstanceError

import pytest
import torch
from torch import Tensor, nn

from seqpipe.skip import (
    DEFAULT_NAMESPACE,
    Namespace,
    Skip,
    SkipLayout,
    SkipTracker,
    inspect_skip_layout,
    is_skippable,
    iter_pops,
    iter_stashes,
    pop,
    skippable,
    stash,
    use_skip_tracker,
    verify_skippables,
)

FEATURES = 4


@pytest.fixture(autouse=True)
def fresh_tracker() -> Iterator[SkipTracker]:
    """Each test gets its own tracker, so a failing test leaves nothing behind."""
    tracker = SkipTracker()
    with use_skip_tracker(tracker):
        yield tracker


# --------------------------------------------------------------------------- model zoo


@skippable(stash=["skip"])
class Down(nn.Module):
    """A linear block that stashes its input for the matching Up."""

    def __init__(self, features: int = FEATURES) -> None:
        super().__init__()
        self.lin = nn.Linear(features, features)

    def forward(self, x: Tensor):
        yield stash("skip", x)
        return torch.tanh(self.lin(x))


@skippable(pop=["skip"])
class Up(nn.Module):
    """A linear block that concatenates the popped skip to its input."""

    def __init__(self, features: int = FEATURES) -> None:
        super().__init__()
        self.lin = nn.Linear(2 * features, features)

    def forward(self, x: Tensor):
        skip = yield pop("skip")
        return self.lin(torch.cat([x, skip], dim=-1))


class PlainDown(nn.Module):
    """Down without skips: same submodules, same output."""

    def __init__(self, features: int = FEATURES) -> None:
        super().__init__()
        self.lin = nn.Linear(features, features)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.lin(x))


class PlainUp(nn.Module):
    """Up without skips: the skip is an explicit argument."""

    def __init__(self, features: int = FEATURES) -> None:
        super().__init__()
        self.lin = nn.Linear(2 * features, features)

    def forward(self, x: Tensor, skip: Tensor) -> Tensor:
        return self.lin(torch.cat([x, skip], dim=-1))


@skippable(stash=["old"])
class OldStyleSuper(nn.Module):
    """Uses the explicit two-argument super(), which a same-name subclass would break."""

    def __init__(self) -> None:
        super(OldStyleSuper, self).__init__()  # noqa: UP008 - the point of the test
        self.lin = nn.Linear(2, 2)

    def forward(self, x: Tensor):
        yield stash("old", x)
        return self.lin(x)


def make_block_class(decorate: bool) -> type[nn.Module]:
    """Two textually identical classes named ``Block``, one of them skippable."""

    class Block(nn.Module):
        """A block."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.norm = nn.LayerNorm(3)

        def forward(self, x: Tensor):
            yield stash("s", x)
            return self.norm(self.lin(x))

    return skippable(stash=["s"])(Block) if decorate else Block


def stasher(*names: str) -> nn.Module:
    """A layer that stashes its input under each name and returns it unchanged."""

    @skippable(stash=names)
    class Stasher(nn.Module):
        def forward(self, x: Tensor):
            for name in sorted(names):
                yield stash(name, x)
            return x

    return Stasher()


def popper(*names: str) -> nn.Module:
    """A layer that adds every popped tensor to its input."""

    @skippable(pop=names)
    class Popper(nn.Module):
        def forward(self, x: Tensor):
            for name in sorted(names):
                x = x + (yield pop(name))
            return x

    return Popper()


# --------------------------------------------------------------------------- class identity


def test_decorator_returns_the_users_class() -> None:
    layer = Down()
    assert type(layer) is Down
    assert isinstance(layer, Down) and isinstance(layer, nn.Module)
    assert Down.__name__ == "Down" and Down.__qualname__ == "Down"
    assert Down.__module__ == __name__
    assert Down.__doc__ == "A linear block that stashes its input for the matching Up."
    assert isinstance(layer.lin, nn.Linear)
    assert is_skippable(layer) and not is_skippable(PlainDown())
    assert inspect.isgeneratorfunction(Down.forward.__wrapped__)
    assert list(inspect.signature(Down.forward).parameters) == ["self", "x"]


def test_declared_names_are_class_level_frozensets() -> None:
    assert Down.stashable_names == frozenset({"skip"}) and Down.poppable_names == frozenset()
    assert Up.stashable_names == frozenset() and Up.poppable_names == frozenset({"skip"})
    assert isinstance(Down.stashable_names, frozenset)


def test_repr_and_state_dict_match_the_undecorated_class() -> None:
    plain, skip = make_block_class(False)(), make_block_class(True)()
    assert repr(skip) == repr(plain)
    assert list(skip.state_dict()) == list(plain.state_dict()) == [
        "lin.weight", "lin.bias", "norm.weight", "norm.bias"]
    assert type(skip).__qualname__ == type(plain).__qualname__
    assert type(skip).__doc__ == "A block."


def test_skippable_checkpoint_loads_into_plain_model() -> None:
    skip_model = nn.Sequential(Down(), nn.ReLU(), Up())
    plain_model = nn.Sequential(PlainDown(), nn.ReLU(), PlainUp())
    assert list(skip_model.state_dict()) == list(plain_model.state_dict())
    plain_model.load_state_dict(skip_model.state_dict(), strict=True)
    skip_model.load_state_dict(plain_model.state_dict(), strict=True)
    assert torch.equal(plain_model[2].lin.weight, skip_model[2].lin.weight)


def test_explicit_two_argument_super_works() -> None:
    layer = OldStyleSuper()
    assert torch.equal(nn.Sequential(layer, popper("old"))(torch.ones(2)),
                       layer.lin(torch.ones(2)) + 1)


def test_deepcopy_and_pickle_keep_behaviour_and_namespaces() -> None:
    ns = Namespace()
    layer = Down().isolate(ns)
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert type(clone) is Down
        assert clone.namespaced("skip") == (ns, "skip")
        assert torch.equal(clone.lin.weight, layer.lin.weight)
        model = nn.Sequential(clone, Up().isolate(ns))
        verify_skippables(model)
        assert model(torch.ones(1, FEATURES)).shape == (1, FEATURES)


def test_pickle_never_stores_the_default_namespace() -> None:
    layer = Down().isolate(Namespace()).isolate(DEFAULT_NAMESPACE)
    assert "_skip_namespaces" not in layer.__dict__ or not layer.__dict__["_skip_namespaces"]
    assert pickle.loads(pickle.dumps(layer)).namespaced("skip") == (DEFAULT_NAMESPACE, "skip")


# --------------------------------------------------------------------------- running


def assert_same_outputs_and_grads(skip_model: nn.Module, plain_forward, plain_params) -> None:
    x1 = torch.randn(5, FEATURES, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    out1, out2 = skip_model(x1), plain_forward(x2)
    torch.testing.assert_close(out1, out2)
    out1.square().sum().backward()
    out2.square().sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)
    for p1, p2 in zip(skip_model.parameters(), plain_params, strict=True):
        torch.testing.assert_close(p1.grad, p2.grad)


def test_plain_sequential_matches_hand_written_model() -> None:
    torch.manual_seed(0)
    skip_model = nn.Sequential(nn.Linear(FEATURES, FEATURES), Down(), nn.ReLU(),
                               nn.Linear(FEATURES, FEATURES), Up(), nn.Linear(FEATURES, 2))
    plain = nn.Sequential(nn.Linear(FEATURES, FEATURES), PlainDown(), nn.ReLU(),
                          nn.Linear(FEATURES, FEATURES), PlainUp(), nn.Linear(FEATURES, 2))
    plain.load_state_dict(skip_model.state_dict())

    def plain_forward(x: Tensor) -> Tensor:
        x = plain[0](x)
        skip = x  # stashed by layer 1, popped by layer 4
        x = plain[3](plain[2](plain[1](x)))
        return plain[5](plain[4](x, skip))

    verify_skippables(skip_model)
    assert_same_outputs_and_grads(skip_model, plain_forward, list(plain.parameters()))


def test_stash_none() -> None:
    @skippable(stash=["nothing"])
    class StashNone(nn.Module):
        def forward(self, x: Tensor):
            yield stash("nothing", None)
            return x * 2

    @skippable(pop=["nothing"])
    class PopNone(nn.Module):
        def forward(self, x: Tensor):
            got = yield pop("nothing")
            assert got is None
            return x + 1

    assert torch.equal(nn.Sequential(StashNone(), PopNone())(torch.ones(2)), torch.full((2,), 3.0))


def test_non_generator_forward() -> None:
    @skippable()
    class NoYield(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x + 1

    assert torch.equal(NoYield()(torch.zeros(2)), torch.ones(2))
    verify_skippables(nn.Sequential(NoYield()))


def test_module_that_stashes_and_pops_its_own_name() -> None:
    @skippable(stash=["mine"], pop=["mine"])
    class Residual(nn.Module):
        def forward(self, x: Tensor):
            yield stash("mine", x)
            y = x * 3
            return y + (yield pop("mine"))

    model = nn.Sequential(Residual())
    verify_skippables(model)
    assert torch.equal(model(torch.ones(2)), torch.full((2,), 4.0))


def test_requests_reach_the_current_tracker_with_namespace(fresh_tracker: SkipTracker) -> None:
    ns = Namespace()
    seen = []

    class Recording(SkipTracker):
        def stash(self, ns: Namespace, name: str, tensor: Tensor | None) -> None:
            seen.append(("stash", ns, name))
            super().stash(ns, name, tensor)

        def pop(self, ns: Namespace, name: str) -> Tensor | None:
            seen.append(("pop", ns, name))
            return super().pop(ns, name)

    with use_skip_tracker(Recording()):
        nn.Sequential(Down().isolate(ns), Up().isolate(ns))(torch.ones(1, FEATURES))
    assert seen == [("stash", ns, "skip"), ("pop", ns, "skip")]
    assert fresh_tracker.tensors == {}


# --------------------------------------------------------------------------- run-time errors


def test_undeclared_stash_names_class_and_fix() -> None:
    @skippable(stash=["declared"])
    class Sloppy(nn.Module):
        def forward(self, x: Tensor):
            yield stash("typo", x)
            return x

    with pytest.raises(TypeError, match=r"Sloppy.*'typo'.*@skippable\(stash=\[\.\.\.\]\)"):
        Sloppy()(torch.ones(1))


def test_undeclared_pop_names_class_and_fix() -> None:
    @skippable(stash=["x"])
    class Greedy(nn.Module):
        def forward(self, x: Tensor):
            return (yield pop("x"))

    with pytest.raises(TypeError, match=r"Greedy.*'x'.*@skippable\(pop=\[\.\.\.\]\)"):
        Greedy()(torch.ones(1))


def test_yielding_something_else_is_a_type_error() -> None:
    @skippable(stash=["x"])
    class Confused(nn.Module):
        def forward(self, x: Tensor):
            yield x
            return x

    with pytest.raises(TypeError, match=r"Confused.forward yielded a Tensor.*stash\(name"):
        Confused()(torch.ones(1))


def test_error_is_raised_at_the_users_yield_line() -> None:
    @skippable()
    class Located(nn.Module):
        def forward(self, x: Tensor):
            yield stash("undeclared", x)  # the traceback must point here
            return x

    with pytest.raises(TypeError) as info:
        Located()(torch.ones(1))
    assert any(entry.name == "forward" and "the traceback must point here" in str(entry.statement)
               for entry in info.traceback)


def test_pop_before_stash_at_run_time() -> None:
    with pytest.raises(RuntimeError, match="popped before it was stashed"):
        Up()(torch.ones(1, FEATURES))


def test_double_stash_without_namespaces_says_so() -> None:
    """Two Down/Up pairs sharing one name, unwrapped: the second pop finds nothing, and the
    message says why (the name is stashed twice), not that it was never stashed."""
    model = nn.Sequential(Down(), Down(), Up(), Up())
    with pytest.raises(RuntimeError, match=r"skip 'skip' is stashed by more than one layer.*"
                                           r"isolate\(Namespace\(\)\).*verify_skippables"):
        model(torch.ones(1, FEATURES))
    ns1, ns2 = Namespace(), Namespace()
    isolated = nn.Sequential(Down().isolate(ns1), Down().isolate(ns2), Up().isolate(ns2),
                             Up().isolate(ns1))
    assert isolated(torch.ones(1, FEATURES)).shape == (1, FEATURES)


def test_stash_and_pop_argument_checks() -> None:
    with pytest.raises(TypeError, match="Tensor or None"):
        stash("x", [1, 2])
    with pytest.raises(TypeError, match="skip name"):
        pop(3)  # type: ignore[arg-type]


def test_decorator_misuse() -> None:
    with pytest.raises(TypeError, match="with parentheses"):
        skippable(Down)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"stash=\['skip'\]"):
        skippable(stash="skip")
    with pytest.raises(TypeError, match="must be str"):
        skippable(pop=[1])
    with pytest.raises(TypeError, match="nn.Module subclasses"):
        skippable()(int)

    class NoForward(nn.Module):
        pass

    with pytest.raises(TypeError, match="must define forward"):
        skippable()(NoForward)

    class Clash(nn.Module):
        def isolate(self) -> None:
            pass

        def forward(self, x: Tensor) -> Tensor:
            return x

    with pytest.raises(TypeError, match="'isolate'.*Clash already defines it"):
        skippable()(Clash)


def test_subclasses_of_a_skippable_class() -> None:
    class Inherits(Down):  # inherits the declarations and the driver
        pass

    @skippable(stash=["skip", "extra"])
    class Extends(Down):  # overrides forward, so declares every name itself
        def forward(self, x: Tensor):
            yield stash("extra", 2 * x)
            return (yield from Down.forward.__wrapped__(self, x))

    assert is_skippable(Inherits()) and Inherits.stashable_names == {"skip"}
    assert Down.stashable_names == {"skip"}  # the base class is untouched
    ns = Namespace()
    model = nn.Sequential(Inherits(), Up(), Extends().isolate(ns, only=["skip"]),
                          popper("extra"), Up().isolate(ns))
    verify_skippables(model)
    assert model(torch.ones(1, FEATURES)).shape == (1, FEATURES)


# --------------------------------------------------------------------------- namespaces


def test_isolate_returns_self_and_is_per_instance() -> None:
    ns = Namespace()
    a, b = Down(), Down()
    assert a.isolate(ns) is a
    assert a.namespaced("skip") == (ns, "skip")
    assert b.namespaced("skip") == (DEFAULT_NAMESPACE, "skip")


def test_isolate_only_some_names() -> None:
    @skippable(stash=["a", "b"])
    class Two(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x

    ns = Namespace()
    layer = Two().isolate(ns, only=["b"])
    assert layer.namespaced("a") == (DEFAULT_NAMESPACE, "a")
    assert layer.namespaced("b") == (ns, "b")


def test_isolate_and_namespaced_argument_checks() -> None:
    with pytest.raises(TypeError, match="takes a Namespace"):
        Down().isolate("ns")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Down declares no skip named 'nope'"):
        Down().isolate(Namespace(), only=["nope"])
    with pytest.raises(ValueError, match="declares no skip named 'nope'"):
        Down().namespaced("nope")


def unet(levels: int = 3) -> tuple[nn.Sequential, nn.Sequential]:
    """A skippable U-Net (Down/Up reused per level) and its plain twin with equal weights."""
    namespaces = [Namespace() for _ in range(levels)]
    downs = [Down().isolate(ns) for ns in namespaces]
    ups = [Up().isolate(ns) for ns in reversed(namespaces)]
    model = nn.Sequential(*downs, nn.Linear(FEATURES, FEATURES), *ups)
    plain = nn.Sequential(*[PlainDown() for _ in range(levels)], nn.Linear(FEATURES, FEATURES),
                          *[PlainUp() for _ in range(levels)])
    plain.load_state_dict(model.state_dict(), strict=True)
    return model, plain


def test_unet_with_namespaces_verifies_runs_and_matches_hand_written() -> None:
    torch.manual_seed(1)
    model, plain = unet(3)
    verify_skippables(model)

    def plain_forward(x: Tensor) -> Tensor:
        skips = []
        for down in plain[:3]:
            skips.append(x)
            x = down(x)
        x = plain[3](x)
        for up in plain[4:]:
            x = up(x, skips.pop())
        return x

    assert_same_outputs_and_grads(model, plain_forward, list(plain.parameters()))


def test_unet_without_namespaces_fails_verification() -> None:
    model = nn.Sequential(Down(), Down(), Down(), Up(), Up(), Up())
    with pytest.raises(TypeError, match=r"'skip' is stashed more than once, by layers 0 \(Down\), "
                                        r"1 \(Down\), 2 \(Down\)"):
        verify_skippables(model)


def test_iter_stashes_and_pops() -> None:
    ns = Namespace()
    model = nn.Sequential(stasher("b", "a"), nn.ReLU(), popper("a"), Up().isolate(ns))
    stashes = [(i, ns_, name) for i, _, ns_, name in iter_stashes(model)]
    pops = [(site.index, site.ns, site.name) for site in iter_pops(model)]
    assert stashes == [(0, DEFAULT_NAMESPACE, "a"), (0, DEFAULT_NAMESPACE, "b")]
    assert pops == [(2, DEFAULT_NAMESPACE, "a"), (3, ns, "skip")]
    assert next(iter_pops(model)).layer is model[2]
    with pytest.raises(TypeError, match="expected nn.Sequential"):
        iter_stashes(nn.ModuleList())


# --------------------------------------------------------------------------- verify_skippables


@pytest.mark.parametrize(("layers", "message"), [
    (lambda: [stasher("a"), nn.ReLU()], r"'a' is stashed by layer 0 \(Stasher\) but never popped"),
    (lambda: [nn.ReLU(), popper("a")], r"'a' is popped by layer 1 \(Popper\) but never stashed"),
    (lambda: [stasher("a"), stasher("a"), popper("a")],
     r"'a' is stashed more than once, by layers 0 \(Stasher\), 1 \(Stasher\)"),
    (lambda: [stasher("a"), popper("a"), popper("a")],
     r"'a' is popped more than once, by layers 1 \(Popper\), 2 \(Popper\)"),
    (lambda: [popper("a"), nn.ReLU(), stasher("a")],
     r"'a' is popped by layer 0 \(Popper\) before it is stashed by layer 2 \(Stasher\)"),
    (lambda: [Down().isolate(Namespace()), Up()],
     r"'skip' \(namespace [0-9a-f]{8}\) is stashed by layer 0 \(Down\) but never popped"),
])
def test_verify_reports_each_problem(layers, message: str) -> None:
    with pytest.raises(TypeError, match=message) as info:
        verify_skippables(nn.Sequential(*layers()))
    assert str(info.value).splitlines()[-1].startswith("hint: ")
    assert "isolate(Namespace())" in str(info.value)


def test_verify_reports_all_problems_at_once() -> None:
    model = nn.Sequential(popper("late"), stasher("lost", "late"), stasher("twice"),
                          stasher("twice"), popper("twice", "orphan"))
    with pytest.raises(TypeError) as info:
        verify_skippables(model)
    lines = str(info.value).splitlines()
    assert lines[0] == "nn.Sequential has 4 skip connection problems:"
    assert lines[1:5] == [
        "  - 'late' is popped by layer 0 (Popper) before it is stashed by layer 1 (Stasher)",
        "  - 'lost' is stashed by layer 1 (Stasher) but never popped",
        "  - 'twice' is stashed more than once, by layers 2 (Stasher), 3 (Stasher)",
        "  - 'orphan' is popped by layer 4 (Popper) but never stashed",
    ]
    assert lines[5].startswith("hint: ") and len(lines) == 6


def test_verify_accepts_valid_models_and_rejects_non_sequential() -> None:
    verify_skippables(nn.Sequential())
    verify_skippables(nn.Sequential(nn.ReLU(), nn.Linear(2, 2)))
    verify_skippables(nn.Sequential(Down(), Up()))
    with pytest.raises(TypeError, match="expected nn.Sequential, got ModuleList"):
        verify_skippables(nn.ModuleList([Down(), Up()]))  # type: ignore[arg-type]


def test_verify_only_inspects_direct_children() -> None:
    inner_pair = nn.Sequential(stasher("inner"), popper("inner"))
    inner_broken = nn.Sequential(stasher("dangling"))
    verify_skippables(nn.Sequential(inner_pair, inner_broken))
    assert torch.equal(nn.Sequential(inner_pair)(torch.ones(1)), torch.full((1,), 2.0))


# --------------------------------------------------------------------------- SkipLayout


def layout_model() -> nn.Sequential:
    """Skips: y 0->6, z 0->1, b 2->4, c 5->6 (names do not sort like stash layers)."""
    return nn.Sequential(stasher("z", "y"), popper("z"), stasher("b"), nn.ReLU(), popper("b"),
                         stasher("c"), popper("c", "y"), nn.ReLU())


@pytest.mark.parametrize(("balance", "expected"), [
    ([8], [("y", 0, 6, 0, 0), ("z", 0, 1, 0, 0), ("b", 2, 4, 0, 0), ("c", 5, 6, 0, 0)]),
    ([5, 3], [("y", 0, 6, 0, 1), ("z", 0, 1, 0, 0), ("b", 2, 4, 0, 0), ("c", 5, 6, 1, 1)]),
    ([3, 3, 2], [("y", 0, 6, 0, 2), ("z", 0, 1, 0, 0), ("b", 2, 4, 0, 1), ("c", 5, 6, 1, 2)]),
    ([2, 2, 2, 2], [("y", 0, 6, 0, 3), ("z", 0, 1, 0, 0), ("b", 2, 4, 1, 2), ("c", 5, 6, 2, 3)]),
    ([1] * 8, [("y", 0, 6, 0, 6), ("z", 0, 1, 0, 1), ("b", 2, 4, 2, 4), ("c", 5, 6, 5, 6)]),
])
def test_layout_partitions(balance: list[int], expected: list[tuple]) -> None:
    layout = inspect_skip_layout(layout_model(), balance)
    assert layout.structure() == tuple(expected)
    assert layout.balance == tuple(balance) and layout.num_partitions == len(balance)
    assert len(layout) == 4 and [skip.name for skip in layout] == ["y", "z", "b", "c"]


def test_layout_queries_with_skips_crossing_zero_one_and_two_boundaries() -> None:
    layout = inspect_skip_layout(layout_model(), [3, 3, 2])

    def names(skips: list) -> list:
        return [skip.name for skip in skips]

    assert names(layout.skips_stashed_by(0)) == ["y", "b"]  # y crosses 2, b crosses 1
    assert names(layout.skips_stashed_by(1)) == ["c"]
    assert names(layout.skips_stashed_by(2)) == []
    assert names(layout.skips_popped_by(0)) == []
    assert names(layout.skips_popped_by(1)) == ["b"]
    assert names(layout.skips_popped_by(2)) == ["y", "c"]  # by stash layer, not by name
    assert names(layout.local_skips(0)) == ["z"]
    assert layout.is_local(DEFAULT_NAMESPACE, "z") and not layout.is_local(DEFAULT_NAMESPACE, "y")
    assert layout.crosses(DEFAULT_NAMESPACE, "y") and not layout.crosses(DEFAULT_NAMESPACE, "z")
    assert not layout.crosses(Namespace(), "y")  # unknown keys (nested skippables) stay local
    assert layout.stash_partition(DEFAULT_NAMESPACE, "y") == 0
    assert layout.pop_partition(DEFAULT_NAMESPACE, "y") == 2
    y = layout.find(DEFAULT_NAMESPACE, "y")
    assert y == Skip(DEFAULT_NAMESPACE, "y", 0, 6, 0, 2) and y.crosses and y.key == (
        DEFAULT_NAMESPACE, "y")
    with pytest.raises(KeyError, match="no skip named 'y'"):
        layout.find(Namespace(), "y")
    with pytest.raises(ValueError, match="partition 3 out of range"):
        layout.skips_stashed_by(3)


def test_layout_with_namespaces() -> None:
    model, _ = unet(3)  # skips 0->6, 1->5, 2->4 in three namespaces
    layout = inspect_skip_layout(model, [2, 3, 2])
    assert layout.structure() == (("skip", 0, 6, 0, 2), ("skip", 1, 5, 0, 2),
                                  ("skip", 2, 4, 1, 1))
    outer_ns = model[0].namespaced("skip")[0]
    assert layout.find(outer_ns, "skip").pop_layer == 6
    assert [s.stash_layer for s in layout.skips_popped_by(2)] == [0, 1]


def test_layout_is_immutable_plain_data() -> None:
    layout = inspect_skip_layout(layout_model(), [4, 4])
    with pytest.raises(FrozenInstanceError):
        layout.balance = (8,)  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        layout.skips[0].name = "other"  # type: ignore[misc]
    assert isinstance(layout.skips, tuple) and isinstance(layout.skips_stashed_by(0), list)
    with pytest.raises(TypeError):
        layout._index[(DEFAULT_NAMESPACE, "y")] = None  # type: ignore[index]
    for skip in layout:
        assert all(isinstance(getattr(skip, field), int) for field in
                   ("stash_layer", "pop_layer", "stash_partition", "pop_partition"))
    assert SkipLayout((4, 4), tuple(reversed(layout.skips))) == layout


def test_layout_ordering_is_deterministic_across_models() -> None:
    def build() -> nn.Sequential:
        return unet(3)[0]  # fresh, random namespaces every time

    first, second = (inspect_skip_layout(build(), [3, 1, 3]) for _ in range(2))
    assert first.structure() == second.structure()
    assert first != second  # namespaces differ ...
    for partition in range(3):  # ... but the per-partition order does not
        for query in ("skips_stashed_by", "skips_popped_by", "local_skips"):
            a = [s.structure() for s in getattr(first, query)(partition)]
            b = [s.structure() for s in getattr(second, query)(partition)]
            assert a == b


LAYOUT_SCRIPT = textwrap.dedent("""
    import torch
    from torch import nn
    from seqpipe.skip import Namespace, inspect_skip_layout, pop, skippable, stash

    names = ["q", "b", "x", "a", "m"]

    @skippable(stash=names)
    class Source(nn.Module):
        def forward(self, x):
            for name in names:
                yield stash(name, x)
            return x

    @skippable(pop=names)
    class Sink(nn.Module):
        def forward(self, x):
            for name in names:
                x = x + (yield pop(name))
            return x

    ns = Namespace()
    model = nn.Sequential(Source(), Source().isolate(ns), nn.ReLU(), Sink(), Sink().isolate(ns))
    layout = inspect_skip_layout(model, [2, 1, 2])
    print(repr(layout.structure()))
""")


def test_layout_order_is_identical_across_processes() -> None:
    procs = [subprocess.Popen([sys.executable, "-c", LAYOUT_SCRIPT], stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONHASHSEED=seed,
                                                  PYTHONPATH=os.pathsep.join(sys.path)))
             for seed in ("1", "2")]  # different str hashes, different namespace uuids
    outputs = {proc.communicate(timeout=120)[0] for proc in procs}
    assert all(proc.returncode == 0 for proc in procs)
    assert len(outputs) == 1
    structure = eval(outputs.pop())  # our own subprocess
    assert [s[:2] for s in structure] == [(name, layer) for layer in (0, 1)
                                          for name in ("a", "b", "m", "q", "x")]


def test_layout_checks_model_and_balance() -> None:
    with pytest.raises(TypeError, match="never popped"):
        inspect_skip_layout(nn.Sequential(stasher("a")), [1])
    # The same checks, and messages, as Pipe's (seqpipe.core.arguments.layer_counts).
    with pytest.raises(ValueError, match="sums to 7 but the module has 8 layers"):
        inspect_skip_layout(layout_model(), [4, 3])
    with pytest.raises(ValueError, match="positive int.* entry 1 of \\[8, 0\\] is 0"):
        inspect_skip_layout(layout_model(), [8, 0])
    with pytest.raises(ValueError, match="balance is empty"):
        inspect_skip_layout(layout_model(), [])
    with pytest.raises(ValueError, match="positive int.* entry 0 of \\[4.0, 4.0\\] is 4.0"):
        inspect_skip_layout(layout_model(), [4.0, 4.0])
    with pytest.raises(TypeError, match="sequence of layer counts"):
        inspect_skip_layout(layout_model(), 8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected nn.Sequential"):
        inspect_skip_layout(nn.ModuleList(), [1])  # type: ignore[arg-type]
