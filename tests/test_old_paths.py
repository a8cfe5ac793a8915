"""Modules moved into ``seqpipe.core`` and ``seqpipe.local`` keep answering to their old
paths (``seqpipe._moved``): imports and pickles written before the move still load."""
from __future__ import annotations

import importlib
import io
import pathlib
import pickle
import sys

import pytest
import torch
from torch import nn

import seqpipe
from seqpipe._moved import MOVED
from seqpipe.core.batchnorm import DeferredBatchNorm

DATA = pathlib.Path(__file__).parent / "data"


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_an_old_path_is_the_moved_module(old: str, new: str) -> None:
    moved = importlib.import_module(new)
    assert importlib.import_module(old) is moved
    assert sys.modules[old] is moved
    assert moved.__name__ == new and moved.__spec__.name == new  # its own spec kept
    assert getattr(seqpipe, old.split(".")[-1]) is moved


def test_documented_old_paths() -> None:
    import seqpipe.core.seeding
    from seqpipe.batchnorm import DeferredBatchNorm as old_class
    from seqpipe.checkpoint import is_recomputing as old_flag
    from seqpipe.seeding import seed_layers

    assert old_class is DeferredBatchNorm
    assert old_flag is seqpipe.is_recomputing
    assert seed_layers is seqpipe.core.seeding.seed_layers


def test_an_unknown_name_still_fails() -> None:
    with pytest.raises(ModuleNotFoundError, match="seqpipe.no_such_module"):
        importlib.import_module("seqpipe.no_such_module")
    with pytest.raises(AttributeError, match="no attribute 'no_such_module'"):
        seqpipe.no_such_module  # noqa: B018


def test_an_object_pickled_under_its_old_class_path_unpickles() -> None:
    bn = DeferredBatchNorm(3)
    data = pickle.dumps(bn, protocol=0)
    assert b"cseqpipe.core.batchnorm\nDeferredBatchNorm\n" in data
    old = data.replace(b"cseqpipe.core.batchnorm\n", b"cseqpipe.batchnorm\n")
    loaded = pickle.loads(old)
    assert type(loaded) is DeferredBatchNorm
    assert torch.equal(loaded.running_var, bn.running_var)


def test_a_model_saved_before_the_move_loads() -> None:
    """``tests/data/deferred_batchnorm_old_path.pt``: ``torch.save`` of
    ``nn.Sequential(DeferredBatchNorm(3))`` (running mean 1, 2, 3; weight 0.5, 0.25, 2)
    made by seqpipe before the move, so its pickle names ``seqpipe.batchnorm``."""
    raw = (DATA / "deferred_batchnorm_old_path.pt").read_bytes()
    assert b"seqpipe.batchnorm" in raw and b"seqpipe.core" not in raw
    model = torch.load(io.BytesIO(raw), weights_only=False)
    assert isinstance(model, nn.Sequential) and type(model[0]) is DeferredBatchNorm
    assert torch.equal(model[0].running_mean, torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(model[0].weight.detach(), torch.tensor([0.5, 0.25, 2.0]))
