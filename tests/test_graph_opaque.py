"""Opaque units (``seqpipe.graph.opaque``): a unit whose code the trace cannot enter (a
branch on tensor values; Mixtral's float32 ``grouped_mm`` in ``test_graph_zoo.py``) runs
as the user's module, traced as one call whose output sizes are learned by running it on
zeros. It trains exactly, its batch stays dynamic, learning its sizes changes nothing of
the model's state, and what cannot be learned is refused naming the unit and the mend."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from graph_check import close, train_both
from graph_models import WIDTH, Routed, RoutedNet, build, example, loss_of
from torch import Tensor, nn

from seqpipe import Pipe
from seqpipe.graph import ConversionError, to_sequential

TOL = dict(atol=1e-10, rtol=1e-8)


def test_a_unit_the_trace_cannot_enter_runs_as_an_opaque_call_and_trains_exactly() -> None:
    # blocks.0 fails to trace (``if h.sum() > 0``); its sibling of the same class is made
    # opaque with it, in one retry. Both branches are taken in the steps (batches 6, 5, 4
    # in micro-batches of 2 and 3: the batch stays dynamic), loss and every gradient and
    # weight as the plain model's
    model, plain = build("routed"), build("routed")
    args, kwargs, _ = example("routed")
    seq = to_sequential(model, args, kwargs)
    assert [(layer.unit, layer.opaque) for layer in seq] == [
        ("stem", False), ("blocks.0", True), ("blocks.1", True), ("head", False)]
    assert "unit='blocks.0', opaque" in repr(seq[1])
    for sign in (1.0, -1.0):  # each branch, called as the model
        x = sign * torch.ones(3, 5, dtype=torch.double)
        mask = torch.ones(3, dtype=torch.double)
        torch.testing.assert_close(seq(x, mask), plain(x, mask), **TOL)
    pipe = Pipe(seq, chunks=2, balance=[2, 2], devices=["cpu", "cpu"])

    def step(batch: Any, target: Tensor) -> Tensor:
        return pipe.train_step(seq.origin.pipeline_input(*batch[0], **batch[1]), target,
                               loss_of("routed"), schedule="1f1b")

    train_both("routed", step, dict(model.named_parameters()), plain, 2, close(TOL))


class Noisy(Routed):
    """An opaque unit with state a run would change: BatchNorm statistics, dropout's RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.drop = nn.BatchNorm1d(WIDTH), nn.Dropout(0.5)

    def forward(self, h: Tensor, mask: Tensor) -> Tensor:
        return self.drop(self.norm(super().forward(h, mask)))


class Flat(Routed):
    def forward(self, h: Tensor, mask: Tensor) -> Tensor:  # (batch * WIDTH,): no input size
        return super().forward(h, mask).flatten()


class FlatNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.flat = nn.Linear(5, WIDTH), Flat()

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.flat(self.stem(x), mask[:, None])


class Picky(Flat):
    def forward(self, h: Tensor, mask: Tensor) -> Tensor:  # the rows its values pick
        out = Routed.forward(self, h, mask)
        return out[out[:, 0] > 0]


class Fragile(Routed):
    def forward(self, h: Tensor, mask: Tensor) -> Tensor:
        out = super().forward(h, mask)
        if not bool(mask.any()):
            raise ValueError("an all-zero mask")
        return out


def test_learning_an_opaque_units_sizes_changes_nothing_and_what_it_cannot_is_refused() -> None:
    args, _, _ = example("routed")
    model = build("routed")
    model.blocks[1] = Noisy().double()
    rng = torch.get_rng_state()
    seq = to_sequential(model, args)
    # the probes ran the unit in train mode on zeros: its statistics and the RNG are intact
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.blocks[1].norm.num_batches_tracked.item() == 0
    assert torch.equal(model.blocks[1].norm.running_mean, torch.zeros(WIDTH, dtype=torch.double))
    model.eval()
    torch.testing.assert_close(seq(*args), model(*args), **TOL)

    with pytest.raises(ConversionError, match=r"output 0 of unit 'flat' \(an opaque call: its "
                                              r"outputs are learned by running it\) has a size "
                                              r"in dim 0 \(96\) that is no size of its inputs.*"
                                              r"Choose units whose outputs keep"):
        to_sequential(FlatNet().double(), args)
    picky = FlatNet().double()
    picky.flat = Picky().double()
    with torch.no_grad():
        picky.flat.down.bias.zero_()  # on zeros no row is picked, on other values some
    with pytest.raises(ConversionError, match=r"output 0 of unit 'flat' .* has sizes that "
                                              r"depend on its input values \(\(0, 16\) on "
                                              r"zeros, \(\d+, 16\) on other values\)"):
        to_sequential(picky, args)
    sized = CountNet(Counted()).double()
    sized.clip.forward = lambda h, mask: (Routed.forward(sized.clip, h, mask), h.shape[0])
    with pytest.raises(ConversionError, match=r"output 1 of unit 'clip' .* is a value that "
                                              r"follows its input sizes \(6, 12.* at the sizes "
                                              r"tried\).*return it as a tensor, or read the "
                                              r"size in the code that uses it"):
        to_sequential(sized, args)
    model.blocks[1] = Fragile().double()
    with pytest.raises(ConversionError, match=r"unit 'blocks.1' cannot be traced \(data-"
                                              r"dependent control flow.*in module 'blocks.1' at "
                                              r".*graph_models.py:\d+ \(if h.sum\(\) > 0:\)\), "
                                              r"and running it on zeros to learn its output "
                                              r"sizes failed too \(ValueError: an all-zero "
                                              r"mask\)"):
        to_sequential(model, args)

    with torch.device("meta"):
        lazy = RoutedNet().double()
    with pytest.raises(ConversionError, match=r"unit 'blocks.0' cannot be traced .*built on "
                                              r"meta it cannot run. Build 'blocks.0' on a real "
                                              r"device before converting"):
        to_sequential(lazy, args)
    lazy.blocks = nn.ModuleList([Routed(), Routed()]).double()  # the mend: real, opaque
    seq = to_sequential(lazy, args)
    assert [layer.opaque for layer in seq] == [False, True, True, False]


class Clipped(Routed):
    def forward(self, h: Tensor, mask: Tensor) -> Tensor:  # the rows without a huge value
        return super().forward(h, mask)[h.abs().amax(1) < 100]


class MeanNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.clip, self.head = nn.Linear(5, WIDTH), Clipped(), nn.Linear(WIDTH, 5)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        kept = self.clip(self.stem(x), mask[:, None])
        return self.head(kept.sum(0) / kept.shape[0])  # the glue reads the rows kept


def test_an_opaque_unit_whose_sizes_follow_values_both_probes_missed_fails_when_it_runs() -> None:
    # on zeros and on seeded random values every row is kept, so the conversion infers
    # (batch, 16); the traced glue then divides by the batch. A huge row drops out at run
    # time: without the check the converted model's mean was silently wrong (divided by
    # 3, not 2); now the call names the unit, the output and both sizes, at this batch
    model = MeanNet().double()
    args, _, _ = example("routed")
    seq = to_sequential(model, args)
    assert [layer.opaque for layer in seq] == [False, True, False]
    x, mask = torch.randn(3, 5, dtype=torch.double), torch.ones(3, dtype=torch.double)
    torch.testing.assert_close(seq(x, mask), model(x, mask), **TOL)  # another batch: fine
    x[1] = 1e4
    model(x, mask)  # the model itself runs: the mean of the 2 rows kept
    with pytest.raises(ValueError, match=r"output 0 of unit 'clip' has sizes \(2, 16\), but "
                                         r"to_sequential inferred \(3, 16\) for these input "
                                         r"sizes .*it runs as an opaque call.*depend on its "
                                         r"input values.*Choose units whose outputs keep "
                                         r"their inputs' sizes"):
        seq(x, mask)


class Unmasked(Routed):
    def forward(self, h: Tensor, mask: Tensor) -> Tensor:  # autocast: one dtype either way
        return torch.tanh(self.up(h)) if h.sum() > 0 else self.down(h)


class DtypeNet(nn.Module):
    """Glue that branches on an opaque unit's output dtype (as code that clamps a float16
    activation does): the trace fixes the branch the conversion's dtype takes."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.block, self.head = nn.Linear(5, WIDTH), Unmasked(), nn.Linear(WIDTH, 5)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.block(self.stem(x), mask[:, None]) * mask[:, None]
        if h.dtype == torch.bfloat16:
            h = h.float() * 2
        return self.head(h)


class Widening(Routed):
    """Computes in float32 and answers in its input's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(5, WIDTH), nn.Linear(5, WIDTH)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return super().forward(x.float(), mask.float()).to(x.dtype)


class WideningNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.head = Widening(), nn.Linear(WIDTH, 5)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.block(x, mask[:, None])
        return self.head(h.float() * 2 if h.dtype == torch.bfloat16 else h.float())


class Counted(Routed):
    def forward(self, h: Tensor, mask: Tensor) -> Any:  # and how many rows hold a huge value
        return super().forward(h, mask), int((h.abs().amax(1) > 100).sum())


class CountNet(MeanNet):
    def __init__(self, unit: nn.Module) -> None:
        super().__init__()
        self.clip = unit

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h, n = self.clip(self.stem(x), mask[:, None])
        return self.head(h) * (n + 1)  # the glue reads the count


class Moving(Routed):
    def forward(self, h: Tensor, mask: Tensor) -> Tensor:  # a huge value: another device
        out = super().forward(h, mask)
        return out.to("meta") if bool(h.abs().amax() > 100) else out


def test_an_opaque_units_dtype_device_and_non_tensor_outputs_are_checked_at_every_call() -> None:
    # the glue after an opaque unit was traced with the dtype, device and non-tensor values
    # its probes showed. On main, under autocast the dtype branch stayed fixed (silently
    # off by up to 0.66), the count stayed the traced constant 0 (silently off by 17), a
    # count that follows any values was fixed at conversion; another input dtype and
    # another device failed later in torch's own asserts, naming no unit
    x, mask = torch.randn(4, 5), torch.ones(4)
    model = DtypeNet()
    seq = to_sequential(model, (x, mask))
    assert [layer.opaque for layer in seq] == [False, True, False]
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            ValueError, match=r"output 0 of unit 'block' is dtype torch.bfloat16, but when "
                              r"converting to_sequential learned torch.float32 .*convert under "
                              r"the same autocast"):
        seq(x, mask)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the mend: convert under autocast
        seq = to_sequential(model, (x, mask))
        torch.testing.assert_close(seq(x, mask), model(x, mask), atol=0, rtol=0)
    seq = to_sequential(WideningNet(), (x, mask))  # its output dtype is its input's
    with pytest.raises(ValueError, match=r"output 0 of unit 'block' is dtype torch.bfloat16, "
                                         r"but when converting to_sequential learned "
                                         r"torch.float32"):
        seq(x.bfloat16(), mask)  # (main: export's own dtype assert failed, naming nothing)

    model = CountNet(Counted()).double()
    args, _, _ = example("routed")
    seq = to_sequential(model, args)  # no huge value on zeros or random values: count 0
    x, mask = torch.randn(3, 5, dtype=torch.double), torch.ones(3, dtype=torch.double)
    torch.testing.assert_close(seq(x, mask), model(x, mask), **TOL)
    x[1] = 1e4
    with pytest.raises(ValueError, match=r"output 1 of unit 'clip' is 1, but when converting "
                                         r"to_sequential learned 0 \(a constant of the traced "
                                         r"glue\) .*return it as a tensor"):
        seq(x, mask)
    counting = CountNet(Counted()).double()
    counting.clip.forward = lambda h, mask: (Routed.forward(counting.clip, h, mask),
                                             int((h > 0).sum()))  # follows any values
    with pytest.raises(ConversionError, match=r"output 1 of unit 'clip' \(an opaque call: its "
                                              r"outputs are learned by running it\) has a value "
                                              r"that depends on its input values \(0 on zeros, "
                                              r"\d+ on other values\); return it as a tensor"):
        to_sequential(counting, args)

    model = MeanNet().double()
    model.clip = Moving().double()
    seq = to_sequential(model, args)
    with pytest.raises(ValueError, match=r"output 0 of unit 'clip' is device meta, but when "
                                         r"converting to_sequential learned cpu \(the device "
                                         r"of its first tensor input\)"):
        seq(x, mask)


def test_units_named_in_opaque_run_opaque_and_train_as_the_traced_ones() -> None:
    # Llama's layers trace fine; opaque= makes them (by class) and the final norm (by name)
    # opaque calls instead, learned by running them: the plain call as the traced
    # conversion's and the plain model's, and three steps through Pipe exactly as the
    # plain model
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    model, plain = build("llama"), build("llama")
    args, kwargs, _ = example("llama")
    seq = to_sequential(model, args, kwargs, opaque=[LlamaDecoderLayer, "model.norm"])
    assert [(layer.unit, layer.opaque) for layer in seq] == [
        ("model.embed_tokens", False), ("model.rotary_emb", False), ("model.layers.0", True),
        ("model.layers.1", True), ("model.norm", True), ("lm_head", False)]
    traced = to_sequential(model, args, kwargs)
    assert not any(layer.opaque for layer in traced)
    x, kw, _ = example("llama", batch=5, step=3)
    got = seq(*x, **kw).logits
    torch.testing.assert_close(got, traced(*x, **kw).logits, **TOL)
    torch.testing.assert_close(got, plain(*x, **kw).logits, **TOL)
    pipe = Pipe(seq, chunks=2, balance=[3, 3], devices=["cpu", "cpu"])

    def step(batch: Any, target: Tensor) -> Tensor:
        return pipe.train_step(seq.origin.pipeline_input(*batch[0], **batch[1]), target,
                               loss_of("llama"), schedule="1f1b")

    train_both("llama", step, dict(model.named_parameters(remove_duplicate=False)), plain, 2,
               close(TOL))


def test_opaque_names_units_or_their_classes_and_anything_else_is_refused() -> None:
    args, _, _ = example("tables")
    model = build("tables")
    cases = [
        (["blocks.0.fc"], r"opaque= names 'blocks.0.fc', which is not a unit: it is inside "
                          r"unit 'blocks.0'; name that unit"),
        (["blocks"], r"opaque= names 'blocks', which is not a unit: the units are 'stem' "
                     r"\(Linear\), 'tables' \(Tables\), 'blocks.0' \(Keyed\), 'blocks.1' "
                     r"\(Keyed\), 'head' \(Linear\); opaque= names units"),
        ([nn.Conv2d], r"opaque= names class Conv2d, but no unit is one: the units are 'stem'"),
        ([3], r"opaque= entries are unit names \(like 'encoder.layers.0'\) or nn.Module "
              r"classes, got 3"),
        (["tables"], r"opaque= names \['tables'\], which the forward on the example does not "
                     r"call exactly once: such a unit is traced as glue"),
    ]
    for opaque, message in cases:
        with pytest.raises(ConversionError, match=message):
            to_sequential(model, args, opaque=opaque)
    with pytest.raises(TypeError, match=r"opaque= takes a list of unit names and module "
                                        r"classes, e.g. opaque=\['head'\], not a single one"):
        to_sequential(model, args, opaque="head")
    seq = to_sequential(model, args, opaque=[nn.Linear, "blocks.1"])  # a class, and a name
    assert [(layer.unit, layer.opaque) for layer in seq] == [
        ("stem", True), ("blocks.0", False), ("blocks.1", True), ("head", True)]
    torch.testing.assert_close(seq(*args), model(*args), **TOL)
