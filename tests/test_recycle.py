"""What the message path makes once while messages repeat (``seqpipe.distributed.recycle``):
send buffers kept for the next message of their size, and headers decoded once per planned
message. One process, ``torch.distributed`` faked (every send completes at once); the
multi-process tests (``test_transport.py``, ``test_distributed*.py``) check the values
that travel through kept buffers against the unpipelined model, step after step."""
from __future__ import annotations

from typing import Any, Iterator, List, Tuple
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from seqpipe.distributed import recycle, wire
from seqpipe.distributed.plan import Planned
from seqpipe.distributed.recycle import Headers, Spares
from seqpipe.distributed.transport import Kind, Transport

CPU = torch.device("cpu")


class _Done:
    """A send that completed at once."""

    def is_completed(self) -> bool:
        return True

    def wait(self, *args: Any) -> bool:
        return True


@pytest.fixture
def sent() -> Iterator[List[Tuple[Tensor, bytes]]]:
    """Every tensor the transport sends, as the object sent and its bytes when sent."""
    log: List[Tuple[Tensor, bytes]] = []

    def isend(buffer: Tensor, dst: int, group: Any = None, tag: int = 0) -> _Done:
        log.append((buffer, buffer.detach().contiguous().view(-1).view(torch.uint8)
                    .numpy().tobytes()))
        return _Done()

    with mock.patch.object(dist, "isend", isend), \
            mock.patch.object(dist, "get_backend", lambda group=None: "gloo"), \
            mock.patch.object(dist, "get_rank", lambda group=None: 0):
        yield log


def _call(transport: Transport, tensors: List[Tensor]) -> None:
    """One call that sends stage 1 an activation per tensor, then ends. (In the first call
    the receiver has posted headers only, so a payload follows its header apart.)"""
    planned = [Planned(Kind.ACTIVATION, i, -1, i, i, 0) for i in range(len(tensors))]
    transport.begin()
    transport.will_send(1, planned)
    for i, tensor in enumerate(tensors):
        transport.send(1, Kind.ACTIVATION, i, [tensor], [False], origin=0)
    transport.flush()


def test_a_completed_send_buffer_carries_the_next_message_of_its_size(sent: Any) -> None:
    transport = Transport(None, CPU)
    first, second = torch.arange(6.0).view(2, 3), torch.full((2, 3), 7.0)
    _call(transport, [first])
    sent.clear()
    _call(transport, [first])
    _call(transport, [second])
    (buffer0, bytes0), (buffer1, bytes1) = sent
    assert buffer1 is buffer0  # the same buffer, taken back after its send completed
    header = wire.read_header(buffer1)
    assert header[2] == 0  # micro-batch 0 both times; the payload is the second one's:
    assert bytes1[wire.HEADER_BYTES:wire.HEADER_BYTES + 24] == second.numpy().tobytes()
    assert bytes0[wire.HEADER_BYTES:wire.HEADER_BYTES + 24] == first.numpy().tobytes()


def test_at_most_two_buffers_are_kept_per_size(sent: Any) -> None:
    transport = Transport(None, CPU)
    _call(transport, [torch.ones(2, 3) * i for i in range(4)])
    sent.clear()
    _call(transport, [torch.ones(2, 3) * i for i in range(4)])  # four in flight at once
    payload = wire.nbytes(((torch.float32, (2, 3)),))
    assert len({id(b) for b, _ in sent}) == 4
    # two of each size: header and payload, and (the first call's) header, payload apart
    assert transport._spares.kept_bytes() == 2 * (wire.HEADER_BYTES + payload) + \
        2 * wire.HEADER_BYTES + 2 * payload
    sent.clear()
    _call(transport, [torch.ones(2, 3)] * 3)
    assert len({id(b) for b, _ in sent}) == 3  # two kept ones, then a new one


def test_a_payload_sent_as_it_is_is_never_kept(sent: Any) -> None:
    transport = Transport(None, CPU)
    transport.direct_bytes = 1  # every one-tensor payload apart from its header, uncopied
    payload = torch.ones(2, 3)
    for _ in range(3):  # (the second call onwards posts the payload apart: ``shapes``)
        _call(transport, [payload])
    last_header, last_payload = sent[-2][0], sent[-1][0]
    assert last_payload.data_ptr() == payload.data_ptr()  # the caller's tensor itself
    assert last_header.numel() == wire.HEADER_BYTES
    assert transport._spares.kept_bytes() <= 2 * wire.HEADER_BYTES  # headers only
    assert all(b.data_ptr() != payload.data_ptr() for free in transport._spares._free.values()
               for b in free)


def test_device_buffers_are_not_kept() -> None:
    spares = Spares(torch.device("meta"))
    spares.give(spares.take(64))
    assert spares.kept_bytes() == 0
    host = Spares(CPU)
    buffer = host.take(64)
    assert host.ours(buffer) and not host.ours(buffer) and not host.ours(torch.empty(64))
    host.give(buffer)
    assert host.take(64) is buffer


def _message(microbatch: int, shape: Tuple[int, ...], reshaped: bool = False) -> Tensor:
    tensor = torch.zeros(shape)
    words = wire.header_words(Kind.ACTIVATION, microbatch, -1, 0, True, reshaped, [tensor],
                              [True], origin=0, values=((1, "a"),))
    spec = wire.spec_of([tensor])
    return wire.pack(words, [tensor], wire.HEADER_BYTES + wire.nbytes(spec), CPU)


def test_a_repeated_header_is_decoded_once_and_a_changed_one_again() -> None:
    headers = Headers()
    calls: List[int] = []
    decode = wire.decode

    def counted(words: List[int]) -> Any:
        calls.append(words[2])
        return decode(words)

    key = (1, (Kind.ACTIVATION, 3, -1, 0))
    with mock.patch.object(recycle, "decode", counted):
        first = headers.read(_message(3, (2, 3)), key)
        again = headers.read(_message(3, (2, 3)), key)  # another buffer, the same bytes
        assert calls == [3] and again is first
        assert (first.identity, first.spec, first.flags, first.values, first.reshaped) == (
            (Kind.ACTIVATION, 3, -1, 0), ((torch.float32, (2, 3)),), (True,), ((1, "a"),),
            False)
        other = headers.read(_message(3, (4, 3), reshaped=True), key)  # a new shape
        assert other.spec == ((torch.float32, (4, 3)),) and other.reshaped
        unplanned = headers.read(_message(3, (4, 3), reshaped=True), None)
        assert unplanned == other and unplanned is not other  # no key: always decoded
        abort = wire.encode_text(Kind.ABORT, "stage 1 failed").view(torch.uint8)
        for _ in range(2):  # a failure notice: never kept
            assert headers.read(abort, key).kind is Kind.ABORT
    assert calls == [3, 3, 3, -1, -1]
    assert wire.decode_text(headers.read(abort, key).words) == "stage 1 failed"
