"""What a failed call leaves in flight: kept alive, and given time to arrive before exit.

A rank that fails tells the ranks that wait on it, and raises at once: its pipeline peers
get an abort message (``Transport.abort``), its replicas the end-of-step collectives they
wait in, saying so (``seqpipe.distributed.verdict``). Neither has necessarily arrived when
the rank raises. A point-to-point send completes only once the peer has posted the matching
receive (usually at once: a waiting peer posted it ahead; later if it is still busy), and a
collective once every member has joined it, which a replica that is still computing does
at the end of its step. On gloo the sender cannot even poll for it: a send's
``is_completed()`` stays ``False`` until ``wait()`` returns, and a ``wait`` with a timeout
that expires breaks every connection of the group. So the raise does not wait (it used to
wait out a fixed patience, which made the failing rank raise seconds after its peers).

Until they arrive, the operations and their buffers must stay alive (dropping one can
cancel it): ``keep`` holds them, with posted receives and sends that no longer matter. If
the process stays up (the caller catches the error), the backend delivers them on its
own. If it ends, an exit handler (registered with the first kept operation) waits for
each before the interpreter shuts down: a message at most until its ``deadline`` (a peer
that already raised on other news never takes it), a collective until it completes or
fails, which its process group's timeout bounds (a replica joins it at the end of its
step). ``dist.destroy_process_group()`` before the exit does not lose them: a gloo group
waits for its running collectives when destroyed, and a pending send keeps its connection.
"""
from __future__ import annotations

import atexit
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, List, Optional, Sequence, Tuple

import torch.distributed as dist

__all__ = ["keep", "deliver"]


@dataclass
class _Kept:
    work: Any  # a dist.Work
    buffers: Any  # what the operation reads or writes: alive until it is done
    deadline: Optional[float]  # monotonic seconds; None: until it completes (collectives)
    polled: bool  # completion can be polled (NCCL); gloo's only shows after wait()
    wanted: bool  # waited for at exit (news for a peer), else only kept alive


_kept: List[_Kept] = []
_registered = False


def keep(operations: Sequence[Tuple[Any, Any]], *, patience: Optional[timedelta] = None,
         group: Optional[dist.ProcessGroup] = None, wanted: bool = True) -> None:
    """Hold ``operations`` (each a ``dist.Work`` and the buffers it uses) until the process
    ends, and with ``wanted`` give them time to complete before it does: up to ``patience``
    from now, or without ``patience`` until each completes or fails (a collective).
    ``group``: the process group they run on (its backend says how to see completion)."""
    global _registered
    deadline = None if patience is None else time.monotonic() + patience.total_seconds()
    polled = wanted and dist.get_backend(group) != "gloo"
    _kept[:] = [k for k in _kept if not k.work.is_completed()]  # let go of what is done
    _kept.extend(_Kept(work, buffers, deadline, polled, wanted) for work, buffers in operations)
    if wanted and operations and not _registered:
        atexit.register(deliver)
        _registered = True


def deliver() -> None:
    """Wait for every kept operation that carries news to complete, each up to its
    deadline (run at exit; a failure to deliver means the peer is gone: skipped)."""
    for kept in [k for k in _kept if k.wanted]:
        remaining = None if kept.deadline is None else kept.deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            continue
        try:
            if kept.polled:
                _poll(kept.work, remaining)
            elif remaining is None:
                kept.work.wait()  # a gloo collective: ends by the group's timeout at worst
            else:
                kept.work.wait(timedelta(seconds=remaining))  # at exit, breaking is fine
        except RuntimeError:  # the peer is gone, or it did not come in time
            continue
    _kept.clear()


def _poll(work: Any, remaining: Optional[float]) -> None:
    """Wait for a work whose completion shows in ``is_completed()`` (NCCL)."""
    deadline = None if remaining is None else time.monotonic() + remaining
    while not work.is_completed() and (deadline is None or time.monotonic() < deadline):
        time.sleep(0.005)
