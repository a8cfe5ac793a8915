"""``Costs``: what one micro-batch's actions take on each stage, as ``Auto`` measures them.

A split backward (``I`` then ``W``) does a ``B``'s operations plus its own work (a graph walk,
more engine calls, saved-tensor holders), so ``I + W`` may exceed ``B``; ``backward`` is
the measured ``B`` where it is known, and the simulator then charges a ``B`` that, not
``I + W``. That difference is what makes joining a split that fills no wait worth it
(``seqpipe.schedule.join``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["Costs"]


@dataclass(frozen=True)
class Costs:
    """Seconds per micro-batch of each stage's ``F``, ``I`` and ``W``, and of its whole
    backward ``B`` (``backward``; ``None``: ``B = I + W``, a split that costs nothing)."""

    forward: tuple[float, ...]
    input: tuple[float, ...]
    weight: tuple[float, ...]
    backward: Optional[tuple[float, ...]] = None

    def table(self) -> list[list[float]]:
        """Per kind (``F``, ``B``, ``I``, ``W``), one cost per stage: the simulator's table."""
        full = (list(self.backward) if self.backward is not None
                else [i + w for i, w in zip(self.input, self.weight)])
        return [list(self.forward), full, list(self.input), list(self.weight)]
