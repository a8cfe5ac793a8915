"""How long ``validate_schedule`` takes at the largest size it is meant for (64 ranks,
1024 micro-batches), for the built-in schedules.

``DistributedPipe`` and ``Pipe.train_step`` validate a schedule before anything runs, so
the validator must stay fast at the largest pipelines people build. This used to be a
timed unit test (``tests/test_schedule.py``, 5 s), which failed whenever the shared
machine was loaded; the timing lives here instead, and the tests keep only what is not a
speed (that the built-ins validate, at sizes that cost little).

Target: each schedule validates in under 5 s (a wall time on the 2-core machine; the CPU
time is printed beside it, which a loaded machine inflates less). Each schedule is timed
``--rounds`` times, interleaved with the others so that load hits all alike; the median
is reported. Run: ``PYTHONPATH=. python benchmarks/validate_schedule.py``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Dict, List, Tuple

from seqpipe.schedule import get_schedule, validate_schedule

TARGET_S = 5.0


def timed(name: str, ranks: int, microbatches: int) -> Tuple[float, float]:
    """Wall and process CPU seconds of one ``validate_schedule`` (which raises if the
    schedule is invalid, so a fast wrong answer cannot pass)."""
    schedule = get_schedule(name)
    wall, cpu = time.perf_counter(), time.process_time()
    validate_schedule(schedule, ranks, microbatches)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    """Print the median wall and CPU time per schedule, and whether it meets the target."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--schedules", default="fill_drain,1f1b")
    args = parser.parse_args()
    names = args.schedules.split(",")
    times: Dict[str, List[Tuple[float, float]]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order
            times[name].append(timed(name, args.ranks, args.microbatches))
    print(f"validate_schedule at {args.ranks} ranks x {args.microbatches} micro-batches, "
          f"median of {args.rounds} (load average {os.getloadavg()[0]:.1f}):")
    for name in names:
        wall = statistics.median(w for w, _ in times[name])
        cpu = statistics.median(c for _, c in times[name])
        verdict = "ok" if wall < TARGET_S else "over"
        print(f"  {name:12s} wall {wall:6.2f} s  cpu {cpu:6.2f} s  "
              f"target < {TARGET_S:.0f} s: {verdict}")


if __name__ == "__main__":
    main()
