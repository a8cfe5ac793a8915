"""``Transport`` on real ``DistributedPipe`` runs: the receive-ahead fast path, the
post-when-needed mode, how long sent buffers are held, refusal after a failure, the order
in which communicators are first used (and that failures use no new ones), the bytes sent
while shapes keep changing, and how headers are copied.

Each worker instruments ``Transport`` on its own process (``send``, ``_isend``, ``recv``) and
checks results against an unpipelined float64 reference built from the same seed. As in
``test_distributed.py``, mismatches are collected and raised together on every rank at the
end of the worker, so a rank that finds one never leaves the others waiting in a collective.
"""
from __future__ import annotations

import cProfile
import graphlib
import pstats
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

import seqpipe.distributed.wire as wire
from distributed_harness import Failures, run_workers
from seqpipe.distributed import DistributedPipe, PeerError
from seqpipe.distributed.transport import HEADER_SLOTS, Kind, Transport, _Posted

DTYPE = torch.float64
HEADER_BYTES = HEADER_SLOTS * 8


class Recorder:
    """Patches ``Transport`` in this process: every message sent, with the buffers it took;
    ``pending_bytes()`` after every buffer; and whether each receive was already posted."""

    def __init__(self) -> None:
        # (destination stage, kind, micro-batch, has a payload, buffers sent)
        self.messages: List[Tuple[int, Kind, int, bool, int]] = []
        self.buffers = 0  # every _isend, in a message or not
        self.irecvs = 0
        self.peak_pending = 0
        self.posted_at_recv: List[bool] = []  # per recv(): was its receive posted already?
        # per wait on a receive not yet complete: the peers whose next receive was still
        # put off then (receives are put off until the rank waits, not posted on arrival)
        self.unposted_at_wait: List[List[int]] = []
        self.irecvs_before_activation: Optional[int] = None  # when activation 0 was sent
        self.originals: Dict[str, Any] = {}

    def __enter__(self) -> "Recorder":
        rec = self
        send, isend, irecv, recv, wait = (Transport.send, Transport._isend, Transport._irecv,
                                          Transport.recv, Transport._wait)
        self.originals = dict(send=send, _isend=isend, _irecv=irecv, recv=recv, _wait=wait)

        def _send(self: Transport, stage: int, kind: Kind, microbatch: int, tensors: Any,
                  *args: Any, **kwargs: Any) -> None:
            before = rec.buffers
            if kind is Kind.ACTIVATION and microbatch == 0 and \
                    rec.irecvs_before_activation is None:
                rec.irecvs_before_activation = rec.irecvs
            send(self, stage, kind, microbatch, tensors, *args, **kwargs)
            payload = any(t is not None for t in tensors)
            rec.messages.append((stage, kind, microbatch, payload, rec.buffers - before))

        def _isend(self: Transport, buffer: Tensor, stage: int, taken_at: int) -> None:
            isend(self, buffer, stage, taken_at)
            rec.buffers += 1
            rec.peak_pending = max(rec.peak_pending, self.pending_bytes())

        def _irecv(self: Transport, buffer: Tensor, stage: int) -> Any:
            rec.irecvs += 1
            return irecv(self, buffer, stage)

        def _recv(self: Transport, stage: int) -> Any:
            rec.posted_at_recv.append(stage in self._posted)
            return recv(self, stage)

        def _wait(self: Transport, work: Any) -> None:
            if not work.is_completed():
                rec.unposted_at_wait.append(sorted(self._due))
            wait(self, work)

        Transport._wait = _wait  # type: ignore[method-assign]
        Transport.send = _send  # type: ignore[method-assign]
        Transport._isend = _isend  # type: ignore[method-assign]
        Transport._irecv = _irecv  # type: ignore[method-assign]
        Transport.recv = _recv  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self.originals.items():
            setattr(Transport, name, original)

    def reset(self) -> None:
        self.messages, self.buffers, self.irecvs = [], 0, 0
        self.peak_pending, self.posted_at_recv, self.unposted_at_wait = 0, [], []
        self.irecvs_before_activation = None


def data(seed: int, batch: int, features: int = 8, out: int = 4) -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, features, generator=gen, dtype=DTYPE),
            torch.randn(batch, out, generator=gen, dtype=DTYPE))


def small() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4)).to(DTYPE)


def built(seed: int, **kwargs: Any) -> Tuple[DistributedPipe, nn.Sequential]:
    """A pipe of ``small()`` and its unpipelined reference, both from ``seed``."""
    torch.manual_seed(seed)
    ref = small()
    torch.manual_seed(seed)
    return DistributedPipe(small(), **kwargs), ref


def matched_step(pipe: DistributedPipe, ref: nn.Sequential, rank: int, world: int, x: Tensor,
                 y: Tensor, failures: Failures, what: str) -> None:
    """One ``train_step`` from zero gradients; loss and gradients equal the reference's."""
    pipe.zero_grad()
    ref.zero_grad()
    loss = pipe.train_step(x if rank == 0 else None, y if rank == world - 1 else None,
                           F.mse_loss)
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    failures.close(loss, ref_loss.detach(), f"{what}: loss")
    failures.grads(pipe, ref, what)


# --------------------------------------------------------------------------- fast path


def _fast_path(rank: int, world: int) -> None:
    failures = Failures(rank)
    pipe, ref = built(1, chunks=4, balance=[2, 3], schedule="1f1b")
    transport = pipe._transport  # on the world: a second group for messages to stage 0
    failures.expect(transport.reverse is not transport.group and transport.ahead,
                    "the world pipeline did not get a group per direction")
    even, ragged = data(2, 8), data(3, 10)  # micro-batches 2, 2, 2, 2 and 3, 3, 2, 2
    # A message carries its tensors in one buffer when the receiver posted a receive of the
    # right size: its shape was seen first in the previous call, or the same in the two
    # calls before. Otherwise it fills the posted receive with a header that says so and
    # sends the payload after it: in step 1 (nothing seen yet: header-only receives); in
    # step 3, where micro-batches 0 and 1 grew from 2 to 3 samples; and in step 4, where
    # they are no longer trusted (the receiver posts only a header for them).
    steps = [("step 1 (first)", even, {0, 1, 2, 3}, True),
             ("step 2 (same as 1)", even, set(), False),
             ("step 3 (batch 10)", ragged, {0, 1}, False),
             ("step 4 (same as 3)", ragged, {0, 1}, False),
             ("step 5 (same as 4)", ragged, set(), False)]
    with Recorder() as rec:
        for what, (x, y), resized, first in steps:
            rec.reset()
            matched_step(pipe, ref, rank, world, x, y, failures, what)
            sent = [(kind, mb) for _, kind, mb, _, _ in rec.messages]
            if rank == 0:
                expected = [(Kind.STEP, -1), *((Kind.ACTIVATION, i) for i in range(4)),
                            (Kind.DONE, -1)]
            else:  # 1F1B on the last stage: B0 .. B3 in order
                expected = [*((Kind.GRAD, i) for i in range(4)), (Kind.LOSS, -1)]
            failures.expect(sent == expected, f"{what}: sent {sent}, expected {expected}")
            for stage, kind, mb, payload, buffers in rec.messages:
                # STEP and DONE carry no tensors; the loss is a scalar: new only in step 1.
                two = payload and (first or (kind in (Kind.ACTIVATION, Kind.GRAD)
                                             and mb in resized))
                failures.expect(stage == 1 - rank, f"{what}: {kind.name} sent to {stage}")
                failures.expect(buffers == (2 if two else 1),
                                f"{what}: {kind.name} {mb} took {buffers} buffer(s)")
            failures.expect(rec.buffers == sum(m[4] for m in rec.messages),
                            f"{what}: {rec.buffers} buffers for {rec.messages}")
            # Receiving ahead: a receive is posted before this rank waits (here, with one
            # peer, when it is needed), never between a message's arrival and its layer.
            failures.expect(bool(rec.posted_at_recv) and not any(
                unposted for unposted in rec.unposted_at_wait),
                            f"{what}: waited with receives not posted: {rec.unposted_at_wait}")
            failures.expect(pipe._transport.pending_bytes() == 0,
                            f"{what}: {pipe._transport.pending_bytes()} bytes held after it")
        # A forward-only call of the last shape: the same activations, one buffer each, and
        # DONE from the last stage.
        rec.reset()
        x, _ = ragged
        with torch.no_grad():
            expected_out = ref(x)
        out = pipe(x if rank == 0 else None)
        if rank == 1:
            failures.close(out, expected_out, "forward after the steps: output")
        sent = [(kind, mb, buffers) for _, kind, mb, _, buffers in rec.messages]
        expected_sent = ([(Kind.STEP, -1, 1), *((Kind.ACTIVATION, i, 1) for i in range(4))]
                         if rank == 0 else [(Kind.DONE, -1, 1)])
        failures.expect(sent == expected_sent, f"forward: sent {sent}")
    # Each message goes straight to its process group's send/recv (seqpipe.distributed.p2p):
    # torch's dist.isend/irecv wrappers, which check per operation what the transport knows,
    # are not called. Each micro-batch's loss is its backward's root: its weight (0.3, 0.3,
    # 0.2, 0.2 here) starts the backward instead of a ``loss * weight`` node of its own
    # (``Tasks._start``); the model has no Mul, so none may run. The gradients still match.
    profile = cProfile.Profile()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        profile.enable()
        matched_step(pipe, ref, rank, world, *ragged, failures, "step 6 (profiled)")
        profile.disable()
    nodes = [e.name for e in prof.events() if e.name.endswith("Backward0")]
    losses = nodes.count("MseLossBackward0")  # the pipe's 4 and the reference's 1
    failures.expect(not any(n.startswith(("MulBackward", "ViewBackward")) for n in nodes)
                    and losses == (5 if rank == 1 else 1), f"backward nodes {sorted(set(nodes))}, "
                    f"{losses} MseLossBackward0")
    calls = {(path.rsplit("/", 1)[-1], name): row[1]
             for (path, _, name), row in pstats.Stats(profile).stats.items()}  # type: ignore
    wrapped = sum(n for (path, name), n in calls.items()
                  if path == "distributed_c10d.py" and name in ("isend", "irecv"))
    direct = sum(n for (path, name), n in calls.items()  # (a group's bound pybind method)
                 if path == "~" and name.endswith(("c10d.send>", "c10d.recv>")))
    failures.expect(wrapped == 0 and direct >= 10,
                    f"a step called dist.isend/irecv {wrapped} times, the group {direct}")
    # A call's actions are compiled once, before the first runs (``Tasks.steps``): one
    # step per action (1F1B, M=4: rank 0 F and B four times each; rank 1 the same with its
    # last B split into I and W), no span asked for per action while nothing traces, and
    # no stage's peers looked up per action (``plan.routes``: only the opening's and the
    # close's three).
    profile = cProfile.Profile()
    profile.enable()
    matched_step(pipe, ref, rank, world, *ragged, failures, "step 7 (profiled, untraced)")
    profile.disable()
    calls = {(path.rsplit("/", 1)[-1], name): row[1]
             for (path, _, name), row in pstats.Stats(profile).stats.items()}  # type: ignore
    counted = {what: calls.get(what, 0) for what in (
        ("tasks.py", "step"), ("tasks.py", "_computing"), ("placement.py", "rank_of"))}
    failures.expect(counted == {("tasks.py", "step"): 8 + rank, ("tasks.py", "_computing"): 0,
                                ("placement.py", "rank_of"): 3}, f"untraced step: {counted}")
    failures.finish()


def test_one_buffer_per_message_once_shapes_are_known() -> None:
    """Two buffers per message with a payload while shapes are new or just changed, one once
    a shape holds; ragged micro-batches resize only the messages whose shapes changed;
    gradients always match."""
    run_workers(_fast_path, 2, timeout=120, pg_timeout=60)


# --------------------------------------------------------------------------- ahead off, memory


def wide() -> nn.Sequential:
    """Activations of 1024 float32 per sample between the stages."""
    return nn.Sequential(nn.Linear(32, 1024), nn.Tanh(), nn.Linear(1024, 4))


def _modes_and_memory(rank: int, world: int) -> None:
    failures = Failures(rank)
    # b. Receives posted only when a message is needed (``ahead=False``): the same results.
    with Recorder() as rec:
        for clock in ("fill_drain", "1f1b"):
            pipe, ref = built(4, chunks=4, balance=[3, 2], schedule=clock)
            pipe._transport.ahead = False
            for n, batch in enumerate((8, 10, 10)):
                rec.reset()
                x, y = data(10 + n, batch)
                what = f"ahead=False {clock} step {n} (batch {batch})"
                matched_step(pipe, ref, rank, world, x, y, failures, what)
                failures.expect(bool(rec.posted_at_recv) and not any(rec.posted_at_recv),
                                f"{what}: a receive was posted ahead: {rec.posted_at_recv}")
            x, _ = data(13, 7)
            with torch.no_grad():
                expected = ref(x)
            out = pipe(x if rank == 0 else None)
            if rank == 1:
                failures.close(out, expected, f"ahead=False {clock}: forward output")

    # c. How many bytes of sent messages stage 0 holds at once (sampled after every send),
    # with 8 micro-batches of 4 samples: one activation message is the header plus
    # 4 x 1024 float32.
    #
    # A sent activation ACT(i) is released when stage 0 receives GRAD(i): stage 1 sends it
    # in B(i), after F(i) took ACT(i). Under 1F1B stage 0 runs F0 F1 B0 F2 B1 F3 ...: one
    # warm-up forward (K - 1 with K = 2 stages), so it sends ACT(i + 1) before GRAD(i) comes
    # back and holds at most 2 activations (plus, until GRAD0, the header-only STEP): under
    # 3 messages. Fill-drain sends all 8 activations before its first backward and holds
    # them all (plus the STEP) until the first gradient arrives.
    message = HEADER_BYTES + 4 * 1024 * 4
    peaks: Dict[str, int] = {}
    gen = torch.Generator().manual_seed(20)
    x, y = torch.randn(32, 32, generator=gen), torch.randn(32, 4, generator=gen)
    with Recorder() as rec:
        for clock in ("1f1b", "fill_drain"):
            torch.manual_seed(5)
            pipe = DistributedPipe(wide(), chunks=8, balance=[2, 1], schedule=clock,
                                   checkpoint="never")
            peak = 0
            for _ in range(2):  # the first step also splits each message in two buffers
                rec.reset()
                loss = pipe.train_step(x if rank == 0 else None, y if rank == 1 else None,
                                       F.mse_loss)
                failures.expect(bool(torch.isfinite(loss)), f"{clock}: loss {loss}")
                failures.expect(pipe._transport.pending_bytes() == 0,
                                f"{clock}: bytes still held after the step")
                peak = max(peak, rec.peak_pending)
            peaks[clock] = peak
    if rank == 0:
        what = f"stage 0 peak held bytes {peaks}, one message {message}"
        failures.expect(peaks["1f1b"] <= 3 * message, what)
        failures.expect(peaks["fill_drain"] >= 8 * message, what)
        failures.expect(peaks["1f1b"] < peaks["fill_drain"], what)
    _direct_payloads(rank, world, failures)
    failures.finish()


def _direct_payloads(rank: int, world: int, failures: Failures) -> None:
    """d. A one-tensor payload of at least ``Transport.direct_bytes`` goes apart from its
    header, as the tensor itself, into a tensor the receiver posted ahead (no copy on either
    side): header and tensor once its shape is trusted; header, a placeholder the posted
    size, then the payload when it changed. Gradients match throughout."""
    sent: List[Tensor] = []
    original = Transport._isend

    def _isend(self: Transport, buffer: Tensor, stage: int, taken_at: int) -> None:
        sent.append(buffer)
        original(self, buffer, stage, taken_at)

    torch.manual_seed(6)
    ref = wide().to(DTYPE)
    torch.manual_seed(6)
    pipe = DistributedPipe(wide().to(DTYPE), chunks=4, balance=[2, 1], schedule="1f1b",
                           checkpoint="never")
    pipe._transport.direct_bytes = 1  # every one-tensor payload (the default: 1 MiB)
    gen = torch.Generator().manual_seed(21)
    kind = Kind.ACTIVATION if rank == 0 else Kind.GRAD
    # (batch, payload buffers per activation or gradient): new shapes go as today (header
    # and payload); trusted ones as header + tensor; micro-batches of 3 after 2 samples:
    # header, placeholder, payload
    for n, (batch, shapes) in enumerate([(8, "new"), (8, "trusted"), (12, "changed"),
                                         (12, "new"), (12, "trusted")]):
        x = torch.randn(batch, 32, generator=gen, dtype=DTYPE)
        y = torch.randn(batch, 4, generator=gen, dtype=DTYPE)
        with mock.patch.object(Transport, "_isend", _isend), Recorder() as rec:
            sent.clear()
            matched_step(pipe, ref, rank, world, x, y, failures, f"direct step {n}")
        what = f"direct step {n} ({shapes} shapes)"
        buffers = [m[4] for m in rec.messages if m[1] is kind]
        expected = {"new": 2, "trusted": 2, "changed": 3}[shapes]
        failures.expect(buffers == [expected] * 4, f"{what}: buffers {buffers}")
        tensors = [b for b in sent if b.dim() == 2]  # sent as tensors, not as bytes
        uncopied = [t for t in tensors if t.shape == (batch // 4, 1024) and t.dtype == DTYPE]
        failures.expect(len(uncopied) == (4 if shapes == "trusted" else 0),
                        f"{what}: {len(uncopied)} tensors sent uncopied")
        fillers = [t for t in tensors if t.shape == (2, 1024) and not t.any()]  # the old size
        failures.expect(len(fillers) == (4 if shapes == "changed" else 0) and
                        len(tensors) == len(uncopied) + len(fillers),
                        f"{what}: {[t.shape for t in tensors]} sent as tensors")
        failures.expect(pipe._transport.pending_bytes() == 0, f"{what}: bytes still held")


def test_ahead_off_matches_and_1f1b_holds_few_sent_activations() -> None:
    """``ahead=False`` under both clocks equals the reference; a 1F1B stage holds O(stages)
    sent activations where fill-drain holds all of them."""
    run_workers(_modes_and_memory, 2, timeout=120, pg_timeout=60)


# --------------------------------------------------------------------------- after a failure


class Boom(nn.Module):
    """A linear layer whose third forward (micro-batch 2) raises."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8).to(DTYPE)
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == 3:
            raise ZeroDivisionError("boom in layer")
        return self.lin(x)


REFUSAL_PG_TIMEOUT = 60.0
"""The process group's timeout in ``_after_failure``'s launch: a refusal that took as long
waited for something (the failed call's messages end no sooner), where it must wait for
nothing; one that took less did not, whatever the machine's load."""


def _after_failure(rank: int, world: int) -> None:
    failures = Failures(rank)
    everyone = list(range(world))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), Boom(), nn.Linear(8, 4)).to(DTYPE)
    pipe = DistributedPipe(model, chunks=4, balance=[2, 1, 1], checkpoint="never",
                           group=dist.new_group(everyone))
    # a group made by the user alone has no second group: both directions share it
    failures.expect(pipe._transport.reverse is pipe._transport.group,
                    "a user subgroup got a second group")
    x, y = data(30, 8)

    def step() -> None:
        pipe.train_step(x if rank == 0 else None, y if rank == world - 1 else None,
                        F.mse_loss)

    origin = "stage 1 failed in the forward of micro-batch 2"
    try:
        step()
    except Exception as exc:  # noqa: BLE001 - checked below
        kind = ZeroDivisionError if rank == 1 else PeerError
        failures.expect(isinstance(exc, kind), f"failing step raised {exc!r}")
    else:
        failures.expect(False, "the failing step did not raise")
    # The same pipe refuses at once, before any message (its last call's may be in flight).
    for call in ("train_step", "forward"):
        with Recorder() as rec:
            started = time.monotonic()
            try:
                step() if call == "train_step" else pipe(x if rank == 0 else None)
            except RuntimeError as exc:
                text = str(exc)
                failures.expect(not isinstance(exc, PeerError), f"{call}: {exc!r}")
                for part in ("failed in an earlier call", origin, "new_group",
                             "new DistributedPipe"):
                    failures.expect(part in text, f"{call}: {part!r} not in {text!r}")
            else:
                failures.expect(False, f"{call} on the failed pipe did not raise")
            elapsed = time.monotonic() - started
        failures.expect(elapsed < REFUSAL_PG_TIMEOUT, f"{call}: took {elapsed:.2f} s to refuse")
        failures.expect(rec.buffers == 0 and rec.irecvs == 0 and not rec.messages,
                        f"{call}: communicated while refusing: {rec.buffers} sends, "
                        f"{rec.irecvs} receives")
    # A new pipe on a new group works, and matches the reference.
    torch.manual_seed(1)
    ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 4)).to(DTYPE)
    torch.manual_seed(1)
    fresh = DistributedPipe(
        nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 4)).to(DTYPE),
        chunks=4, balance=[2, 1, 1], group=dist.new_group(everyone))
    for n in range(2):
        matched_step(fresh, ref, rank, world, x, y, failures, f"new pipe step {n}")
    failures.finish()


def test_failed_pipe_refuses_further_calls_and_a_new_one_works() -> None:
    run_workers(_after_failure, 3, timeout=120, pg_timeout=REFUSAL_PG_TIMEOUT)


# -- packing, in this process -----------------------------------------------------------
def _odd_tensors() -> List[Tensor]:
    """One tensor of every dtype the wire carries, in awkward layouts."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=gen)
    tensors: List[Tensor] = [
        base[:, ::2],  # strided, and a view (uniform stride 2) after flattening
        base.t(),  # transposed
        torch.tensor(3.5, dtype=torch.float64),  # 0-dim, like the loss
        torch.zeros(0, 5),  # empty
        torch.randn(3, dtype=torch.complex64, generator=gen).conj().imag,  # a negated view
    ]
    for dtype in wire._DTYPES:
        if dtype.is_complex:
            tensors.append(torch.randn(2, 3, dtype=dtype, generator=gen))
        elif dtype.is_floating_point:
            tensors.append(torch.randn(3, 5, generator=gen).to(dtype))
        elif dtype == torch.bool:
            tensors.append(torch.rand(7, generator=gen) > 0.5)
        else:
            tensors.append(torch.randint(-8 if dtype != torch.uint8 else 0, 8, (5,),
                                         generator=gen).to(dtype))
    return tensors


def test_a_message_packs_into_one_buffer_and_unpacks_bit_exact() -> None:
    tensors = _odd_tensors()
    spec = wire.spec_of(tensors)
    header = torch.arange(HEADER_SLOTS, dtype=torch.int64)
    size = HEADER_BYTES + wire.nbytes(spec)
    buffer = wire.pack(header, tensors, size, torch.device("cpu"))
    assert buffer.dtype == torch.uint8 and buffer.numel() == size
    assert torch.equal(buffer[:HEADER_BYTES].view(torch.int64), header)
    unpacked = wire.unpack(buffer, HEADER_BYTES, spec)
    for sent, got in zip(tensors, unpacked):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got, sent)
        # in place: the received tensors share the buffer's memory (no copy)
        assert got.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    # words written straight into a host buffer: the same bytes as the header tensor
    packed = wire.pack(header.tolist(), tensors, size, torch.device("cpu"))
    assert torch.equal(packed[:HEADER_BYTES].view(torch.int64), header)
    assert all(torch.equal(a, b) for a, b in zip(wire.unpack(packed, HEADER_BYTES, spec),
                                                 tensors))
    # a placeholder (the receiver expected another shape): header, then zeros
    filler = wire.pack(header, [], size, torch.device("cpu"))
    assert torch.equal(filler[:HEADER_BYTES].view(torch.int64), header)
    assert not filler[HEADER_BYTES:].any()


def test_a_direct_payload_is_the_tensor_itself_with_its_view_flags_applied() -> None:
    """``direct``: one tensor of at least ``least`` bytes (never with ``None``); ``as_sent``
    shares a dense tensor's memory and resolves what raw memory would get wrong (a negated
    or conjugated view, a strided one); ``placeholder`` is zeros of the posted spec."""
    cpu = torch.device("cpu")
    one = ((torch.float32, (32, 1024)),)
    assert wire.direct(one, 64 << 10) and not wire.direct(one, (128 << 10) + 1)
    assert not wire.direct(one) and wire.direct(((torch.float32, (256, 1024)),))  # 1 MiB
    assert not wire.direct(one, None) and not wire.direct(one * 2, 1)
    assert not wire.direct((), 1)
    for tensor in _odd_tensors():
        sent = wire.as_sent(tensor, cpu)
        assert sent.is_contiguous() and not sent.is_neg() and not sent.is_conj()
        assert torch.equal(sent, tensor) and not sent.requires_grad
    dense = torch.randn(4, 5, requires_grad=True)
    assert wire.as_sent(dense, cpu).data_ptr() == dense.data_ptr()  # no copy
    filler = wire.placeholder(((torch.float64, (3, 2)),), cpu)
    assert filler.dtype == torch.float64 and filler.shape == (3, 2) and not filler.any()


# -- a send that cannot go out ----------------------------------------------------------
class ToDtype(nn.Module):
    """Passes its input through, or casts it to ``dtype`` once ``dtype`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.dtype: Any = None

    def forward(self, x: Tensor) -> Tensor:
        return x if self.dtype is None else x.to(self.dtype)


def _unsendable(rank: int, world: int) -> None:
    # once with the message in one buffer, once sent apart from its header (``direct``):
    # then the notice fills both receives stage 1 posted, the header's and the tensor's
    for direct in (None, 1):
        torch.manual_seed(0)
        cast = ToDtype()
        pipe = DistributedPipe(nn.Sequential(nn.Linear(8, 8), cast, nn.Linear(8, 4)).to(DTYPE),
                               chunks=2, balance=[2, 1],
                               group=None if direct is None else dist.new_group([0, 1]))
        pipe._transport.direct_bytes = direct
        x, y = data(40, 7)  # micro-batches of 4 and 3: the messages after ACT 0 differ in size

        def step(pipe: DistributedPipe = pipe, x: Tensor = x, y: Tensor = y) -> Tensor:
            return pipe.train_step(x if rank == 0 else None, y if rank == 1 else None,
                                   F.mse_loss)

        step()  # shapes known: stage 1 now posts the activation's receive ahead, sized for it
        cast.dtype = torch.float8_e4m3fn  # a dtype the wire does not carry
        try:
            step()
        except TypeError as exc:  # the sender: the original error, with the stage's note
            assert rank == 0 and "cannot send a torch.float8_e4m3fn tensor" in str(exc), exc
        except PeerError as exc:  # the receiver: told, in the buffer it had posted
            assert rank == 1 and "cannot send a torch.float8_e4m3fn tensor" in str(exc), exc
            assert "stage 0 failed in the forward of micro-batch 0" in str(exc), exc
        else:
            raise AssertionError(f"the step did not fail (direct_bytes={direct})")


def test_a_tensor_the_wire_cannot_carry_fails_both_ranks_after_shapes_are_cached() -> None:
    run_workers(_unsendable, 2, timeout=60)


# -- NCCL on a hand-made group ----------------------------------------------------------
def _shared_nccl_group(rank: int, world: int) -> None:
    failures = Failures(rank)
    group = dist.new_group(list(range(world)))
    real = dist.get_backend

    def as_if_nccl(g: Any = None) -> str:
        return "nccl" if g is group else real(g)

    # Only the backend's name is faked: the pipe must warn, and fall back to receiving
    # when a message is needed (one group both ways), and still compute the same thing.
    with mock.patch.object(dist, "get_backend", as_if_nccl), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe, ref = built(5, chunks=4, balance=[2, 3], schedule="1f1b", group=group)
    texts = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    failures.expect(any("both directions share it" in t and "mesh_groups" in t
                        for t in texts), f"no warning about the shared group: {texts}")
    failures.expect(not pipe._transport.ahead and pipe._transport.reverse is group,
                    "a shared NCCL group must receive only when needed")
    x, y = data(6, 8)
    matched_step(pipe, ref, rank, world, x, y, failures, "shared group, receive when needed")
    failures.finish()


def test_a_hand_made_nccl_group_warns_and_receives_only_when_needed() -> None:
    run_workers(_shared_nccl_group, 2, timeout=60)


# -- communicators: opened in one order at construction, and failures stay on them -----
class Touches:
    """Patches ``dist.isend``/``dist.irecv`` in this process: every point-to-point
    operation, in order, as ``(op, group, peer's global rank)`` (group ``None``: the
    world)."""

    def __init__(self) -> None:
        self.ops: List[Tuple[str, Any, int]] = []
        self.originals = (dist.isend, dist.irecv)

    def __enter__(self) -> "Touches":
        isend, irecv = self.originals

        def _isend(tensor: Tensor, dst: int, group: Any = None, **kw: Any) -> Any:
            self.ops.append(("isend", group, dst))
            return isend(tensor, dst=dst, group=group, **kw)

        def _irecv(tensor: Tensor, src: int, group: Any = None, **kw: Any) -> Any:
            self.ops.append(("irecv", group, src))
            return irecv(tensor, src=src, group=group, **kw)

        dist.isend, dist.irecv = _isend, _irecv  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.isend, dist.irecv = self.originals  # type: ignore[assignment]

    def first(self, rank: int, names: Dict[Any, str]) -> List[Tuple[str, int, int, str, int]]:
        """This rank's first operation on each (group, pair of ranks), in order:
        ``(group name, lower rank, higher rank, op, when)``."""
        seen: Dict[Tuple[str, int, int], Tuple[str, int, int, str, int]] = {}
        for when, (op, group, peer) in enumerate(self.ops):
            key = (names[group], min(rank, peer), max(rank, peer))
            seen.setdefault(key, (*key, op, when))
        return sorted(seen.values(), key=lambda first: first[-1])


class ArmedBoom(nn.Module):
    """A linear layer that raises on the third forward after being armed."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8).to(DTYPE)
        self.left: Any = None

    def forward(self, x: Tensor) -> Tensor:
        if self.left is not None:
            self.left -= 1
            if self.left == 0:
                raise ZeroDivisionError("boom on stage 2")
        return self.lin(x)


def _cycle(firsts: List[List[Tuple[str, int, int, str, int]]]) -> Optional[str]:
    """A cycle in the order the ranks first touch their (group, pair)s, if any: with
    NCCL's lazy communicators, each first touch blocks until the peer arrives, so ranks
    that disagree on the order deadlock."""
    order = graphlib.TopologicalSorter()
    for mine in firsts:
        for before, after in zip(mine, mine[1:]):
            order.add(after[:3], before[:3])
    try:
        order.prepare()
    except graphlib.CycleError as exc:
        return str(exc.args[1])
    return None


def _step_edges(rank: int, world: int, rec: Recorder, failures: Failures, what: str) -> None:
    """One train step's control messages (1F1B, one stage per rank): the rank of stage 0
    tells stage 1 of the call before its first forward and the other stages after it;
    the last stage sends the loss to every rank, stage 0 DONE to every rank, and a middle
    stage DONE to stage 0 (its last backward's weight half runs after its last message:
    ``plan.split_tails``); and a rank waits only with every receive it can post posted."""
    control = [(dst, kind) for dst, kind, _, _, _ in rec.messages
               if kind in (Kind.STEP, Kind.LOSS, Kind.DONE)]
    others = [r for r in range(world) if r != rank]
    expected = {0: [(r, Kind.STEP) for r in others] + [(r, Kind.DONE) for r in others],
                world - 1: [(r, Kind.LOSS) for r in others]}.get(rank, [(0, Kind.DONE)])
    failures.expect(control == expected, f"{what}: control messages {control}")
    if rank == 0:
        first = [(dst, kind, mb) for dst, kind, mb, _, _ in rec.messages[:world]]
        failures.expect(first == [(1, Kind.STEP, -1), (1, Kind.ACTIVATION, 0),
                                  *((r, Kind.STEP, -1) for r in range(2, world))],
                        f"{what}: stage 0 sent first {first}")
    failures.expect(not any(rec.unposted_at_wait),
                    f"{what}: waited with receives not posted: {rec.unposted_at_wait}")
    # a call's first receive from each peer is put off: stage 0 posts none before its
    # first forward has sent its activation
    if rank == 0:
        failures.expect(rec.irecvs_before_activation == 0,
                        f"{what}: stage 0 posted {rec.irecvs_before_activation} receives "
                        f"before its first forward's activation")


def _communicators(rank: int, world: int) -> None:
    failures = Failures(rank)
    boom = ArmedBoom()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), boom, nn.Linear(8, 4)).to(DTYPE)
    with Touches() as touches, Recorder() as rec:
        pipe = DistributedPipe(model, chunks=4, balance=[1, 1, 1, 1], checkpoint="never")
        built_at = len(touches.ops)
        transport = pipe._transport
        names = {transport.group: "forward", transport.reverse: "reverse"}
        for n, batch in enumerate((8, 10, 6)):  # shapes change: placeholders, payloads
            x, y = data(50 + n, batch)
            rec.reset()
            pipe.train_step(x if rank == 0 else None, y if rank == world - 1 else None,
                            F.mse_loss)
            _step_edges(rank, world, rec, failures, f"step {n}")
        pipe(data(60, 8)[0] if rank == 0 else None)
        opened = {(names[g], peer, op) for op, g, peer in touches.ops[:built_at]}
        used = {(names[g], peer, op) for op, g, peer in touches.ops[built_at:]}
        failures.expect(used <= opened, f"calls used pairs not opened at construction: "
                                        f"{sorted(used - opened)}")
        firsts = touches.first(rank, names)
        failures.expect(all(when < built_at for *_, when in firsts),
                        f"a pair was first used after construction: {firsts}")
        # A failure on stage 2 of 4: the news travels only over pairs the calls used.
        boom.left = 3 if rank == 2 else None
        before = len(touches.ops)
        x, y = data(70, 8)
        try:
            pipe.train_step(x if rank == 0 else None, y if rank == world - 1 else None,
                            F.mse_loss)
        except (ZeroDivisionError, PeerError) as exc:
            failures.expect(isinstance(exc, ZeroDivisionError if rank == 2 else PeerError),
                            f"raised {exc!r}")
            failures.expect("stage 2 failed in the forward of micro-batch 2"
                            in str(exc) + " ".join(getattr(exc, "__notes__", [])),
                            f"the failure is not named: {exc!r}")
        else:
            failures.expect(False, "the failing step did not raise")
        during = {(names[g], peer, op) for op, g, peer in touches.ops[before:]}
        failures.expect(during <= opened, f"the failure used pairs not opened at "
                                          f"construction: {sorted(during - opened)}")
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, firsts)
    for a in range(world):
        for b in range(a + 1, world):
            theirs = {f[:3]: f[3] for f in everyone[b]}
            for first in everyone[a]:
                if first[1:3] == (a, b):
                    pair = sorted((first[3], theirs.get(first[:3], "nothing")))
                    failures.expect(pair == ["irecv", "isend"],
                                    f"{first[:3]} first touched by {pair}: not one matched "
                                    f"send and receive")
    cycle = _cycle(everyone)
    failures.expect(cycle is None, f"ranks first touch their pairs in conflicting orders: "
                                   f"{cycle}")
    failures.finish()


def test_communicators_open_in_one_order_at_construction_and_failures_stay_on_them() -> None:
    """Every (group, pair) a pipeline uses is first touched while it is built, by one
    matched send and receive, in an order all ranks agree on (NCCL creates a communicator
    per pair lazily, blocking until both ends arrive); later calls, and a failure on stage
    2 of 4 (relayed, not sent to every stage), use only those pairs."""
    run_workers(_communicators, 4, timeout=120, pg_timeout=60)


# -- shapes that keep changing: bytes on the wire ---------------------------------------
def _boundary(t: int) -> int:
    """Payload bytes of one activation (or its gradient) between ``small()``'s stages at
    balance [2, 3]: a micro-batch of 2 sequences of ``t`` steps, 16 float64 features."""
    return wire.nbytes(((DTYPE, (2, t, 16)),))


def _varying_length(rank: int, world: int) -> None:
    failures = Failures(rank)
    pipe, ref = built(7, chunks=4, balance=[2, 3], schedule="1f1b")
    transport = pipe._transport
    loss_bytes = wire.nbytes(((DTYPE, ()),))
    step_bytes = wire.nbytes(((torch.int64, (2,)),))
    # every step a new sequence length (never the same twice in a row), then one held
    lengths = [5, 9, 3, 12, 7, 4, 10, 6, 6, 6]
    gen = torch.Generator().manual_seed(8)
    with Recorder() as rec:
        for n, t in enumerate(lengths):
            x = torch.randn(8, t, 8, generator=gen, dtype=DTYPE)
            y = torch.randn(8, t, 4, generator=gen, dtype=DTYPE)
            rec.reset()
            before = transport.sent_bytes
            matched_step(pipe, ref, rank, world, x, y, failures, f"step {n} (length {t})")
            sent = transport.sent_bytes - before
            # one buffer per message, header and payload: what no scheme can go below
            # (stage 0's opening message carries the call's kind: two int64)
            least = (2 * HEADER_BYTES + step_bytes if rank == 0
                     else HEADER_BYTES + loss_bytes) + 4 * (HEADER_BYTES + _boundary(t))
            # Step 1 posts header-only receives (nothing seen yet): header, then payload,
            # no byte more. Step 2 meets receives posted at step 1's size, trusted since
            # seen: each activation (gradient) fills one with a placeholder, then the
            # payload. From then on those messages are not trusted to keep their shape:
            # header-only receives again, until the same length comes twice in a row.
            extra = 4 * _boundary(lengths[0]) if n == 1 else 0
            failures.expect(sent == least + extra, f"step {n}: sent {sent} bytes, expected "
                                                   f"{least} + {extra}")
            payload = [m for m in rec.messages if m[1] in (Kind.ACTIVATION, Kind.GRAD)]
            one = n == len(lengths) - 1  # the length held: received in place again
            failures.expect(all(m[4] == (1 if one else 2) for m in payload),
                            f"step {n}: buffers per message {[m[4] for m in payload]}")
    failures.finish()


def test_a_sequence_length_that_changes_every_step_costs_a_round_trip_not_bytes() -> None:
    """With the sequence length changing every step, each activation and gradient goes as
    a header then its payload: as many bytes as one buffer would take (the old scheme
    filled the receive posted at the old size first, about doubling the traffic), and
    one buffer again once a length holds; gradients match the plain model throughout."""
    run_workers(_varying_length, 2, timeout=120, pg_timeout=60)


# -- headers: never a blocking host-to-device copy --------------------------------------
class CopyMode(TorchDispatchMode):
    """Appends every copy between tensors (``copy_``, ``_to_copy``) to ``seen`` as
    ``(op, bytes, non_blocking)``."""

    def __init__(self, seen: List[Tuple[str, int, bool]]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            asynchronous = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            self.seen.append(("copy_", args[1].numel() * args[1].element_size(),
                              bool(asynchronous)))
        elif func is torch.ops.aten._to_copy.default:
            self.seen.append(("_to_copy", args[0].numel() * args[0].element_size(),
                              bool(kwargs.get("non_blocking", False))))
        return func(*args, **kwargs)


class Copies:
    """Patches ``Transport.send`` and ``Transport.recv`` to record their copies."""

    def __init__(self) -> None:
        self.seen: List[Tuple[str, int, bool]] = []
        self.originals = (Transport.send, Transport.recv)

    def __enter__(self) -> "Copies":
        seen, (send, recv) = self.seen, self.originals

        def _send(transport: Transport, *args: Any, **kwargs: Any) -> None:
            with CopyMode(seen):
                send(transport, *args, **kwargs)

        def _recv(transport: Transport, stage: int) -> Any:
            with CopyMode(seen):
                return recv(transport, stage)

        Transport.send, Transport.recv = _send, _recv  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        Transport.send, Transport.recv = self.originals  # type: ignore[method-assign]


def _header_copies(rank: int, world: int) -> None:
    failures = Failures(rank)
    pipe, ref = built(9, chunks=4, balance=[2, 3], schedule="1f1b")
    for n, batch in enumerate((8, 10)):  # the second: placeholders, header-only receives
        x, y = data(80 + n, batch)
        with Recorder() as rec, Copies() as copies:
            matched_step(pipe, ref, rank, world, x, y, failures, f"step {n}")
        # A host buffer takes its header in place: no header tensor is copied in (on a GPU
        # one is, queued from pinned memory: test_on_cuda_...); payloads are copied
        # between tensors on the stage's device; nothing moves with .to().
        headers = [c for c in copies.seen if c[1] == HEADER_BYTES]
        failures.expect(rec.messages and not headers,
                        f"step {n}: {len(headers)} header copies for {len(rec.messages)} "
                        f"messages: {headers}")
        failures.expect(not any(c[0] == "_to_copy" for c in copies.seen),
                        f"step {n}: a tensor was moved with .to(): {copies.seen}")
    failures.finish()


def test_headers_reach_the_buffer_without_a_blocking_copy() -> None:
    """On gloo the buffer is host memory: the header is written into it in place, with no
    copy at all (on a GPU it is copied from pinned memory, queued: the host goes on; that
    and reading received headers through a side stream run only on CUDA)."""
    run_workers(_header_copies, 2, timeout=120, pg_timeout=60)


class DoneWork:
    """A receive that has completed."""

    def wait(self, *args: Any) -> bool:
        return True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_headers_are_pinned_and_read_back_through_a_side_stream() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    with mock.patch.object(dist, "get_rank", return_value=0), \
            mock.patch.object(dist, "get_backend", return_value="nccl"):
        transport = Transport(None, device)  # no process group: only headers are read
    assert transport._side is not None  # the stream headers are read back on
    payload = torch.randn(3, 5, device=device)
    header = wire.encode(Kind.GRAD, 3, -1, 0, True, False, [payload], [True], pin=True)
    assert header.is_pinned()
    spec = wire.spec_of([payload])
    buffer = wire.pack(header, [payload], HEADER_BYTES + wire.nbytes(spec), device)
    torch.cuda.synchronize()  # stands in for the receive the side stream would wait for
    words = transport._arrival(_Posted(None, spec, buffer, DoneWork()))  # type: ignore[arg-type]
    assert words == header.tolist()
    assert torch.equal(wire.unpack(buffer, HEADER_BYTES, spec)[0], payload)


def test_a_header_reads_back_word_for_word_and_decodes() -> None:
    """The header of a message as the receiver reads it (``read_header`` on the received
    bytes): every word back, negative ones and the zero padding included, and ``decode``
    gives back what ``encode`` was told, values of every kind too."""
    tensors = [torch.randn(3, 5), None, torch.zeros(2, dtype=torch.int64)]
    values = ((1, None), (3, True), (4, -(2 ** 63)), (5, -0.25), (6, "déjà"))
    header = wire.encode(wire.Kind.SKIP, 7, -1, 9, False, True, tensors, [True, False, False],
                         origin=-1, values=values)
    assert header.dtype == torch.int64 and header.shape == (HEADER_SLOTS,)
    size = HEADER_BYTES + wire.nbytes(wire.spec_of(tensors))
    words = wire.read_header(wire.pack(header, [t for t in tensors if t is not None], size,
                                       torch.device("cpu")))
    assert words == header.tolist()
    kind, microbatch, key, count, atomic, reshaped, origin, specs, got = wire.decode(words)
    assert (kind, microbatch, key, count, atomic, reshaped, origin) == \
        (wire.Kind.SKIP, 7, -1, 9, False, True, -1)
    assert specs == [(torch.float32, True, (3, 5)), None, (torch.int64, False, (2,))]
    assert got == values
    text = wire.read_header(wire.pack(wire.encode_text(wire.Kind.ABORT, "stage 1 failed"), [],
                                      HEADER_BYTES, torch.device("cpu")))
    assert wire.decode_text(text) == "stage 1 failed"
