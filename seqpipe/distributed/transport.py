"""Point-to-point messages between pipeline stages over ``torch.distributed``.

Only tensors travel. Every message is a fixed-size int64 header followed by its tensors;
the header names the message kind, the micro-batch, the skip (by its index in the skip
layout, the same on every rank), and each tensor's dtype, shape and whether it wants a
gradient. So uneven micro-batches and batch sizes that change between steps need no
agreement in advance, and a receiver can take messages from a peer in whatever order the
peer sent them (NCCL delivers point-to-point messages between two ranks strictly in
order). Sends are non-blocking: a stage never waits for its neighbour to receive, so
schedules such as 1F1B cannot deadlock on sends. NCCL and gloo share this one code path.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Kind", "Message", "Transport", "PeerError", "HEADER_SLOTS"]

HEADER_SLOTS = 256
_MAGIC = 0x5E9419E
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
           torch.complex128]


_abandoned: List[Tuple[dist.Work, Tensor, int]] = []  # sends left behind by a failed call


class Kind(enum.IntEnum):
    """What a message carries."""

    ACTIVATION = 1
    GRAD = 2
    SKIP = 3
    SKIP_GRAD = 4
    ABORT = 5
    STEP = 6  # from stage 0 at the start of a call: how many micro-batches (``count``)
    DONE = 7  # from the stage that finishes last: every stage has done its part
    LOSS = 8  # from the last stage at the end of a training step: the mini-batch loss


class PeerError(RuntimeError):
    """Another stage failed; raised on every rank that was waiting on it."""


@dataclass
class Message:
    """A received message: its kind, micro-batch, skip index and tensors (None = absent)."""

    kind: Kind
    microbatch: int
    key: int
    tensors: Tuple[Optional[Tensor], ...]
    flags: Tuple[bool, ...]
    count: int = 0  # micro-batches in the call (STEP messages)
    atomic: bool = True  # a single tensor rather than a tuple (activations)


def _encode(kind: Kind, microbatch: int, key: int, count: int, atomic: bool,
            tensors: Sequence[Optional[Tensor]], flags: Sequence[bool]) -> Tensor:
    words = [_MAGIC, int(kind), microbatch, key, count, int(atomic), len(tensors)]
    for tensor, flag in zip(tensors, flags):
        if tensor is None:
            words += [0]
            continue
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"cannot send a {tensor.dtype} tensor between stages; supported: "
                            f"{', '.join(str(d) for d in _DTYPES)}")
        words += [1, _DTYPES.index(tensor.dtype), int(flag), tensor.dim(), *tensor.shape]
    if len(words) > HEADER_SLOTS:
        raise ValueError(f"a message of {len(tensors)} tensors with these shapes needs "
                         f"{len(words)} header slots, more than {HEADER_SLOTS}; send fewer "
                         f"or lower-rank tensors between stages")
    return torch.tensor(words + [0] * (HEADER_SLOTS - len(words)), dtype=torch.int64)


def _encode_text(kind: Kind, text: str) -> Tensor:
    """A header that carries a short UTF-8 text in its spare slots (one message, no tensors)."""
    room = (HEADER_SLOTS - 8) * 8
    data = text.encode("utf-8")[:room]
    data += b"\0" * (-len(data) % 8)
    words = [_MAGIC, int(kind), -1, -1, 0, 1, 0, len(data)]
    words += [int.from_bytes(data[i:i + 8], "little", signed=True) for i in range(0, len(data), 8)]
    return torch.tensor(words + [0] * (HEADER_SLOTS - len(words)), dtype=torch.int64)


def _decode_text(header: List[int]) -> str:
    data = b"".join(w.to_bytes(8, "little", signed=True) for w in header[8:HEADER_SLOTS])
    return data[:header[7]].rstrip(b"\0").decode("utf-8", "replace")


def _decode(header: List[int]) -> Tuple[Kind, int, int, int, bool, List[Optional[Tuple]]]:
    if header[0] != _MAGIC:
        raise RuntimeError("received a corrupt pipeline header: the stages disagree about "
                           "the message order (are all ranks running the same schedule?)")
    kind, microbatch, key, count, atomic, n = header[1:7]
    specs: List[Optional[Tuple]] = []
    pos = 7
    for _ in range(n):
        if header[pos] == 0:
            specs.append(None)
            pos += 1
            continue
        dtype, flag, ndim = _DTYPES[header[pos + 1]], bool(header[pos + 2]), header[pos + 3]
        specs.append((dtype, flag, tuple(header[pos + 4:pos + 4 + ndim])))
        pos += 4 + ndim
    return Kind(kind), microbatch, key, count, bool(atomic), specs


class Transport:
    """Sends and receives stage messages on ``group`` (stage index = rank in the group)."""

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device,
                 timeout: Optional[timedelta] = None) -> None:
        self.group = group
        self.device = device
        self.timeout = timeout
        self._pending: List[Tuple[dist.Work, Tensor, int]] = []

    def _global(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage) if self.group is not None else stage

    def _isend(self, tensor: Tensor, stage: int) -> None:
        tensor = tensor.contiguous()
        work = dist.isend(tensor, dst=self._global(stage), group=self.group)
        assert work is not None
        self._pending.append((work, tensor, stage))

    def _recv(self, tensor: Tensor, stage: int) -> Tensor:
        work = dist.irecv(tensor, src=self._global(stage), group=self.group)
        assert work is not None
        if self.timeout is None:
            work.wait()
        else:
            work.wait(self.timeout)
        return tensor

    def send(self, stage: int, kind: Kind, microbatch: int, tensors: Sequence[Optional[Tensor]],
             flags: Optional[Sequence[bool]] = None, *, key: int = -1, count: int = 0,
             atomic: bool = True) -> None:
        """Queue a message to ``stage``; returns at once."""
        flags = flags if flags is not None else [False] * len(tensors)
        header = _encode(kind, microbatch, key, count, atomic, tensors, flags).to(self.device)
        self._isend(header, stage)
        for tensor in tensors:
            if tensor is not None:
                self._isend(tensor.detach(), stage)

    def recv(self, stage: int) -> Message:
        """The next message from ``stage``; raises ``PeerError`` if it reports a failure."""
        header = self._recv(torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self.device),
                            stage).tolist()
        kind, microbatch, key, count, atomic, specs = _decode(header)
        if kind is Kind.ABORT:
            raise PeerError(_decode_text(header))
        tensors = tuple(None if spec is None else self._recv(
            torch.empty(spec[2], dtype=spec[0], device=self.device), stage) for spec in specs)
        flags = tuple(bool(spec and spec[1]) for spec in specs)
        return Message(kind, microbatch, key, tensors, flags, count, atomic)

    def abort(self, stages: Sequence[int], text: str,
              patience: timedelta = timedelta(seconds=2)) -> None:
        """Tell ``stages`` that this one failed, so they raise instead of waiting.

        The news is one message (the text rides in the header), so a peer already waiting
        on this stage gets all of it even if this process exits right after. It waits up to
        ``patience`` for the sends to go out, polling rather than waiting with a timeout
        (gloo closes a connection whose wait times out), and keeps unfinished sends alive
        (dropping one can cancel it); a dead peer cannot be told, and is skipped.
        """
        header = _encode_text(Kind.ABORT, text).to(self.device)
        for stage in stages:
            try:
                self._isend(header, stage)
            except Exception:  # noqa: BLE001 - a dead peer cannot be told; the others can
                pass
        pending, self._pending = self._pending, []
        deadline = time.monotonic() + patience.total_seconds()
        while time.monotonic() < deadline and not all(w.is_completed() for w, _, _ in pending):
            time.sleep(0.005)
        _abandoned.extend(pending)

    def flush(self) -> None:
        """Wait until every queued send has gone out; ``PeerError`` names a lost receiver."""
        pending, self._pending = self._pending, []
        for work, _, stage in pending:
            try:
                work.wait()
            except Exception as exc:
                raise PeerError(f"lost stage {stage} while sending to it: "
                                f"{type(exc).__name__}: {exc}") from exc
