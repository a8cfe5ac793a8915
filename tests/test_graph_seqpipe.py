"""Converted models (``seqpipe.to_sequential``) with the rest of seqpipe, in one process:
deferred BatchNorm under recomputation, ``checkpoint_every``, the balance helpers choosing
boundaries over units, and a model built on ``meta`` (GPT-2; Llama, whose rotary buffers no
checkpoint holds). (``schedule="auto"`` and per-layer seeds of a meta-built model run on 2
ranks: ``test_graph_distributed.py``.)"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List

import pytest
import torch
import torch.nn.functional as F
from graph_check import train_both
from graph_models import build, example, gpt2, loss_of, zoo_model
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from seqpipe import Pipe
from seqpipe.balance import balance_by_size, balance_by_time
from seqpipe.graph import to_sequential

TOL = dict(atol=1e-10, rtol=1e-8)


def expect(actual: Tensor, wanted: Tensor, what: str) -> None:
    torch.testing.assert_close(actual, wanted, **TOL, msg=what)


class WholeBatchStats:
    """The running statistics a plain BatchNorm reaches when it sees the whole mini-batch
    of its inputs at once: ``model``'s BatchNorms' inputs, per micro-batch, are collected
    and folded in by ``F.batch_norm`` on their concatenation (not by seqpipe's code)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.inputs: Dict[str, List[Tensor]] = {}
        for name, module in model.named_modules():
            if isinstance(module, _BatchNorm):
                module.register_forward_pre_hook(self._keep(name))

    def _keep(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self.inputs.setdefault(name, []).append(args[0].detach())
        return hook

    def fold(self, running: Dict[str, Tensor]) -> None:
        """Update ``running`` (``{"bn.running_mean": ...}``) with the collected inputs."""
        for name, inputs in self.inputs.items():
            bn = self.model.get_submodule(name)
            F.batch_norm(torch.cat(inputs), running[f"{name}.running_mean"],
                         running[f"{name}.running_var"], training=True, momentum=bn.momentum)
            running[f"{name}.num_batches_tracked"] += 1
        self.inputs.clear()


def test_converted_resnet_with_deferred_batch_norm_under_recomputation() -> None:
    # every micro-batch recomputed in backward: BatchNorm must count each once
    model, plain = build("resnet"), build("resnet")
    seq = to_sequential(model, *example("resnet")[:2])
    pipe = Pipe(seq, chunks=3, balance=[4, 4], devices=["cpu", "cpu"], checkpoint="always",
                deferred_batch_norm=True)
    whole = WholeBatchStats(plain)  # plain sees the micro-batches one by one: collect them
    running = {k: v.clone() for k, v in plain.state_dict().items() if "running" in k or
               "num_batches" in k}

    def step(batch: Any, target: Tensor) -> Tensor:
        loss = pipe.train_step(seq.origin.pipeline_input(*batch[0], **batch[1]), target,
                               loss_of("resnet"), schedule="1f1b")
        return loss

    def compare(actual: Tensor, wanted: Tensor, what: str) -> None:
        expect(actual, wanted, what)
        if what.startswith("resnet: loss"):  # the reference ran this step: fold its inputs
            whole.fold(running)

    train_both("resnet", step, dict(model.named_parameters()), plain, 3, compare)
    mine = model.state_dict()
    assert int(mine["bn1.num_batches_tracked"]) == 3  # once per mini-batch, recomputed or not
    for key, value in running.items():
        expect(mine[key], value, f"{key} after 3 steps")


@pytest.mark.parametrize("name", ["mlp", "unet"])
def test_checkpoint_every_on_a_converted_model(name: str) -> None:
    # runs of 2 layers recomputed one at a time, skips stashed and popped inside them
    model, plain = build(name), build(name)
    seq = to_sequential(model, *example(name)[:2])
    n = len(seq)
    pipe = Pipe(seq, chunks=3, balance=[n // 2, n - n // 2], devices=["cpu", "cpu"],
                checkpoint="always", checkpoint_every=2)

    def step(batch: Any, target: Tensor) -> Tensor:
        return pipe.train_step(seq.origin.pipeline_input(*batch[0], **batch[1]), target,
                               loss_of(name), schedule="1f1b")

    train_both(name, step, dict(model.named_parameters(remove_duplicate=False)), plain, 3,
               expect)


class Uneven(nn.Module):
    """A wide first unit, three narrow ones, a long skip from the first to the last."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(8, 512)
        self.narrow = nn.Linear(512, 8)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = self.wide(x)
        y = self.b(self.a(self.narrow(h)))
        return y + h[:, :8]


def test_balance_helpers_choose_boundaries_over_units() -> None:
    torch.manual_seed(0)
    model = Uneven()
    x = torch.randn(6, 8)
    seq = to_sequential(model, (x,))
    assert [layer.unit for layer in seq] == ["wide", "narrow", "a", "b"]
    # the wide unit alone outweighs the three others together: it is a stage of its own
    assert balance_by_size(2, seq, seq.origin.pipeline_input(x)) == [1, 3]
    balance = balance_by_time(2, seq, seq.origin.pipeline_input(x), timeout=0.05)
    assert sum(balance) == 4 and len(balance) == 2 and min(balance) >= 1
    pipe = Pipe(seq, chunks=2, balance=balance, devices=["cpu", "cpu"])
    torch.testing.assert_close(pipe(seq.origin.pipeline_input(x)), model(x))


def test_a_model_built_on_meta_converts_and_loads_a_checkpoint() -> None:
    # its glue reads tensor values when not tracing (Hugging Face's mask shortcut), which
    # an eager dry run on meta could not do; and the example may be a real tensor
    real = gpt2()
    with torch.device("meta"):
        model = gpt2()
    args, kwargs, _ = example("gpt2")
    seq = to_sequential(model, args, kwargs)
    assert all(p.is_meta for p in seq.parameters())
    seq.to_empty(device="cpu")
    model.load_state_dict(real.state_dict())
    model.eval(), real.eval()
    torch.testing.assert_close(seq(*args, **kwargs).logits, real(*args, **kwargs).logits)


def test_a_meta_built_model_whose_buffers_no_checkpoint_holds() -> None:
    # Llama's rotary inv_freq is computed in __init__ and kept out of state_dict(): built on
    # meta, no checkpoint restores it (the model would compute garbage): named, with the
    # mend, which converts and then loads exactly
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    real = build("llama")
    with torch.device("meta"):
        model = zoo_model("llama").double()
    args, kwargs, _ = example("llama")
    with pytest.warns(UserWarning, match=r"non-persistent buffers \['model.rotary_emb.inv_freq'"
                                         r", 'model.rotary_emb.original_inv_freq'\].*Build the "
                                         r"modules that own them \(model.rotary_emb\) on a real "
                                         r"device before converting"):
        to_sequential(model, args, kwargs)
    model.model.rotary_emb = LlamaRotaryEmbedding(model.config)  # the mend: real, on the CPU
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*non-persistent buffers")
        seq = to_sequential(model, args, kwargs)
    for layer in seq:  # each stage materialises what is on meta, and moves the rest
        if any(t.is_meta for t in (*layer.parameters(), *layer.buffers())):
            layer.to_empty(device="cpu")
    model.load_state_dict(real.state_dict())
    model.eval(), real.eval()
    torch.testing.assert_close(seq(*args, **kwargs).logits, real(*args, **kwargs).logits,
                               **TOL)
