"""A message's host CPU with and without ``seqpipe.distributed.recycle``, after a layer.

One process, one intra-op thread, no communication: the two sides of a hop as the transport
runs them in a training loop's steady state, alternating round by round.

* send: ``wire.header_words`` and ``wire.buffers`` of a fresh (``rows``, 1024) float32
  activation into a new byte buffer each time (as before session 11), or into a buffer
  kept by ``recycle.Spares`` (given back two messages later, as a 1F1B stage's release
  does);
* receive: ``wire.read_header``, ``wire.decode`` and the payload's spec and flags of a
  received buffer (as before), or ``recycle.Headers.read`` of the same planned message.

Before each of them, four 1024² float32 matmuls (16 MiB of weights) run, so the caches are
as cold as after a stage's layers. Reported: median and lower quartile of the wall time
per call (µs; no other thread runs).

Run: ``PYTHONPATH=. python benchmarks/wire_recycle.py`` (``--rows 32``: 128 KiB, the MLP's
and the transformer's messages).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List

import torch
from _common import load_average, pin_malloc
from torch import Tensor

from seqpipe.distributed.recycle import Headers, Spares
from seqpipe.distributed.wire import Kind, buffers, decode, header_words, read_header, spec_of

CPU = torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32, help="activation rows of 1024 floats")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--skip", type=int, default=20, help="untimed first rounds")
    args = parser.parse_args()
    pin_malloc()
    torch.set_num_threads(1)
    x = torch.randn(args.rows, 1024)
    weights = [torch.randn(1024, 1024) for _ in range(4)]

    def layer() -> Tensor:
        with torch.no_grad():
            h = x
            for w in weights:
                h = torch.relu(h @ w)
            return h

    spares, headers = Spares(CPU), Headers()
    held: Dict[bool, List[Tensor]] = {False: [], True: []}

    def send(kept: bool, i: int, out: Tensor) -> Tensor:
        words = header_words(Kind.ACTIVATION, i, -1, 0, True, False, [out], [True], origin=0)
        sent = buffers(words, [out], spec_of([out]), CPU, alloc=spares.take if kept else None)
        if kept:
            spares.ours(sent[0])
        held[kept].append(sent[0])
        if len(held[kept]) > 2:  # taken by the receiver: its send completed
            old = held[kept].pop(0)
            if kept:
                spares.give(old)
        return sent[0]

    def receive(kept: bool, buffer: Tensor, i: int) -> object:
        if kept:
            return headers.read(buffer, (1, (Kind.ACTIVATION, i, -1, 0))).spec
        specs = decode(read_header(buffer))[7]
        flags = tuple(bool(s and s[1]) for s in specs)
        return tuple((s[0], s[2]) for s in specs if s is not None), flags

    times: Dict[str, List[int]] = {k: [] for k in ("send", "send kept", "receive",
                                                   "receive kept")}
    print(f"load average {load_average()} (at start)")
    for r in range(args.rounds):
        for kept in (False, True) if r % 2 else (True, False):
            suffix = " kept" if kept else ""
            out = layer()
            start = time.perf_counter_ns()
            buffer = send(kept, r % 8, out)
            times["send" + suffix].append(time.perf_counter_ns() - start)
            received = buffer.clone()
            layer()
            start = time.perf_counter_ns()
            receive(kept, received, r % 8)
            times["receive" + suffix].append(time.perf_counter_ns() - start)
    print(f"load average {load_average()} (at end)\n")
    print("| side | µs per message, median (lower quartile) |\n| --- | --- |")
    for name, values in times.items():
        timed = sorted(values[args.skip:])
        print(f"| {name} | {statistics.median(timed) / 1e3:.1f} "
              f"({timed[len(timed) // 4] / 1e3:.1f}) |")


if __name__ == "__main__":
    main()
