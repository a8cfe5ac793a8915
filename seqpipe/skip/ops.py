"""The two requests a skippable ``forward`` can yield: ``stash`` a tensor, or ``pop`` one.

A skippable layer's ``forward`` is a generator. It never touches the skip storage itself;
it *yields* a request and the driver installed by :func:`~seqpipe.skip.skippable` carries it
out against the current skip tracker::

    yield stash("skip", x)      # hand x over; the yield evaluates to None
    x = yield pop("skip")       # receive the tensor stashed under "skip"

Keeping requests as plain values (rather than calls into a tracker) is what lets the same
layer run in a plain ``nn.Sequential`` and inside a pipeline, where the engine decides where
the stashed tensor goes.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["Pop", "Stash", "pop", "stash"]


@dataclass(frozen=True)
class Stash:
    """A request to keep ``tensor`` under ``name`` until a later layer pops it."""

    name: str
    tensor: Tensor | None


@dataclass(frozen=True)
class Pop:
    """A request for the tensor stashed under ``name``."""

    name: str


def _check_name(name: object, what: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"{what}() takes a skip name (str) first, got {type(name).__name__}")
    return name


def stash(name: str, tensor: Tensor | None) -> Stash:
    """Build the request ``yield stash(name, tensor)``; ``tensor`` may be ``None``."""
    _check_name(name, "stash")
    if tensor is not None and not isinstance(tensor, Tensor):
        raise TypeError(
            f"stash('{name}', ...) takes a Tensor or None, got {type(tensor).__name__}")
    return Stash(name, tensor)


def pop(name: str) -> Pop:
    """Build the request ``x = yield pop(name)``."""
    return Pop(_check_name(name, "pop"))
