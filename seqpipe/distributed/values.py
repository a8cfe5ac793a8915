"""Non-tensor values between processes: a few plain types, as int64 words of a header.

A micro-batch may carry values that are not tensors from one stage to the next (see
``seqpipe.core.microbatch``). Only tensors travel between processes, so such a value rides in
the message header as words: ``None``, ``bool``, ``int`` (64-bit), ``float`` (its IEEE
bits) and ``str`` (UTF-8, as long as the header has room). They arrive as the same type and
value; nothing is pickled. Any other type is a ``TypeError`` naming it. Texts (a failure
notice) use the same byte packing.
"""
from __future__ import annotations

import struct
from typing import Any, List, Sequence, Tuple

__all__ = ["SUPPORTED", "check_values", "to_words", "from_words", "bytes_to_words",
           "words_to_bytes"]

SUPPORTED = "None, bool, int, float and str"
_NONE, _BOOL, _INT, _FLOAT, _STR = range(5)
_TAGS = {type(None): _NONE, bool: _BOOL, int: _INT, float: _FLOAT, str: _STR}
Values = Tuple[Tuple[int, Any], ...]  # (position in the micro-batch's tuple, value)


def check_values(values: Values) -> None:
    """``TypeError`` for a value that cannot travel between processes."""
    for position, value in values:
        if type(value) not in _TAGS:
            raise TypeError(
                f"item {position} of a micro-batch is a {type(value).__name__}, which cannot "
                f"travel between the stages of a DistributedPipe: only tensors and {SUPPORTED} "
                f"values do (nothing is pickled). Make it a tensor, or compute it in the layers "
                f"of the stage that uses it")
        if type(value) is int and not -2 ** 63 <= value < 2 ** 63:
            raise ValueError(f"item {position} of a micro-batch is the int {value}, which "
                             f"does not fit in 64 bits; only 64-bit ints travel between stages")


def bytes_to_words(data: bytes) -> List[int]:
    """``data``'s length, then its bytes packed into little-endian int64 words."""
    padded = data + b"\0" * (-len(data) % 8)
    return [len(data)] + [int.from_bytes(padded[i:i + 8], "little", signed=True)
                          for i in range(0, len(padded), 8)]


def words_to_bytes(words: Sequence[int], pos: int) -> Tuple[bytes, int]:
    """The bytes ``bytes_to_words`` packed from ``words[pos]`` on, and where they end."""
    size = words[pos]
    count = -(-size // 8)
    data = b"".join(w.to_bytes(8, "little", signed=True) for w in words[pos + 1:pos + 1 + count])
    return data[:size], pos + 1 + count


def to_words(values: Values) -> List[int]:
    """The header words of ``values``: their count, then position, type tag and value."""
    check_values(values)
    words = [len(values)]
    for position, value in values:
        tag = _TAGS[type(value)]
        words += [position, tag]
        if tag in (_BOOL, _INT):
            words.append(int(value))
        elif tag == _FLOAT:
            words.append(struct.unpack("<q", struct.pack("<d", value))[0])
        elif tag == _STR:
            words += bytes_to_words(value.encode("utf-8"))
    return words


def from_words(words: Sequence[int], pos: int) -> Values:
    """The values ``to_words`` wrote from ``words[pos]`` on."""
    values = []
    count, pos = words[pos], pos + 1
    for _ in range(count):
        position, tag, pos = words[pos], words[pos + 1], pos + 2
        value: Any = None
        if tag in (_BOOL, _INT):
            value, pos = (bool(words[pos]) if tag == _BOOL else words[pos]), pos + 1
        elif tag == _FLOAT:
            value, pos = struct.unpack("<d", struct.pack("<q", words[pos]))[0], pos + 1
        elif tag == _STR:
            data, pos = words_to_bytes(words, pos)
            value = data.decode("utf-8")
        values.append((position, value))
    return tuple(values)
