"""Per-layer seeds (``seqpipe.core.seeding``) and materialising layers built on ``meta``."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from distributed_harness import run_workers
from seqpipe.core.seeding import seed_layers, uninitialisable
from seqpipe.distributed.materialize import materialize


class Scaled(nn.Module):
    """A layer whose own parameter no reset_parameters() reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def build() -> nn.Sequential:
    return nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 8), nn.LayerNorm(8), nn.ReLU(),
                         nn.Linear(8, 4), nn.BatchNorm1d(4), nn.Linear(4, 10))


def assert_same_values(a: nn.Module, b: nn.Module) -> None:
    for (name, x), (_, y) in zip((*a.named_parameters(), *a.named_buffers()),
                                 (*b.named_parameters(), *b.named_buffers())):
        assert torch.equal(x.detach().cpu(), y.detach().cpu()), name


def test_seed_layers_depends_on_base_seed_and_index_only() -> None:
    torch.manual_seed(1)
    first = seed_layers(build(), 1234)
    torch.manual_seed(2)  # another global state before building: same weights after seeding
    second = build()
    state = torch.get_rng_state()
    seed_layers(second, 1234)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's stream did not move
    assert_same_values(first, second)
    other = seed_layers(build(), 99)
    assert not torch.equal(other[1].weight, first[1].weight)


def test_a_tied_weight_keeps_its_first_holders_values() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10, bias=False))
    model[2].weight = model[0].weight
    alone = seed_layers(nn.Sequential(nn.Embedding(10, 4)), 7)
    seed_layers(model, 7)
    assert model[2].weight is model[0].weight
    assert torch.equal(model[0].weight, alone[0].weight)


def test_uninitialisable_names_what_no_reset_reaches() -> None:
    assert uninitialisable(Scaled()) == ["scale"]
    assert uninitialisable(nn.Linear(2, 2)) == []
    assert uninitialisable(nn.MultiheadAttention(4, 2)) == []  # its _reset_parameters


def _on_meta() -> nn.Sequential:
    with torch.device("meta"):
        return build()


def test_materialize_initialises_only_layers_on_meta() -> None:
    reference = seed_layers(build(), 5)
    model = _on_meta()
    real = nn.Linear(4, 8)
    model[1] = real
    kept = real.weight.detach().clone()
    layers = [(n, str(n), layer) for n, layer in enumerate(model)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # with base_seed: nothing to warn about
        done = materialize(layers, torch.device("cpu"), base_seed=5)
    assert done == ["0", "2", "4", "5", "6"]  # ReLU has nothing; layer 1 was real
    assert torch.equal(model[1].weight, kept)  # real weights are never touched
    for n in (0, 2, 4, 5, 6):
        assert_same_values(model[n], reference[n])


def test_materialize_without_a_seed_says_which_layers_it_initialised() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Scaled())
    model.to("meta")
    with pytest.warns(UserWarning) as record:
        materialize([(n, str(n), layer) for n, layer in enumerate(model)], torch.device("cpu"))
    text = " ".join(str(w.message) for w in record)
    assert "initialised layers ['0', '1']" in text and "base_seed=" in text
    assert "nothing initialises ['1.scale']" in text
    assert not model[0].weight.is_meta


def test_materialize_refuses_a_layer_half_on_meta() -> None:
    layer = nn.Linear(4, 4)
    layer.bias = nn.Parameter(torch.zeros(4, device="meta"))
    with pytest.raises(ValueError, match=r"layer 3 \(Linear\) has some parameters or buffers "
                                         r"on the meta device and others with real values"):
        materialize([(3, "3", layer)], torch.device("cpu"))


def _meta_with_base_seed(rank: int, world: int) -> None:
    from seqpipe.distributed import DistributedPipe

    reference = seed_layers(build(), 1234)
    pipe = DistributedPipe(_on_meta(), chunks=2, base_seed=1234,
                           balance=[3, 4] if world == 2 else [2, 3, 2])
    names = dict(reference.named_parameters())
    names.update(dict(reference.named_buffers()))
    mine = {**dict(pipe.named_parameters()), **dict(pipe.named_buffers())}
    assert mine, "this stage holds no tensor"
    for name, tensor in mine.items():
        assert torch.equal(tensor, names[name]), (rank, name)
    # A normally built model: its real weights are moved, never re-initialised.
    torch.manual_seed(0)
    model = build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pipe = DistributedPipe(model, chunks=2, base_seed=1234,
                           balance=[3, 4] if world == 2 else [2, 3, 2])
    for name, tensor in pipe.state_dict().items():
        assert torch.equal(tensor, before[name]), (rank, name)
    with pytest.raises(ValueError, match="device='meta' holds no values to train"):
        DistributedPipe(build(), chunks=2, device="meta")


@pytest.mark.parametrize("world", [2, 3])
def test_a_meta_built_pipe_with_base_seed_holds_the_seeded_whole_models_weights(
        world: int) -> None:
    run_workers(_meta_with_base_seed, world, timeout=120)
