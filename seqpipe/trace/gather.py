"""One timeline from many processes: events gathered to one rank, on one clock.

Each rank's clock (``time.perf_counter``) has its own origin. The first rank of the group
estimates every other rank's offset NTP-style: it sends its time, the other rank answers
with its own at arrival, and ``offset = t_other - (t_sent + t_back) / 2``, kept from the
round trip (of several) that was shortest, so the error is at most half of it. Events
then travel as tensors, like the transport's messages (float64 times, int64 fields; no
pickled objects), in one ``all_gather`` on the pipeline's group (after one of their
sizes), and the first rank shifts each rank's events onto its own clock, each offset
first clamped into what the recorded messages allow (``seqpipe.trace.align``).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from seqpipe.trace.align import causal_offsets
from seqpipe.trace.events import WHATS, Event, EventKind, Recording, StepRecord

__all__ = ["clock_offsets", "decode", "encode", "gather_recording"]

_KINDS = list(EventKind)
_TAG = 0x5E97  # the clock exchange's messages, apart from the transport's


def _opt(value: Optional[int]) -> int:
    return -1 if value is None else value


def _back(value: int) -> Optional[int]:
    return None if value < 0 else value


def encode(events: Sequence[Event]) -> Tuple[Tensor, Tensor]:
    """``events`` as a float64 ``[n, 2]`` tensor of (start, end) and an int64 ``[n, 7]``
    one of (kind, stage, micro-batch, rank, peer, what, step); -1 stands for ``None``."""
    times = torch.tensor([[e.start, e.end] for e in events], dtype=torch.float64)
    fields = torch.tensor(
        [[_KINDS.index(e.kind), e.stage, _opt(e.microbatch), e.rank, _opt(e.peer),
          -1 if e.what is None else WHATS.index(e.what), e.step] for e in events],
        dtype=torch.int64)
    return times.reshape(-1, 2), fields.reshape(-1, 7)


def decode(times: Tensor, fields: Tensor) -> List[Event]:
    """The events ``encode`` made."""
    return [Event(_KINDS[k], stage, start, end, _back(mb), rank, _back(peer),
                  None if what < 0 else WHATS[what], step)
            for (start, end), (k, stage, mb, rank, peer, what, step)
            in zip(times.tolist(), fields.tolist())]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock_offsets(group: Any, device: torch.device, clock: Callable[[], float],
                  rounds: int = 8) -> List[float]:
    """On the group's first rank: each rank's clock minus the first rank's (0.0 for
    itself); zeros elsewhere. Collective over ``group``."""
    me, n = dist.get_rank(group), dist.get_world_size(group)
    offsets = [0.0] * n
    buffer = torch.zeros(1, dtype=torch.float64, device=device)

    def peer(r: int) -> int:
        return dist.get_global_rank(group, r) if group is not None else r

    if me != 0:
        for _ in range(rounds):
            dist.recv(buffer, peer(0), group=group, tag=_TAG)
            _sync(device)
            buffer.fill_(clock())
            dist.send(buffer, peer(0), group=group, tag=_TAG)
        return offsets
    for r in range(1, n):
        best = (float("inf"), 0.0)
        for _ in range(rounds):
            sent = clock()
            dist.send(buffer, peer(r), group=group, tag=_TAG)
            dist.recv(buffer, peer(r), group=group, tag=_TAG)
            theirs = buffer.item()
            back = clock()
            if back - sent < best[0]:
                best = (back - sent, theirs - (sent + back) / 2)
        offsets[r] = best[1]
    return offsets


def _all_gather(parts: Sequence[Tensor], group: Any, device: torch.device
                ) -> List[List[Tensor]]:
    """Every rank's ``parts`` (2-D tensors whose first dimensions may differ between
    ranks), on the CPU: one all-gather of their sizes, one of their bytes."""
    n = dist.get_world_size(group)
    size = torch.tensor([len(p) for p in parts], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    counts = [s.tolist() for s in sizes]
    widths = [p.element_size() * p.shape[1] for p in parts]  # bytes per row
    longest = max(sum(c * w for c, w in zip(row, widths)) for row in counts)
    mine = torch.zeros(longest, dtype=torch.uint8)
    joined = torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in parts])
    mine[:joined.numel()] = joined
    received = [torch.zeros_like(mine, device=device) for _ in range(n)]
    dist.all_gather(received, mine.to(device), group=group)
    out = []
    for row, buffer in zip(counts, received):
        buffer, pieces, at = buffer.cpu(), [], 0
        for count, width, like in zip(row, widths, parts):
            piece = buffer[at:at + count * width].view(like.dtype)
            pieces.append(piece.reshape(count, like.shape[1]))
            at += count * width
        out.append(pieces)
    return out


def gather_recording(local: Recording, group: Any, device: torch.device,
                     clock: Callable[[], float]) -> Recording:
    """Every rank's ``local`` recording merged, on the group's first rank (on its clock);
    ``local`` itself elsewhere. Collective over ``group``."""
    device = torch.device(device)
    offsets = clock_offsets(group, device, clock)
    times, fields = encode(local.events)
    steps = torch.tensor([[s.index, s.start, s.end] for s in local.steps],
                         dtype=torch.float64).reshape(-1, 3)
    everyone = _all_gather([times, fields, steps], group, device)
    if dist.get_rank(group) != 0:
        return local
    mine = [decode(t, f) for t, f, _ in everyone]
    ranks = [dist.get_global_rank(group, r) if group is not None else r
             for r in range(len(everyone))]
    offsets = causal_offsets(offsets, ranks, [e for events in mine for e in events])
    events = [replace(e, start=e.start - offsets[r], end=e.end - offsets[r])
              for r, rank_events in enumerate(mine) for e in rank_events]
    bounds: Dict[int, Tuple[float, float]] = {}
    for r, (_, _, rows) in enumerate(everyone):
        for index, start, end in rows.tolist():
            lo, hi = bounds.get(int(index), (start - offsets[r], end - offsets[r]))
            bounds[int(index)] = (min(lo, start - offsets[r]), max(hi, end - offsets[r]))
    merged = Recording(events, [_spanning(s, bounds.get(s.index)) for s in local.steps])
    merged.finish()
    return merged


def _spanning(step: StepRecord, bounds: Optional[Tuple[float, float]]) -> StepRecord:
    if bounds is None:
        return step
    return replace(step, start=bounds[0], end=bounds[1])
