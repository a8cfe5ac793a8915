"""One hop of a pipeline step, end to end: where the time between two stages' actions goes.

``sleep_timeline.py --hops`` installs this in every rank: ``torch.distributed.isend`` and
``irecv`` are wrapped so that each point-to-point operation records its peer, its size,
when it was issued, and when the first ``wait`` on it began and returned (its work object
is wrapped). Any runtime that calls them (seqpipe's ``Transport``, torch pipelining's
``PipelineStage`` through ``P2POp``) is recorded the same way.

A hop on the measured critical path (``sleep_timeline.critical_path``) goes from a sender's
action end to the receiver's action start. Its message is the sender's first ``isend`` to
the receiver after that action ended, and the receive is the one with the same ordinal on
the receiver's side (the n-th send from one rank to another meets the n-th receive, per
direction, in both runtimes). The hop then splits into:

* ``build``: sender's action end → its ``isend`` issued (autograd's output, packing the
  message, the runtime's bookkeeping);
* ``posted late``: how long after the send the receiver issued the receive (0 when posted
  ahead; gloo hands the data over only once both ends are there);
* ``wire``: the later of the send and the receive's wait start → the wait's return (gloo,
  the socket, the receiver's wake-up);
* ``waited before``: the receiver's previous action end → its wait start on this message
  (what it did first: other waits, posting, bookkeeping; only while it was not yet the
  message's turn: when the message came later than this, it is not on the path);
* ``to layer``: the wait's return → the receiver's action start (decoding the header,
  unpacking, posting the next receive, the runtime up to the layer);
* ``other waits``: the receiver's time inside waits on other operations between the
  message's wait return and its action start (a send it waits for, another receive).

The step's edges (``split_edges``): the sends and receives the first action's rank issued
before that action (``head sends``/``head recvs``, counts), and the tail from the last
action's end: to the last send its rank issued (``tail to last send``: closing messages
built and sent), from there to the last wait's return on any rank (``tail wire``), and
from there to the step's end on the last rank (``tail return``).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

__all__ = ["install", "LOG", "split_hop", "split_edges", "HOP_PARTS", "EDGE_PARTS",
           "summarize"]

# one row per point-to-point operation: [kind, peer (global rank), bytes, issued,
# wait start, wait end]
Row = List[Any]
LOG: List[Row] = []
HOP_PARTS = ("build", "posted late", "wire", "to layer", "other waits")
EDGE_PARTS = ("head sends", "head recvs", "tail to last send", "tail wire", "tail return")


class _TimedWork:
    """A work object that records its first wait in its row of ``LOG``."""

    def __init__(self, work: Any, row: Row) -> None:
        self._work, self._row = work, row

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            if self._row[4] is None:
                self._row[4], self._row[5] = start, time.perf_counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _peer(args: Tuple[Any, ...], kwargs: Dict[str, Any], name: str) -> int:
    if len(args) > 1 and args[1] is not None:
        return int(args[1])
    if kwargs.get(name) is not None:
        return int(kwargs[name])
    group = kwargs.get("group", args[2] if len(args) > 2 else None)
    return dist.get_global_rank(group, kwargs[f"group_{name}"]) if group is not None \
        else int(kwargs[f"group_{name}"])


def _timed(kind: str, op: Any, peer_name: str) -> Any:
    def wrapper(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        row: Row = [kind, _peer((tensor, *args), kwargs, peer_name),
                    tensor.numel() * tensor.element_size(), time.perf_counter(), None, None]
        work = op(tensor, *args, **kwargs)
        LOG.append(row)
        return _TimedWork(work, row) if work is not None else None
    wrapper.__name__ = op.__name__
    return wrapper


def install() -> None:
    """Record every ``isend``/``irecv`` of this process from now on (both the public names
    and ``distributed_c10d``'s own, which ``P2POp`` checks against)."""
    from torch.distributed import distributed_c10d as c10d
    isend, irecv = _timed("send", c10d.isend, "dst"), _timed("recv", c10d.irecv, "src")
    for module in (dist, c10d):
        module.isend, module.irecv = isend, irecv  # type: ignore[attr-defined]


def split_hop(sender: int, receiver: int, sent_after: float, action_start: float,
              previous_end: float, logs: List[List[Row]]) -> Optional[Dict[str, float]]:
    """The parts of one hop (see the module doc), or ``None`` if its message is not found.

    ``sent_after``: the sender's action end; ``action_start``: the receiver's action start;
    ``previous_end``: the receiver's previous action end (or the step start).
    """
    sends = [r for r in logs[sender] if r[0] == "send" and r[1] == receiver]
    recvs = [r for r in logs[receiver] if r[0] == "recv" and r[1] == sender]
    n = next((n for n, r in enumerate(sends) if r[3] >= sent_after), None)
    if n is None or n >= len(recvs) or recvs[n][5] is None:
        return None
    send, recv = sends[n], recvs[n]
    issued, wait_start, wait_end = recv[3], recv[4], recv[5]
    others = sum(min(r[5], action_start) - max(r[4], wait_end) for r in logs[receiver]
                 if r is not recv and r[4] is not None and r[5] > wait_end
                 and r[4] < action_start)
    return {"build": send[3] - sent_after,
            "posted late": max(0.0, issued - send[3]),
            "wire": wait_end - max(send[3], wait_start, issued),
            "to layer": action_start - wait_end,
            "other waits": others,
            "waited before": max(0.0, wait_start - previous_end),
            "bytes": float(send[2])}


def split_edges(first: Tuple[int, float], last: Tuple[int, float], end: float,
                logs: List[List[Row]]) -> Dict[str, float]:
    """The head's operations and the tail's parts (see the module doc); ``first`` and
    ``last``: (rank, time) of the first action's start and of the last action's end."""
    rank, start = first
    head = [r for r in logs[rank] if r[3] < start]
    rank, stop = last
    sends = [r[3] for r in logs[rank] if r[0] == "send" and r[3] >= stop]
    last_send = max(sends, default=stop)
    waits = [r[5] for log in logs for r in log if r[5] is not None and r[5] >= last_send]
    last_wait = max(waits, default=last_send)
    return {"head sends": float(sum(r[0] == "send" for r in head)),
            "head recvs": float(sum(r[0] == "recv" for r in head)),
            "tail to last send": last_send - stop, "tail wire": last_wait - last_send,
            "tail return": end - last_wait}


def summarize(hops: List[Dict[str, float]]) -> Dict[str, float]:
    """Medians of each part over ``hops`` (ms; ``bytes`` as is)."""
    if not hops:
        return {}
    keys = (*HOP_PARTS, "waited before")
    out = {k: statistics.median(h[k] for h in hops) * 1e3 for k in keys}
    out["bytes"] = statistics.median(h["bytes"] for h in hops)
    out["count"] = float(len(hops))
    return out
