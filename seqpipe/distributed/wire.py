"""The wire format of a pipeline message: one byte buffer, a header and then the tensors.

Only tensors travel. The header (``HEADER_SLOTS`` int64 words) names the message kind, the
micro-batch, the stage whose action sends it (a rank may hold several stages), the skip
(by its index in the skip layout, the same on every rank), whether the payload had
another shape than the receiver expected ("reshaped"), and each tensor's
dtype, shape and whether it wants a gradient, then the micro-batch's non-tensor values
(``seqpipe.distributed.values``: a few plain types, as words); a failure notice carries its
text in the header instead. The tensors follow in the same buffer, each at an offset
aligned for any dtype, so a receiver takes them out as views, without copying. One buffer
per message rather than one per tensor halves the rendezvous a hop costs (each point-to-point
operation is a handshake with the peer), at the price of one copy of the payload on each
side. Where that copy costs more than a second operation, a payload of one large tensor
goes apart from its header, as the tensor itself, into a tensor the receiver posted beside
the header's receive (``direct``, ``buffers``, ``receives``).
"""
from __future__ import annotations

import enum
import functools
import math
import struct
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from seqpipe.distributed.values import Values, bytes_to_words, from_words, to_words, words_to_bytes

__all__ = ["HEADER_SLOTS", "HEADER_BYTES", "Kind", "Message", "Spec", "spec_of", "nbytes",
           "pack", "unpack", "encode", "header_words", "as_header", "encode_text", "decode",
           "decode_text", "read_header", "DIRECT_BYTES", "direct", "as_sent", "placeholder",
           "buffers", "receives"]

HEADER_SLOTS = 256
HEADER_BYTES = HEADER_SLOTS * 8
DIRECT_BYTES = 1 << 20  # a one-tensor payload this large travels apart, uncopied (``direct``)
_ALIGN = 16  # payload offsets: a multiple of every dtype's size, so views need no copy
_MAGIC = 0x5E9419E
_FIXED = 9  # magic, kind, micro-batch, key, count, atomic, reshaped, origin, number of tensors
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
           torch.complex128]
_DTYPE_INDEX = {dtype: n for n, dtype in enumerate(_DTYPES)}
# Host tensors of these dtypes are copied into a message through NumPy's view of both
# (one call, where torch's slicing, viewing and copying cost several): the rest (bfloat16,
# complex, device tensors) through torch.
_NUMPY_COPIES = frozenset((torch.float32, torch.float64, torch.float16, torch.int64,
                           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool))

Spec = Tuple[Tuple[torch.dtype, Tuple[int, ...]], ...]  # a payload: each tensor's dtype, shape

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


@dataclass
class Message:
    """A received message: its kind, micro-batch, skip index, tensors (None = absent)
    and non-tensor values."""

    kind: Kind
    microbatch: int
    key: int
    tensors: Tuple[Optional[Tensor], ...]
    flags: Tuple[bool, ...]
    count: int = 0  # micro-batches in the call (STEP messages)
    atomic: bool = True  # a single tensor rather than a tuple (activations)
    origin: int = -1  # the stage whose action sent it (-1: the call's opening and close)
    values: Values = ()  # an activation's non-tensor items, with their positions


def spec_of(tensors: Iterable[Optional[Tensor]]) -> Spec:
    return tuple((t.dtype, tuple(t.shape)) for t in tensors if t is not None)


def _sizes(spec: Spec) -> List[int]:
    return [math.prod(shape) * dtype.itemsize for dtype, shape in spec]


@functools.lru_cache(maxsize=4096)  # asked twice per message, of a few specs per call
def nbytes(spec: Spec) -> int:
    """The bytes ``spec``'s tensors take in a message, each aligned."""
    return sum(-(-n // _ALIGN) * _ALIGN for n in _sizes(spec))


Alloc = Callable[[int], Tensor]  # a byte buffer of this many bytes on the transport's device


def pack(header: Union[Tensor, List[int], None], tensors: Sequence[Tensor], size: int,
         device: torch.device, *, pin: bool = False, alloc: Optional[Alloc] = None) -> Tensor:
    """One byte buffer of ``size``: the header (if any), then each tensor, aligned.

    ``header``: a header tensor (``encode``; from pinned memory on a GPU, its copy is
    queued and the host does not wait), or its words (``header_words``), which a host
    buffer takes in place, without a header tensor or a copy (a device buffer gets them
    as a header tensor, in pinned memory with ``pin``). ``alloc``: where the buffer comes
    from (a kept one: ``seqpipe.distributed.recycle.Spares``), else a new one.
    """
    buffer = alloc(size) if alloc is not None else torch.empty(size, dtype=torch.uint8,
                                                               device=device)
    host = buffer.numpy() if device.type == "cpu" else None
    offset = 0
    if header is not None:
        if isinstance(header, list) and host is not None:
            host[:HEADER_BYTES] = 0
            struct.pack_into(f"={len(header)}q", host, 0, *header)
        else:
            if isinstance(header, list):
                header = as_header(header, pin)
            buffer[:HEADER_BYTES].copy_(header.view(torch.uint8), non_blocking=True)
        offset = HEADER_BYTES
    if not tensors:
        buffer[offset:].zero_()  # a placeholder: send zeros, not stale memory
        return buffer
    for tensor in tensors:
        n = tensor.numel() * tensor.element_size()
        if host is not None and tensor.dtype in _NUMPY_COPIES and tensor.device == device \
                and not tensor.is_neg():  # (a negated view: NumPy cannot read it)
            host[offset:offset + n] = np.ascontiguousarray(tensor.detach().numpy()).view(
                np.uint8).reshape(-1)
        else:
            data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            buffer[offset:offset + n].copy_(data)
        offset += -(-n // _ALIGN) * _ALIGN
    return buffer


def direct(spec: Spec, least: Optional[int] = DIRECT_BYTES) -> bool:
    """Whether a message whose receiver posted ``spec`` sends its payload apart from its
    header, as the tensor itself: one tensor of at least ``least`` bytes (None: never).

    Sender and receiver decide from the same posted spec, so they agree without a word.
    The second point-to-point operation pays where the copy it saves costs more: on this
    project's 2-core CPU machine the sender's CPU per message is level at 1 MiB, a quarter
    to three fifths lower at 4-8 MiB, and no lower below 1 MiB (``benchmarks/dist_direct.py``,
    docs/benchmark-history.md "Session 10: hop3"). The receiver gains little either way.
    """
    return least is not None and len(spec) == 1 and nbytes(spec) >= least


def as_sent(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` as a direct message sends it: on ``device``, dense, its negation or
    conjugation (a view's flag) applied, sharing its memory where it can (no copy)."""
    return tensor.detach().to(device).resolve_conj().resolve_neg().contiguous()


def placeholder(spec: Spec, device: torch.device) -> Tensor:
    """Zeros the size of a direct receive posted for ``spec``: what fills it when the
    message carries something else (a new shape, a failure notice)."""
    (dtype, shape), = spec
    return torch.zeros(shape, dtype=dtype, device=device)


def buffers(header: Union[Tensor, List[int]], payload: Sequence[Tensor], expected: Spec,
            device: torch.device, *, least: Optional[int] = DIRECT_BYTES,
            pin: bool = False, alloc: Optional[Alloc] = None,
            actual: Optional[Spec] = None) -> List[Tensor]:
    """What a message sends, in order, to fill the receives its peer posted for a payload
    of ``expected`` (``receives``): the header, and

    * ``payload`` as it is, apart from the header (``direct``), or in one buffer after it,
      where it is the payload expected;
    * else a placeholder of the posted size (after the header, or apart from it), and then
      the payload on its own (the header says so: "reshaped"). A failure notice is a
      header whose payload is ``[]``.

    The byte buffers (not a payload sent as it is, nor a placeholder) come from ``alloc``;
    ``actual``: ``spec_of(payload)``, where the caller has it.
    """
    actual = spec_of(payload) if actual is None else actual
    reshaped = actual != expected
    if direct(expected, least):
        sent = [pack(header, [], HEADER_BYTES, device, pin=pin, alloc=alloc),
                placeholder(expected, device) if reshaped else as_sent(payload[0], device)]
    else:
        sent = [pack(header, [] if reshaped else payload,
                     HEADER_BYTES + nbytes(expected), device, pin=pin, alloc=alloc)]
    if reshaped and payload:
        sent.append(pack(None, payload, nbytes(actual), device, alloc=alloc))
    return sent


def receives(expected: Spec, device: torch.device, least: Optional[int] = DIRECT_BYTES
             ) -> Tuple[Tensor, Optional[Tensor]]:
    """The buffers posted for a message whose payload is expected to be ``expected``: the
    header and that payload in one byte buffer, or the header and, apart, the payload's
    tensor itself (``direct``), which the message's layer then takes as it is."""
    if not direct(expected, least):
        return torch.empty(HEADER_BYTES + nbytes(expected), dtype=torch.uint8,
                           device=device), None
    (dtype, shape), = expected
    return (torch.empty(HEADER_BYTES, dtype=torch.uint8, device=device),
            torch.empty(shape, dtype=dtype, device=device))


def unpack(buffer: Tensor, offset: int, spec: Spec) -> List[Tensor]:
    """The tensors of ``spec`` laid out in ``buffer`` from ``offset``: each shares the
    buffer's storage (no copy), set on it at its offset (one call, not a slice and two
    views; offsets are aligned for every dtype)."""
    tensors = []
    storage = buffer.untyped_storage()
    base = buffer.storage_offset() + offset
    for dtype, shape in spec:
        tensors.append(torch.empty(0, dtype=dtype, device=buffer.device).set_(
            storage, base // dtype.itemsize, shape))
        base += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
    return tensors


def encode(kind: Kind, microbatch: int, key: int, count: int, atomic: bool, reshaped: bool,
           tensors: Sequence[Optional[Tensor]], flags: Sequence[bool], *,
           pin: bool = False, origin: int = -1, values: Values = ()) -> Tensor:
    """The header of a message, on the host (in pinned memory with ``pin``)."""
    return as_header(header_words(kind, microbatch, key, count, atomic, reshaped, tensors,
                                  flags, origin=origin, values=values), pin)


def header_words(kind: Kind, microbatch: int, key: int, count: int, atomic: bool,
                 reshaped: bool, tensors: Sequence[Optional[Tensor]], flags: Sequence[bool],
                 *, origin: int = -1, values: Values = ()) -> List[int]:
    """The words of a message's header (``encode`` makes them a header tensor; ``pack``
    writes them straight into a host buffer); ``TypeError`` or ``ValueError`` for what
    the wire cannot carry."""
    words = [_MAGIC, int(kind), microbatch, key, count, int(atomic), int(reshaped), origin,
             len(tensors)]
    for tensor, flag in zip(tensors, flags):
        if tensor is None:
            words += [0]
            continue
        index = _DTYPE_INDEX.get(tensor.dtype)
        if index is None:
            raise TypeError(f"cannot send a {tensor.dtype} tensor between stages; supported: "
                            f"{', '.join(str(d) for d in _DTYPES)}")
        words += [1, index, int(flag), tensor.dim(), *tensor.shape]
    words += to_words(values)
    if len(words) > HEADER_SLOTS:
        raise ValueError(f"a message of {len(tensors)} tensors with these shapes and "
                         f"{len(values)} non-tensor values needs {len(words)} header slots, "
                         f"more than {HEADER_SLOTS}; send fewer or lower-rank tensors, or "
                         f"shorter strings, between stages")
    return words


def as_header(words: List[int], pin: bool) -> Tensor:
    """``words`` as the ``HEADER_SLOTS`` int64 words of a header, zero-padded.

    Packed by ``struct`` into a zeroed byte array that the tensor then shares: a fraction of
    what ``torch.tensor`` of a Python list costs per message (~3 µs against ~55 µs).
    """
    data = bytearray(HEADER_BYTES)
    struct.pack_into(f"={len(words)}q", data, 0, *words)
    header = torch.frombuffer(data, dtype=torch.int64)
    return header.pin_memory() if pin else header


_WORDS = struct.Struct(f"={HEADER_SLOTS}q")


def read_header(buffer: Tensor) -> List[int]:
    """The header words at the start of ``buffer``, a byte tensor in host memory (read
    through NumPy's view of it: a third of what ``.tolist()`` of an int64 view costs)."""
    return list(_WORDS.unpack_from(buffer.numpy()))


def encode_text(kind: Kind, text: str, *, pin: bool = False) -> Tensor:
    """A header that carries a short UTF-8 text in its spare slots (one message, no tensors)."""
    room = (HEADER_SLOTS - _FIXED - 1) * 8
    words = [_MAGIC, int(kind), -1, -1, 0, 1, 0, -1, 0]
    return as_header(words + bytes_to_words(text.encode("utf-8")[:room]), pin)


def decode_text(header: List[int]) -> str:
    return words_to_bytes(header, _FIXED)[0].decode("utf-8", "replace")


def decode(header: List[int]
           ) -> Tuple[Kind, int, int, int, bool, bool, int, List[Optional[Tuple]], Values]:
    if header[0] != _MAGIC:
        raise RuntimeError("received a corrupt pipeline header: the stages disagree about "
                           "the message order (are all ranks running the same schedule?)")
    kind, microbatch, key, count, atomic, reshaped, origin, n = header[1:_FIXED]
    specs: List[Optional[Tuple]] = []
    pos = _FIXED
    for _ in range(n):
        if header[pos] == 0:
            specs.append(None)
            pos += 1
            continue
        dtype, flag, ndim = _DTYPES[header[pos + 1]], bool(header[pos + 2]), header[pos + 3]
        specs.append((dtype, flag, tuple(header[pos + 4:pos + 4 + ndim])))
        pos += 4 + ndim
    values = from_words(header, pos) if kind != Kind.ABORT else ()  # ABORT: text follows
    return (Kind(kind), microbatch, key, count, bool(atomic), bool(reshaped), origin, specs,
            values)
