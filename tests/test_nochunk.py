"""Non-tensor inputs and ``NoChunk``: through ``Pipe``, the torch compat layer and
``DistributedPipe``.

Every micro-batch receives the input's non-tensor values unchanged and a ``NoChunk`` tensor
whole; non-tensor values a layer returns reach the next partition (across processes too);
outputs and gradients, the ``NoChunk`` tensor's included, equal the unpipelined model's.
"""
from __future__ import annotations

import copy
from typing import Any, List, Tuple

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

from distributed_harness import run_workers
from seqpipe import NoChunk, Pipe, is_recomputing
from seqpipe.core.microbatch import scatter

DTYPE = torch.float64
MODES = ("always", "except_last", "never")


class Stamp(nn.Module):
    """Takes ``(x, table, n, flag, name, none)``; records what it saw; passes ``n + 1`` on."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).to(DTYPE)
        self.seen: List[Tuple[Any, ...]] = []

    def forward(self, inputs: Tuple[Any, ...]) -> Tuple[Any, ...]:
        x, table, n, flag, name, none = inputs
        if not is_recomputing():
            self.seen.append((x.shape[0], tuple(table.shape), n, flag, name, none))
        return torch.tanh(self.lin(x) * table), table, n + 1, flag, name, none


class Head(nn.Module):
    """The last layer: the activation, or with ``tag`` also its non-tensor ``n``."""

    def __init__(self, tag: bool = False) -> None:
        super().__init__()
        self.tag = tag

    def forward(self, inputs: Tuple[Any, ...]) -> Any:
        return (inputs[0], inputs[2]) if self.tag else inputs[0]


def model(tag: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Stamp(), Stamp(), Stamp(), Head(tag))


def inputs() -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(10, 4, generator=gen, dtype=DTYPE, requires_grad=True)
    table = torch.randn(4, generator=gen, dtype=DTYPE, requires_grad=True)
    return x, table


def leaf(t: Tensor) -> Tensor:
    return t.detach().clone().requires_grad_()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("balance", [[4], [2, 2], [1, 2, 1]], ids=["1part", "2parts", "3parts"])
def test_non_tensors_and_nochunk_match_the_plain_model(balance, mode):
    plain, wrapped = model(), model()
    pipe = Pipe(wrapped, chunks=4, checkpoint=mode, balance=balance,
                devices=["cpu"] * len(balance))
    x, table = inputs()
    out = pipe((x, NoChunk(table), 3, True, "s", None))
    out.square().sum().backward()
    rx, rtable = leaf(x), leaf(table)
    ref = plain((rx, rtable, 3, True, "s", None))
    ref.square().sum().backward()

    assert_close(out, ref)
    assert_close(x.grad, rx.grad)
    assert_close(table.grad, rtable.grad)  # the micro-batches' gradients, summed
    for mine, theirs in zip(wrapped.parameters(), plain.parameters()):
        assert_close(mine.grad, theirs.grad)
    for k, layer in enumerate(wrapped[:3]):  # across partitions: n grows layer by layer
        assert layer.seen == [(size, (4,), 3 + k, True, "s", None) for size in (3, 3, 2, 2)]


def test_a_nochunk_tensor_without_a_batch_dimension_and_its_gradient():
    class Scale(nn.Module):
        def forward(self, inputs):
            x, temperature = inputs
            return x / temperature, temperature

    def build():
        torch.manual_seed(0)
        return nn.Sequential(Pair(nn.Linear(4, 4).to(DTYPE)), nn.Identity(), Scale(), Head())

    plain, wrapped = build(), build()
    pipe = Pipe(wrapped, chunks=3, balance=[2, 2], devices=["cpu", "cpu"])
    x, _ = inputs()
    temperature = torch.tensor(2.5, dtype=DTYPE, requires_grad=True)
    out = pipe((x, NoChunk(temperature)))
    out.sum().backward()
    rtemperature = leaf(temperature)
    ref = plain((leaf(x), rtemperature))
    ref.sum().backward()
    assert_close(out, ref)
    assert_close(temperature.grad, rtemperature.grad)


class Pair(nn.Module):
    """Applies ``lin`` to the first item of a pair and passes the second on."""

    def __init__(self, lin: nn.Module) -> None:
        super().__init__()
        self.lin = lin

    def forward(self, inputs):
        x, other = inputs
        return self.lin(x), other


def test_non_tensor_outputs_come_back_as_a_list_per_micro_batch():
    pipe = Pipe(model(tag=True), chunks=4, balance=[2, 2], devices=["cpu", "cpu"])
    x, table = inputs()
    out, n = pipe((x, NoChunk(table), 3, False, "s", None))
    assert n == [6, 6, 6, 6]
    ref, _ = model(tag=True)((x, table, 3, False, "s", None))
    assert_close(out, ref)
    with torch.no_grad():
        _, n = pipe((x[:1], NoChunk(table), 0, False, "s", None))
    assert n == [3]


def test_scatter_gives_whole_tensors_and_constants_to_every_micro_batch():
    x, table = torch.arange(5.0).view(5, 1), torch.ones(3)
    pieces = scatter((x, NoChunk(table), 7, None), 2)
    assert [p.value[0].flatten().tolist() for p in pieces] == [[0, 1, 2], [3, 4]]
    for piece in pieces:
        _, whole, seven, none = piece.value
        assert whole is table and seven == 7 and none is None


# -- errors -------------------------------------------------------------------------------

@pytest.fixture
def pipe() -> Pipe:
    return Pipe(model(), chunks=2, balance=[2, 2], devices=["cpu", "cpu"])


@pytest.mark.parametrize("value, described", [
    ((NoChunk(torch.ones(2)), 3, None), "a tuple of (NoChunk, int, NoneType)"),
    (NoChunk(torch.ones(2)), "a NoChunk"),
    ((1, "a"), "a tuple of (int, str)"),
])
def test_an_input_with_nothing_to_cut_is_an_error_naming_it(pipe, value, described):
    escaped = described.replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(TypeError, match=rf"needs a tensor to cut into micro-batches .*got "
                                        rf"{escaped} with none; pass at least one tensor "
                                        rf"unwrapped"):
        pipe(value)


@pytest.mark.parametrize("value", [3, None, "x", [torch.ones(2)]])
def test_nochunk_of_a_non_tensor_is_an_error(value):
    with pytest.raises(TypeError, match="NoChunk only supported for tensors, found: .*; pass "
                                        "a non-tensor argument as it is"):
        NoChunk(value)


def test_a_tensor_nested_in_an_input_item_is_an_error(pipe):
    x, _ = inputs()
    with pytest.raises(TypeError, match="item 1 of the pipeline input holds tensors inside a "
                                        "list.*pass each tensor as an item"):
        pipe((x, [x], 3, True, "s", None))


def test_a_layer_returning_nochunk_is_an_error():
    class Wraps(nn.Module):
        def forward(self, x):
            return x, NoChunk(x)

    pipe = Pipe(nn.Sequential(Wraps(), Head()), balance=[1, 1], devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match="item 1 is a NoChunk, which marks a pipeline input "
                                        "only"):
        pipe(torch.ones(2, 4))


def test_a_micro_batch_without_a_tensor_between_partitions_is_an_error():
    class Count(nn.Module):
        def forward(self, x):
            return x.shape[0], None

    pipe = Pipe(nn.Sequential(Count(), nn.Identity()), balance=[1, 1], devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match=r"the output of the layer \(Count\) before the partition "
                                        r"boundary.* got a tuple of \(int, NoneType\) with no "
                                        r"tensor; return tensors from that layer, or move the "
                                        r"boundary"):
        pipe(torch.ones(2, 4))


def test_micro_batch_outputs_of_different_kinds_are_an_error():
    class Odd(nn.Module):
        def forward(self, x):
            return x, (None if x.shape[0] == 1 else x)

    pipe = Pipe(nn.Sequential(nn.Identity(), Odd()), chunks=2, balance=[1, 1],
                devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match=r"outputs differ in kind: a tuple of \(Tensor, Tensor\) "
                                        r"and a tuple of \(Tensor, NoneType\)"):
        pipe(torch.ones(3, 2))


def test_a_zero_dim_tensor_to_cut_suggests_nochunk(pipe):
    with pytest.raises(ValueError, match="0-dim tensor .*wrap a tensor without one in NoChunk"):
        pipe((torch.ones(4, 4), torch.tensor(1.0)))


# -- the torch compat layer ---------------------------------------------------------------

class Spread(nn.Module):
    """A torch-Pipe-style layer: positional arguments, a tensor, a whole tensor and
    non-tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).to(DTYPE)
        self.seen: List[Tuple[Any, ...]] = []

    def forward(self, a, b, n, none):
        if not is_recomputing():
            self.seen.append((a.shape[0], tuple(b.shape), n, none))
        return torch.tanh(self.lin(a)) * n + b, b, n, none


class Last(nn.Module):
    def forward(self, a, b, n, none):
        return a


def test_torch_pipe_passes_non_tensors_and_nochunk_as_torch_did():
    from seqpipe.compat.torch_pipe import NoChunk as TorchNoChunk
    from seqpipe.compat.torch_pipe import Pipe as TorchPipe
    from seqpipe.compat.torch_pipe.microbatch import NoChunk as FromMicrobatch

    assert TorchNoChunk is FromMicrobatch is NoChunk
    torch.manual_seed(0)
    layers = [Spread(), Spread(), Last()]
    plain = copy.deepcopy(layers)
    model = TorchPipe(nn.Sequential(*layers), chunks=4, checkpoint="always")
    a, b = inputs()
    b = b.detach().view(1, 4).requires_grad_()
    out = model(a, TorchNoChunk(b), 3, None).local_value()
    out.sum().backward()

    ra, rb = leaf(a), leaf(b)
    value: Any = (ra, rb, 3, None)
    for layer in plain:
        value = layer(*value) if isinstance(value, tuple) else layer(value)
    value.sum().backward()
    assert_close(out, value)
    assert_close(a.grad, ra.grad)
    assert_close(b.grad, rb.grad)
    assert_close(layers[0].lin.weight.grad, plain[0].lin.weight.grad)
    assert layers[1].seen == [(size, (1, 4), 3, None) for size in (3, 3, 2, 2)]
    with pytest.raises(TypeError, match="needs a tensor to cut"):
        model(TorchNoChunk(b), 3)


# -- DistributedPipe ----------------------------------------------------------------------

def _distributed(rank: int, world: int) -> None:
    from seqpipe.distributed import DistributedPipe

    x, table = inputs()
    x, table = x.detach(), table.detach()
    y = torch.randn(10, 4, generator=torch.Generator().manual_seed(2), dtype=DTYPE)

    def loss_fn(out: Tensor, target: Tensor) -> Tensor:
        return (out - target).square().mean()

    problems = []
    for schedule in ("fill_drain", "1f1b"):
        for mode in MODES:
            pipe = DistributedPipe(model(), chunks=4, balance=[2, 2], schedule=schedule,
                                   checkpoint=mode)
            # the same input on every rank: read on the first, its non-tensors travel on
            loss = pipe.train_step((x, NoChunk(table), 3, True, "s", None), y, loss_fn)
            plain = model()
            ref = loss_fn(plain((x, table, 3, True, "s", None)), y)
            ref.backward()
            if not torch.allclose(loss, ref.detach()):
                problems.append(f"{schedule}/{mode}: loss {loss} != {ref}")
            names = dict(plain.named_parameters())
            for name, param in pipe.named_parameters():
                if not torch.allclose(param.grad, names[name].grad):
                    problems.append(f"{schedule}/{mode}: gradient of {name}")
            held = [layer for layer in pipe.children() if isinstance(layer, Stamp)]
            first = 2 * rank  # layers 0 and 1 on rank 0, 2 (and the head) on rank 1
            for k, layer in enumerate(held):
                if layer.seen != [(n, (4,), 3 + first + k, True, "s", None)
                                  for n in (3, 3, 2, 2)]:
                    problems.append(f"{schedule}/{mode}: layer {first + k} saw {layer.seen}")
    pipe = DistributedPipe(model(tag=True), chunks=4, balance=[2, 2])
    with torch.no_grad():
        out = pipe((x, NoChunk(table), 3, True, "s", None))
        ref, _ = model(tag=True)((x, table, 3, True, "s", None))
    if rank == 1 and not (torch.allclose(out[0], ref) and out[1] == [6] * 4):
        problems.append(f"inference: {out}")
    assert not problems, problems


class Relay(nn.Module):
    def forward(self, inputs):
        return inputs


class AddDict(nn.Module):
    def forward(self, inputs):
        return (*inputs, {"a": 1})


class DropLast(nn.Module):
    def forward(self, inputs):
        return inputs[:-1]


class Check(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: List[Tuple[Any, ...]] = []

    def forward(self, inputs):
        self.seen.append(inputs[1:])
        return inputs[0]


def _typed(values: Any) -> List[Tuple[type, Any]]:
    return [(type(v), v) for v in values]


VALUES = (0.1, -(2 ** 62), True, False, None, "ünïcode", "", 2.5e300)


def _wire_values(rank: int, world: int) -> None:
    """Each kind of value the wire carries arrives as the same type and value; a dict is
    refused on the stage that would send it, and the other rank hears of it."""
    from seqpipe.distributed import DistributedPipe

    check = Check()
    pipe = DistributedPipe(nn.Sequential(Relay(), check), chunks=2, balance=[1, 1])
    x = torch.ones(4, 2)
    out = pipe((x, *VALUES) if rank == 0 else None)
    if rank == 1:
        assert [_typed(seen) for seen in check.seen] == [_typed(VALUES)] * 2, check.seen
        assert torch.equal(out, x)
    with pytest.raises((TypeError, RuntimeError)) as info:
        pipe((x, {"a": 1}) if rank == 0 else None)
    if rank == 0:
        assert info.type is TypeError
        assert "item 1 of a micro-batch is a dict, which cannot travel between the stages" \
            in str(info.value)
    else:
        assert "TypeError: item 1 of a micro-batch is a dict" in str(info.value)


def _two_stages_per_rank(rank: int, world: int) -> None:
    """Under "zbv" rank 1 holds stages 1 and 2: values cross that hop in memory, and what
    could not cross to another rank is refused there too."""
    from seqpipe.distributed import DistributedPipe

    check = Check()
    pipe = DistributedPipe(nn.Sequential(Relay(), Relay(), Relay(), check), chunks=2,
                           balance=[1, 1, 1, 1], schedule="zbv")
    x = torch.ones(4, 2)
    out = pipe((x, *VALUES))  # every rank passes the input; stage 0's rank reads it
    if pipe.is_last:
        assert [_typed(seen) for seen in check.seen] == [_typed(VALUES)] * 2, check.seen
        assert torch.equal(out, x)
    # stage 2 drops the dict: only the in-memory hop from stage 1 could carry it
    pipe = DistributedPipe(nn.Sequential(Relay(), AddDict(), DropLast(), Check()), chunks=2,
                           balance=[1, 1, 1, 1], schedule="zbv")
    with pytest.raises((TypeError, RuntimeError)) as info:
        pipe((x, 3))
    if rank == 1:
        assert info.type is TypeError and "is a dict, which cannot travel" in str(info.value)
    else:
        assert "TypeError: item 2 of a micro-batch is a dict" in str(info.value)


def test_distributed_pipe_carries_non_tensors_between_ranks():
    run_workers(_distributed, 2, timeout=240, pg_timeout=60)


def test_distributed_wire_carries_plain_values_and_refuses_others():
    run_workers(_wire_values, 2, timeout=180, pg_timeout=60)


def test_distributed_values_cross_a_hop_inside_one_rank_alike():
    run_workers(_two_stages_per_rank, 2, timeout=180, pg_timeout=60)


def test_header_words_round_trip_each_supported_value_and_refuse_others():
    import enum
    import math

    from seqpipe.distributed.values import check_values, from_words, to_words

    values = tuple(enumerate((*VALUES, math.inf, 2 ** 63 - 1, -(2 ** 63), "x" * 17)))
    words = [99] + to_words(values)  # from an offset, as in a header
    assert _typed(v for _, v in from_words(words, 1)) == _typed(v for _, v in values)
    assert [p for p, _ in from_words(words, 1)] == list(range(len(values)))
    nan = from_words(to_words(((0, math.nan),)), 0)[0][1]
    assert math.isnan(nan)

    class Mode(enum.IntEnum):
        A = 1

    for bad in (Mode.A, {"a": 1}, b"bytes", 1j):
        with pytest.raises(TypeError, match=f"item 3 of a micro-batch is a "
                                            f"{type(bad).__name__}, which cannot travel"):
            check_values(((3, bad),))
    with pytest.raises(ValueError, match="does not fit in 64 bits"):
        check_values(((0, 2 ** 63),))
