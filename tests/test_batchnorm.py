"""Deferred BatchNorm: running statistics equal a plain BatchNorm's on the whole mini-batch."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from seqpipe import Pipe
from seqpipe.core.batchnorm import convert_deferred_batch_norm

STATS = ("running_mean", "running_var", "num_batches_tracked")


def cpu_pipe(model: nn.Sequential, balance, **kwargs) -> Pipe:
    return Pipe(model, balance=balance, devices=["cpu"] * len(balance), **kwargs)


def assert_same_stats(bn: nn.Module, ref: nn.Module) -> None:
    for name in STATS:
        assert_close(getattr(bn, name), getattr(ref, name), atol=1e-6, rtol=1e-5,
                     msg=lambda m, n=name: f"{n}: {m}")


def model_1d(**bn_kwargs) -> nn.Sequential:
    """Linear -> BatchNorm1d -> ReLU -> Linear; the BN is layer 1."""
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6, **bn_kwargs), nn.ReLU(),
                         nn.Linear(6, 2))


def model_2d(**bn_kwargs) -> nn.Sequential:
    """Conv2d -> BatchNorm2d -> ReLU -> Conv2d; the BN is layer 1."""
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4, **bn_kwargs),
                         nn.ReLU(), nn.Conv2d(4, 2, 1))


def batches(kind: str, size: int, count: int):
    shape = (size, 5) if kind == "1d" else (size, 3, 5, 5)
    # shifted and scaled so that the statistics are far from the initial ones
    return [torch.randn(*shape) * (1.5 + i) + 0.7 * i for i in range(count)]


def train_both(kind: str, *, size: int, count: int, chunks: int = 4, mode: str = "never",
               deferred: bool = True, balance=(2, 2), **bn_kwargs):
    """Run ``count`` training mini-batches (forward and backward) through a Pipe and a plain
    copy; return both BatchNorm layers and the two pipes."""
    model = (model_1d if kind == "1d" else model_2d)(**bn_kwargs)
    ref = copy.deepcopy(model)
    pipe = cpu_pipe(model, list(balance), chunks=chunks, checkpoint=mode,
                    deferred_batch_norm=deferred)
    for x in batches(kind, size, count):
        pipe(x).sum().backward()
        ref(x).sum().backward()
    return pipe[1], ref[1], pipe, ref


@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_one_minibatch_matches_plain_batchnorm_on_the_whole_batch(kind):
    bn, ref, _, _ = train_both(kind, size=16, count=1)
    assert int(bn.num_batches_tracked) == 1
    assert_same_stats(bn, ref)


@pytest.mark.parametrize("size", [10, 9])  # micro-batches 3,3,2,2 and 3,2,2,2
@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_uneven_micro_batches(kind, size):
    bn, ref, _, _ = train_both(kind, size=size, count=1)
    assert_same_stats(bn, ref)


def test_fewer_samples_than_chunks():
    bn, ref, _, _ = train_both("2d", size=3, count=2, chunks=4)  # 3 micro-batches of 1 image
    assert_same_stats(bn, ref)


@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_several_minibatches_in_a_row(kind):
    bn, ref, _, _ = train_both(kind, size=10, count=3)
    assert int(bn.num_batches_tracked) == 3
    assert_same_stats(bn, ref)


@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_cumulative_average_with_momentum_none(kind):
    bn, ref, _, _ = train_both(kind, size=10, count=3, momentum=None)
    assert_same_stats(bn, ref)


def test_custom_momentum():
    bn, ref, _, _ = train_both("1d", size=12, count=2, momentum=0.5)
    assert_same_stats(bn, ref)


@pytest.mark.parametrize("mode", ["always", "except_last"])
@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_recomputation_does_not_count_twice(kind, mode):
    bn, ref, _, _ = train_both(kind, size=10, count=3, mode=mode)
    assert int(bn.num_batches_tracked) == 3
    assert_same_stats(bn, ref)


@pytest.mark.parametrize("balance", [(4,), (1, 3), (2, 1, 1)])
def test_any_partitioning(balance):
    bn, ref, _, _ = train_both("1d", size=10, count=2, balance=balance)
    assert_same_stats(bn, ref)


def test_batchnorm1d_on_three_dim_input():
    model = nn.Sequential(nn.Identity(), nn.BatchNorm1d(3))
    ref = copy.deepcopy(model)
    pipe = cpu_pipe(model, [1, 1], chunks=4, deferred_batch_norm=True)
    x = torch.randn(10, 3, 6) * 2 + 1
    pipe(x), ref(x)
    assert_same_stats(pipe[1], ref[1])


def test_no_grad_training_forward_updates_once():
    model = model_1d()
    ref = copy.deepcopy(model)
    pipe = cpu_pipe(model, [2, 2], chunks=4, deferred_batch_norm=True)
    x = batches("1d", 10, 1)[0]
    with torch.no_grad():
        pipe(x), ref(x)
    assert_same_stats(pipe[1], ref[1])


def test_training_output_normalises_each_micro_batch_with_its_own_statistics():
    bn = nn.BatchNorm1d(4)
    pipe = cpu_pipe(nn.Sequential(nn.Identity(), bn), [1, 1], chunks=2,
                    deferred_batch_norm=True)
    x = torch.randn(8, 4) * 3 + 2
    y = pipe(x)
    expected = torch.cat([nn.functional.batch_norm(half, None, None, bn.weight, bn.bias,
                                                   training=True) for half in x.chunk(2)])
    assert_close(y, expected)


@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_eval_output_matches_plain_eval(kind):
    _, _, pipe, ref = train_both(kind, size=10, count=3)
    pipe.eval(), ref.eval()
    x = batches(kind, 9, 1)[0]
    assert_close(pipe(x), ref(x), atol=1e-6, rtol=1e-5)


def test_eval_forward_leaves_statistics_alone():
    _, _, pipe, _ = train_both("1d", size=10, count=1)
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    pipe.eval()
    pipe(batches("1d", 10, 1)[0])
    assert_close(pipe.state_dict(), before)


def test_without_deferred_batchnorm_the_statistics_differ():
    """The control: a plain BatchNorm in a 4-chunk pipe updates once per micro-batch."""
    bn, ref, _, _ = train_both("1d", size=16, count=1, deferred=False)
    assert int(bn.num_batches_tracked) == 4 and int(ref.num_batches_tracked) == 1
    assert not torch.allclose(bn.running_mean, ref.running_mean, atol=1e-4)
    assert not torch.allclose(bn.running_var, ref.running_var, atol=1e-4)


def test_conversion_keeps_the_layer_its_class_and_its_state_dict_keys():
    model = model_1d()
    bn = model[1]
    keys = list(model.state_dict())
    pipe = cpu_pipe(model, [2, 2], deferred_batch_norm=True)
    assert pipe[1] is bn
    assert isinstance(bn, nn.BatchNorm1d)
    assert list(pipe.state_dict()) == keys


def test_a_failed_forward_does_not_leak_statistics_into_the_next_update() -> None:
    class FailOnce(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.armed = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.armed and x.shape[0] == 2:  # the last micro-batch of the bad call
                self.armed = False
                raise RuntimeError("fail")
            return x

    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3)
    plain = copy.deepcopy(bn)
    pipe = Pipe(nn.Sequential(bn, FailOnce()), chunks=4, deferred_batch_norm=True,
                balance=[1, 1], devices=["cpu", "cpu"])
    with pytest.raises(RuntimeError, match="fail"):
        pipe(torch.randn(10, 3) * 5 + 3)  # micro-batches 3, 3, 2, 2: fails at the third
    x = torch.randn(8, 3)
    pipe(x)
    plain(x)
    torch.testing.assert_close(bn.running_mean, plain.running_mean)
    torch.testing.assert_close(bn.running_var, plain.running_var)


def test_statistics_pending_elsewhere_neither_block_nor_get_this_pipes_commit() -> None:
    """The end of a mini-batch walks the partitions only while some deferred BatchNorm holds
    statistics (``seqpipe.core.batchnorm.end_statistics``): a pipe's own are committed even
    while another model's are pending, those stay pending (and uncommitted) until their own
    commit, and after that nothing is left pending to walk for."""
    from seqpipe.core import batchnorm

    torch.manual_seed(0)
    elsewhere = convert_deferred_batch_norm(nn.Sequential(nn.BatchNorm1d(5)))
    elsewhere(torch.randn(6, 5))  # accumulated outside any pipe: pending, not committed
    before = elsewhere[0].running_mean.clone()
    model = model_1d()
    ref = copy.deepcopy(model)
    pipe = cpu_pipe(model, [4], chunks=1, deferred_batch_norm=True)  # the direct call
    x = torch.randn(8, 5) * 3 + 1
    pipe(x).sum().backward()
    ref(x).sum().backward()
    assert_same_stats(pipe[1], ref[1])
    assert set(batchnorm._pending) == {elsewhere[0]}
    assert_close(elsewhere[0].running_mean, before)
    elsewhere[0].commit()
    assert not batchnorm._pending and not torch.equal(elsewhere[0].running_mean, before)


def deferred_over(bn: nn.Module, x: torch.Tensor, sizes) -> nn.Module:
    """``bn`` made deferred, trained on ``x`` split into micro-batches of ``sizes``, committed."""
    convert_deferred_batch_norm(bn)
    for part in x.split(list(sizes)):
        bn(part)
    bn.commit()
    return bn


def test_two_sample_micro_batches_record_the_unbiased_variance_of_the_whole_batch():
    """Against float64 ground truth, with micro-batches of 2 samples, where each one's
    unbiased variance is twice its biased one: a biased/unbiased mix-up in the merge, or a
    micro-batch counted twice (its variance then divides by 2N - 1, not N - 1: 5 % off
    here), is far outside the tolerance. That tolerance is a few float32 roundings: the
    kernel takes each micro-batch's statistics in float32, as a plain BatchNorm does for
    the whole batch; the merge is in float64."""
    torch.manual_seed(0)
    x = torch.randn(10, 6) * 3 + 50  # far from the initial statistics
    bn = deferred_over(nn.BatchNorm1d(6), x, [2] * 5)
    truth = x.double()
    expected_mean = 0.1 * truth.mean(0)
    expected_var = 0.9 + 0.1 * truth.var(0, unbiased=True)
    assert int(bn.num_batches_tracked) == 1
    assert_close(bn.running_mean.double(), expected_mean, rtol=4e-7, atol=0)
    assert_close(bn.running_var.double(), expected_var, rtol=4e-7, atol=0)


@pytest.mark.parametrize("layer,shape", [
    (nn.BatchNorm1d, (11, 4)), (nn.BatchNorm1d, (11, 4, 6)), (nn.BatchNorm2d, (11, 4, 3, 5)),
    (nn.BatchNorm3d, (11, 4, 2, 3, 4))])
def test_every_batchnorm_dimension_matches_plain_on_the_whole_batch(layer, shape):
    torch.manual_seed(0)
    x = torch.randn(*shape) * 2 + 3
    plain = layer(4)
    bn = deferred_over(copy.deepcopy(plain), x, [4, 4, 3])
    plain(x)
    assert_same_stats(bn, plain)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs(dtype):
    """Half inputs into float32 parameters (as under autocast): the kernel's statistics are
    float32 either way, so the float32 tolerance holds. A BatchNorm whose running buffers
    are themselves half keeps each micro-batch's statistics in half before the merge: two
    roundings to the buffer's precision where a plain BatchNorm has one, so the tolerance
    is two of its units in the last place."""
    torch.manual_seed(0)
    x = (torch.randn(12, 4, 3, 3) * 2 + 3).to(dtype)
    plain = nn.BatchNorm2d(4)
    bn = deferred_over(copy.deepcopy(plain), x, [4, 4, 4])
    plain(x)
    assert_same_stats(bn, plain)
    plain = nn.BatchNorm2d(4).to(dtype)
    bn = deferred_over(copy.deepcopy(plain), x, [4, 4, 4])
    plain(x)
    ulp = torch.finfo(dtype).eps
    for name in ("running_mean", "running_var"):
        assert getattr(bn, name).dtype == dtype
        assert_close(getattr(bn, name), getattr(plain, name), rtol=2 * ulp, atol=0)


def test_an_unpickled_deferred_batchnorm_starts_empty_and_trains() -> None:
    """``torch.save`` of a whole model pickles the layer with whatever it had accumulated,
    and pickles of earlier versions hold ``_count``/``_sum``/``_m2`` instead of ``_stats``:
    a loaded layer starts with empty accumulators, then matches a plain BatchNorm. (A
    converted layer's class is made at run time and does not pickle; torchgpipe's
    ``DeferredBatchNorm`` is a class of its own, built directly.)"""
    import io

    from seqpipe.compat.torchgpipe.batchnorm import DeferredBatchNorm

    torch.manual_seed(0)
    saved = nn.Sequential(DeferredBatchNorm(3, chunks=2))
    saved(torch.randn(6, 3))  # pending, not committed: not carried over
    saved[0].__dict__.update(_count=6, _sum=torch.zeros(3), _m2=torch.zeros(3))  # as before
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)[0]
    assert not hasattr(loaded, "_count") and loaded._stats == []
    plain = nn.BatchNorm1d(3)
    plain.load_state_dict(loaded.state_dict())
    x = torch.randn(8, 3) * 2 + 1
    for part in x.chunk(2):
        loaded(part)  # commits after its second forward (chunks=2)
    plain(x)
    assert_same_stats(loaded, plain)
