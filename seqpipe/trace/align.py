"""Clock offsets kept consistent with the messages the ranks exchanged.

An NTP-style estimate (``seqpipe.trace.gather.clock_offsets``) is off by up to half a
round trip, which on a loaded machine can exceed the time between a send and its
receiver's use of the message, so the merged timeline could show a message used before
it was sent. The recorded messages themselves bound each offset: a message sent by rank
``a`` at ``s`` (its clock) and had by rank ``b`` at ``c`` (the end of ``b``'s wait for
it, or else the start of the action that consumed it, on ``b``'s clock) says
``offset_b - offset_a <= c - s``. Each rank's estimate is clamped into the interval its
messages with already-aligned ranks allow (ranks in order: a pipeline's neighbours come
first); an empty interval (clocks that drifted during the recording) leaves the estimate.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from seqpipe.trace.events import Event, EventKind, What

__all__ = ["causal_offsets"]

# which actions consume each message, on the receiving stage
_CONSUMERS = {What.ACTIVATION: (EventKind.FORWARD,), What.SKIP: (EventKind.FORWARD,),
              What.GRADIENT: (EventKind.BACKWARD, EventKind.INPUT_GRAD),
              What.SKIP_GRAD: (EventKind.BACKWARD, EventKind.INPUT_GRAD)}

_Key = Tuple[int, Optional[int], Optional[str], Optional[int], int]  # stage, peer, what, mb, step


def _had(events: Sequence[Event]) -> Dict[_Key, Tuple[int, float]]:
    """When each received message was had: (rank, time) by (stage, sender, what, mb, step)."""
    had: Dict[_Key, Tuple[int, float]] = {}
    starts = {(e.kind, e.stage, e.microbatch, e.step): (e.rank, e.start) for e in events
              if e.kind in (EventKind.FORWARD, EventKind.BACKWARD, EventKind.INPUT_GRAD)}
    for e in events:
        if e.kind is EventKind.WAIT:
            had[(e.stage, e.peer, e.what, e.microbatch, e.step)] = (e.rank, e.end)
    for e in events:
        if e.kind is not EventKind.SEND or e.peer is None:
            continue
        key = (e.peer, e.stage, e.what, e.microbatch, e.step)
        if key in had:
            continue
        for kind in _CONSUMERS.get(e.what or "", ()):
            consumer = starts.get((kind, e.peer, e.microbatch, e.step))
            if consumer is not None:
                had[key] = consumer
                break
    return had


def causal_offsets(offsets: Sequence[float], ranks: Sequence[int],
                   events: Sequence[Event]) -> List[float]:
    """``offsets`` (per group index, of the ranks ``ranks``: global ranks, as in
    ``Event.rank``), each clamped into what the recorded messages allow; see above."""
    index = {rank: i for i, rank in enumerate(ranks)}
    had = _had(events)
    # (sender index, receiver index, c - s): offset_receiver - offset_sender <= c - s
    gaps: List[Tuple[int, int, float]] = []
    for e in events:
        if e.kind is EventKind.SEND and e.peer is not None:
            got = had.get((e.peer, e.stage, e.what, e.microbatch, e.step))
            if got is not None and got[0] != e.rank and got[0] in index and e.rank in index:
                gaps.append((index[e.rank], index[got[0]], got[1] - e.start))
    out = list(offsets)
    for r in range(1, len(out)):
        hi = min((out[a] + gap for a, b, gap in gaps if b == r and a < r), default=None)
        lo = max((out[b] - gap for a, b, gap in gaps if a == r and b < r), default=None)
        if lo is not None and hi is not None and lo > hi:
            continue  # inconsistent bounds: keep the estimate
        if hi is not None:
            out[r] = min(out[r], hi)
        if lo is not None:
            out[r] = max(out[r], lo)
    return out
