"""The peers' documented surface through ``seqpipe.compat``: arguments, errors, empty models,
DeferredBatchNorm as a class, RRef backward, the skip API's details and denied moves."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import seqpipe.compat.torch_pipe as torch_pipe
import seqpipe.compat.torchgpipe as torchgpipe
from seqpipe.compat._moving import MovingDenied
from seqpipe.compat.torch_pipe import Pipe
from seqpipe.compat.torchgpipe import GPipe
from seqpipe.compat.torchgpipe.batchnorm import DeferredBatchNorm

SKIPS = [torchgpipe.skip, torch_pipe.skip]


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)).double()


def _gpipe(model: nn.Sequential, **kwargs: Any) -> GPipe:
    return GPipe(model, [2, 1], devices=["cpu", "cpu"], **kwargs)


class _Mode:
    """A checkpoint argument that is not a str, but whose str() is a mode, as configs give."""

    def __str__(self) -> str:
        return "never"


@pytest.mark.parametrize("make", [_gpipe, lambda m, **kw: Pipe(m, **kw)], ids=["gpipe", "pipe"])
def test_chunks_and_checkpoint_are_read_with_int_and_str(make: Any) -> None:
    pipe = make(_mlp(), chunks=42.000, checkpoint=_Mode())
    assert (pipe.chunks, pipe.checkpoint) == (42, "never")
    assert type(pipe.chunks) is int
    with pytest.raises(ValueError, match="^number of chunks must be positive integer$"):
        make(_mlp(), chunks=0)
    with pytest.raises(ValueError, match="^checkpoint is not one of 'always', 'except_last', "
                                         "or 'never'$"):
        make(_mlp(), checkpoint="sometimes")


@pytest.mark.parametrize("make", [_gpipe, lambda m, **kw: Pipe(m, **kw)], ids=["gpipe", "pipe"])
def test_module_checks_read_as_the_peers(make: Any) -> None:
    with pytest.raises(TypeError, match="^module must be nn.Sequential to be partitioned$"):
        make(nn.ModuleList([nn.Linear(1, 1)]))
    layer = nn.Linear(1, 1)
    with pytest.raises(ValueError, match="^module with duplicate children is not supported$"):
        make(nn.Sequential(layer, layer))


def test_gpipe_balance_errors_read_as_torchgpipes() -> None:
    with pytest.raises(ValueError, match=r"^balance is required\n\n.*"
                                         r"seqpipe\.compat\.torchgpipe\.balance") as info:
        GPipe(_mlp())
    assert "balance_by_time(partitions, model, sample)" in str(info.value)
    with pytest.raises(ValueError, match=r"^module and sum of balance have different length "
                                         r"\(module: 3, sum of balance: 4\)\n"):
        GPipe(_mlp(), [2, 2], devices=["cpu"] * 2)
    with pytest.raises(ValueError, match=r"^all balance numbers must be positive integer "
                                         r"\(balance: \[3, 0\]\)\n"):
        GPipe(_mlp(), [3, 0], devices=["cpu"] * 2)
    with pytest.raises(IndexError, match=r"^too few devices to hold given partitions "
                                         r"\(devices: 1, partitions: 2\)$"):
        GPipe(_mlp(), [2, 1], devices=["cpu"])


def test_an_empty_sequential_returns_its_input() -> None:
    x = torch.randn(3, 2)
    gpipe = GPipe(nn.Sequential(), [])
    assert gpipe(x) is x and len(gpipe) == 0 and gpipe.devices == [] and gpipe.balance == []
    assert list(gpipe.state_dict()) == [] and len(gpipe.partitions) == 0
    pipe = Pipe(nn.Sequential())
    assert pipe(x) is x and len(pipe) == 0
    with pytest.raises(TypeError, match="tensor"):
        gpipe("not a tensor")


def _bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).double()


def test_deferred_batch_norm_built_directly_commits_every_chunks_forwards() -> None:
    """Outside a pipeline, as torchgpipe's: micro-batches accumulate; every ``chunks``
    forwards the running statistics become a plain BatchNorm's on the whole batch."""
    torch.manual_seed(0)
    deferred, plain = DeferredBatchNorm(4, chunks=2).double(), nn.BatchNorm1d(4).double()
    for _ in range(3):
        x = torch.randn(8, 4, dtype=torch.float64)
        deferred(x[:4])
        assert_close(deferred.running_mean, plain.running_mean)  # not yet committed
        deferred(x[4:])
        plain(x)
        assert_close(deferred.running_mean, plain.running_mean)
        assert_close(deferred.running_var, plain.running_var)
    assert int(deferred.num_batches_tracked) == 3
    deferred.eval()
    plain.eval()
    x = torch.randn(5, 4, dtype=torch.float64)
    assert_close(deferred(x), plain(x))  # eval normalises with the running statistics


def test_convert_deferred_batch_norm_classmethod_and_in_a_gpipe() -> None:
    model, reference = _bn_model(), _bn_model()
    bn = model[1]
    assert DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=4) is model
    assert model[1] is bn and isinstance(bn, DeferredBatchNorm) and bn.chunks == 4
    assert isinstance(bn, nn.BatchNorm1d)
    pipe = GPipe(model, [1, 1], devices=["cpu"] * 2, chunks=4)
    for _ in range(3):
        x = torch.randn(16, 4, dtype=torch.float64)
        pipe(x)
        reference(x)
        assert_close(bn.running_mean, reference[1].running_mean)
        assert_close(bn.running_var, reference[1].running_var)
    pipe.eval()
    reference.eval()
    x = torch.randn(6, 4, dtype=torch.float64)
    assert_close(pipe(x), reference(x))


def test_gpipe_deferred_batch_norm_counts_chunks_like_torchgpipe() -> None:
    pipe = GPipe(_bn_model(), [1, 1], devices=["cpu"] * 2, chunks=2, deferred_batch_norm=True)
    assert isinstance(pipe[1], DeferredBatchNorm) and pipe[1].chunks == 2


def test_rref_backward_on_a_scalar_output() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    reference = copy.deepcopy(model)
    x = torch.randn(1, 3, dtype=torch.float64)
    out = Pipe(model, chunks=1)(x)
    out.backward()
    reference(x).backward()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert_close(mine.grad, theirs.grad)
    with pytest.raises(ValueError, match="without dist_autograd_ctx_id"):
        out.backward(dist_autograd_ctx_id=3)


@pytest.mark.parametrize("skip", SKIPS, ids=["torchgpipe", "torch_pipe"])
def test_skippable_repr_reads_as_the_peers(skip: Any) -> None:
    @skip.skippable(stash=["s"])
    class Keep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> Any:
            yield skip.stash("s", x)
            return self.lin(x)

    text = repr(Keep())
    assert text.startswith("@skippable(Keep(") and "(lin): Linear(in_features=2" in text


@pytest.mark.parametrize("skip", SKIPS, ids=["torchgpipe", "torch_pipe"])
def test_stub_classes_can_be_declared_and_verified(skip: Any) -> None:
    @skip.skippable(stash=["a"])
    class Stasher(nn.Module):
        pass

    @skip.skippable(pop=["a"])
    class Popper(nn.Module):
        pass

    skip.verify_skippables(nn.Sequential(Stasher(), Popper()))
    with pytest.raises(NotImplementedError, match="forward"):
        Stasher()(torch.zeros(1))
    with pytest.raises(TypeError, match="^one or more pairs of stash and pop do not match:"
                                        "\n\n.*'a'.*never popped"):
        skip.verify_skippables(nn.Sequential(Stasher()))


@pytest.mark.parametrize("skip", SKIPS, ids=["torchgpipe", "torch_pipe"])
def test_verify_reports_a_layer_that_stashes_and_pops_one_name(skip: Any) -> None:
    @skip.skippable(stash=["x"], pop=["x"])
    class Both(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            yield skip.stash("x", x)
            y = yield skip.pop("x")
            return y

    with pytest.raises(TypeError, match="'1' declared 'x' both as stashable and as poppable"):
        skip.verify_skippables(nn.Sequential(nn.ReLU(), Both()))


@pytest.mark.parametrize("make", [_gpipe, lambda m: Pipe(m)], ids=["gpipe", "pipe"])
@pytest.mark.parametrize("move", [
    lambda p: p.to(0), lambda p: p.to(device=0), lambda p: p.to("cpu"),
    lambda p: p.to(torch.device("cpu")), lambda p: p.to(torch.zeros(1)), lambda p: p.cuda(),
    lambda p: p.cpu()], ids=["int", "device=int", "str", "device", "tensor", "cuda", "cpu"])
def test_moves_are_denied_with_the_peers_type_error(make: Any, move: Any) -> None:
    pipe = make(_mlp())
    with pytest.raises(MovingDenied, match="^denied to move parameters and buffers, because "):
        move(pipe)
    assert pipe.to(torch.float32) is pipe and pipe[0].weight.dtype == torch.float32
