"""Moving tensors between devices, on copy streams where the device has streams.

On CPU there are no streams and a move is at most a copy. On an accelerator, a copy runs
on a copy stream of its (source, destination) device pair, so it neither queues behind
the sender's compute nor holds up the receiver's. The pair's streams are made once and
kept for the life of the process (not per thread: the stage threads are new at every
call, and a new stream per call would scatter the received activations over streams the
caching allocator cannot reuse memory across).

Which stream a copy runs on is PyTorch's rule: a host-to-device copy runs on the
destination's current stream, a device-to-host one on the source's, and a device-to-device
one on the *source's* current stream, after a barrier with the destination's. So a pair
has a copy stream on each accelerator end, and both are made current for the copy. The
sequence is:

1. the source-side copy stream waits for the sender's compute stream (the tensor is made);
2. the copy runs, allocating the received tensor on the destination-side copy stream;
3. the receiver's compute stream waits for the destination-side copy stream;
4. the sent tensor is recorded on the source-side copy stream and the received one on the
   receiver's compute stream, so the caching allocator reuses neither memory too early.

A hand-off on one device needs no copy and no event: every stage thread runs with the
caller's current stream for each device (``seqpipe.local.thread_state``), so producer and
consumer are ordered on that one stream, as is the caller's final concatenation.
Only the generic ``torch.accelerator``/``torch.Stream`` API is used.
"""
from __future__ import annotations

import threading
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["CopyStreams", "Pair", "move", "on_stream"]


@dataclass(frozen=True)
class Pair:
    """The copy streams of a (source, destination) pair: one per accelerator end."""

    source: Optional[torch.Stream]
    destination: Optional[torch.Stream]


class CopyStreams:
    """One ``Pair`` of copy streams per (source, destination) device pair, made once."""

    def __init__(self, new_stream: Callable[[torch.device], torch.Stream] = torch.Stream,
                 ) -> None:
        self._new_stream = new_stream
        self._pairs: Dict[Tuple[torch.device, torch.device], Pair] = {}
        self._lock = threading.Lock()

    def pair(self, source: torch.device, destination: torch.device) -> Pair:
        key = (source, destination)
        found = self._pairs.get(key)
        if found is None:
            with self._lock:
                found = self._pairs.get(key)
                if found is None:
                    found = Pair(self._side(source), self._side(destination))
                    self._pairs[key] = found
        return found

    def _side(self, device: torch.device) -> Optional[torch.Stream]:
        return None if device.type == "cpu" else self._new_stream(device)


_COPY_STREAMS = CopyStreams()


@contextmanager
def on_stream(stream: Optional[torch.Stream]) -> Iterator[None]:
    """``stream`` current on its device inside the block (thread-safe, unlike ``with
    stream:``, which keeps the stream it replaced on the shared stream object). Setting a
    stream also makes its device current; the current device is restored too."""
    if stream is None:
        yield
        return
    device = torch.accelerator.current_device_index()
    before = torch.accelerator.current_stream(stream.device)
    torch.accelerator.set_stream(stream)
    try:
        yield
    finally:
        torch.accelerator.set_stream(before)
        torch.accelerator.set_device_index(device)


def move(tensor: Optional[Tensor], device: torch.device,
         streams: CopyStreams = _COPY_STREAMS) -> Optional[Tensor]:
    """``tensor`` detached and on ``device``, ready for use on ``device``'s current stream."""
    if tensor is None:
        return None
    tensor = tensor.detach()
    if tensor.device == device or (device.type == "cpu" and tensor.device.type == "cpu"):
        return tensor
    pair = streams.pair(tensor.device, device)
    if pair.source is not None:
        pair.source.wait_stream(torch.accelerator.current_stream(tensor.device))
    with ExitStack() as stack:
        stack.enter_context(on_stream(pair.source))
        stack.enter_context(on_stream(pair.destination))
        moved = tensor.to(device, non_blocking=device.type != "cpu")
    if pair.source is not None:
        tensor.record_stream(pair.source)
    if pair.destination is not None:
        compute = torch.accelerator.current_stream(device)
        compute.wait_stream(pair.destination)
        moved.record_stream(compute)
    return moved
