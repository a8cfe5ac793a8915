"""Two-rank CPU training throughput: seqpipe's DistributedPipe against torch.distributed.pipelining.

Model: ``depth`` × (Linear(width, width) + ReLU) (default 8 × Linear(1024)), split in two
equal stages of ``depth / 2`` blocks, one stage per process. Two processes on loopback, gloo,
``torch.set_num_threads(1)`` in each. The micro-batch size is fixed (``--micro-batch``,
default 32 samples); the mini-batch is ``M`` micro-batches, so it grows with ``M``. A step
is zero-grad + forward + MSE loss + backward of one mini-batch (no optimizer); the loss is
the mean of the micro-batch losses everywhere, so every variant computes the same
gradients (checked before timing).

Variants, for each ``M`` in ``--chunks``:

* ``seqpipe fill_drain`` / ``seqpipe 1f1b``: ``DistributedPipe(model, chunks=M,
  balance=[d, d], schedule=..., checkpoint="never")``, ``train_step(x, y, mse_loss)``.
  ``checkpoint="never"`` because torch.distributed.pipelining does not recompute; both
  then do exactly the same arithmetic.
* ``torch GPipe`` / ``torch 1F1B``: ``PipelineStage(half, rank, 2, cpu)`` built by hand
  from the same ``nn.Sequential`` half, ``ScheduleGPipe`` / ``Schedule1F1B(stage, M,
  loss_fn=mse_loss)``, ``step(x)`` on rank 0 and ``step(target=y, losses=[],
  return_outputs=False)`` on rank 1 (defaults otherwise, i.e. ``scale_grads=True``).
* ``1 process``: the whole model in one process (rank 0, while rank 1 waits), one thread,
  the same ``M`` micro-batches one after another, ``(loss / M).backward()`` each
  (gradient accumulation). Its rate is the "one-process same-micro-batch rate" r1.

Timing. Each step starts with a barrier; both ranks read ``time.perf_counter`` (the
system-wide monotonic clock, comparable across the two processes) after the barrier and
after the step; the step time is the last end minus the first start. Variants run
interleaved, round by round, in an order that rotates each round; the first ``--warmup``
rounds are not timed. Each round also measures the *foreign* load: busy CPU time of the
whole machine (``/proc/stat``) minus both ranks' own, in cores; only rounds with at most
``--max-foreign`` cores of foreign load count, and the script keeps going (up to
``--max-rounds``) until ``--rounds`` such quiet rounds were timed. Figures are medians over
the quiet rounds; a ratio seqpipe/torch is the median of the per-round ratios (paired).

Efficiency at ``M``: throughput / (2M/(M+1) × r1), the ideal of a 2-stage pipeline whose
stages take half a micro-batch each, fed by the one-process rate at the same micro-batch
size. Targets: seqpipe/torch ≥ 1.15× at M ∈ {4, 8, 16}; efficiency ≥ 95 % at M = 8.

Diagnostic variant ``2 halves, no comm``: each rank runs only its own half on the same M
micro-batches (stage 0 backpropagates a constant gradient), with no communication at all.
It measures how fast each core does half the work while the other core is busy too (shared
caches and memory bandwidth); ``one / (2 × its time)`` is the efficiency ceiling of any
2-process pipeline on this machine, before bubbles and communication. Its time is the
*compute floor*; times ``(M + 1) / M`` (the bubble of a 2-stage fill-drain or 1F1B clock) it
is the fastest any runtime could run this split at that moment, so torch's step over it,
the *ceiling* column, is the most seqpipe/torch could be in that run (as in
``dist_transformer_vs_torch.py``). Each variant's main-thread CPU per step and rank
(``time.thread_time``: the thread running the step; gloo's I/O threads excluded) is
printed beside it, the figure issue 24 compares with torch's.

Memory (``--memory-chunks``, default 8): one step per pipelined variant, on each rank,

* inside a ``torch.autograd.graph.saved_tensors_hooks`` context (thread-local; both
  libraries run the stage's forward and backward in the rank's main thread) that counts
  the bytes of every distinct storage autograd saves for backward, from the moment it is
  saved until autograd drops it (after that node's backward), and records the peak of the
  sum; parameters and the caller's input/target are excluded (every variant saves the
  same weights, and the caller owns the mini-batch). See ``SavedBytes``;
* under ``torch.profiler`` with ``profile_memory=True``: the peak of the net bytes the CPU
  allocator handed out during the step, i.e. everything the step keeps alive at its worst
  (activations, buffers held by pending sends, received tensors, gradients);
* for seqpipe, the peak bytes of sent buffers its ``Transport`` still holds (a sent buffer
  is kept until the receiver has certainly taken it; ``Transport.pending_bytes``).

Run: ``PYTHONPATH=. python benchmarks/dist_vs_torch_pipelining.py`` (``--help`` for sizes).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from _common import load_average, make_model, pin_malloc
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import seqpipe
from seqpipe.distributed import DistributedPipe

SEQ = ("seqpipe fill_drain", "seqpipe 1f1b")
TORCH = ("torch GPipe", "torch 1F1B")
ONE = "1 process"
HALVES = "2 halves, no comm"
PAIRS = {"fill_drain": (SEQ[0], TORCH[0]), "1f1b": (SEQ[1], TORCH[1])}
RATIO_TARGET = 1.15
EFFICIENCY_TARGET = 0.95


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(output, target)


# -- the variants ----------------------------------------------------------------------
class Variants:
    """Every variant's step function for one ``M`` on this rank (same weights everywhere)."""

    def __init__(self, model: nn.Sequential, rank: int, chunks: int, micro: int,
                 width: int, only: Optional[Sequence[str]] = None) -> None:
        self.rank, self.chunks = rank, chunks
        half = len(model) // 2
        gen = torch.Generator().manual_seed(1234 + chunks)
        self.x = torch.randn(chunks * micro, width, generator=gen)
        self.y = torch.randn(chunks * micro, width, generator=gen)
        self.steps: Dict[str, Callable[[], None]] = {}
        self.params: Dict[str, List[nn.Parameter]] = {}
        self.pipes: Dict[str, DistributedPipe] = {}
        want = only or (*SEQ, *TORCH, ONE, HALVES)
        for name in SEQ:
            if name in want:
                pipe = DistributedPipe(copy.deepcopy(model), chunks=chunks, balance=[half, half],
                                       schedule=name.split()[1], checkpoint="never",
                                       device="cpu")
                self._add(name, list(pipe.parameters()), self._seqpipe_step(pipe))
                self.pipes[name] = pipe
        for name, cls in zip(TORCH, (ScheduleGPipe, Schedule1F1B)):
            if name in want:
                part = copy.deepcopy(model)[rank * half:(rank + 1) * half]
                stage = PipelineStage(part, rank, 2, torch.device("cpu"))
                schedule = cls(stage, n_microbatches=chunks, loss_fn=loss_fn)
                self._add(name, list(part.parameters()), self._torch_step(schedule))
        if ONE in want:
            whole = copy.deepcopy(model)
            params = list(whole.parameters())
            self._add(ONE, params[len(params) // 2 * rank:len(params) // 2 * (rank + 1)],
                      self._one_step(whole) if rank == 0 else (lambda: None))
            self.reference = self._one_step(whole)  # the gradient check runs it on both ranks
        if HALVES in want:
            part = copy.deepcopy(model)[rank * half:(rank + 1) * half]
            self._add(HALVES, list(part.parameters()), self._half_step(part))

    def _add(self, name: str, params: List[nn.Parameter], step: Callable[[], None]) -> None:
        def run() -> None:
            for p in params:
                p.grad = None
            step()
        self.steps[name], self.params[name] = run, params

    def _seqpipe_step(self, pipe: DistributedPipe) -> Callable[[], None]:
        x = self.x if self.rank == 0 else None
        y = self.y if self.rank == 1 else None
        return lambda: pipe.train_step(x, y, loss_fn) and None

    def _torch_step(self, schedule: Any) -> Callable[[], None]:
        if self.rank == 0:
            return lambda: schedule.step(self.x)
        return lambda: schedule.step(target=self.y, losses=[], return_outputs=False)

    def _one_step(self, whole: nn.Sequential) -> Callable[[], None]:
        xs, ys = self.x.chunk(self.chunks), self.y.chunk(self.chunks)

        def step() -> None:
            for x, y in zip(xs, ys):
                (loss_fn(whole(x), y) / self.chunks).backward()
        return step


    def _half_step(self, part: nn.Sequential) -> Callable[[], None]:
        """This rank's half alone, M micro-batches, no communication: a compute ceiling."""
        xs, ys = self.x.chunk(self.chunks), self.y.chunk(self.chunks)
        grad = torch.full((xs[0].shape[0], part[-2].out_features), 1e-3)

        def step() -> None:
            for x, y in zip(xs, ys):
                if self.rank == 1:  # the input would be stage 0's output: same shape
                    (loss_fn(part(x), y) / self.chunks).backward()
                else:
                    part(x).backward(grad)
        return step


def check_gradients(variants: Variants) -> float:
    """Largest relative difference between any variant's gradients and the 1-process ones."""
    for step in variants.steps.values():
        dist.barrier()
        step()
    if variants.rank != 0:
        variants.reference()
    reference = [p.grad for p in variants.params[ONE]]
    worst = 0.0
    for name, params in variants.params.items():
        if name == HALVES:
            continue
        for p, ref in zip(params, reference):
            assert p.grad is not None, f"{name}: no gradient"
            worst = max(worst, float((p.grad - ref).abs().max() / ref.abs().max()))
    return worst


# -- timing ----------------------------------------------------------------------------
def _busy_seconds() -> float:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system  # every thread of this process (gloo's included)


def time_rounds(variants: Any, args: argparse.Namespace,
                clock: Callable[[], float] = _own_cpu) -> Dict[str, Any]:
    """Interleaved timed rounds; returns per-variant step times of the quiet rounds.

    ``variants.steps``: the step of each variant; each step's CPU time is read with
    ``clock`` on each rank (default: the whole process's), summed over both (``cpu``) and
    per rank (``ranks``), and with ``time.thread_time`` per rank (``main``: the thread
    that runs the step, gloo's threads excluded)."""
    names = list(variants.steps)
    for _ in range(args.warmup):
        for name in names:
            dist.barrier()
            variants.steps[name]()
    starts: List[List[float]] = []  # per round: [t0, t1] per variant (in `names` order)
    cpus: List[List[float]] = []
    mains: List[List[float]] = []  # per round: this rank's main-thread CPU per variant
    rounds: List[float] = []  # per round: [own cpu over the round, busy over the round]
    quiet = r = 0
    while quiet < args.rounds and r < args.max_rounds:
        shift = r % len(names)
        dist.barrier()
        busy0, own0, w0 = _busy_seconds(), _own_cpu(), time.perf_counter()
        row = [0.0] * (2 * len(names))
        crow = [0.0] * len(names)
        mrow = [0.0] * len(names)
        for name in names[shift:] + names[:shift]:
            k = names.index(name)
            dist.barrier()
            m0, c0, t0 = time.thread_time(), clock(), time.perf_counter()
            variants.steps[name]()
            t1, c1, m1 = time.perf_counter(), clock(), time.thread_time()
            row[2 * k:2 * k + 2] = [t0, t1]
            crow[k], mrow[k] = c1 - c0, m1 - m0
        dist.barrier()
        w1, own1, busy1 = time.perf_counter(), _own_cpu(), _busy_seconds()
        mine = torch.tensor([own1 - own0, busy1 - busy0, w1 - w0], dtype=torch.float64)
        both = [torch.zeros_like(mine) for _ in range(2)]
        dist.all_gather(both, mine)
        own = float(both[0][0] + both[1][0])
        foreign = max(0.0, (float(both[0][1]) - own) / float(both[0][2]))
        rounds.append(foreign)
        starts.append(row)
        cpus.append(crow)
        mains.append(mrow)
        quiet += foreign <= args.max_foreign
        r += 1
    mine_t = torch.tensor(starts, dtype=torch.float64)
    mine_c = torch.tensor(cpus, dtype=torch.float64)
    mine_m = torch.tensor(mains, dtype=torch.float64)
    all_t = [torch.zeros_like(mine_t) for _ in range(2)]
    all_c = [torch.zeros_like(mine_c) for _ in range(2)]
    all_m = [torch.zeros_like(mine_m) for _ in range(2)]
    dist.all_gather(all_t, mine_t)
    dist.all_gather(all_c, mine_c)
    dist.all_gather(all_m, mine_m)
    keep = [i for i, f in enumerate(rounds) if f <= args.max_foreign]
    out: Dict[str, Any] = {"rounds": r, "quiet": len(keep), "foreign": rounds}
    for k, name in enumerate(names):
        t0 = torch.minimum(all_t[0][:, 2 * k], all_t[1][:, 2 * k])
        t1 = torch.maximum(all_t[0][:, 2 * k + 1], all_t[1][:, 2 * k + 1])
        if name == ONE:  # rank 1 only waits: the step is rank 0's own time
            t0, t1 = all_t[0][:, 2 * k], all_t[0][:, 2 * k + 1]
        wall = (t1 - t0).tolist()
        cpu = (all_c[0][:, k] + all_c[1][:, k]).tolist()
        out[name] = {"wall": [wall[i] for i in keep], "cpu": [cpu[i] for i in keep],
                     "ranks": [[c[i, k].item() for i in keep] for c in all_c],
                     "main": [[c[i, k].item() for i in keep] for c in all_m]}
    return out


# -- memory ----------------------------------------------------------------------------
class _Held:
    """What the pack hook hands autograd: the tensor, plus a release when autograd drops it."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor: Tensor, key: int, owner: "SavedBytes") -> None:
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self) -> None:
        self.owner.release(self.key)


class SavedBytes:
    """Peak bytes of storage that autograd keeps saved for backward (one thread's graph).

    ``pack`` is called for every tensor a forward op saves; it counts the tensor's whole
    storage once however many saved tensors share it (views, a ReLU output that is also the
    next Linear's input), and wraps the tensor in a ``_Held`` that only autograd references:
    when autograd frees the saved tensor (after the node's backward, or with its graph),
    the wrapper dies and the storage's count drops; at zero its bytes leave the live sum.
    A storage can only be reused after it is freed, so keying by its data pointer is safe
    while it is counted. Storages of ``exclude`` (the parameters) are not counted.
    """

    def __init__(self, exclude: Sequence[Tensor]) -> None:
        self.exclude = {p.untyped_storage().data_ptr() for p in exclude}
        self.live: Dict[int, List[int]] = {}
        self.total = self.peak = 0

    def pack(self, tensor: Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.exclude or storage.nbytes() == 0:
            return tensor
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [0, storage.nbytes()]
            self.total += entry[1]
            self.peak = max(self.peak, self.total)
        entry[0] += 1
        return _Held(tensor, key, self)

    @staticmethod
    def unpack(held: Any) -> Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.total -= entry[1]
            del self.live[key]


def _allocation_peak(prof: Any) -> Tuple[int, int]:
    """(peak, end) of the net bytes the CPU allocator handed out while ``prof`` recorded."""
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    total = peak = 0
    for event in events:
        total += event.nbytes()
        peak = max(peak, total)
    return peak, total


def measure_memory(variants: Variants) -> Dict[str, Dict[str, int]]:
    """Per pipelined variant, on this rank: saved-for-backward and allocator peaks of a step."""
    out = {}
    for name in (*SEQ, *TORCH):
        params = variants.params[name]
        counter = SavedBytes([*params, variants.x, variants.y])  # the caller's tensors
        for p in params:
            p.grad = None
        dist.barrier()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            variants.steps[name]()
        for p in params:
            p.grad = None
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    profile_memory=True) as prof:
            variants.steps[name]()
        peak, end = _allocation_peak(prof)
        out[name] = {"saved_peak": counter.peak, "saved_end": counter.total,
                     "alloc_peak": peak, "alloc_end": end,
                     "pending_peak": _pending_peak(variants, name)}
    return out


def _pending_peak(variants: Variants, name: str) -> int:
    """seqpipe: peak bytes of sent tensors its transport still references during a step."""
    pipe = variants.pipes.get(name)
    if pipe is None:
        return -1
    transport = pipe._transport
    peak = 0
    original = transport._isend

    def isend(tensor: Tensor, stage: int, taken_at: int) -> None:
        nonlocal peak
        original(tensor, stage, taken_at)
        peak = max(peak, transport.pending_bytes())
    transport._isend = isend  # type: ignore[method-assign]
    try:
        dist.barrier()
        variants.steps[name]()
    finally:
        del transport._isend
    return peak


# -- the ranks -------------------------------------------------------------------------
def _init(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=300))


def bench_rank(rank: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    if args.malloc == "pinned":
        pin_malloc()
    _init(rank, port)
    try:
        model = make_model(args.width, args.depth)
        results: Dict[str, Any] = {"chunks": {}}
        for m in args.chunks:
            variants = Variants(model, rank, m, args.micro_batch, args.width)
            error = check_gradients(variants)
            timed = time_rounds(variants, args)
            timed["grad_error"] = error
            results["chunks"][m] = timed
            if rank == 0:
                loads = sorted(timed["foreign"])
                print(f"  M={m}: {timed['quiet']}/{timed['rounds']} quiet rounds (foreign load "
                      f"min {loads[0]:.2f}, median {_med(loads):.2f} cores), max grad rel. "
                      f"diff {error:.1e}", file=sys.stderr, flush=True)
            del variants
        if args.memory_chunks:
            variants = Variants(model, rank, args.memory_chunks, args.micro_batch, args.width)
            check_gradients(variants)  # also a warm-up
            queue.put(("memory", rank, measure_memory(variants)))
        if rank == 0:
            queue.put(("timing", rank, results))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(fn: Callable[..., None], *args: Any) -> List[Any]:
    """Run ``fn(rank, port, *args, queue)`` on two processes; return what they queued."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    context = mp.start_processes(fn, args=(_free_port(), *args, queue), nprocs=2, join=False,
                                 start_method="spawn")
    out = []
    done = False
    while not done:
        done = context.join(timeout=0.2)
        while not queue.empty():  # drain as we go: a full pipe would block the sender
            out.append(queue.get())
    return out


# -- report ----------------------------------------------------------------------------
def _med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def timing_table(results: Dict[str, Any], args: argparse.Namespace) -> List[str]:
    micro = args.micro_batch
    lines = ["| M | batch | variant | step ms (IQR) | steps/s | samples/s | CPU cores | "
             "vs 1 process | efficiency | seqpipe/torch | ceiling | "
             "main-thread CPU ms, rank 0 / 1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    floors: List[str] = []
    foreign: List[float] = []
    summary: List[str] = []
    torch_of = {s: t for s, t in PAIRS.values()}
    for m, timed in results.items():
        foreign += [f for f in timed["foreign"] if f <= args.max_foreign]
        ideal = 2 * m / (m + 1)
        one = _med(timed[ONE]["wall"])
        floor = _med(timed[HALVES]["wall"]) * (m + 1) / m  # + a 2-stage pipeline's bubble
        floors.append(f"M={m}: compute floor {floor * m / (m + 1) * 1e3:.1f} ms, "
                      f"{floor * 1e3:.1f} ms with the (M+1)/M bubble")
        for name in (*SEQ, *TORCH, ONE, HALVES):
            wall, cpu = timed[name]["wall"], timed[name]["cpu"]
            med = _med(wall)
            q = statistics.quantiles(wall, n=4) if len(wall) >= 4 else [med, med, med]
            cores = _med([c / w for c, w in zip(cpu, wall)])
            speed = one / med
            eff = "-" if name == ONE else f"{speed / ideal:.1%}"
            if name == HALVES:  # the efficiency a zero-cost pipeline could reach (see docs)
                eff = f"ceiling {one / (2 * med):.1%}"
            ratio = ceiling = "-"
            if name in torch_of:
                paired = [t / s for s, t in zip(wall, timed[torch_of[name]]["wall"])]
                ratio = f"**{_med(paired):.3f}×**"
                top = _med(timed[torch_of[name]]["wall"]) / floor
                ceiling = f"{top:.3f}×"
                ok = _med(paired) >= RATIO_TARGET
                summary.append(f"M={m} {name}/torch: {_med(paired):.3f}× "
                               f"({'meets' if ok else 'misses'} {RATIO_TARGET}×); the most "
                               f"any runtime could reach here: {top:.3f}×")
                if m == 8:
                    summary.append(f"M=8 {name} efficiency: {speed / ideal:.1%} "
                                   f"({'meets' if speed / ideal >= EFFICIENCY_TARGET else 'misses'}"
                                   f" {EFFICIENCY_TARGET:.0%})")
            lines.append(f"| {m} | {m * micro} | {name} | {med * 1e3:.1f} "
                         f"({(q[2] - q[0]) * 1e3:.1f}) | {1 / med:.2f} | {m * micro / med:.0f} "
                         f"| {cores:.2f} | {speed:.2f}× (ideal {ideal:.2f}) | {eff} | {ratio} "
                         f"| {ceiling} | "
                         + " / ".join(f"{_med(c) * 1e3:.1f}" for c in timed[name]["main"])
                         + " |")
    head = ["Quiet rounds per M: " + ", ".join(
        f"M={m}: {t['quiet']}/{t['rounds']}" for m, t in results.items()),
        f"Foreign load over the kept rounds: median {_med(foreign):.2f} cores, max "
        f"{max(foreign, default=float('nan')):.2f} (limit {args.max_foreign}); gradients of "
        f"every variant agree with the 1-process ones to "
        f"{max(t['grad_error'] for t in results.values()):.1e} (max relative difference).",
        "Ceiling of seqpipe/torch: torch's step over the compute floor (the 2 halves row: "
        "each rank its half at the same time, no communication) times (M+1)/M (a 2-stage "
        "pipeline's bubble), the fastest any runtime could run this split here: "
        + "; ".join(floors) + ".", ""]
    return head + lines + ["", "Targets:", *(f"- {line}" for line in summary)]


def memory_table(memory: Dict[int, Dict[str, Dict[str, int]]],
                 args: argparse.Namespace) -> List[str]:
    half = args.depth // 2
    per_mb = half * args.micro_batch * args.width * 4
    mib = 2 ** 20
    lines = [f"Memory of one step at M={args.memory_chunks} (micro-batch {args.micro_batch}). "
             f"Saved for backward: peak bytes of the storages autograd holds for backward "
             f"(parameters and the caller's input/target excluded); one micro-batch's "
             f"activations per stage = {half} ReLU outputs = {per_mb / mib:.2f} MiB (stage 1 "
             f"also saves its received input). Allocator: peak net bytes the CPU allocator "
             f"handed out during the step (torch.profiler profile_memory; includes the "
             f"{sum(p.numel() for p in make_model(args.width, half).parameters()) * 4 / mib:.1f}"
             f" MiB of parameter gradients), and what was still allocated at the end.", "",
             "| variant | stage 0 saved peak MiB (micro-batches) | stage 1 saved peak MiB | "
             "stage 0 allocator peak / end MiB | stage 1 allocator peak / end MiB | "
             "held by pending sends, stage 0 / 1 MiB |",
             "|---|---|---|---|---|---|"]
    for name in (*SEQ, *TORCH):
        s0, s1 = memory[0][name], memory[1][name]
        lines.append(f"| {name} | {s0['saved_peak'] / mib:.2f} ({s0['saved_peak'] / per_mb:.2f}) "
                     f"| {s1['saved_peak'] / mib:.2f} "
                     f"| {s0['alloc_peak'] / mib:.2f} / {s0['alloc_end'] / mib:.2f} "
                     f"| {s1['alloc_peak'] / mib:.2f} / {s1['alloc_end'] / mib:.2f} | "
                     + (f"{s0['pending_peak'] / mib:.2f} / {s1['pending_peak'] / mib:.2f} |"
                        if s0["pending_peak"] >= 0 else "- |"))
    left = {name: (memory[0][name]["saved_end"], memory[1][name]["saved_end"])
            for name in (*SEQ, *TORCH)}
    if any(a or b for a, b in left.values()):
        lines.append(f"Saved bytes left after the step (a leak): {left}")
    return lines


def seqpipe_version() -> str:
    """The commit of the checkout seqpipe is imported from, ``+dirty`` if it has changes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(seqpipe.__file__)))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                                capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "seqpipe"], cwd=root,
                               text=True, capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "seqpipe (not a git checkout)"
    return f"seqpipe at {commit}{'+dirty' if dirty else ''}"


_VERSION_AT_START = seqpipe_version()  # the code the ranks import (at spawn)


def machine_line() -> str:
    now = seqpipe_version()
    version = _VERSION_AT_START + ("" if now == _VERSION_AT_START else f" (now {now})")
    return (f"torch {torch.__version__}, python {platform.python_version()}, "
            f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
            f"2 ranks × 1 intra-op thread, gloo on 127.0.0.1, {version}, "
            f"load average {load_average()}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8,
                        help="Linear+ReLU blocks (even: half per stage)")
    parser.add_argument("--micro-batch", type=int, default=32, help="samples per micro-batch")
    parser.add_argument("--chunks", type=int, nargs="*", default=[2, 4, 8, 16],
                        help="micro-batches per step (M); none: only the memory measurement")
    parser.add_argument("--rounds", type=int, default=20, help="quiet timed rounds per M")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds per M")
    parser.add_argument("--max-foreign", type=float, default=0.3,
                        help="keep rounds whose foreign load is at most this many cores")
    parser.add_argument("--max-rounds", type=int, default=200, help="give up after this many")
    parser.add_argument("--memory-chunks", type=int, default=8,
                        help="M for the saved-bytes measurement (0: skip)")
    parser.add_argument("--malloc", choices=("pinned", "default"), default="pinned",
                        help="fix glibc's malloc thresholds (see _common.pin_malloc)")
    args = parser.parse_args(argv)
    if args.depth % 2:
        parser.error("--depth must be even (two equal stages)")
    print(f"# {machine_line()} (at start)", file=sys.stderr, flush=True)
    started = time.perf_counter()
    answers = spawn(bench_rank, args)
    timing = next(r for kind, _, r in answers if kind == "timing")["chunks"]
    memory = {rank: r for kind, rank, r in answers if kind == "memory"}
    print(f"Command: python {' '.join(sys.argv)}")
    print(f"Machine: {machine_line()} (at end); {time.perf_counter() - started:.0f} s")
    print(f"Model: {args.depth} × (Linear({args.width}, {args.width}) + ReLU), 2 stages of "
          f"{args.depth // 2}; micro-batch {args.micro_batch}; MSE loss; no optimizer")
    print()
    if timing:
        print("\n".join(timing_table(timing, args)))
    if memory:
        print()
        print("\n".join(memory_table(memory, args)))


if __name__ == "__main__":
    main()
