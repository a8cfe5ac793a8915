"""Where a sleep-timed pipeline step loses time against ``simulate()``: its critical path.

The sleep model (``sleep_model.py``) makes every action a ``time.sleep`` of known length, so
``seqpipe.schedule.simulate`` gives the step's makespan with zero-cost runtime and
communication, and whatever a measured step takes beyond it is the runtime's (or the
machine's). This benchmark records, on each of ``--ranks`` K processes, every sleep's start
and end (``time.perf_counter``, one clock for all processes), for seqpipe's
``DistributedPipe`` and torch pipelining on the same schedule (the variants of
``dist_schedules.py``, run alternately), maps the sleeps back to the schedule's actions and
walks the measured **critical path** back from the action that ended last: each action's
predecessor is whichever ended later of the previous action on its rank and the action on
another rank whose message it needs (the sender's forward for an ``F``, the receiver's
backward, or ``I``, for a ``B``/``I``). The makespan then splits exactly into

* ``head``: from the step's start (after a barrier) to the first action on the path;
* ``asked``: the sleeps the path's actions asked for (with no runtime cost, at least the
  simulated makespan: the same path's work);
* ``overrun``: how much longer those sleeps took than asked (the machine waking a sleeper
  late: the same for any runtime);
* ``hops`` (and their count): from a sender's action end to the receiver's action start,
  where the receiver waited for the message: serialization, the wire, the wake-up, and
  both ends' bookkeeping;
* ``local``: gaps between two actions of one rank on the path (bookkeeping between
  actions);
* ``tail``: from the path's last action end to the last rank's return (closing the call).

Schedules with one stage per rank only (``fill_drain``, ``1f1b``, ``zb_h1``, ``zb_h2``).

Run: ``PYTHONPATH=. python benchmarks/sleep_timeline.py`` (``--help`` for more).
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import hop_split
import sleep_model
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import load_average
from dist_schedules import make_config, seqpipe_variant, torch_variant

from seqpipe.schedule import Phase, get_schedule, simulate

SCHEDULES = ("fill_drain", "1f1b", "zb_h1", "zb_h2")
PARTS = ("head", "asked", "overrun", "hops", "local", "tail")
Sleep = Tuple[str, float, float, float]  # F / I / W, start, end, seconds asked
_SLEEPS: List[Sleep] = []


def _recorded(seconds: float) -> None:
    """``sleep_model._sleep``, recording which node slept (F, I or W) and when."""
    if sleep_model._ENABLED[0] and seconds > 0:
        name = sys._getframe(1).f_code.co_qualname  # SleepLayer.forward, _InputPath.backward...
        start = time.perf_counter()
        time.sleep(seconds)
        _SLEEPS.append(("F" if name[0] != "_" else name[1], start, time.perf_counter(), seconds))


def _worker(rank: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.ranks, timeout=datetime.timedelta(seconds=300))
    sleep_model._sleep = _recorded  # the layers look it up when they sleep
    if args.hops:
        hop_split.install()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.chunks * 4, args.width, generator=gen)
    y = torch.randn(args.chunks * 4, args.width, generator=gen)
    variants = {}
    for name in args.schedules:
        config = make_config(name, _config_args(args))
        variants[f"torch {name}"] = torch_variant(config, rank, args.chunks, x, y)
        variants[f"seqpipe {name}"] = seqpipe_variant(config, args.chunks, x, y)
    steps: Dict[str, List[Tuple[float, float, List[Sleep], List[Any]]]] = {
        k: [] for k in variants}
    for r in range(args.warmup + args.rounds):
        order = list(variants.items())
        for key, variant in (order if r % 2 else order[::-1]):  # alternate who goes first
            dist.barrier()
            _SLEEPS.clear()
            hop_split.LOG.clear()
            start = time.perf_counter()
            variant.run()
            end = time.perf_counter()
            if r >= args.warmup:
                steps[key].append((start, end, list(_SLEEPS), list(hop_split.LOG)))
    everyone: List[Optional[Dict[str, Any]]] = [None] * args.ranks
    dist.all_gather_object(everyone, steps)
    if rank == 0:
        queue.put(everyone)
    dist.barrier()
    dist.destroy_process_group()


def _config_args(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(ranks=args.ranks, real=False, ms=args.ms, layers_per_stage=1,
                              width=args.width, depth=0)


# -- the critical path ------------------------------------------------------------------
Key = Tuple[Phase, int, int]  # phase, micro-batch, rank (= stage)


def _actions(sim_timeline: Sequence[Tuple[float, float, Any]], sleeps: List[Sleep],
             rank: int) -> Dict[Key, Tuple[float, float, float]]:
    """The rank's actions as measured: ``(start, end, seconds asked)``, each from its sleeps
    in order (a ``B`` sleeps ``I`` then ``W``, but not on stage 0; an ``I`` on stage 0
    sleeps not at all and is left out)."""
    out: Dict[Key, Tuple[float, float, float]] = {}
    n = 0
    for _, _, action in sim_timeline:
        count = {Phase.FORWARD: 1, Phase.BACKWARD: 2 if rank else 1,
                 Phase.BACKWARD_INPUT: 1 if rank else 0, Phase.BACKWARD_WEIGHT: 1}[action.phase]
        if not count:
            continue
        mine = sleeps[n:n + count]
        n += count
        out[(action.phase, action.microbatch, rank)] = (
            min(s[1] for s in mine), max(s[2] for s in mine), sum(s[3] for s in mine))
    if n != len(sleeps):
        raise RuntimeError(f"rank {rank}: {len(sleeps)} sleeps for {n} expected")
    return out


def _sender(key: Key, last: int, done: Dict[Key, Tuple[float, float, float]]) -> Optional[Key]:
    """The action on another rank whose message ``key`` needs, if any."""
    phase, i, rank = key
    if phase is Phase.FORWARD:
        return (Phase.FORWARD, i, rank - 1) if rank > 0 else None
    if rank == last:
        return None
    for theirs in (Phase.BACKWARD, Phase.BACKWARD_INPUT):
        if (theirs, i, rank + 1) in done:
            return (theirs, i, rank + 1)
    return None


def critical_path(start: float, end: float, per_rank: List[List[Sleep]],
                  timeline: List[List[Tuple[float, float, Any]]],
                  logs: Optional[List[List[Any]]] = None,
                  hops: Optional[List[Dict[str, float]]] = None) -> Dict[str, float]:
    """One step's makespan split along its measured critical path (see the module doc);
    with ``logs`` (each rank's ``hop_split.LOG``), each hop's parts are added to ``hops``."""
    done: Dict[Key, Tuple[float, float, float]] = {}
    order: Dict[Key, Optional[Key]] = {}  # the previous action on the same rank
    for rank, sleeps in enumerate(per_rank):
        mine = _actions(timeline[rank], sleeps, rank)
        done.update(mine)
        previous: Optional[Key] = None
        for key in sorted(mine, key=lambda k: mine[k][0]):
            order[key], previous = previous, key
    last = len(per_rank) - 1
    parts = dict.fromkeys(PARTS, 0.0)
    parts["hop count"] = 0.0
    key: Optional[Key] = max(done, key=lambda k: done[k][1])
    parts["tail"] = end - done[key][1]  # type: ignore[index]
    while key is not None:
        first, stop, asked = done[key]
        parts["asked"] += asked
        parts["overrun"] += stop - first - asked
        local, remote = order[key], _sender(key, last, done)
        local_end = done[local][1] if local is not None else start
        remote_end = done[remote][1] if remote is not None else -1.0
        if remote is not None and remote_end > local_end:
            parts["hops"] += first - remote_end
            parts["hop count"] += 1
            split = hop_split.split_hop(remote[2], key[2], remote_end, first, local_end,
                                        logs) if logs and hops is not None else None
            if split is not None:
                hops.append(split)  # type: ignore[union-attr]
            key = remote
        elif local is not None:
            parts["local"] += first - local_end
            key = local
        else:
            parts["head"] += first - start
            key = None
    parts["makespan"] = end - start
    if logs and any(logs):
        last = max(done, key=lambda k: done[k][1])
        first = min(done, key=lambda k: done[k][0])
        parts.update(hop_split.split_edges((first[2], done[first][0]), (last[2], done[last][1]),
                                           end, logs))
    return parts


def report(everyone: List[Dict[str, Any]], args: argparse.Namespace) -> List[str]:
    hop_lines = ["| variant | hops split | bytes | " +
                 " | ".join(f"{p} ms" for p in (*hop_split.HOP_PARTS, "waited before")) +
                 " | head sends | head recvs | " +
                 " | ".join(f"{p} ms" for p in hop_split.EDGE_PARTS[2:]) + " |",
                 "|---|---|---|" + "---|" * (len(hop_split.HOP_PARTS) + 1 +
                                             len(hop_split.EDGE_PARTS))]
    lines = ["| variant | simulate ms | makespan ms | / simulate | " +
             " | ".join(f"{p} ms" for p in PARTS) + " | hops on the path | ms per hop |",
             "|---|---|---|---|" + "---|" * len(PARTS) + "---|---|"]
    for key in everyone[0]:
        name = key.split()[1]
        config = make_config(name, _config_args(args))
        f, i, w = config.costs  # type: ignore[misc]
        sim = simulate(get_schedule(name), args.ranks, args.chunks, forward_cost=f,
                       input_cost=i, weight_cost=w)
        hops: List[Dict[str, float]] = []
        steps = [critical_path(min(r[key][n][0] for r in everyone),
                               max(r[key][n][1] for r in everyone),
                               [r[key][n][2] for r in everyone], sim.timeline,
                               [r[key][n][3] for r in everyone], hops)
                 for n in range(len(everyone[0][key]))]
        split = hop_split.summarize(hops)
        if split:
            edges = {p: statistics.median(s[p] for s in steps) * (1 if p.startswith("head")
                                                                  else 1e3)
                     for p in hop_split.EDGE_PARTS}
            hop_lines.append(f"| {key} | {split['count']:.0f} | {split['bytes']:.0f} | " +
                             " | ".join(f"{split[p]:.3f}" for p in (*hop_split.HOP_PARTS,
                                                                   "waited before")) + " | " +
                             " | ".join(f"{edges[p]:.2f}" for p in hop_split.EDGE_PARTS) + " |")
        med = {p: statistics.median(s[p] for s in steps) for p in (*PARTS, "makespan",
                                                                    "hop count")}
        per_hop = statistics.median(s["hops"] / max(s["hop count"], 1) for s in steps)
        lines.append(f"| {key} | {sim.makespan:.0f} | {med['makespan'] * 1e3:.1f} | "
                     f"{med['makespan'] * 1e3 / sim.makespan:.3f} | " +
                     " | ".join(f"{med[p] * 1e3:.2f}" for p in PARTS) +
                     f" | {med['hop count']:.0f} | {per_hop * 1e3:.2f} |")
    return lines + ([""] + hop_lines if len(hop_lines) > 2 else [])


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="K")
    parser.add_argument("--chunks", type=int, default=8, help="M")
    parser.add_argument("--ms", type=float, default=10.0, help="F = I = W per stage, ms")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds")
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zb_h1"], choices=SCHEDULES)
    parser.add_argument("--hops", action="store_true",
                        help="also split each hop on the path (benchmarks/hop_split.py)")
    args = parser.parse_args(argv)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    print(f"# load average {load_average()} (at start)", file=sys.stderr, flush=True)
    queue = mp.get_context("spawn").SimpleQueue()
    context = mp.start_processes(_worker, args=(port, args, queue), nprocs=args.ranks,
                                 join=False, start_method="spawn")
    everyone = None
    while not context.join(timeout=0.2):
        if not queue.empty():
            everyone = queue.get()
    if everyone is None:
        everyone = queue.get()
    print(f"Command: python {' '.join(sys.argv)}")
    print(f"K={args.ranks}, M={args.chunks}, F=I=W={args.ms:g} ms per stage, {args.rounds} "
          f"rounds (medians); load average {load_average()} (at end)")
    print()
    print("\n".join(report(everyone, args)))


if __name__ == "__main__":
    main()
