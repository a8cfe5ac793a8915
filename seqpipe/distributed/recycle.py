"""What a message costs only once while a call's messages repeat from step to step.

A training loop sends the same planned messages every step (``seqpipe.distributed.plan``),
with the same shapes: an activation of one micro-batch is the same size as the next one's,
and its header says the same thing as the one of the previous step. Two things the wire
made per message are therefore made once and kept:

* ``Spares``: the byte buffer a message is packed into. A buffer whose send has completed
  (the transport waited for it: ``Transport._release``, ``flush``) is kept for the next
  message of the same size, instead of going back to the allocator and a new one being
  taken: on the 2-core CPU machine a fresh 130 KiB buffer after a layer's matmuls costs
  ~25 µs (the allocator's cold bookkeeping), a kept one nothing. At most ``keep`` per size
  (2: what a 1F1B stage has in flight), so a step holds no more than before beyond those.
  Only host buffers are kept: on a GPU the caching allocator already reuses memory, and a
  kept device buffer would have to be ordered against the stream of its send.
* ``Headers``: the decoded header of each planned message. A received header whose bytes
  are those of the same planned message last time (a header is zero-padded, so its bytes
  are a function of what it says) is not read and decoded again; anything else (a new shape,
  a failure notice, an unplanned message) is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional, Tuple

import torch
from torch import Tensor

from seqpipe.distributed.values import Values
from seqpipe.distributed.wire import HEADER_BYTES, Kind, Spec, decode, read_header

__all__ = ["Spares", "Header", "Headers"]


class Spares:
    """Message buffers of this process whose sends completed, kept by size for the next
    message (``keep`` per size; none on a device other than the host's)."""

    def __init__(self, device: torch.device, keep: int = 2) -> None:
        self.device = device
        self.keep = keep if device.type == "cpu" else 0
        self._free: Dict[int, List[Tensor]] = {}
        self._lent: List[Tensor] = []  # taken, not yet told apart (``ours``)

    def take(self, size: int) -> Tensor:
        """A byte buffer of ``size``: a kept one, else a new one."""
        free = self._free.get(size)
        buffer = free.pop() if free else torch.empty(size, dtype=torch.uint8,
                                                     device=self.device)
        self._lent.append(buffer)
        return buffer

    def ours(self, buffer: Tensor) -> bool:
        """Whether ``buffer``, about to be sent, came from ``take`` (it is then to be given
        back once its send completed), not from elsewhere (a payload sent as it is)."""
        for n, lent in enumerate(self._lent):
            if lent is buffer:
                del self._lent[n]
                return True
        return False

    def give(self, buffer: Tensor) -> None:
        """``buffer``'s send has completed: keep it for the next message of its size."""
        free = self._free.setdefault(buffer.numel(), [])
        if len(free) < self.keep:
            free.append(buffer)

    def kept_bytes(self) -> int:
        """Bytes of the buffers kept now."""
        return sum(b.numel() for free in self._free.values() for b in free)


@dataclass(frozen=True)
class Header:
    """A received message's header, decoded: what ``wire.decode`` says, and what it
    implies: the message's ``identity`` (as ``Planned`` names it), the payload's spec and
    its gradient flags (``words``: the raw words, for a failure notice)."""

    kind: Kind
    microbatch: int
    key: int
    count: int
    atomic: bool
    reshaped: bool
    origin: int
    specs: Tuple[Optional[Tuple], ...]
    values: Values
    spec: Spec
    flags: Tuple[bool, ...]
    words: List[int]
    identity: Tuple[Kind, int, int, int]


class Headers:
    """The last decoded header of each planned message, by the key its receiver gives."""

    def __init__(self) -> None:
        self._last: Dict[Hashable, Tuple[bytes, Header]] = {}

    def read(self, host: Tensor, key: Optional[Hashable]) -> Header:
        """The header at the start of ``host`` (a byte tensor in host memory), decoded, or
        the same header as this ``key``'s last one if its bytes are the same (``key``
        None: an unplanned message, always decoded)."""
        raw = host.numpy()[:HEADER_BYTES].tobytes()
        last = self._last.get(key) if key is not None else None
        if last is not None and last[0] == raw:
            return last[1]
        words = read_header(host)
        kind, microbatch, mkey, count, atomic, reshaped, origin, specs, values = decode(words)
        header = Header(kind, microbatch, mkey, count, atomic, reshaped, origin, tuple(specs),
                        values, tuple((s[0], s[2]) for s in specs if s is not None),
                        tuple(bool(s and s[1]) for s in specs), words,
                        (kind, microbatch, mkey, origin))
        if key is not None and kind is not Kind.ABORT:
            self._last[key] = (raw, header)
        return header
