"""Private random streams: every recomputation replays its forward's draws, on every stage.

Stages run side by side in threads; a shared generator (the global CPU one, or one GPU's)
would be advanced by one stage between another's forward and its recomputation, so the
recomputation would draw another dropout mask. Each (stage, micro-batch) draws from its own
generators instead. A probe layer records what it drew in the checkpointed forward and in
the recomputation, keyed by its input (identical in both), and the two must agree.
"""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import pytest
import torch
from torch import Tensor, nn

from seqpipe import Pipe, is_checkpointing, is_recomputing
from seqpipe.core.rng import isolated_rng, needs_private_rng

Key = Tuple[float, ...]


class Probe(nn.Module):
    """Applies ``draw`` to its input and records the result per micro-batch and pass."""

    def __init__(self, draw: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.draw = draw
        self.forward_draws: Dict[Key, Tensor] = {}
        self.recomputed_draws: Dict[Key, Tensor] = {}

    def forward(self, x: Tensor) -> Tensor:
        out = self.draw(x)
        key = tuple(x.detach().flatten()[:6].tolist())
        if is_checkpointing():
            self.forward_draws[key] = out.detach().clone()
        elif is_recomputing():
            self.recomputed_draws[key] = out.detach().clone()
        return out


def dropout(x: Tensor) -> Tensor:
    return nn.functional.dropout(x, 0.5, training=True)


def native_dropout(x: Tensor) -> Tensor:
    """The fused dropout accelerators take (no generator argument), called directly."""
    return torch.ops.aten.native_dropout(x, 0.5, True)[0]


def noise(x: Tensor) -> Tensor:
    """``randn``/``rand_like`` overloads without a generator argument."""
    return x + torch.randn(x.shape) + torch.rand_like(x)


def probed_model(stages: int, draw: Callable[[Tensor], Tensor]) -> nn.Sequential:
    layers = []
    for _ in range(stages):
        # The Linear after each probe saves the probe's output for backward, so the
        # recomputation must run through the probe.
        layers += [nn.Linear(16, 16), Probe(draw), nn.Linear(16, 16)]
    return nn.Sequential(*layers)


@pytest.mark.parametrize("draw", [dropout, native_dropout, noise])
@pytest.mark.parametrize("stages", [2, 3])
def test_every_recomputation_replays_its_forward(stages, draw):
    chunks = 4
    model = probed_model(stages, draw)
    pipe = Pipe(model, chunks=chunks, checkpoint="always", balance=[3] * stages,
                devices=["cpu"] * stages)
    for _ in range(3):
        pipe(torch.randn(4 * chunks, 16)).sum().backward()
    probes = [m for m in model if isinstance(m, Probe)]
    for probe in probes:
        assert len(probe.forward_draws) == 3 * chunks
        assert probe.recomputed_draws.keys() == probe.forward_draws.keys()
        mismatched = [k for k, v in probe.forward_draws.items()
                      if not torch.equal(probe.recomputed_draws[k], v)]
        assert not mismatched, f"{len(mismatched)} recomputations drew other values"
    if draw is not noise:  # private streams, not one stream repeated: masks all differ
        masks = [d != 0 for p in probes for d in p.forward_draws.values()]
        assert len({tuple(m.flatten().tolist()) for m in masks}) == len(masks)


def test_fixed_global_seed_fixes_every_draw():
    def run(seed: int) -> Tensor:
        torch.manual_seed(0)
        pipe = Pipe(probed_model(2, noise), chunks=4, checkpoint="except_last",
                    balance=[3, 3], devices=["cpu", "cpu"])
        torch.manual_seed(seed)
        return pipe(torch.ones(8, 16))

    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))


def test_a_single_partition_draws_what_the_unwrapped_model_draws():
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 16))

    x = torch.randn(8, 16)
    plain, pipe = build(), Pipe(build(), chunks=1, balance=[3], devices=["cpu"])
    torch.manual_seed(5)
    expected = plain(x)
    torch.manual_seed(5)
    assert torch.equal(pipe(x), expected)


def test_native_dropout_keeps_its_contract():
    x = torch.randn(64, 32, requires_grad=True)
    with isolated_rng(3):
        out, mask = torch.ops.aten.native_dropout(x, 0.25, True)
    assert mask.dtype == torch.bool and 0.6 < mask.float().mean() < 0.9
    torch.testing.assert_close(out, x * mask / 0.75)
    out.sum().backward()
    torch.testing.assert_close(x.grad, mask / 0.75)
    with isolated_rng(3):
        again = torch.ops.aten.native_dropout(x, 0.25, True)[1]
    assert torch.equal(again, mask)


def test_a_given_generator_is_respected():
    with isolated_rng(3):
        a = torch.randn(5, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, torch.randn(5, generator=torch.Generator().manual_seed(7)))


def test_a_positional_generator_argument_is_filled_in_place():
    """``poisson`` takes its generator positionally (most random ops take it by keyword);
    the omitted and the explicit ``None`` forms both get the private one."""
    rates = torch.full((256,), 4.0)
    with isolated_rng(3):
        omitted = torch.ops.aten.poisson(rates)
    with isolated_rng(3):
        explicit = torch.ops.aten.poisson(rates, None)
    assert torch.equal(omitted, explicit)
    assert torch.equal(omitted, torch.poisson(rates, torch.Generator().manual_seed(3)))


@pytest.mark.parametrize("devices, private", [
    (["cpu"], False),
    (["cuda:0"], False),
    (["cpu", "cpu"], True),
    (["cuda:0", "cuda:0"], True),   # two stages on one device: the case
    (["cuda:0", "cuda:1"], True),   # checkpoint would still fork the shared CPU generator
    (["cpu", "cuda:0"], True),
])
def test_every_multi_stage_pipeline_uses_private_streams(devices, private):
    assert needs_private_rng([torch.device(d) for d in devices]) is private


def test_inside_a_private_stream_the_rng_state_is_the_streams() -> None:
    """``torch.get_rng_state``/``set_rng_state`` (what ``torch.utils.checkpoint`` and
    ``torch.random.fork_rng`` save and restore) read and write the private stream inside
    one, and leave the global generator alone; outside, they are the global generator's."""
    torch.manual_seed(0)
    outside = torch.get_rng_state()
    with isolated_rng(7):
        state = torch.get_rng_state()
        first = torch.rand(4)
        torch.set_rng_state(state)
        assert torch.equal(torch.rand(4), first)  # the stream went back, and replayed
        with torch.random.fork_rng():
            torch.rand(4)
        second = torch.rand(4)  # fork_rng put the stream back where it was
    assert not torch.equal(state, outside)
    assert torch.equal(torch.get_rng_state(), outside)
    with isolated_rng(7):
        assert torch.equal(torch.rand(4), first)
        assert torch.equal(torch.rand(4), second)
    torch.set_rng_state(state)  # outside: the global generator, as in torch
    assert torch.equal(torch.rand(4), first)
