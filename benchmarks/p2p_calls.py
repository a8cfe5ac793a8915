"""Main-thread CPU of one point-to-point operation: ``dist.isend``/``irecv`` against the
process group's own ``send``/``recv`` (what ``dist.isend`` calls after its per-call checks:
the tensor, the group, the peer's rank in it, membership). Session 12 measured whether the
transport should call the group directly for its message buffers (docs/benchmark-history.md,
"Session 12: cpu2").

Two processes on loopback, gloo, one thread each. Each round, one message of ``--bytes``
(default 130 KiB: the MLP's activation with its header) goes from rank 0 to rank 1, each
call right after a 1024² matmul (caches cold, as after a layer), in one of four orders: the
receive posted before the send or after it (the second operation meets the first: a send
after the receive writes the payload itself), times the two forms; the orders alternate
round by round. ``time.thread_time`` around the call (the call only, not the wait); medians
in µs.

Run: ``PYTHONPATH=. python benchmarks/p2p_calls.py`` (~20 s).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from _common import load_average
from dist_vs_torch_pipelining import _init, spawn

FORMS = ("dist.isend/irecv", "group.send/recv")


def _call(form: str, op: str, buffer: torch.Tensor, peer: int) -> Any:
    if form == FORMS[0]:
        return (dist.isend(buffer, dst=peer) if op == "send" else dist.irecv(buffer, src=peer))
    group = dist.group.WORLD
    assert group is not None
    return group.send([buffer], peer, 0) if op == "send" else group.recv([buffer], peer, 0)


def bench_rank(rank: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    _init(rank, port)
    try:
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        buffer = torch.zeros(args.bytes, dtype=torch.uint8)
        cpu: Dict[str, List[float]] = {}
        orders = [(form, first) for form in FORMS for first in ("recv first", "send first")]
        for r in range(args.rounds * len(orders)):
            form, first = orders[r % len(orders)]
            op = "send" if rank == 0 else "recv"
            dist.barrier()
            if (op == "recv") != (first == "recv first"):  # the other rank goes first
                dist.barrier()
                time.sleep(0.001)  # its operation is issued by now
            a @ b  # right before the call, whichever goes first
            c = time.thread_time()
            work = _call(form, op, buffer, 1 - rank)
            spent = time.thread_time() - c
            if (op == "recv") == (first == "recv first"):
                dist.barrier()
            work.wait()
            cpu.setdefault(f"{op} ({first}), {form}", []).append(spent)
        queue.put(("cpu", rank, {k: statistics.median(v) for k, v in cpu.items()}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=130 << 10)
    parser.add_argument("--rounds", type=int, default=150, help="rounds of each order")
    args = parser.parse_args(argv)
    print(f"# load average {load_average()} (at start)", file=sys.stderr, flush=True)
    found: Dict[str, float] = {}
    for _, _, medians in spawn(bench_rank, args):
        found.update(medians)
    print(f"Command: python {' '.join(sys.argv)}; load average {load_average()} (at end)")
    print("| operation | " + " | ".join(f"{f} µs" for f in FORMS) + " |")
    print("|---|---|---|")
    for op in ("send (recv first)", "send (send first)", "recv (recv first)",
               "recv (send first)"):
        print(f"| {op} | " + " | ".join(f"{found[f'{op}, {f}'] * 1e6:.1f}" for f in FORMS)
              + " |")


if __name__ == "__main__":
    main()
