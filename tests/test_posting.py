"""When the transport posts a receive (``Transport.recv``): the next message from a peer as
soon as the one before it arrived, so its data flows while the rank computes, but ``DONE``
only when it is needed: it comes after the rank's last message anyway, and posting it on the
arrival of the last activation put a receive (~0.1 ms of CPU) before the last stage's last
forward. One process: two transports joined by a faked wire (each receive takes the next
buffer sent its way); the multi-process tests run the real pipelines."""
from __future__ import annotations

from collections import deque
from typing import Any, Deque, Dict, Iterator, List, Tuple
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from seqpipe.distributed.plan import Planned
from seqpipe.distributed.transport import Kind, Transport

CPU = torch.device("cpu")


class _Sent:
    def is_completed(self) -> bool:
        return True

    def wait(self, *args: Any) -> bool:
        return True


class _Received:
    """A posted receive: waiting copies the next buffer sent its way into it."""

    def __init__(self, wire: "Wire", buffer: Tensor, key: Tuple[int, int]) -> None:
        self.wire, self.buffer, self.key, self.done = wire, buffer, key, False

    def is_completed(self) -> bool:
        return self.done

    def wait(self, *args: Any) -> bool:
        if not self.done:
            sent = self.wire.queues[self.key].popleft()
            assert sent.numel() == self.buffer.numel(), "a receive of another size than sent"
            self.buffer.copy_(sent)
            self.done = True
        return True


class Wire:
    """Two ranks' point-to-point operations in one process, in order per direction."""

    def __init__(self) -> None:
        self.queues: Dict[Tuple[int, int], Deque[Tensor]] = {(0, 1): deque(), (1, 0): deque()}
        self.posted: List[Tuple[int, int]] = []  # (receiver, sender) of every receive posted

    def isend(self, tensor: Tensor, dst: int, group: Any = None) -> _Sent:
        self.queues[(1 - dst, dst)].append(tensor.detach().clone().view(-1).view(torch.uint8))
        return _Sent()

    def irecv(self, tensor: Tensor, src: int, group: Any = None) -> _Received:
        self.posted.append((1 - src, src))
        return _Received(self, tensor.view(-1).view(torch.uint8), (src, 1 - src))


@pytest.fixture
def wire() -> Iterator[Wire]:
    fake = Wire()
    with mock.patch.object(dist, "isend", fake.isend), \
            mock.patch.object(dist, "irecv", fake.irecv), \
            mock.patch.object(dist, "get_backend", lambda group=None: "gloo"):
        yield fake


def _transport(rank: int) -> Transport:
    with mock.patch.object(dist, "get_rank", lambda group=None: rank):
        return Transport(None, CPU)


def test_done_is_posted_when_needed_not_on_the_last_activation(wire: Wire) -> None:
    plan = [Planned(Kind.ACTIVATION, i, -1, i, i, 0) for i in range(2)] + \
        [Planned(Kind.DONE, -1, -1, 2, 2)]
    sender, receiver = _transport(0), _transport(1)
    for _ in range(2):  # the second call: sizes known, every receive posted ahead
        sender.begin()
        receiver.begin()
        sender.will_send(1, plan)
        receiver.expect(0, plan)
        wire.posted.clear()
        for i in range(2):
            sender.send(1, Kind.ACTIVATION, i, [torch.full((2, 3), float(i))], [False],
                        origin=0)
            message = receiver.recv(0)
            assert torch.equal(message.tensors[0], torch.full((2, 3), float(i)))
        posted_before_done = len(wire.posted)
        sender.send(1, Kind.DONE, -1, [])
        assert receiver.recv(0).kind is Kind.DONE
        sender.flush()
        receiver.flush()
    # activation 0 (posted at the first recv), activation 1 (on 0's arrival); DONE: later
    assert posted_before_done == 2
    assert len(wire.posted) == 3
