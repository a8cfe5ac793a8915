"""A call whose partitions cannot draw random numbers runs without private random streams
(``seqpipe.core.random_free``); anything that might draw keeps them."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from seqpipe import Pipe
from seqpipe.core.batchnorm import convert_deferred_batch_norm
from seqpipe.core.random_free import draws_no_random
from seqpipe.demo import build_model


class Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class MyReLU(nn.ReLU):
    """A subclass: its forward could be anything."""


def test_the_demo_cnn_with_deferred_batchnorm_draws_nothing():
    model = convert_deferred_batch_norm(build_model())
    assert draws_no_random([model[:7], model[7:]])
    with torch.device("cpu"):  # torch.device's function mode turns no op into a random one
        assert draws_no_random([model])


@pytest.mark.parametrize("layer", [nn.Dropout(0.1), nn.RReLU(), MyReLU(),
                                   nn.TransformerEncoderLayer(4, 2, 8)])
def test_a_layer_that_might_draw_keeps_the_private_streams(layer):
    assert not draws_no_random([nn.Sequential(nn.Linear(4, 4), nn.Sequential(layer))])


def test_hooks_and_modes_keep_the_private_streams():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    handle = model[1].register_forward_pre_hook(lambda module, args: None)
    assert not draws_no_random([model])
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda m, args, out: None)
    try:
        assert not draws_no_random([model])
    finally:
        handle.remove()
    with Passthrough():
        assert not draws_no_random([model])
    assert draws_no_random([model])


@pytest.mark.parametrize("chunks", [1, 4])
def test_a_random_free_pipe_leaves_the_global_generator_alone_and_matches_plain(chunks):
    """Before, every call of a multi-stage ``Pipe`` drew its tasks' seeds from the global
    generator and ran each forward under the private-stream dispatch mode; a model that
    draws nothing now does neither (the generator's state shows it), and computes what the
    plain model computes, recomputation included (BatchNorm normalises per micro-batch, so
    the plain model runs the same micro-batches)."""
    torch.manual_seed(0)
    model = build_model()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=chunks, checkpoint="always", balance=[7, 13],
                devices=["cpu"] * 2)
    x = torch.randn(8, 3, 8, 8)
    state = torch.get_rng_state()
    out = pipe(x)
    out.square().sum().backward()
    assert torch.equal(torch.get_rng_state(), state)
    expected = torch.cat([ref(part) for part in x.chunk(chunks)])
    expected.square().sum().backward()
    assert_close(out, expected)
    for p, q in zip(pipe.parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


def test_dropout_in_a_pipe_still_draws_its_seeds():
    torch.manual_seed(0)
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)), chunks=2, balance=[1, 1],
                devices=["cpu"] * 2)
    state = torch.get_rng_state()
    pipe(torch.randn(4, 4))
    assert not torch.equal(torch.get_rng_state(), state)
