"""The CUDA paths: copy streams between partitions, GPU stages' backward on the autograd
thread, and DistributedPipe over NCCL. Skipped without CUDA (CI has none); run on a GPU
machine with ``python -m pytest -q tests/test_cuda.py``.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from distributed_harness import Failures, run_workers
from seqpipe import Pipe
from seqpipe.distributed import DistributedPipe
from seqpipe.skip import pop, skippable, stash

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
needs_two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs two CUDA devices")
MODES = ("always", "except_last", "never")


@skippable(stash=["identity"])
class Keep(nn.Module):
    def forward(self, x: Tensor) -> Any:
        yield stash("identity", x)
        return x


@skippable(pop=["identity"])
class Add(nn.Module):
    def forward(self, x: Tensor) -> Any:
        identity = yield pop("identity")
        return x + identity


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), Keep(), nn.ReLU(), nn.Linear(32, 32),
                         nn.Dropout(0.0), nn.Tanh(), nn.Linear(32, 32), Add(),
                         nn.Linear(32, 4)).double()


def _compare(devices: List[str], mode: str) -> None:
    model = _model()
    ref = copy.deepcopy(model).to(devices[-1])
    x = torch.randn(12, 16, dtype=torch.float64, requires_grad=True)
    ref_x = x.detach().to(devices[-1]).requires_grad_()
    expected = ref(ref_x)
    expected.square().mean().backward()
    pipe = Pipe(model, chunks=4, balance=[4, 5], devices=devices, checkpoint=mode)
    out = pipe(x.to(devices[0]).detach().requires_grad_()) if devices[0] != "cpu" else pipe(x)
    out.square().mean().backward()
    assert out.device == torch.device(devices[-1])
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-8)
    theirs = dict(ref.named_parameters())
    for name, param in pipe.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad.to(devices[-1]), theirs[name].grad,
                                   atol=1e-10, rtol=1e-8)
    if devices[0] == "cpu":
        assert x.grad is not None
        torch.testing.assert_close(x.grad.to(devices[-1]), ref_x.grad, atol=1e-10, rtol=1e-8)


@needs_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("devices", [["cuda:0", "cuda:0"], ["cpu", "cuda:0"], ["cuda:0", "cpu"]])
def test_pipe_on_gpu_matches_the_plain_model(devices: List[str], mode: str) -> None:
    _compare(devices, mode)


@needs_two_gpus
@pytest.mark.parametrize("mode", MODES)
def test_pipe_across_two_gpus_matches_the_plain_model(mode: str) -> None:
    _compare(["cuda:0", "cuda:1"], mode)


@needs_gpu
@pytest.mark.parametrize("devices", [["cuda:0", "cuda:0"], ["cpu", "cuda:0"], ["cuda:0", "cpu"]])
def test_pipe_on_a_side_stream_matches_and_keeps_its_copy_streams(devices: List[str]) -> None:
    """The caller on a non-default stream: every stage and hand-off follows it (stages on
    one device share the stream, so no event is needed), and a device pair's copy streams
    are the same objects on every call, whatever thread makes the copy."""
    from seqpipe.core.stream import _COPY_STREAMS

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        _compare(devices, "except_last")
        pairs = dict(_COPY_STREAMS._pairs)
        _compare(devices, "always")
    assert _COPY_STREAMS._pairs == pairs
    assert all(a is b for a, b in zip(pairs.values(), _COPY_STREAMS._pairs.values()))


@needs_two_gpus
def test_copy_between_gpus_runs_on_the_pairs_streams() -> None:
    from seqpipe.core.stream import _COPY_STREAMS, move

    a = torch.randn(1 << 20, device="cuda:0")
    expected = a.cpu()
    torch.cuda._sleep(50_000_000)  # keep cuda:0's compute stream busy
    moved = move(a * 1, torch.device("cuda", 1))
    assert torch.cuda.current_device() == 0  # setting the copy streams did not move it
    assert torch.cuda.current_stream(0) == torch.cuda.default_stream(0)
    pair = _COPY_STREAMS.pair(torch.device("cuda", 0), torch.device("cuda", 1))
    assert pair.source.device == torch.device("cuda", 0)
    assert pair.destination.device == torch.device("cuda", 1)
    torch.testing.assert_close(moved.cpu(), expected)  # ordered after the producer


@needs_gpu
@pytest.mark.parametrize("devices", [["cuda:0", "cuda:0"], ["cpu", "cuda:0"]])
def test_recomputation_replays_dropout_on_shared_gpu(devices: List[str]) -> None:
    """Issue 17.3 on a GPU: two stages on one device (or CPU + GPU) replay every mask."""
    from test_rng import Probe, dropout, native_dropout, probed_model

    for draw in (dropout, native_dropout):
        model = probed_model(2, draw)
        pipe = Pipe(model, chunks=4, checkpoint="always", balance=[3, 3], devices=devices)
        for _ in range(3):
            pipe(torch.randn(16, 16, device=devices[0])).sum().backward()
        for probe in (m for m in model if isinstance(m, Probe)):
            assert len(probe.forward_draws) == 12
            assert probe.recomputed_draws.keys() == probe.forward_draws.keys()
            for key, mask in probe.forward_draws.items():
                assert torch.equal(probe.recomputed_draws[key], mask)


def _nccl(rank: int, world: int, kind: str = "cuda") -> None:
    failures = Failures(rank, dict(atol=1e-10, rtol=1e-8))
    device = torch.device(kind, rank) if kind == "cuda" else torch.device(kind)
    for schedule in ("fill_drain", "1f1b"):
        for batch in (12, 10):  # even, then ragged micro-batches (new shapes: reshaped path)
            ref = _model().to(device)
            gen = torch.Generator().manual_seed(batch)
            x = torch.randn(batch, 16, generator=gen, dtype=torch.float64).to(device)
            y = torch.randn(batch, 4, generator=gen, dtype=torch.float64).to(device)
            ref_loss = F.mse_loss(ref(x), y)
            ref_loss.backward()
            pipe = DistributedPipe(_model(), chunks=4, balance=[4, 5], schedule=schedule,
                                   device=device)
            for step in range(2):  # the second step receives ahead into cached shapes
                pipe.zero_grad()
                loss = pipe.train_step(x if rank == 0 else None, y if rank == 1 else None,
                                       F.mse_loss)
                what = f"{schedule} batch {batch} step {step}"
                failures.close(loss, ref_loss.detach(), f"{what}: loss")
                failures.grads(pipe, ref, what)
            out = pipe.eval()(x if rank == 0 else None)
            if rank == 1:
                failures.close(out, ref.eval()(x), f"{schedule}: forward")
    failures.finish()
    dist.barrier()


@needs_two_gpus
def test_distributed_pipe_over_nccl_matches_the_plain_model() -> None:
    run_workers(_nccl, 2, timeout=300, backend="nccl")


@needs_two_gpus
def test_large_activations_over_nccl_do_not_deadlock_under_1f1b() -> None:
    """Activations far larger than NCCL's buffers, both clocks: no hang (see transport)."""
    run_workers(_large, 2, timeout=300, backend="nccl")


def _large(rank: int, world: int) -> None:
    torch.manual_seed(0)
    width = 2048
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    x = torch.randn(8192, width, device="cuda") if rank == 0 else None  # 16 MiB / micro-batch
    y = torch.randn(8192, width, device="cuda") if rank == 1 else None
    losses: Dict[str, float] = {}
    for schedule in ("fill_drain", "1f1b"):
        pipe = DistributedPipe(copy.deepcopy(model), chunks=4, balance=[2, 1],
                               schedule=schedule)
        for _ in range(2):
            losses[schedule] = float(pipe.train_step(x, y, F.mse_loss))
    assert abs(losses["fill_drain"] - losses["1f1b"]) < 1e-3 * abs(losses["1f1b"]), losses
