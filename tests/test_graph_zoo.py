"""``seqpipe.to_sequential`` on the models people hold: Hugging Face architectures from
tiny configs (``graph_models.ZOO``: Llama, Mistral, Qwen2, BERT, GPT-NeoX, OPT, T5, BART,
ViT, Gemma, Gemma 3, Phi-3, GPT-J, RoBERTa, DistilBERT and ModernBERT
classifiers, Whisper, ConvNeXt, Swin, DeiT, Mamba, RWKV; Mixtral in bfloat16, and in
float32 through opaque units; Mamba-2 by hand, ``SEQPIPE_BY_HAND=1``), each with its
documented call, trained through ``Pipe`` against the plain model (loss, every gradient
and weight), T5 also from ``labels=`` alone; their default units; a model that computes
its own loss from ``labels=``; torchvision's ResNet as written. docs/models.md, "Models
tested", lists them."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from graph_check import close, train_both
from graph_models import BY_HAND, ZOO, build, example, loss_of
from torch import Tensor
from torch.export import Dim
from torch.utils._pytree import tree_leaves

from seqpipe import Pipe
from seqpipe.graph import default_units, to_sequential

TOL = dict(atol=1e-10, rtol=1e-8)


# units of each ZOO model by default (docs/models.md, "Models tested")
ZOO_UNITS = {"llama": 6, "mistral": 6, "qwen2": 6, "bert": 6, "neox": 7, "opt": 6, "t5": 15,
             "bart": 11, "vit": 5, "gemma": 6, "phi3": 6, "gptj": 7, "roberta": 4,
             "distilbert": 6, "whisper": 12, "convnext": 7, "swin": 7, "gemma3": 5,
             "modernbert": 7, "deit": 5, "mamba": 5, "mamba2": 5, "rwkv": 5, "t5-labels": 15}


HAND = pytest.mark.skipif(not os.environ.get("SEQPIPE_BY_HAND"), reason="checked by hand "
                          "(SEQPIPE_BY_HAND=1), kept out of CI for its time: kin of a ZOO model")


@pytest.mark.parametrize("name", [*ZOO, "t5-labels",
                                  *(pytest.param(n, marks=HAND) for n in BY_HAND)])
def test_the_models_people_hold_train_like_the_plain_ones(name: str) -> None:
    # Hugging Face architectures from tiny configs, with their documented call: two
    # partitions, 1F1B, three SGD steps; loss, every gradient and weight as the plain model
    model, plain = build(name), build(name)
    args, kwargs, _ = example(name)
    seq = to_sequential(model, args, kwargs)
    assert len(seq) == ZOO_UNITS[name], [layer.unit for layer in seq]
    assert {id(p) for p in seq.parameters()} == {id(p) for p in model.parameters()}
    if name == "llama":  # tie_word_embeddings: one Parameter in the first and last layer
        tied = model.get_input_embeddings().weight
        assert tied is model.lm_head.weight
        assert any(p is tied for p in seq[0].parameters())
        assert any(p is tied for p in seq[-1].parameters())
    model.eval(), plain.eval()
    got, want = seq(*args, **kwargs), plain(*args, **kwargs)
    assert type(got) is type(want)
    for a, b in zip(tree_leaves(got), tree_leaves(want)):
        torch.testing.assert_close(a, b, **TOL, msg=f"{name}: plain call")
    model.train(), plain.train()
    n = len(seq)
    pipe = Pipe(seq, chunks=2, balance=[n // 2, n - n // 2], devices=["cpu", "cpu"])

    def step(batch: Any, target: Tensor) -> Tensor:
        return pipe.train_step(seq.origin.pipeline_input(*batch[0], **batch[1]), target,
                               loss_of(name), schedule="1f1b")

    train_both(name, step, dict(model.named_parameters(remove_duplicate=False)), plain, 2,
               close(TOL))


def test_default_units_descend_through_wrappers() -> None:
    # BERT: bert > encoder > layer (the trunk two wrappers down); OPT: its forward calls
    # model.decoder directly, never model, which was the one default unit above it
    assert default_units(build("bert")) == [
        "bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1", "bert.pooler",
        "dropout", "classifier"]
    assert default_units(build("opt")) == [
        "model.decoder.embed_tokens", "model.decoder.embed_positions",
        "model.decoder.final_layer_norm", "model.decoder.layers.0", "model.decoder.layers.1",
        "lm_head"]


def test_a_model_that_computes_its_own_loss_from_labels() -> None:
    # labels= is an input like any other; the model's loss (a scalar, first in the flat
    # output) is computed in the last layer's glue, and loss_fn just takes it (T5 from
    # labels alone, three steps: "t5-labels" above)
    model, plain = build("llama"), build("llama")
    args, kwargs, labels = example("llama")
    kwargs = {**kwargs, "labels": labels}
    seq = to_sequential(model, args, kwargs)
    pipe = Pipe(seq, chunks=2, balance=[3, 3], devices=["cpu", "cpu"])
    loss = pipe.train_step(seq.origin.pipeline_input(*args, **kwargs), labels,
                           lambda out, _: out[0])
    want = sum(plain(ids, **{**kwargs, "attention_mask": mask, "labels": y}).loss * len(y) / 6
               for ids, mask, y in zip(args[0].chunk(2), kwargs["attention_mask"].chunk(2),
                                       labels.chunk(2)))
    want.backward()
    torch.testing.assert_close(loss, want.detach(), **TOL)
    theirs = dict(plain.named_parameters())
    for key, param in model.named_parameters():
        torch.testing.assert_close(param.grad, theirs[key].grad, **TOL, msg=key)


def test_a_mixture_of_experts_in_bfloat16() -> None:
    # Mixtral: routing by top-k, grouped matmuls over the experts, and a size export shares
    # between the layers; in bfloat16 (torch's grouped_mm traces only that), one step,
    # within bfloat16's rounding
    model, plain = build("mixtral"), build("mixtral")
    seq = to_sequential(model, *example("mixtral")[:2])
    assert [layer.unit for layer in seq][2:4] == ["model.layers.0", "model.layers.1"]
    pipe = Pipe(seq, chunks=2, balance=[3, 3], devices=["cpu", "cpu"])

    def step(batch: Any, target: Tensor) -> Tensor:
        return pipe.train_step(seq.origin.pipeline_input(*batch[0], **batch[1]), target,
                               loss_of("mixtral"), schedule="1f1b")

    bf16 = dict(atol=2e-3, rtol=1.6e-2)
    train_both("mixtral", step, dict(model.named_parameters()), plain, 2, close(bf16),
               batches=(6,))


def test_a_mixture_of_experts_in_float32_through_opaque_layers() -> None:
    # in float32 torch cannot trace grouped_mm (its fake kernel takes bfloat16 only): the
    # decoder layers become opaque units, called as Mixtral's own layers and traced as one
    # call each, the batch and (declared dynamic) the length following their inputs'; two
    # steps, loss and every gradient and weight as the plain model's
    model, plain = build("mixtral-fp32"), build("mixtral-fp32")
    both = {0: Dim.AUTO, 1: Dim.AUTO}
    seq = to_sequential(model, *example("mixtral-fp32")[:2], dynamic_shapes={
        "input_ids": both, "attention_mask": both, "use_cache": None})
    ids = torch.randint(2, 64, (3, 5))  # another batch and length
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    torch.testing.assert_close(seq(ids, attention_mask=mask, use_cache=False).logits,
                               plain(ids, attention_mask=mask, use_cache=False).logits)
    assert [(layer.unit, layer.opaque) for layer in seq] == [
        ("model.embed_tokens", False), ("model.rotary_emb", False), ("model.layers.0", True),
        ("model.layers.1", True), ("model.norm", False), ("lm_head", False)]
    pipe = Pipe(seq, chunks=2, balance=[3, 3], devices=["cpu", "cpu"])

    def step(batch: Any, target: Tensor) -> Tensor:
        return pipe.train_step(seq.origin.pipeline_input(*batch[0], **batch[1]), target,
                               loss_of("mixtral-fp32"), schedule="1f1b")

    train_both("mixtral-fp32", step, dict(model.named_parameters()), plain, 2,
               close(dict(atol=2e-5, rtol=1e-4)), batches=(6, 5))


def test_a_torchvision_resnet_as_written_trains_like_the_plain_one() -> None:
    # torchvision's ResNet code (Bottleneck blocks, an in-place ReLU reused in each block,
    # max and adaptive average pooling, torch.flatten in the glue), BatchNorm in train mode:
    # its default units, and three steps through Pipe, the in-place ReLU the first layer of
    # the second stage (it writes the tensor the stage receives)
    model, plain = build("tvresnet"), build("tvresnet")
    args, kwargs, _ = example("tvresnet")
    seq = to_sequential(model, args, kwargs)
    assert [layer.unit for layer in seq] == [
        "conv1", "bn1", "relu", "maxpool", "layer1.0", "layer1.1", "layer2.0", "layer3.0",
        "layer4.0", "avgpool", "fc"]
    pipe = Pipe(seq, chunks=2, balance=[2, 9], devices=["cpu", "cpu"], checkpoint="never")

    def step(batch: Any, target: Tensor) -> Tensor:
        return pipe.train_step(seq.origin.pipeline_input(*batch[0], **batch[1]), target,
                               loss_of("tvresnet"), schedule="1f1b")

    train_both("tvresnet", step, dict(model.named_parameters()), plain, 2, close(TOL))
