"""The transport's point-to-point calls (``seqpipe.distributed.p2p``): a message buffer goes
to its process group directly, without ``dist.isend``/``irecv``'s per-call checks; anything
else, and everything while those functions are wrapped, goes through them. One process,
the group faked; the multi-process tests (``test_transport.py``, ``test_distributed*.py``)
send every message of a real pipeline this way and check it against the unpipelined model."""
from __future__ import annotations

from typing import Any, Iterator, List, Tuple
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from seqpipe.distributed import p2p
from seqpipe.distributed.plan import Planned
from seqpipe.distributed.transport import Kind, Transport

CPU = torch.device("cpu")


class _Done:
    def is_completed(self) -> bool:
        return True

    def wait(self, *args: Any) -> bool:
        return True


class FakeGroup:
    """A process group that records each operation it is asked for."""

    def __init__(self) -> None:
        self.calls: List[Tuple[str, List[Tensor], int, int]] = []

    def send(self, tensors: List[Tensor], rank: int, tag: int) -> _Done:
        self.calls.append(("send", tensors, rank, tag))
        return _Done()

    def recv(self, tensors: List[Tensor], rank: int, tag: int) -> _Done:
        self.calls.append(("recv", tensors, rank, tag))
        return _Done()


@pytest.fixture
def group() -> Iterator[FakeGroup]:
    fake = FakeGroup()
    with mock.patch.object(dist, "get_backend", lambda group=None: "gloo"), \
            mock.patch.object(dist, "get_rank", lambda group=None: 0), \
            mock.patch.object(dist, "get_global_rank", lambda group, rank: rank + 4):
        yield fake


def test_a_message_buffer_goes_to_the_group_directly(group: FakeGroup) -> None:
    transport = Transport(group, CPU)  # type: ignore[arg-type]
    transport.begin()
    transport.will_send(1, [Planned(Kind.ACTIVATION, 0, -1, 0, 0, 0)])
    tensor = torch.arange(6.0).view(2, 3)
    transport.send(1, Kind.ACTIVATION, 0, [tensor], [False], origin=0)
    # (a first call: the receiver posted a header only, so the payload follows apart)
    assert [(op, len(tensors), rank, tag) for op, tensors, rank, tag in group.calls] == \
        [("send", 1, 1, 0)] * 2  # the peer's rank in the group (not the world's, 5)
    buffer = group.calls[-1][1][0]
    assert buffer.dtype is torch.uint8
    assert torch.equal(buffer[:24].view(torch.float32).view(2, 3), tensor)
    transport.flush()


def test_a_posted_receive_goes_to_the_group_directly(group: FakeGroup) -> None:
    transport = Transport(group, CPU)  # type: ignore[arg-type]
    buffer = torch.empty(64, dtype=torch.uint8)
    transport._irecv(buffer, 1)
    assert [(op, tensors[0] is buffer, rank, tag) for op, tensors, rank, tag in group.calls] \
        == [("recv", True, 1, 0)]


def test_other_tensors_take_torchs_functions(group: FakeGroup) -> None:
    """A payload sent as it is (any dtype) keeps ``dist.isend``'s checks, with the world
    rank it takes."""
    seen: List[Tuple[str, Tensor, int, Any]] = []

    def isend(tensor: Tensor, dst: int, group: Any = None) -> _Done:
        seen.append(("isend", tensor, dst, group))
        return _Done()

    def irecv(tensor: Tensor, src: int, group: Any = None) -> _Done:
        seen.append(("irecv", tensor, src, group))
        return _Done()

    payload = torch.zeros(4)
    with mock.patch.object(dist, "isend", isend), mock.patch.object(p2p, "_ISEND", isend), \
            mock.patch.object(dist, "irecv", irecv), mock.patch.object(p2p, "_IRECV", irecv):
        p2p.isend(payload, group, 1)  # type: ignore[arg-type]
        p2p.irecv(payload, group, 1)  # type: ignore[arg-type]
        p2p.isend(torch.zeros(4, dtype=torch.uint8), group, 1)  # type: ignore[arg-type]
    assert [(op, t is payload, rank, g is group) for op, t, rank, g in seen[:2]] == \
        [("isend", True, 5, True), ("irecv", True, 5, True)]
    assert len(seen) == 2 and len(group.calls) == 1  # the byte buffer: the group's own


def test_a_wrapped_isend_sees_every_operation(group: FakeGroup) -> None:
    """While a test or a benchmark wraps ``dist.isend``/``irecv`` (to record, or to make a
    send fail), every operation goes through the wrapper."""
    seen: List[str] = []

    def isend(tensor: Tensor, dst: int, group: Any = None) -> _Done:
        seen.append(f"isend {dst}")
        return _Done()

    def irecv(tensor: Tensor, src: int, group: Any = None) -> _Done:
        seen.append(f"irecv {src}")
        return _Done()

    buffer = torch.zeros(8, dtype=torch.uint8)
    with mock.patch.object(dist, "isend", isend), mock.patch.object(dist, "irecv", irecv):
        p2p.isend(buffer, group, 1)  # type: ignore[arg-type]
        p2p.irecv(buffer, group, 1)  # type: ignore[arg-type]
    assert seen == ["isend 5", "irecv 5"] and group.calls == []
