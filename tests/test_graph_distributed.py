"""``seqpipe.to_sequential`` models in ``DistributedPipe``: on 2 ranks the four models of
``graph_models`` under 1f1b, zb_h1 and interleaved_1f1b, and the MLP under ``"auto"``
(three SGD steps, batch size changing, loss, every gradient and weight against the plain
model; the ResNet with deferred BatchNorm under recomputation), a meta-built ResNet
materialised from per-layer seeds, Hugging Face Llama (its head tied to the embedding
across the ranks), a model with opaque units and one whose glue reads constant tables
on both ranks under 1f1b, then a DCP checkpoint of the converted GPT-2 saved under one
balance, loaded under another and into the plain model by its own keys; on 3 ranks the
U-Net under zb_h1 (a skip over the middle stage), the MLP under interleaved_1f1b, the
ResNet, BART (the encoder's output skips to the decoder layers on two ranks) and GPT-2
(its tie spans the first and last stage) under 1f1b."""
from __future__ import annotations

import copy
import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
from graph_check import train_both
from graph_models import ResNet, build, example, loss_of
from torch import Tensor, nn

from distributed_harness import Failures, run_workers
from seqpipe.distributed import DistributedPipe
from seqpipe.distributed.checkpoint import gather_full_state_dict, load, load_into_plain, save
from seqpipe.graph import to_sequential
from seqpipe.seeding import seed_layers

TOL = {"gpt2": dict(atol=2e-5, rtol=1e-4)}
DOUBLE = dict(atol=1e-10, rtol=1e-8)


def _train(world: int, name: str, converted: nn.Sequential, schedule: str,
           failures: Failures) -> DistributedPipe:
    seq = copy.deepcopy(converted)  # a DistributedPipe frees the layers other ranks hold
    n = len(seq)
    stages = world * (2 if schedule.startswith("interleaved") else 1)
    balance = [n // stages + (i < n % stages) for i in range(stages)]
    # the ResNet's BatchNorms count each micro-batch once, recomputed or not
    pipe = DistributedPipe(seq, chunks=world * 2, balance=balance, schedule=schedule,
                           deferred_batch_norm=name == "resnet")
    params = {seq.origin.original_key(k): p
              for k, p in pipe.named_parameters(remove_duplicate=False)}

    def step(batch: Any, target: Tensor) -> Tensor:
        given = seq.origin.pipeline_input(*batch[0], **batch[1])
        return pipe.train_step(given if pipe.is_first else None,
                               target if pipe.is_last else None, loss_of(name))

    train_both(name, step, params, build(name), world * 2,
               lambda a, b, what: failures.close(a, b, f"{schedule}: {what}"))
    return pipe


def _checkpoint(rank: int, converted: nn.Sequential, folder: str, failures: Failures) -> None:
    pipe = DistributedPipe(copy.deepcopy(converted), chunks=2, balance=[2, 5])
    save(pipe, None, folder)
    seq2 = copy.deepcopy(converted)
    with torch.no_grad():
        for p in seq2.parameters():
            p.zero_()
    pipe2 = DistributedPipe(seq2, chunks=2, balance=[5, 2])
    load(pipe2, None, folder)
    full = gather_full_state_dict(pipe2)
    if rank == 0:
        assert full is not None
        mine = build("gpt2").state_dict()
        failures.expect(set(full) == set(mine), f"gathered keys {sorted(set(full) ^ set(mine))}")
        for key, value in full.items():
            failures.close(value, mine[key], f"loaded into another balance: {key}")
        plain = build("gpt2")
        with torch.no_grad():
            for p in plain.parameters():
                p.zero_()
        load_into_plain(plain, None, folder)
        for key, value in plain.state_dict().items():
            failures.close(value, mine[key], f"loaded into the plain model: {key}")


def _seeded(converted: nn.Sequential, failures: Failures) -> None:
    """A ResNet built on meta, converted, each rank materialising its own layers from
    per-layer seeds: the values ``seed_layers`` gives the converted whole model."""
    want = seed_layers(copy.deepcopy(converted), 7).state_dict()
    with torch.device("meta"):
        model = ResNet().double()
    pipe = DistributedPipe(to_sequential(model, *example("resnet")[:2]), chunks=2,
                           balance=[4, 4], base_seed=7)
    for key, value in pipe.state_dict().items():
        failures.close(value, want[key], f"meta-built, seeded: {key}")


def _two(rank: int, world: int, folder: str) -> None:
    for name in ("mlp", "unet", "resnet", "gpt2"):
        failures = Failures(rank, TOL.get(name, DOUBLE))
        seq = to_sequential(build(name), *example(name)[:2])
        extra = ("auto",) if name == "mlp" else ()  # measures step 1, switches from step 2
        for schedule in ("1f1b", "zb_h1", "interleaved_1f1b", *extra):
            pipe = _train(world, name, seq, schedule, failures)
        if name == "mlp":
            failures.expect(pipe.auto_choice is not None, "schedule='auto' picked nothing")
        if name == "resnet":
            _seeded(seq, failures)
        failures.finish()
    # Llama: rotary embeddings, GQA, RMSNorm, the head tied to the embedding across ranks
    failures = Failures(rank, DOUBLE)
    _train(world, "llama", to_sequential(build("llama"), *example("llama")[:2]), "1f1b",
           failures)
    # opaque units (a branch on tensor values) on both ranks; constant tables the glue of
    # both ranks reads, looked up by a string
    for name in ("routed", "tables"):
        _train(world, name, to_sequential(build(name), *example(name)[:2]), "1f1b", failures)
    failures.finish()
    failures = Failures(rank, DOUBLE)
    _checkpoint(rank, seq, folder, failures)
    dist.barrier()
    failures.finish()


def _three(rank: int, world: int) -> None:
    # the U-Net's encoder features skip from stage 0 over stage 1 to stage 2, and back
    failures = Failures(rank, DOUBLE)
    _train(world, "unet", to_sequential(build("unet"), *example("unet")[:2]), "zb_h1",
           failures)
    # six stages over three ranks (two each), and BatchNorm with deferred statistics
    _train(world, "mlp", to_sequential(build("mlp"), *example("mlp")[:2]),
           "interleaved_1f1b", failures)
    _train(world, "resnet", to_sequential(build("resnet"), *example("resnet")[:2]), "1f1b",
           failures)
    # BART: the encoder's output and the masks skip to every decoder layer, across ranks
    _train(world, "bart", to_sequential(build("bart"), *example("bart")[:2]), "1f1b",
           failures)
    failures.finish()
    failures = Failures(rank, TOL["gpt2"])
    seq = to_sequential(build("gpt2"), *example("gpt2")[:2])
    pipe = _train(world, "gpt2", seq, "1f1b", failures)
    args, kwargs, _ = example("gpt2")
    out = pipe.eval()(seq.origin.pipeline_input(*args, **kwargs) if pipe.is_first else None)
    if pipe.is_last:  # DistributedPipe.forward answers in the model's own structure
        failures.expect(type(out).__name__ == "CausalLMOutputWithCrossAttentions"
                        and out.logits.shape == (6, 12, 64), f"forward gave {type(out)}")
    else:
        failures.expect(out is None, f"forward on stage {rank} gave {type(out)}")
    failures.finish()


@pytest.mark.parametrize("world", [2, 3])
def test_converted_models_train_like_the_plain_ones_on_several_ranks(world: int) -> None:
    if world == 2:
        with tempfile.TemporaryDirectory() as folder:
            run_workers(_two, 2, os.path.join(folder, "ckpt"), timeout=300)
    else:
        run_workers(_three, 3, timeout=200)
