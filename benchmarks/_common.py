"""Shared pieces of the seqpipe benchmarks: the model, the training step, robust timing.

Timing follows three rules, because this machine is small (2 cores) and often shared:

* warm-up steps first (allocator, thread pools and oneDNN/MKL kernels settle);
* the variants run *interleaved*: round ``r`` runs every variant once, in an order that
  rotates from round to round, so slow drift (thermal, other processes) hits all of them
  alike and no variant always runs right after the same neighbour;
* the figure reported is the median over rounds, and a ratio between two variants is the
  median of the per-round ratios (a paired statistic, which cancels drift better than the
  ratio of two medians; both are printed where it matters).

Each step also records the process CPU time it used, so a reader can tell a slow step from
a step that did not get the cores (``cpu/wall`` near the thread count means it had them),
and the minor page faults it took.

Page faults are the reason for ``pin_malloc``: glibc adapts its mmap and trim thresholds to
the allocation history, so whether a step's big tensors come from reused heap memory or
from fresh, zero-filled pages (thousands of page faults, 5-10 % of a 100 ms step) depends
on what ran before, not on the code under test; an interleaved run of two variants can
leave one of them faulting every step and the other never. Fixing the thresholds with
``mallopt`` (what ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` do) removes that
noise; the scripts do it by default and take ``--malloc default`` to measure without it.

Other processes. On a shared machine other jobs take the cores at random moments, which
wrecks a measurement of 2-core pipeline parallelism. Each step therefore also records the
*foreign load*: the machine's busy CPU time (``/proc/stat``, 10 ms ticks) minus this
process's own, in cores, averaged over the step. ``interleave(..., max_foreign=x)`` keeps
running rounds until every variant has ``rounds`` steps with a foreign load of at most
``x`` cores (or ``max_rounds`` rounds ran), and ``Samples.quiet(x)`` keeps only those
steps (``paired_ratio`` only the rounds where both steps were quiet); the scripts report
quiet-step figures and say how many steps were quiet.
"""
from __future__ import annotations

import copy
import ctypes
import os
import platform
import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

__all__ = ["make_model", "train_step", "Samples", "interleave", "paired_ratio", "paired_ratios",
           "machine", "load_average", "clone", "pin_malloc", "print_ratios"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def pin_malloc(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Fix glibc's adaptive malloc thresholds (see the module docstring); False if no glibc.

    Call it first thing, before the big tensors are allocated. Allocations below
    ``mmap_threshold`` come from the heap and freed heap memory is kept (up to
    ``trim_threshold``) for reuse instead of being handed back to the kernel.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
                    and libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return False


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def make_model(width: int, depth: int, seed: int = 0) -> nn.Sequential:
    """``depth`` × (Linear(width, width) + ReLU): a deep, perfectly balanced model."""
    torch.manual_seed(seed)
    layers: List[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def clone(module: nn.Sequential) -> nn.Sequential:
    """An independent copy with the same weights (each variant trains its own copy)."""
    return copy.deepcopy(module)


def train_step(module: nn.Module, x: Tensor) -> None:
    """One training step without the optimizer: zero grads, forward, loss, backward."""
    for p in module.parameters():
        p.grad = None
    module(x).sum().backward()


@dataclass
class Samples:
    """Wall-clock and process-CPU seconds, and minor page faults, of each timed step."""

    wall: List[float] = field(default_factory=list)
    cpu: List[float] = field(default_factory=list)
    faults: List[int] = field(default_factory=list)
    foreign: List[float] = field(default_factory=list)  # other processes' cores, per step

    @property
    def median(self) -> float:
        return statistics.median(self.wall)

    @property
    def iqr(self) -> float:
        """Inter-quartile range of the wall times (a robust spread)."""
        if len(self.wall) < 4:
            return 0.0
        q = statistics.quantiles(self.wall, n=4)
        return q[2] - q[0]

    @property
    def cores_used(self) -> float:
        """Median CPU seconds per wall second: how many cores the step kept busy."""
        return statistics.median(c / w for c, w in zip(self.cpu, self.wall) if w > 0)

    @property
    def median_faults(self) -> float:
        return statistics.median(self.faults)

    def quiet(self, max_foreign: Optional[float]) -> "Samples":
        """Only the steps during which other processes used at most ``max_foreign`` cores."""
        if max_foreign is None:
            return self
        keep = [i for i, f in enumerate(self.foreign) if f <= max_foreign]
        return Samples([self.wall[i] for i in keep], [self.cpu[i] for i in keep],
                       [self.faults[i] for i in keep], [self.foreign[i] for i in keep])


class _ForeignLoad:
    """Cores used by other processes between ``start()`` and ``stop()`` (Linux only)."""

    def __init__(self) -> None:
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    @staticmethod
    def _busy() -> Optional[int]:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except OSError:
            return None
        idle = fields[3] + fields[4]
        return sum(fields[:8]) - idle

    def start(self) -> None:
        times = os.times()
        self._t0, self._busy0 = time.perf_counter(), self._busy()
        self._self0 = times.user + times.system

    def stop(self) -> float:
        """Average foreign cores over the interval (0.0 where /proc/stat is unavailable)."""
        busy, times, t1 = self._busy(), os.times(), time.perf_counter()
        if busy is None or self._busy0 is None:
            return 0.0
        own = times.user + times.system - self._self0
        return max(0.0, ((busy - self._busy0) / self.tick - own) / (t1 - self._t0))


def interleave(variants: Mapping[str, Callable[[], None]], *, rounds: int, warmup: int,
               max_foreign: Optional[float] = None, max_rounds: Optional[int] = None,
               ) -> Dict[str, Samples]:
    """Time every variant ``rounds`` times, interleaved, after ``warmup`` untimed rounds.

    With ``max_foreign``, rounds continue until ``rounds`` of them were quiet (foreign load
    at most ``max_foreign`` cores) or ``max_rounds`` (default ``4 * rounds``) rounds ran.
    """
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    out = {name: Samples() for name in names}
    load = _ForeignLoad()
    limit = rounds if max_foreign is None else (max_rounds or 4 * rounds)
    quiet = {name: 0 for name in names}
    r = 0
    while r < limit and min(quiet.values()) < rounds:
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            load.start()
            f0, c0, t0 = _minor_faults(), time.process_time(), time.perf_counter()
            variants[name]()
            t1, c1, f1 = time.perf_counter(), time.process_time(), _minor_faults()
            foreign = load.stop()
            out[name].wall.append(t1 - t0)
            out[name].cpu.append(c1 - c0)
            out[name].faults.append(f1 - f0)
            out[name].foreign.append(foreign)
            quiet[name] += max_foreign is None or foreign <= max_foreign
        r += 1
    return out


def paired_ratios(a: Samples, b: Samples, *, cpu: bool = False,
                  max_foreign: Optional[float] = None) -> List[float]:
    """Per-round ``a.wall[r] / b.wall[r]`` (CPU times with ``cpu``), quiet rounds only."""
    xs, ys = (a.cpu, b.cpu) if cpu else (a.wall, b.wall)
    return [x / y for x, y, fa, fb in zip(xs, ys, a.foreign, b.foreign)
            if max_foreign is None or max(fa, fb) <= max_foreign]


def paired_ratio(a: Samples, b: Samples, *, cpu: bool = False,
                 max_foreign: Optional[float] = None) -> float:
    """Median of ``paired_ratios`` (over all rounds if none was quiet)."""
    ratios = paired_ratios(a, b, cpu=cpu, max_foreign=max_foreign)
    return statistics.median(ratios or paired_ratios(a, b, cpu=cpu))


def load_average() -> str:
    """The 1-minute load average (other processes competing for the cores)."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:  # pragma: no cover - not on every platform
        return "n/a"


def machine(threads: Sequence[int] = ()) -> str:
    """One line naming what the numbers were measured on."""
    extra = f", torch threads {list(threads)}" if threads else ""
    return (f"torch {torch.__version__}, python {platform.python_version()}, "
            f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}){extra}, "
            f"load average {load_average()}")


def print_ratios(samples: Mapping[str, Samples], pairs: Sequence[Sequence[str]]) -> None:
    """Each variant's median wall and process-CPU milliseconds per step, then each pair's
    paired ratios (``a / b``, wall and CPU)."""
    width = max(len(name) for name in samples)
    for name, s in samples.items():
        print(f"{name:<{width}}  median {s.median * 1e3:8.2f} ms  "
              f"cpu {statistics.median(s.cpu) * 1e3:8.2f} ms")
    for a, b in pairs:
        wall, cpu = paired_ratio(samples[a], samples[b]), paired_ratio(samples[a], samples[b],
                                                                       cpu=True)
        print(f"{a:>{width}} / {b:<{width}} wall {wall:.3f}  cpu {cpu:.3f}")
