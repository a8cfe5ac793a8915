"""Point-to-point messages between pipeline stages over ``torch.distributed``.

A message is one tensor-only buffer, or a header and one large tensor sent as it is
(``seqpipe.distributed.wire``), so uneven micro-batches and batch sizes that change between
steps need no agreement in advance. Sends are non-blocking (1F1B cannot deadlock on sends);
NCCL and gloo share this code path, each operation handed to its group (``p2p``).

**Receiving ahead.** Each call, both ends of every pair of stages are told the same plan
(``seqpipe.distributed.plan``): the messages one sends the other, in order. A receiver posts
the receives of a peer's next message, header *and* payload, sized as the same message was
in the previous call, before the peer sends it, so the data is written straight into place
(no second round trip per hop). A call's first receive from each peer is put off until the
rank first waits or ends an action (``post_due``: at the opening they cost stage 0 ~0.1 ms
each before its first forward); each later one is posted as soon as the message before it
arrived, so its data flows while this rank computes (posting only when the rank waits cost
a 2-rank MLP 6-8 %). The sender keeps the same record, so it knows what the receiver posted:
when the shapes differ it fills that receive, with a header that says so, and sends the
real payload after it (one extra round trip; which size is posted, and when a changing
shape stops being trusted: ``seqpipe.distributed.shapes``). A failure notice fills what the
peer posted the same way. A header that repeats the same planned message's last one is not
decoded again (``seqpipe.distributed.recycle.Headers``).

**Headers stay on the host side.** On a GPU a header is built in pinned memory and copied
into the message buffer without blocking, and a received header is read back through a
side stream that waits only for that receive: the host waits for the message to arrive, not
for the compute queued before it, and never for a send.

**One process group per direction.** Messages to a higher stage travel on ``group``, to a
lower one on ``reverse`` (same ranks): with NCCL, the operations between two ranks of one
group run in issue order on one stream, so a receive posted ahead would hold up this rank's
later sends to that peer, and 1F1B could deadlock (docs/distributed.md, "On the wire"). A
pipeline on a group for which no second group could be made (``seqpipe.distributed.mesh``)
uses its one group both ways; on NCCL it then posts each receive only when it is needed.
Every (group, pair) a call uses is opened when the pipeline is built
(``seqpipe.distributed.communicators``), and failures travel only over those.

**Letting go of sent tensors.** A sent tensor must stay alive until its send completes.
The plan says when a message has certainly been taken (its receiver has since sent
something it only sends after the action that needs it), so each send is waited for and
released then (a host buffer of ours is kept for the next message of its size:
``recycle.Spares``), and a 1F1B stage holds O(stages) sent activations, not O(micro-batches).
"""
from __future__ import annotations

import sys
from collections import defaultdict, deque
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Deque, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from seqpipe.distributed import inflight, p2p
from seqpipe.distributed.communicators import open_pairs
from seqpipe.distributed.recycle import Headers, Spares
from seqpipe.distributed.shapes import SeenShapes
from seqpipe.distributed.values import Values
from seqpipe.distributed.wire import (
    DIRECT_BYTES,
    HEADER_BYTES,
    HEADER_SLOTS,
    Kind,
    Message,
    Spec,
    buffers,
    decode_text,
    encode_text,
    header_words,
    nbytes,
    receives,
    spec_of,
    unpack,
)

if TYPE_CHECKING:
    from seqpipe.distributed.plan import Planned

__all__ = ["Kind", "Message", "Transport", "PeerError", "HEADER_SLOTS"]

Channel = Tuple[int, int]  # (sending stage, receiving stage)
_Sent = Tuple[int, dist.Work, Tensor, bool]  # taken_at, work, buffer kept alive, ours (Spares)


class PeerError(RuntimeError):
    """Another stage failed; raised on every rank that was waiting on it.

    ``peer``: the stage this rank heard it from (or lost), if known; it is not told again.
    """

    def __init__(self, *args: object, peer: Optional[int] = None) -> None:
        super().__init__(*args)
        self.peer = peer


@dataclass
class _Posted:
    """The receives posted for a peer's next message, sized for the payload expected."""

    planned: Optional["Planned"]
    spec: Spec
    buffer: Tensor
    work: dist.Work
    direct: Optional[Tuple[Tensor, dist.Work]] = None  # the payload's tensor, received apart

    def operations(self) -> List[Tuple[dist.Work, Tensor]]:
        return [(self.work, self.buffer)] + ([self.direct[::-1]] if self.direct else [])


class Transport:
    """Sends and receives stage messages on ``group`` (stage index = rank in the group).

    ``reverse``: the group carrying messages to lower stages (default: ``group`` itself).
    ``ahead``: post each peer's next receive as soon as the previous message is taken,
    else when the message is needed (default: ahead unless NCCL must share one group
    between both directions). ``tag``: every message's, the pipe's own (``rebuild``).
    """

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device,
                 timeout: Optional[timedelta] = None, *,
                 reverse: Optional[dist.ProcessGroup] = None,
                 ahead: Optional[bool] = None, tag: int = 0) -> None:
        self.group, self.tag = group, tag
        self.reverse = reverse if reverse is not None else group
        self.device = device
        self.timeout = timeout
        shared_nccl = reverse is None and dist.get_backend(group) == "nccl"
        self.ahead = not shared_nccl if ahead is None else ahead
        self.index = dist.get_rank(group)
        self.failure: Optional[str] = None
        self._incoming: Dict[int, Deque[Planned]] = defaultdict(deque)
        self._outgoing: Dict[int, Deque[Planned]] = defaultdict(deque)
        self._posted: Dict[int, _Posted] = {}
        self._due: Dict[int, None] = {}  # peers whose next receive is put off (in order)
        self._seen_in = SeenShapes()  # of the messages received, per peer
        self._seen_out = SeenShapes()  # of the messages sent, per peer
        self._pending: Dict[int, List[_Sent]] = defaultdict(list)
        self._globals: Dict[int, int] = {}  # stage -> global rank
        self.sent_bytes = 0  # every buffer sent, headers and placeholders included
        self.direct_bytes: Optional[int] = DIRECT_BYTES  # (``wire.direct``; None: never)
        self._pin = device.type == "cuda"  # headers in pinned host memory, copied async
        self._side = torch.cuda.Stream(device) if self._pin else None
        self._arrived = torch.cuda.Event() if self._pin else None
        self._spares, self._headers = Spares(device), Headers()  # what repeats (``recycle``)
        self._groups: p2p.Groups = {}  # this call's, checked (``begin``)

    # -- communicators -----------------------------------------------------------------
    def connect(self, channels: Iterable[Channel]) -> None:
        """Open every pair's communicator now, all ranks alike (``communicators``)."""
        open_pairs(self, channels)

    # -- a call's plan -----------------------------------------------------------------
    def begin(self) -> None:
        """Start a call; refused after a failed one, whose messages may still be in flight,
        and (torch's ``ValueError``) on a process group destroyed since the last one."""
        if self.failure is not None:
            first = self.failure.splitlines()[0] if self.failure else "a stage failed"
            raise RuntimeError(
                f"this pipeline failed in an earlier call ({first}); messages of that call "
                f"may still be in flight, so it cannot run another. Build a new DistributedPipe "
                f"(on this group or a torch.distributed.new_group): they cannot reach it")
        self._groups = p2p.groups(self.group, self.reverse)

    def expect(self, src: int, planned: Iterable["Planned"]) -> None:
        """The next messages stage ``src`` will send this one, in order."""
        self._incoming[src].extend(planned)
        if self.ahead and src not in self._posted and self._incoming[src]:
            self._due[src] = None  # posted when this rank waits or acts (``post_due``)

    def will_send(self, dst: int, planned: Iterable["Planned"]) -> None:
        """The next messages this stage will send stage ``dst``, in order."""
        self._outgoing[dst].extend(planned)

    # -- the wire ----------------------------------------------------------------------
    def global_rank(self, stage: int) -> int:
        """The global rank of ``stage`` (looked up once per peer: every message asks)."""
        if stage not in self._globals:
            self._globals[stage] = dist.get_global_rank(self.group, stage) \
                if self.group is not None else stage
        return self._globals[stage]

    def group_between(self, src: int, dst: int) -> Optional[dist.ProcessGroup]:
        """The group carrying messages from stage ``src`` to stage ``dst``: one per direction."""
        return self.group if src < dst else self.reverse

    def _isend(self, buffer: Tensor, stage: int, taken_at: int) -> None:
        work = p2p.isend(buffer, stage, self._groups.get(self.index < stage),  # (``p2p``)
                         self.group_between(self.index, stage), self.global_rank, self.tag)
        self.sent_bytes += buffer.numel() * buffer.element_size()
        self._pending[stage].append((taken_at, work, buffer, self._spares.ours(buffer)))

    def _irecv(self, buffer: Tensor, stage: int) -> dist.Work:
        return p2p.irecv(buffer, stage, self._groups.get(stage < self.index),
                         self.group_between(stage, self.index), self.global_rank, self.tag)

    def _wait(self, work: dist.Work) -> None:
        work.wait() if self.timeout is None else work.wait(self.timeout)

    def post_due(self) -> None:
        """Post the receives put off so far (the rank is about to wait, or ended an action).
        One that fails (a lost peer) stays put off, to fail when needed, naming that peer."""
        if not self._due:  # (after nearly every action)
            return
        due, self._due = self._due, {}
        for src in due:
            if src in self._posted or not self._incoming[src]:
                continue
            try:
                self._post(src)
            except RuntimeError:  # (gloo/NCCL errors are RuntimeErrors)
                self._due[src] = None

    def _post(self, src: int) -> None:
        """Post the receive of the next message from ``src``, sized for what is expected."""
        queue = self._incoming[src]
        planned = queue.popleft() if queue else None
        spec = self._seen_in.posted(src, planned)
        buffer, payload = receives(spec, self.device, self.direct_bytes)
        work = self._irecv(buffer, src)
        self._posted[src] = _Posted(planned, spec, buffer, work, None if payload is None
                                    else (payload, self._irecv(payload, src)))

    # -- sending -----------------------------------------------------------------------
    def send(self, stage: int, kind: Kind, microbatch: int, tensors: Sequence[Optional[Tensor]],
             flags: Optional[Sequence[bool]] = None, *, key: int = -1, count: int = 0,
             atomic: bool = True, origin: int = -1, values: Values = ()) -> None:
        """Queue a message to ``stage`` (a rank; ``origin``: the pipeline stage whose action
        sends it; ``values``: an activation's non-tensor items); returns at once."""
        flags = flags if flags is not None else [False] * len(tensors)
        planned = self._next_out(stage, (kind, microbatch, key, origin))  # taken off once sent
        expected = self._seen_out.posted(stage, planned)  # what ``stage`` posted for it
        payload = [t for t in tensors if t is not None]
        actual = spec_of(payload)
        taken_at = planned.taken_at if planned else sys.maxsize
        header = header_words(kind, microbatch, key, count, atomic, actual != expected,
                              tensors, flags, origin=origin, values=values)
        for buffer in buffers(header, payload, expected, self.device, least=self.direct_bytes,
                              pin=self._pin, alloc=self._spares.take, actual=actual):
            self._isend(buffer, stage, taken_at)
        if planned is not None:
            self._seen_out.saw(stage, planned, actual)
            self._outgoing[stage].popleft()

    def _next_out(self, dst: int, identity: Tuple[Kind, int, int, int]) -> Optional["Planned"]:
        """The planned message this send is; it stays first in line until it went out, so
        that a failure before then (say, a dtype the wire cannot carry) tells ``dst`` in a
        buffer of the size ``dst`` posted for it."""
        queue = self._outgoing[dst]
        if not queue:
            return None
        if queue[0].identity != identity:
            raise RuntimeError(f"internal error: sending {identity} to stage {dst}, but the "
                               f"plan says {queue[0].identity} comes next")
        return queue[0]

    # -- receiving ---------------------------------------------------------------------
    def recv(self, stage: int) -> Message:
        """The next message from ``stage``; raises ``PeerError`` if it reports a failure."""
        if stage not in self._posted:
            self._due.pop(stage, None)
            self._post(stage)
        posted = self._posted.pop(stage)
        planned = posted.planned
        header = self._headers.read(self._arrival(posted),
                                    None if planned is None else (stage, planned.identity))
        if header.kind is Kind.ABORT:
            inflight.keep(posted.operations()[1:], group=self.group, wanted=False)  # placeholder
            raise PeerError(decode_text(header.words), peer=stage)
        if planned is not None and planned.identity != header.identity:
            raise RuntimeError(f"internal error: stage {stage} sent {header.identity} where "
                               f"the plan says {planned.identity}")
        spec, specs = header.spec, header.specs
        if posted.direct is not None:  # the payload's tensor, or a placeholder in it
            self._wait(posted.direct[1])
        if not header.reshaped:
            if spec != posted.spec:
                raise RuntimeError(f"internal error: stage {stage} sent a payload of another "
                                   f"shape than this stage posted, without saying so")
            payload = [posted.direct[0]] if posted.direct is not None else \
                unpack(posted.buffer, HEADER_BYTES, spec)
        else:
            buffer = torch.empty(nbytes(spec), dtype=torch.uint8, device=self.device)
            if spec:
                work = self._irecv(buffer, stage)
                self.post_due()
                self._wait(work)
            payload = unpack(buffer, 0, spec)
        if planned is not None:
            self._seen_in.saw(stage, planned, spec)
            self._release(stage, planned.sent_at)
        if self.ahead and self._incoming[stage]:
            self._post(stage)  # now: its data can flow while this rank computes
        tensors = tuple(payload) if len(payload) == len(specs) else \
            tuple(None if s is None else payload.pop(0) for s in specs)
        return Message(header.kind, header.microbatch, header.key, tensors, header.flags,
                       header.count, header.atomic, header.origin, header.values)

    def _arrival(self, posted: _Posted) -> Tensor:
        """Wait for a posted receive; the bytes of its header, on the host.

        On a GPU the wait and the copy of the header run on a side stream, so the host
        waits for this message and 2 KiB, not for the compute queued on the current stream;
        the current stream then waits for the receive before the payload is used.
        """
        if self._due and not posted.work.is_completed():
            self.post_due()  # this rank waits now: the receives put off cost nothing here
        if self._side is None or self._arrived is None:  # the buffer is host memory
            self._wait(posted.work)
            return posted.buffer
        host = torch.empty(HEADER_BYTES, dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(self._side):
            self._wait(posted.work)  # makes the side stream, not the host, wait
            host.copy_(posted.buffer[:HEADER_BYTES], non_blocking=True)
            self._arrived.record(self._side)
        self._arrived.synchronize()
        torch.cuda.current_stream(self.device).wait_event(self._arrived)
        return host

    # -- releasing sends ---------------------------------------------------------------
    def _release(self, dst: int, before: int) -> None:
        """Drop sends to ``dst`` that it has taken: needed before its action ``before``."""
        taken = [entry for entry in self._pending[dst] if entry[0] < before]
        for entry in taken:
            self._complete(entry, dst)
        if taken:
            self._pending[dst] = [entry for entry in self._pending[dst] if entry[0] >= before]

    def _complete(self, sent: _Sent, stage: int) -> None:
        """Wait for a send to ``stage``; its buffer is then kept for reuse, if ours."""
        _, work, buffer, spare = sent
        try:
            work.wait()
        except Exception as exc:
            raise PeerError(f"lost stage {stage} while sending to it: "
                            f"{type(exc).__name__}: {exc}", peer=stage) from exc
        if spare:
            self._spares.give(buffer)

    def pending_bytes(self) -> int:
        """Bytes of sent tensors still held until their sends are known to be complete."""
        return sum(t.numel() * t.element_size() for sent in self._pending.values()
                   for _, _, t, _ in sent)

    def flush(self) -> None:
        """Wait until every queued send has gone out; ``PeerError`` names a lost receiver.

        Ends the call: every planned message must have been sent and taken by then.
        """
        pending, self._pending = self._pending, defaultdict(list)
        for stage, sent in pending.items():
            for entry in sent:
                self._complete(entry, stage)
        left = {s: [p.identity for p in q] for s, q in (*self._incoming.items(),
                                                         *self._outgoing.items()) if q}
        self._due.clear()
        if left or self._posted:
            raise RuntimeError(f"internal error: the call ended with planned messages left "
                               f"over: {left}, receives posted from {sorted(self._posted)}")

    # -- failure -----------------------------------------------------------------------
    def abort(self, text: str, heard_from: Optional[int] = None,
              patience: timedelta = timedelta(seconds=2)) -> None:
        """Tell the stages that still expect a message from this one in this call that a
        stage failed, so they raise instead of waiting (and pass it on the same way).

        Only pairs the plan uses carry the news (another pair could need a new communicator,
        which blocks on NCCL); a stage waiting on this one expects a message from it, so it is
        told, and passes it on; ``heard_from``, which told this one (or was lost), is not told
        back. The news is one message (the text rides in the header) that fills what the peer
        posted for its next message from this stage. It returns without waiting: that send,
        the call's unfinished sends and its posted receives stay alive (dropping one can
        cancel it), and at exit the news gets up to ``patience`` to go out (``inflight``); a dead
        peer is skipped. The transport refuses further calls (their messages would meet these).
        """
        self.failure = text
        header = encode_text(Kind.ABORT, text, pin=self._pin)
        for stage in self.relay_to(heard_from):
            posted = self._seen_out.posted(stage, self._outgoing[stage][0])
            try:  # the header fills what the peer posted (a direct one: with a placeholder)
                for buffer in buffers(header, [], posted, self.device, least=self.direct_bytes):
                    self._isend(buffer, stage, sys.maxsize)
            except Exception:  # noqa: BLE001 - a dead peer cannot be told; the others can
                pass
        sent = [entry for entries in self._pending.values() for entry in entries]
        inflight.keep([(w, b) for at, w, b, _ in sent if at == sys.maxsize], patience=patience,
                      group=self.group)
        inflight.keep([(w, b) for at, w, b, _ in sent if at != sys.maxsize] +
                      [op for p in self._posted.values() for op in p.operations()],
                      group=self.group, wanted=False)
        self._pending = defaultdict(list)
        self._posted.clear()
        self._due.clear()
        self._incoming.clear()
        self._outgoing.clear()

    def relay_to(self, heard_from: Optional[int] = None) -> List[int]:
        """The stages still expecting a message from this one in this call, but ``heard_from``."""
        return sorted(s for s, queue in self._outgoing.items() if queue and s != heard_from)
