"""``seqpipe.to_sequential`` in one process: four free-form models (``graph_models``)
converted, trained in ``Pipe`` under two schedules against the plain model, their own
``state_dict`` and ``eval()`` intact; the errors that refuse what cannot be converted."""
from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from graph_check import close, train_both
from graph_models import build, example, loss_of
from torch import Tensor, nn
from torch.export import Dim
from torch.utils._pytree import tree_leaves

import seqpipe
from seqpipe import Pipe
from seqpipe.graph import ConversionError, default_units, to_sequential

TOL = dict(atol=1e-10, rtol=1e-8)
FLOAT_TOL = dict(atol=2e-5, rtol=1e-4)  # GPT-2 runs in float32


# units of the models whose forward branches on a config flag (graph_models.Flags)
# and of the one whose constant tables are read twice (traced into the glue: no unit)
FLAG_UNITS = {"flags": ["embed", "blocks.0", "blocks.1", "blocks.2", "norm", "head", "aux"],
              "flags-post": ["embed", "blocks.0", "blocks.1", "blocks.2", "head"],
              "tables": ["stem", "blocks.0", "blocks.1", "head"]}


@pytest.mark.parametrize("name", ["mlp", "unet", "resnet", "gpt2", "flags", "flags-post",
                                  "tables"])
def test_converted_model_trains_like_the_plain_one(name: str) -> None:
    model, plain = build(name), build(name)
    args, kwargs, _ = example(name)
    seq = seqpipe.to_sequential(model, args, kwargs)
    assert isinstance(seq, nn.Sequential) and len(seq) >= 4
    if name in FLAG_UNITS:  # the branches the flags choose, and only those, are traced
        assert [layer.unit for layer in seq] == FLAG_UNITS[name]
    # the layers hold the model's own parameter objects, under the model's own keys
    own = {id(p) for p in model.parameters()}
    assert {id(p) for p in seq.parameters()} == own
    assert {seq.origin.original_key(k) for k in seq.state_dict()} <= set(model.state_dict())
    expect = close(FLOAT_TOL if name == "gpt2" else TOL)
    for mode in ("eval", "train"):  # the plain call, in the model's own output structure
        getattr(model, mode)(), getattr(plain, mode)()
        got, want = seq(*args, **kwargs), plain(*args, **kwargs)
        assert type(got) is type(want)
        for a, b in zip(tree_leaves(got), tree_leaves(want)):
            expect(a, b, f"{name}: plain call in {mode} mode")
    n = len(seq)
    # BatchNorm statistics: recomputation would update them twice (seqpipe's own rule for
    # any model: see docs/pipe.md), so the ResNet runs without checkpointing
    checkpoint = "never" if name == "resnet" else "except_last"
    pipe = Pipe(seq, chunks=3, balance=[n // 2, n - n // 2], devices=["cpu", "cpu"],
                checkpoint=checkpoint)
    for schedule in ("1f1b", "zb_h1"):
        def step(batch: Any, target: Tensor, schedule: str = schedule) -> Tensor:
            return pipe.train_step(seq.origin.pipeline_input(*batch[0], **batch[1]), target,
                                   loss_of(name), schedule=schedule)
        train_both(name, step, dict(model.named_parameters(remove_duplicate=False)), plain,
                   3, expect)
    # Pipe.forward answers in the model's structure, in eval mode equal to the model's
    model.eval(), plain.eval()
    got = pipe(seq.origin.pipeline_input(*args, **kwargs))
    want = plain(*args, **kwargs)
    assert type(got) is type(want)
    for a, b in zip(tree_leaves(got), tree_leaves(want)):
        expect(a, b, f"{name}: Pipe.forward in eval mode")
    # the model's own state_dict round trip
    fresh = build(name)
    fresh.load_state_dict(model.state_dict())
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value, model.state_dict()[key], msg=key)


def test_default_units_descend_into_trunks() -> None:
    assert default_units(build("gpt2")) == [
        "transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0",
        "transformer.h.1", "transformer.ln_f", "lm_head"]
    assert default_units(build("resnet")) == [
        "conv1", "bn1", "relu", "layer1.0", "layer1.1", "layer2.0", "layer2.1", "fc"]


def test_values_that_jump_ahead_are_skips_straight_from_their_layer() -> None:
    seq = to_sequential(build("unet"), *example("unet")[:2])
    routes = {(i, name.split(">")[1]) for i, layer in enumerate(seq)
              for name in type(layer).stash_order}
    assert routes == {(0, "4"), (1, "3")}  # down1 -> up1, down2 -> up2


def test_glue_devices_follow_the_input_and_fixed_sizes_are_checked_first() -> None:
    seq = to_sequential(build("gpt2"), *example("gpt2")[:2])
    code = inspect.getsource(seq[0]._code)
    assert "device(type='cpu')" not in code and "device = getattr_1" in code
    ids = torch.randint(64, (4, 10))  # 12 tokens when traced
    with pytest.raises(ValueError, match=r"does not fit the traced model \(Guard failed: "
                                         r"input_ids.size\(\)\[1\] == 12\).*dynamic_shapes="):
        seq(ids, attention_mask=torch.ones_like(ids), use_cache=False)


def test_a_dimension_declared_dynamic_takes_other_sizes() -> None:
    model = build("gpt2").eval()
    both = {0: Dim.AUTO, 1: Dim.AUTO}  # batch and sequence length
    seq = to_sequential(model, *example("gpt2")[:2], dynamic_shapes={
        "input_ids": both, "attention_mask": both, "use_cache": None})
    for length in (9, 20):
        ids = torch.randint(64, (3, length))
        mask = torch.ones_like(ids)
        mask[0, :2] = 0
        torch.testing.assert_close(seq(ids, attention_mask=mask, use_cache=False).logits,
                                   model(ids, attention_mask=mask, use_cache=False).logits)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        if h.sum() > 0:  # data-dependent control flow in the glue
            h = -h
        return self.b(h)


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(self.a(x)))


class GlueBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(F.batch_norm(self.a(x), None, None, training=True))


class Counts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, h: Tensor) -> Tensor:
        self.calls += 1  # a table the forward writes: not a constant the glue may read
        return h


class Counted(Twice):
    def __init__(self) -> None:
        super().__init__()
        self.count = Counts()

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.count(self.a(self.count(x))))


class ToNumpy(Branchy):
    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        return self.b(h * len(h.detach().numpy()))  # leaves torch: no trace can follow


def test_errors_name_the_module_and_the_mend() -> None:
    x = torch.randn(3, 4)
    with pytest.raises(ConversionError, match=r"cannot trace the model's own forward at "
                                              r".*test_graph.py:\d+ \(if h.sum\(\) > 0:.*\): "
                                              r"data-dependent control flow.*Mend: code "
                                              r"outside every unit \(the glue\) is traced: "
                                              r"make the module that runs it a unit.*move it "
                                              r"into a submodule.*opaque call"):
        to_sequential(Branchy(), (x,))  # in a unit it converts: tests/test_graph_opaque.py
    with pytest.raises(ConversionError, match=r"cannot trace the model's own forward at "
                                              r".*test_graph.py:\d+ \(return self.b\(h \* "
                                              r"len\(h.detach\(\).numpy\(\)\)\).*an operation "
                                              r"that cannot be traced.*or write the "
                                              r"nn.Sequential by hand"):
        to_sequential(ToNumpy(), (x,))
    with pytest.raises(ConversionError, match=r"module 'count' writes 'count.calls' in the "
                                              r"traced glue.*make the module that writes it a "
                                              r"unit"):
        to_sequential(Counted(), (x,))
    with pytest.raises(ConversionError, match=r"unit 'a' \(Linear\) is called 2 times in one "
                                              r"forward.*units=\[\.\.\.\] naming the parent"):
        to_sequential(Twice(), (x,))
    with pytest.raises(ConversionError, match=r"the model's own forward calls "
                                              r"aten.batch_norm.default in the traced glue.*"
                                              r"make the module that calls it a unit"):
        to_sequential(GlueBatchNorm(), (x,))
    with pytest.raises(ConversionError, match=r"module 'a' \(Linear\) holds parameters, buffers "
                                              r"or train/eval behaviour but is not inside a "
                                              r"unit.*add it to units="):
        to_sequential(Twice(), (x,), units=["b"])  # 'a' would be traced into the glue
    with pytest.raises(ConversionError, match=r"units 'transformer' and 'transformer.h.0' "
                                              r"overlap"):
        to_sequential(build("gpt2"), *example("gpt2")[:2], units=["transformer", "transformer.h.0"])
    with pytest.raises(ConversionError, match=r"'h.0', which is not a submodule of "
                                              r"GPT2LMHeadModel; did you mean 'transformer.h.0'"):
        to_sequential(build("gpt2"), *example("gpt2")[:2], units=["h.0"])
    with pytest.raises(ConversionError, match=r"batch \(dim 0\) smaller than 2"):
        to_sequential(Twice(), (torch.randn(1, 4),))


def test_a_fixed_input_changed_is_refused() -> None:
    model = build("mlp")
    args, kwargs, _ = example("mlp")
    seq = to_sequential(model, args, kwargs)
    with pytest.raises(ValueError, match=r"traced as the constant 2.0 and is now 3.0"):
        seq(*args, **{**kwargs, "scale": 3.0})


class GlueDropout(nn.Module):
    """Dropout in the glue: functional (BART's encoder) and one module called twice (T5's
    stacks)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: Tensor) -> Tensor:
        h = F.dropout(self.drop(self.a(x)), 0.3, self.training)
        return self.b(self.drop(h))


def test_dropout_in_the_glue_follows_train_and_eval_mode() -> None:
    # converted in eval mode (as from_pretrained leaves a model), then trained: the glue's
    # dropout must be on, drawing as the model does; and off again in eval mode
    model, plain = GlueDropout().double(), GlueDropout().double()
    plain.load_state_dict(model.state_dict())
    x = torch.randn(6, 4, dtype=torch.double)
    seq = to_sequential(model.eval(), (x,))
    assert [layer.unit for layer in seq] == ["a", "b"]  # the twice-called dropout is glue
    for mode in ("train", "eval", "train"):
        getattr(model, mode)(), getattr(plain, mode)()
        torch.manual_seed(3)
        got = seq(x)
        torch.manual_seed(3)
        torch.testing.assert_close(got, plain(x), **TOL, msg=mode)
    dropped = seq(x)  # the model is in train mode: the glue drops
    model.eval()
    assert not torch.equal(dropped, seq(x))
    seq.train()  # the converted model's own train()/eval() reaches the glue too
    torch.manual_seed(3)
    got = seq(x)
    torch.manual_seed(3)
    torch.testing.assert_close(got, plain.train()(x), **TOL)


class LastNorm(nn.Module):
    """Blocks whose output is their last submodule's (a LayerNorm, as in BART's and BERT's
    layers); a unit that reads only the shape of its input (BART's positions)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.pos = Positions()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        h = h + self.pos(h[:, :, -1])  # only the shape of h[:, :, -1] is read
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Positions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(16, 8))

    def forward(self, like: Tensor) -> Tensor:
        return self.table[: like.shape[1]]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, h: Tensor) -> Tensor:
        return self.norm(h + torch.relu(self.lin(h)))


def test_units_ending_in_a_submodule_and_units_reading_only_a_shape() -> None:
    torch.manual_seed(0)
    model = LastNorm().double()
    x = torch.randn(6, 5, 4, dtype=torch.double)
    seq = to_sequential(model, (x,))
    assert [layer.unit for layer in seq] == ["embed", "pos", "blocks.0", "blocks.1", "head"]
    torch.testing.assert_close(seq(x), model(x), **TOL)
    pipe = Pipe(seq, chunks=3, balance=[2, 3], devices=["cpu", "cpu"])
    torch.testing.assert_close(pipe(seq.origin.pipeline_input(x)), model(x), **TOL)


class Spread(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, h: Tensor) -> Tensor:
        slots = torch.arange(h.shape[0] * 4, device=h.device) % 4  # a size from the batch
        return self.lin(h) + slots.view(-1, 4).to(h.dtype)


class Spreads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Spread() for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_size_the_trace_shares_between_units() -> None:
    # export computes 4 * batch once, in blocks.0, and hands it to blocks.1 and blocks.2
    # (as Mixtral's experts do): each unit computes its own
    torch.manual_seed(0)
    model = Spreads().double()
    x = torch.randn(6, 4, dtype=torch.double)
    seq = to_sequential(model, (x,))
    pipe = Pipe(seq, chunks=3, balance=[1, 2], devices=["cpu", "cpu"])
    for batch in (x, x[:5]):  # micro-batches of 2 and of 2, 2, 1
        torch.testing.assert_close(pipe(seq.origin.pipeline_input(batch)), model(batch), **TOL)


class EndBias(nn.Module):
    """A buffer the glue reads at the very end, moved to the output's device (BART's
    ``final_logits_bias``): export checks its dtype and device first."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("bias", torch.arange(4.0))

    def forward(self, x: Tensor) -> Tensor:
        h = self.c(self.b(self.a(x)))
        return h + self.bias.to(h.device)


def test_a_buffer_read_at_the_end_sits_in_the_last_layer_alone() -> None:
    # not also in the first (a buffer shared across stages is refused by DistributedPipe,
    # and sits on two devices in Pipe)
    model = EndBias().double()
    x = torch.randn(6, 4, dtype=torch.double)
    seq = to_sequential(model, (x,))
    assert [[name for name, _ in layer.named_buffers()] for layer in seq] == [[], [], ["bias"]]
    pipe = Pipe(seq, chunks=2, balance=[1, 2], devices=["cpu", "cpu"])
    torch.testing.assert_close(pipe(seq.origin.pipeline_input(x)), model(x), **TOL)
