"""Activation memory of the three checkpoint modes: ``always``, ``except_last``, ``never``.

Model: 2 partitions × ``depth`` (Linear(width) + ReLU) on ``cpu`` (default 12 pairs each,
width 1024, batch 512, ``chunks=4``). Each mode runs in its own subprocess (a fresh heap,
no cross-talk), does one warm-up training step, then ``--steps`` measured ones.

How bytes are measured, and why this way. ``saved_tensors_hooks`` are thread-local and
seqpipe runs every stage on its own worker thread, so hooks set by the caller see
nothing; hooks installed inside each layer would nest inside (and override)
``torch.utils.checkpoint``'s own, changing what is measured; ``tracemalloc`` does not see
PyTorch's C++ allocations, and peak RSS mixes in freed-but-kept heap pages. PyTorch's CPU
allocator takes its memory from glibc ``malloc`` in whatever thread allocates, so the
process-wide count of bytes in use, ``mallinfo2().uordblks + hblkhd`` (all arenas, mmapped
chunks included), sees every tensor of every stage. Two figures come from it:

* ``saved``: bytes in use right after the forward returned (its worker threads have
  joined) minus bytes in use right before it. That is exactly what the forward leaves
  alive for the backward: saved activations, checkpoint inputs, cross-partition tensors
  and the gathered output (one batch of ``width`` floats, the same in every mode). It is a
  difference of two exact readings, no sampling. **This is the saved-activation figure
  the target applies to.**
* ``peak``: the highest bytes-in-use seen by a sampling thread (every ~0.2 ms; it needs
  the GIL, which PyTorch kernels release) during the whole step, minus the same
  baseline. It adds what exists only during backward: recomputed activations of the
  micro-batch being backpropagated on each stage (both stages may recompute at once),
  activation gradients, and each parameter's gradient (param-sized; listed as ``grads``
  so it can be read off). Sampling can miss a spike shorter than a sampling interval, so
  it is a lower bound on the true peak, a tight one for spikes that last milliseconds.

A ``plain`` row (the unwrapped model, same batch) is the reference: ``never`` should save
about as much as it. With torchgpipe installed, its rows for the same modes are shown too.

Target: ``saved(always) / saved(never)`` ≤ 25 %.

``--every`` compares ``checkpoint_every=N`` instead (seqpipe only, ``checkpoint="always"``):
rows for N = 1, 2, the whole partition (``N`` = None) and no checkpointing (``never``),
with the median step time (wall clock, forward and backward) beside the two figures.
Each layer is its own segment at N = 1, so the forward keeps every layer's input; the
backward then holds one segment's recomputed activations at a time. That pays where a
layer keeps more inside than its input: ``--blocks`` makes every layer an MLP block,
``Linear(width, 4 width)``, GELU, ``Linear(4 width, width)`` (a transformer's feed-forward),
instead of a lone Linear or ReLU.

Run: ``PYTHONPATH=. python benchmarks/memory.py`` (``--help`` for sizes).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

import torch
from _common import clone, make_model
from torch import nn

TARGET = 0.25
MODES = ("always", "except_last", "never")
MiB = float(1 << 20)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def in_use() -> int:
    """Bytes handed out by malloc and not yet freed, over all threads' arenas."""
    info = _libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class PeakSampler:
    """A thread that records the highest ``in_use()`` seen while it runs."""

    def __init__(self, interval: float = 2e-4) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, in_use())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakSampler":
        self.peak = in_use()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, in_use())


def mlp_blocks(width: int, depth: int) -> nn.Sequential:
    """``depth`` MLP blocks (Linear(width, 4 width), GELU, Linear(4 width, width)), each one
    layer of the Sequential."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                         nn.Linear(4 * width, width)) for _ in range(depth)))


def build(impl: str, mode: str, width: int, depth: int, chunks: int,
          blocks: bool = False) -> nn.Module:
    """``mode`` may name a ``checkpoint_every`` after an ``@``: ``"always@2"``."""
    model = mlp_blocks(width, 2 * depth) if blocks else clone(make_model(width, 2 * depth))
    balance = [len(model) // 2] * 2
    if impl == "plain":
        return model
    if impl == "seqpipe":
        from seqpipe import Pipe

        mode, _, every = mode.partition("@")
        return Pipe(model, chunks=chunks, checkpoint=mode, balance=balance,
                    devices=["cpu", "cpu"], checkpoint_every=int(every) if every else None)
    if impl == "torchgpipe":
        from torchgpipe import GPipe

        return GPipe(model, balance=balance, devices=["cpu", "cpu"], chunks=chunks,
                     checkpoint=mode)
    raise ValueError(f"unknown implementation {impl!r}")


def child(impl: str, mode: str, width: int, depth: int, batch: int, chunks: int,
          steps: int, blocks: bool = False) -> Dict[str, float]:
    """Measure one (implementation, mode) in this process; returns bytes (and seconds)."""
    torch.set_num_threads(1)
    module = build(impl, mode, width, depth, chunks, blocks)
    x = torch.randn(batch, width)
    saved: List[int] = []
    peaks: List[int] = []
    times: List[float] = []
    for step in range(steps + 1):
        for p in module.parameters():
            p.grad = None
        base = in_use()
        with PeakSampler() as sampler:
            start = time.perf_counter()
            out = module(x)
            after_forward = in_use()
            out.sum().backward()
            elapsed = time.perf_counter() - start
            del out
        if step:  # the first step is a warm-up
            saved.append(after_forward - base)
            peaks.append(sampler.peak - base)
            times.append(elapsed)
    grads = sum(p.numel() * p.element_size() for p in module.parameters())
    return {"saved": statistics.median(saved), "peak": statistics.median(peaks),
            "grads": float(grads), "seconds": statistics.median(times)}


def run_child(impl: str, mode: str, args: argparse.Namespace) -> Dict[str, float]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, mode,
           "--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch),
           "--chunks", str(args.chunks), "--steps", str(args.steps)] + (
               ["--blocks"] if args.blocks else [])
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=12, help="Linear+ReLU pairs per partition")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="measured steps per mode")
    parser.add_argument("--impl", nargs="+", default=["plain", "seqpipe", "torchgpipe"],
                        choices=("plain", "seqpipe", "torchgpipe"))
    parser.add_argument("--every", action="store_true",
                        help="compare checkpoint_every = 1, 2, whole partition, never")
    parser.add_argument("--blocks", action="store_true",
                        help="every layer an MLP block (Linear, GELU, Linear; 4x wide inside)")
    parser.add_argument("--child", nargs=2, metavar=("IMPL", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        impl, mode = args.child
        print(json.dumps(child(impl, mode, args.width, args.depth, args.batch, args.chunks,
                               args.steps, args.blocks)))
        return 0

    if args.every:
        return every_table(args)
    impls = list(args.impl)
    if "torchgpipe" in impls:
        try:
            import torchgpipe  # noqa: F401
        except ImportError:
            print("note: torchgpipe is not installed; its rows are skipped")
            impls.remove("torchgpipe")
    unit = args.batch * args.width * 4
    print(f"# torch {torch.__version__}; model 2 partitions x {args.depth} x "
          f"(Linear({args.width}) + ReLU), batch {args.batch}, chunks {args.chunks}; "
          f"median of {args.steps} steps after 1 warm-up, one subprocess per row")
    print(f"# one batch of activations ({args.batch} x {args.width} floats) = "
          f"{unit / MiB:.1f} MiB")
    print(f"{'impl':<11} {'checkpoint':<12} {'saved MiB':>10} {'(batches)':>10} "
          f"{'peak MiB':>9} {'grads MiB':>10}")
    results: Dict[str, Dict[str, Dict[str, float]]] = {}
    for impl in impls:
        for mode in (["-"] if impl == "plain" else MODES):
            r = run_child(impl, mode, args)
            results.setdefault(impl, {})[mode] = r
            print(f"{impl:<11} {mode:<12} {r['saved'] / MiB:>10.1f} {r['saved'] / unit:>10.2f} "
                  f"{r['peak'] / MiB:>9.1f} {r['grads'] / MiB:>10.1f}", flush=True)
    if any(r["never"]["saved"] < 8 * MiB for i, r in results.items() if i != "plain"):
        print("warning: under 8 MiB saved in mode 'never'; allocator noise (~0.5 MiB) "
              "dominates, enlarge --batch or --depth")
    for impl in impls:
        if impl == "plain":
            continue
        r = results[impl]
        saved = r["always"]["saved"] / r["never"]["saved"]
        peak = r["always"]["peak"] / r["never"]["peak"]
        peak_net = ((r["always"]["peak"] - r["always"]["grads"])
                    / (r["never"]["peak"] - r["never"]["grads"]))
        line = (f"{impl}: saved always/never = {saved * 100:.1f} %; step peak always/never = "
                f"{peak * 100:.1f} % ({peak_net * 100:.1f} % without the grads)")
        if impl == "seqpipe":
            line += f"  (target saved <= {TARGET * 100:.0f} %: "
            line += "MET)" if saved <= TARGET else "MISSED)"
        print(line)
    return 0


def every_table(args: argparse.Namespace) -> int:
    """seqpipe rows for ``checkpoint_every`` = 1, 2, the whole partition, and never."""
    unit = args.batch * args.width * 4
    layers = (f"{args.depth} MLP blocks ({args.width} -> {4 * args.width} -> {args.width})"
              if args.blocks else f"{args.depth} x (Linear({args.width}) + ReLU) = "
              f"{2 * args.depth} layers")
    print(f"# torch {torch.__version__}; model 2 partitions x {layers} per partition, batch "
          f"{args.batch}, chunks {args.chunks}; median of {args.steps} steps after 1 "
          f"warm-up, one subprocess per row; one batch of activations = {unit / MiB:.1f} MiB")
    print(f"{'checkpoint':<12} {'every':>6} {'saved MiB':>10} {'(batches)':>10} "
          f"{'peak MiB':>9} {'step ms':>8}")
    for mode, every in (("always", "1"), ("always", "2"), ("always", "whole"),
                        ("never", "-")):
        r = run_child("seqpipe", mode if every in ("whole", "-") else f"{mode}@{every}", args)
        print(f"{mode:<12} {every:>6} {r['saved'] / MiB:>10.1f} {r['saved'] / unit:>10.2f} "
              f"{r['peak'] / MiB:>9.1f} {r['seconds'] * 1e3:>8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
