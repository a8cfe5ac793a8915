"""The counts users pass — ``chunks``, ``balance`` entries, partition counts — read as ints.

Anything with ``__index__`` is an int here (``numpy.int64(4)`` from a config, a
``torch.Size`` entry), as it is for ``range`` or list indexing; bools and floats are not,
since ``chunks=True`` or ``balance=[1.5, 1.5]`` are mistakes rather than counts. The
messages name the offending value and say what is expected, so none reads as a
contradiction ("must be a positive int, got [2, 1]").
"""
from __future__ import annotations

import operator
from typing import List, Optional

__all__ = ["integer", "check_checkpoint_every", "check_chunks", "layer_counts"]


def integer(value: object) -> Optional[int]:
    """``value`` as a Python int if it is integral (``__index__``) and not a bool, else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def check_chunks(chunks: object) -> int:
    """A valid ``chunks`` (number of micro-batches) as an int, or ``ValueError``."""
    count = integer(chunks)
    if count is None or count <= 0:
        raise ValueError(f"chunks must be a positive int (the number of micro-batches), "
                         f"got {chunks!r}")
    return count


def check_checkpoint_every(every: object) -> Optional[int]:
    """A valid ``checkpoint_every`` (layers per checkpointed segment) as an int, or None
    (the whole partition is one segment), else ``ValueError``."""
    if every is None:
        return None
    count = integer(every)
    if count is None or count <= 0:
        raise ValueError(
            f"checkpoint_every must be a positive int (checkpoint each run of that many "
            f"consecutive layers of a partition separately) or None (the whole partition "
            f"at once), got {every!r}")
    return count


def layer_counts(balance: object, num_layers: int) -> List[int]:
    """``balance`` (layers per partition) as a list of ints summing to ``num_layers``.

    ``TypeError`` when it is not a sequence of counts at all (say ``balance=5``), else
    ``ValueError`` naming the first bad entry or the wrong sum.
    """
    if isinstance(balance, (str, bytes)) or not hasattr(balance, "__iter__"):
        raise TypeError(
            f"balance must be a sequence of layer counts, one per partition, got {balance!r}; "
            f"to have it chosen for you, pass e.g. seqpipe.balance.balance_by_params("
            f"partitions, model)")
    entries = list(balance)  # type: ignore[call-overload]
    if not entries:
        raise ValueError("balance is empty; give the number of layers of each partition")
    counts = [integer(entry) for entry in entries]
    for position, (entry, count) in enumerate(zip(entries, counts)):
        if count is None or count <= 0:
            raise ValueError(
                f"every entry of balance must be a positive int (a partition's number of "
                f"layers, at least 1), but entry {position} of {entries} is {entry!r}")
    checked: List[int] = counts  # type: ignore[assignment]
    if sum(checked) != num_layers:
        raise ValueError(
            f"balance {checked} sums to {sum(checked)} but the module has {num_layers} "
            f"layers; the entries must add up to {num_layers}")
    return checked
