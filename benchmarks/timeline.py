"""Where a seqpipe training step spends its time: a per-task timeline of a 2-stage pipeline.

A diagnostic companion to ``throughput.py``. It wraps (in this process only, by
monkeypatching; ``seqpipe`` itself is untouched) ``Stage.forward`` and ``Stage.backward``
to record, for every (stage, micro-batch) task, its wall interval and the CPU time of the
thread that ran it. For each step it prints

* the step's wall time and each stage's busy fraction (how much of the step the stage's
  thread spent inside tasks: 1.0 on both stages is perfect overlap);
* the *schedule bound*: the step time a fill-drain schedule would take if every task
  lasted exactly its measured CPU time and each stage had a core of its own. It is what
  two dedicated cores would give; the gap between it and the wall time is time lost to
  other processes (the machine is shared), to the GIL, or to waiting between tasks.

With ``--verbose`` it lists every task.

Run: ``PYTHONPATH=. python benchmarks/timeline.py --chunks 4`` (``--help`` for more).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from _common import clone, make_model, pin_malloc, train_step

import seqpipe.core.stage as stage_module
from seqpipe import Pipe


@dataclass
class Task:
    stage: int
    phase: str  # "F" or "B"
    start: float
    end: float
    cpu: float


EVENTS: List[Task] = []
_LOCK = threading.Lock()


def _record(phase: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return original(self, *args, **kwargs)
        finally:
            task = Task(self.index, phase, t0, time.perf_counter(), time.thread_time() - c0)
            with _LOCK:
                EVENTS.append(task)
    return wrapper


def instrument() -> None:
    stage_module.Stage.forward = _record("F", stage_module.Stage.forward)  # type: ignore
    stage_module.Stage.backward = _record("B", stage_module.Stage.backward)  # type: ignore


def schedule_bound(tasks: List[Task], stages: int) -> float:
    """Fill-drain makespan with task durations = their CPU times, a core per stage.

    Forward: stage s runs micro-batches in order, each after stage s-1 finished it.
    Backward (after the whole forward, as in seqpipe): stage s runs them in reverse
    order, each after stage s+1 finished it. Tasks are matched to micro-batches by their
    order on each stage, which is the schedule's order.
    """
    fwd: Dict[int, List[float]] = {}
    bwd: Dict[int, List[float]] = {}
    for t in sorted(tasks, key=lambda t: t.start):
        (fwd if t.phase == "F" else bwd).setdefault(t.stage, []).append(t.cpu)
    m = len(fwd[0])
    done: Dict[Tuple[int, int], float] = {}
    for s in range(stages):
        free = 0.0
        for i in range(m):
            start = max(free, done.get((s - 1, i), 0.0))
            free = done[(s, i)] = start + fwd[s][i]
    forward_end = max(done.values())
    done_b: Dict[Tuple[int, int], float] = {}
    for s in reversed(range(stages)):
        free = forward_end
        for k, i in enumerate(reversed(range(m))):
            start = max(free, done_b.get((s + 1, i), forward_end))
            free = done_b[(s, i)] = start + bwd[s][k]
    return max(done_b.values())


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8, help="Linear+ReLU pairs in all")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--checkpoint", default="never",
                        choices=("always", "except_last", "never"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--verbose", action="store_true", help="list every task")
    args = parser.parse_args(argv)
    pin_malloc()
    torch.set_num_threads(args.threads)
    instrument()
    model = make_model(args.width, args.depth)
    plain = clone(model)
    half = len(model) // 2
    pipe = Pipe(clone(model), chunks=args.chunks, checkpoint=args.checkpoint,
                balance=[half, len(model) - half], devices=["cpu", "cpu"])
    x = torch.randn(args.batch, args.width)
    for _ in range(2):
        train_step(plain, x)
        train_step(pipe, x)
    print(f"# {args.depth} x Linear({args.width}), batch {args.batch}, chunks {args.chunks}, "
          f"checkpoint {args.checkpoint}, threads {args.threads}")
    print(f"{'step':>4} {'plain ms':>9} {'plain cpu':>9} {'pipe ms':>8} {'pipe cpu':>8} "
          f"{'busy s0':>7} {'busy s1':>7} {'bound ms':>8}")
    bounds, walls = [], []
    for step in range(args.steps):
        c0, t0 = time.process_time(), time.perf_counter()
        train_step(plain, x)
        plain_wall, plain_cpu = time.perf_counter() - t0, time.process_time() - c0
        EVENTS.clear()
        c0, t0 = time.process_time(), time.perf_counter()
        train_step(pipe, x)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        tasks = list(EVENTS)
        busy = [sum(t.end - t.start for t in tasks if t.stage == s) / wall for s in (0, 1)]
        bound = schedule_bound(tasks, 2)
        bounds.append(bound)
        walls.append(wall)
        print(f"{step:>4} {plain_wall * 1e3:>9.1f} {plain_cpu * 1e3:>9.1f} {wall * 1e3:>8.1f} "
              f"{cpu * 1e3:>8.1f} {busy[0]:>7.2f} {busy[1]:>7.2f} {bound * 1e3:>8.1f}")
        if args.verbose:
            for t in sorted(tasks, key=lambda t: t.start):
                print(f"      s{t.stage} {t.phase} {1e3 * (t.start - t0):7.1f} -> "
                      f"{1e3 * (t.end - t0):7.1f} ms  wall {1e3 * (t.end - t.start):6.1f}  "
                      f"cpu {1e3 * t.cpu:6.1f}")
    print(f"median: pipe {statistics.median(walls) * 1e3:.1f} ms, schedule bound "
          f"{statistics.median(bounds) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
