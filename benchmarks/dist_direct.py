"""One hop's host CPU, a message in one buffer against a large tensor sent apart, uncopied.

``seqpipe.distributed.wire.direct`` decides, per message, whether a payload of one tensor
travels in one buffer with its header (a copy of the payload on each side, one
point-to-point operation) or apart from it, as the tensor itself (no copy, two operations).
This times that choice alone, at several payload sizes: 2 processes on loopback, gloo, one
intra-op thread each; per round, the receiver posts the message's receives ahead (as the
transport does), the sender builds the message (``wire.header_words``, ``wire.buffers``) and
issues its sends, the receiver waits, reads the header and takes the payload
(``wire.read_header``, ``wire.decode``, ``wire.unpack`` or the posted tensor) and posts the
next receives (``wire.receives``). Before each message both ranks run a 512² matmul, so the
caches are as cold as after a layer, and the payload is a fresh tensor, as a layer's output
is. Reported: the median main-thread CPU time (``time.thread_time``: Python, the copy, the
socket writes) per message on each side, the two modes alternating in blocks.

Run: ``PYTHONPATH=. python benchmarks/dist_direct.py --rows 32 256 1024 2048 --messages 100``
(a payload is ``rows`` × 1024 float32: 32 rows = 128 KiB).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import load_average, pin_malloc

from seqpipe.distributed.wire import (
    HEADER_BYTES,
    Kind,
    buffers,
    decode,
    header_words,
    read_header,
    receives,
    spec_of,
    unpack,
)

MODES: Dict[str, Optional[int]] = {"one buffer": None, "direct": 1}


def _rank(rank: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    pin_malloc()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    cpu = torch.device("cpu")
    work = torch.randn(512, 512)
    times: Dict[Tuple[int, str], List[float]] = {}
    for rows in args.rows:
        base = torch.randn(rows, 1024)
        spec = spec_of([base])
        for _ in range(args.blocks):
            for mode, least in MODES.items():
                posted: List[Tuple[Any, Any]] = []
                if rank == 1:
                    header, payload = receives(spec, cpu, least)
                    posted = [(dist.irecv(header, src=0), header), (None, payload)]
                    if payload is not None:
                        posted[1] = (dist.irecv(payload, src=0), payload)
                for n in range(args.messages):
                    dist.barrier()
                    torch.mm(work, work)
                    if rank == 0:
                        tensor = base * 1.0  # a fresh output, as a layer's
                        start = time.thread_time()
                        words = header_words(Kind.ACTIVATION, n, -1, 0, True, False, [tensor],
                                             [True])
                        sent = [dist.isend(b, dst=1) for b in
                                buffers(words, [tensor], spec, cpu, least=least)]
                        times.setdefault((rows, mode), []).append(time.thread_time() - start)
                        time.sleep(0.001)
                        for w in sent:
                            w.wait()
                    else:
                        time.sleep(0.0005)  # the message is there: this times taking it
                        start = time.thread_time()
                        for w, _ in posted:
                            if w is not None:
                                w.wait()
                        decode(read_header(posted[0][1]))
                        if posted[1][1] is None:
                            unpack(posted[0][1], HEADER_BYTES, spec)
                        if n + 1 < args.messages:
                            header, payload = receives(spec, cpu, least)
                            posted = [(dist.irecv(header, src=0), header), (None, payload)]
                            if payload is not None:
                                posted[1] = (dist.irecv(payload, src=0), payload)
                        times.setdefault((rows, mode), []).append(time.thread_time() - start)
    queue.put((rank, {k: statistics.median(v[args.skip:]) for k, v in times.items()}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="*", default=[32, 256, 1024, 2048],
                        help="payload rows of 1024 float32 (32: 128 KiB)")
    parser.add_argument("--messages", type=int, default=100, help="messages per block")
    parser.add_argument("--blocks", type=int, default=2, help="blocks per mode, alternating")
    parser.add_argument("--skip", type=int, default=10, help="untimed first messages")
    parser.add_argument("--port", type=int, default=29587)
    args = parser.parse_args()
    print(f"load average {load_average()} (at start)")
    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=_rank, args=(r, args.port, args, queue)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    answers = dict(queue.get(timeout=900) for _ in procs)
    for proc in procs:
        proc.join()
    print(f"load average {load_average()} (at end)\n")
    print("| payload | sender, one buffer | sender, direct | receiver, one buffer | "
          "receiver, direct |\n| --- | --- | --- | --- | --- |")
    for rows in args.rows:
        cells = [f"{answers[r][(rows, mode)] * 1e6:.0f} µs" for r in (0, 1) for mode in MODES]
        print(f"| {rows * 4} KiB | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
