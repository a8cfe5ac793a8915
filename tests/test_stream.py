"""Copy streams: one pair per (source, destination) devices, stable across calls and threads.

The CUDA side of ``move`` (which stream waits for which) runs in tests/test_cuda.py; here
the stream bookkeeping is checked with fake streams, and the CPU paths of ``move``.
"""
from __future__ import annotations

import threading
from typing import List

import torch

from seqpipe.core.stream import CopyStreams, move, on_stream


class FakeStream:
    def __init__(self, device: torch.device) -> None:
        self.device = device


def fake_streams(made: List[FakeStream]) -> CopyStreams:
    def new(device: torch.device) -> FakeStream:
        made.append(FakeStream(device))
        return made[-1]
    return CopyStreams(new)  # type: ignore[arg-type]


CPU, GPU0, GPU1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)


def test_a_pair_has_a_copy_stream_on_each_accelerator_end():
    made: List[FakeStream] = []
    streams = fake_streams(made)
    h2d, d2h, d2d = streams.pair(CPU, GPU0), streams.pair(GPU0, CPU), streams.pair(GPU0, GPU1)
    assert h2d.source is None and h2d.destination.device == GPU0
    assert d2h.source.device == GPU0 and d2h.destination is None
    assert (d2d.source.device, d2d.destination.device) == (GPU0, GPU1)
    assert len(made) == 4
    assert streams.pair(GPU1, GPU0) is not d2d  # each direction has its own pair
    assert streams.pair(CPU, CPU) == streams.pair(CPU, CPU)


def test_the_streams_of_a_pair_are_made_once_for_every_call_and_thread():
    made: List[FakeStream] = []
    streams = fake_streams(made)
    first = streams.pair(GPU0, GPU1)
    seen = []
    barrier = threading.Barrier(4)

    def worker() -> None:
        barrier.wait()
        for _ in range(50):
            seen.append(streams.pair(GPU0, GPU1))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 200 and all(p is first for p in seen)
    assert len(made) == 2


def test_a_cpu_hand_off_is_the_tensor_itself_detached():
    x = torch.randn(3, requires_grad=True) * 2
    moved = move(x, CPU)
    assert moved.data_ptr() == x.data_ptr() and not moved.requires_grad
    assert move(None, CPU) is None


def test_no_stream_is_a_no_op_context():
    with on_stream(None):
        pass
