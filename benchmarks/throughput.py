"""Training throughput on two CPU partitions: seqpipe against the plain module and torchgpipe.

The model is balanced: ``depth`` × (Linear(width) + ReLU), split in two equal partitions
on ``cpu``; a step is zero-grad + forward + ``sum()`` + backward on a batch of ``batch``
samples (8 × Linear(1024), batch 256: 130-160 ms plain on one core here). For each
number of micro-batches (2, 4, 8) it times a training step of

* ``plain``: the unwrapped ``nn.Sequential``;
* ``seqpipe``: ``Pipe(..., balance=[d, d], devices=["cpu", "cpu"], chunks=c)``, each
  partition's forward *and* backward on its own worker thread, so the two partitions
  overlap (PyTorch kernels release the GIL);
* ``torchgpipe``: ``torchgpipe.GPipe`` 0.0.7 with the same arguments. It keys its worker
  threads by device, so both ``cpu`` partitions share one thread in forward, and its
  backward is one autograd graph run by the caller's thread: no overlap on CPU.

All variants live in one process, are stepped interleaved (see ``_common``) after
warm-up, and are reported as samples/s from the median step time. torchgpipe 0.0.7
runs unpatched on torch 2.13 (nothing is monkeypatched); it is optional, and skipped with a
note if it is not installed (``pip install torchgpipe==0.0.7 --no-deps``).

Threads. The machine has 2 cores, so intra-op parallelism and pipeline parallelism
compete for them:

* ``threads=1`` (``torch.set_num_threads(1)``): one core per stage, the regime a CPU
  pipeline is meant for. The plain module and torchgpipe then use one core, seqpipe two.
  Caveat, found with this benchmark: ``torch.set_num_threads`` only sets the OpenMP/MKL
  thread count of the thread that calls it. A *new* thread starts from the default (one
  per core, or ``OMP_NUM_THREADS``), so its matmuls run 2-way parallel even after
  ``set_num_threads(1)``. seqpipe's stage worker threads (and torchgpipe's forward
  worker) are new threads, so the stage on a worker thread may use 2 OpenMP threads. On
  a quiet machine that costs nothing measurable (it even helps a little in the pipeline's
  fill and drain, when the other stage idles); when other processes share the cores,
  OpenMP's spin-waiting makes it very costly. See docs/benchmarks.md.
* ``threads=default`` (torch's default, one per core, here 2): the plain module's matmuls
  use both cores; seqpipe's two stage threads each run 2-thread kernels, i.e. 4 busy
  threads on 2 cores (oversubscribed), and torchgpipe gets both cores for one stage at a
  time.

Neither regime alone is fair to everyone, so both are reported, plus a "best of" line
that compares each library in its own best regime: that is the number a user who tunes
``torch.set_num_threads`` would see. A first line measures how well two single-threaded
matmul streams run side by side on this machine (``core_scaling``), the ceiling for any
2-stage CPU pipeline's gain over one core.

Targets: seqpipe/torchgpipe ≥ 1.2× at the same settings.

Run: ``PYTHONPATH=. python benchmarks/throughput.py`` (``--help`` for sizes and modes).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from _common import Samples, clone, interleave, machine, make_model, pin_malloc, train_step
from torch import nn

from seqpipe import Pipe

TARGET = 1.2
DEFAULT_THREADS = torch.get_num_threads()

try:  # optional comparison
    from torchgpipe import GPipe
except ImportError:  # pragma: no cover - depends on the environment
    GPipe = None


@dataclass(frozen=True)
class Config:
    """Sizes of the throughput model and batch."""

    width: int = 1024
    depth: int = 8
    batch: int = 256


def wrap(impl: str, model: nn.Sequential, chunks: int, checkpoint: str) -> nn.Module:
    """``model`` (a fresh copy) as ``impl`` runs it: plain, seqpipe or torchgpipe."""
    half = len(model) // 2
    balance = [half, len(model) - half]
    if impl == "plain":
        return model
    if impl == "seqpipe":
        return Pipe(model, chunks=chunks, checkpoint=checkpoint, balance=balance,
                    devices=["cpu", "cpu"])
    if impl == "torchgpipe":
        if GPipe is None:
            raise RuntimeError("torchgpipe is not installed")
        return GPipe(model, balance=balance, devices=["cpu", "cpu"], chunks=chunks,
                     checkpoint=checkpoint)
    raise ValueError(f"unknown implementation {impl!r}")


def impls() -> List[str]:
    return ["seqpipe"] + (["torchgpipe"] if GPipe is not None else [])


def build_variants(cfg: Config, chunks: Sequence[int], checkpoint: str,
                   ) -> Dict[str, Callable[[], None]]:
    """Step functions keyed ``plain``, ``seqpipe/c4``, ``torchgpipe/c4``, ..."""
    model = make_model(cfg.width, cfg.depth)
    x = torch.randn(cfg.batch, cfg.width)
    modules: Dict[str, nn.Module] = {"plain": clone(model)}
    for impl in impls():
        for c in chunks:
            modules[f"{impl}/c{c}"] = wrap(impl, clone(model), c, checkpoint)
    return {name: _stepper(m, x) for name, m in modules.items()}


def _stepper(module: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    return lambda: train_step(module, x)


def check_same_gradients(checkpoint: str) -> None:
    """Sanity: every implementation computes the plain module's gradients."""
    model = make_model(32, 4)
    x = torch.randn(16, 32)
    ref = clone(model)
    train_step(ref, x)
    for impl in impls():
        other = wrap(impl, clone(model), 4, checkpoint)
        train_step(other, x)
        for pa, pb in zip(ref.parameters(), other.parameters()):
            assert pb.grad is not None, impl
            torch.testing.assert_close(pa.grad, pb.grad, msg=impl)


def run_regime(cfg: Config, chunks: Sequence[int], checkpoint: str, threads: int, rounds: int,
               warmup: int, max_foreign: Optional[float] = None,
               max_rounds: Optional[int] = None) -> Dict[str, Samples]:
    """Interleaved samples of every variant under ``threads`` intra-op threads.

    With ``max_foreign``, only steps during which other processes used at most that many
    cores are kept (if some variant has fewer than 3, every step is kept, with a note).
    """
    torch.set_num_threads(threads)
    everything = interleave(build_variants(cfg, chunks, checkpoint), rounds=rounds,
                            warmup=warmup, max_foreign=max_foreign, max_rounds=max_rounds)
    return _keep_quiet(everything, max_foreign)


def _keep_quiet(everything: Dict[str, Samples], max_foreign: Optional[float],
                ) -> Dict[str, Samples]:
    quiet = {k: v.quiet(max_foreign) for k, v in everything.items()}
    total = len(next(iter(everything.values())).wall)
    kept = min(len(v.wall) for v in quiet.values())
    if kept < 3:
        print(f"note: only {kept} of {total} steps of some variant were quiet; "
              f"reporting every step")
        return everything
    if max_foreign is not None:
        print(f"note: kept at least {kept} of {total} steps per variant (other processes "
              f"below {max_foreign} cores)")
    return quiet


def core_scaling(cfg: Config, rounds: int, max_foreign: Optional[float],
                 max_rounds: Optional[int]) -> float:
    """How well this machine runs two single-threaded matmul streams side by side.

    ``one``: a thread does the model's forward matmuls (batch/4 rows, one micro-batch of
    chunks=4) ``depth`` times; ``two``: two threads do that at once. The result,
    ``2 * one / two``, is 2.0 on two independent cores; less means the two cores slow
    each other down (shared cache or memory bandwidth, or vCPUs that are SMT siblings
    on the host), which caps any 2-stage CPU pipeline's speed-up over one core.
    """
    torch.set_num_threads(1)
    w = torch.randn(cfg.width, cfg.width)
    x = torch.randn(max(1, cfg.batch // 4), cfg.width)

    def work() -> None:
        for _ in range(cfg.depth * 4):
            torch.mm(x, w)

    def work_in_new_thread() -> None:
        torch.set_num_threads(1)  # a new thread does not inherit it (see the docstring)
        work()

    def two() -> None:
        other = threading.Thread(target=work_in_new_thread)
        other.start()
        work()
        other.join()

    samples = _keep_quiet(interleave({"one": work, "two": two}, rounds=rounds, warmup=2,
                                     max_foreign=max_foreign, max_rounds=max_rounds),
                          max_foreign)
    return 2 * samples["one"].median / samples["two"].median


def throughput(cfg: Config, s: Samples) -> float:
    return cfg.batch / s.median


def report(cfg: Config, chunks: Sequence[int], checkpoint: str, threads: int,
           samples: Dict[str, Samples]) -> None:
    plain = samples["plain"]
    foreign = statistics.median(plain.foreign)
    print(f"## checkpoint={checkpoint!r}, torch threads={threads} "
          f"(median foreign load {foreign:.2f} cores)")
    print(f"{'variant':<15} {'median ms':>9} {'IQR ms':>7} {'samples/s':>9} {'cores':>5}"
          f" {'vs plain':>8} {'vs torchgpipe':>13}")
    for name, s in samples.items():
        impl, _, c = name.partition("/")
        vs_plain = plain.median / s.median
        tg = samples.get(f"torchgpipe/{c}") if impl == "seqpipe" else None
        vs_tg = f"{tg.median / s.median:>12.2f}x" if tg is not None else f"{'':>13}"
        print(f"{name:<15} {s.median * 1e3:>9.1f} {s.iqr * 1e3:>7.1f} "
              f"{throughput(cfg, s):>9.0f} {s.cores_used:>5.2f} {vs_plain:>7.2f}x {vs_tg}")


def best_of(cfg: Config, chunks: Sequence[int], checkpoint: str,
            regimes: Dict[int, Dict[str, Samples]]) -> None:
    """Each variant in its own best thread regime."""
    def best(name: str) -> Tuple[float, int]:
        return max((throughput(cfg, r[name]), t) for t, r in regimes.items() if name in r)

    plain, plain_t = best("plain")
    print(f"\n## best thread setting per variant, checkpoint={checkpoint!r}")
    print(f"plain: {plain:.0f} samples/s (threads={plain_t})")
    for c in chunks:
        sp, sp_t = best(f"seqpipe/c{c}")
        line = (f"chunks={c}: seqpipe {sp:.0f}/s (threads={sp_t}) = {sp / plain:.2f}x plain")
        if GPipe is not None:
            tg, tg_t = best(f"torchgpipe/c{c}")
            line += f", torchgpipe {tg:.0f}/s (threads={tg_t}), seqpipe/torchgpipe {sp / tg:.2f}x"
        print(line)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=Config.width)
    parser.add_argument("--depth", type=int, default=Config.depth,
                        help="Linear+ReLU pairs, split evenly over two partitions")
    parser.add_argument("--batch", type=int, default=Config.batch)
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--checkpoint", nargs="+", default=["never", "except_last"],
                        choices=("always", "except_last", "never"),
                        help="checkpoint modes to run (default: never except_last)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, DEFAULT_THREADS],
                        help=f"torch intra-op thread counts to run (default: 1 "
                             f"{DEFAULT_THREADS}, the latter being torch's default here)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per regime")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds per regime")
    parser.add_argument("--malloc", choices=("pinned", "default"), default="pinned")
    parser.add_argument("--max-foreign", type=float, default=0.3,
                        help="keep only steps during which other processes used at most this many "
                             "cores (default 0.3; negative: keep every step)")
    parser.add_argument("--no-scaling", action="store_true",
                        help="skip the 2-core scaling measurement")
    parser.add_argument("--max-rounds", type=int, default=None,
                        help="give up waiting for quiet rounds after this many (default 4x)")
    args = parser.parse_args(argv)
    if args.malloc == "pinned":
        pin_malloc()
    cfg = Config(args.width, args.depth, args.batch)
    max_foreign = args.max_foreign if args.max_foreign >= 0 else None
    if GPipe is None:
        print("note: torchgpipe is not installed; comparing with the plain module only")
    print(f"# {machine(args.threads)}")
    print(f"# model {cfg.depth} x (Linear({cfg.width}) + ReLU) in 2 cpu partitions, "
          f"batch {cfg.batch}, {args.rounds} interleaved rounds after {args.warmup} warm-up "
          f"rounds per regime, malloc {args.malloc}")
    if not args.no_scaling:
        scaling = core_scaling(cfg, max(args.rounds, 10), max_foreign, args.max_rounds)
        print(f"2-core scaling of single-threaded matmuls: {scaling:.2f} (2.00 = two "
              f"independent cores; caps a 2-stage pipeline's gain over one core)")
    for checkpoint in args.checkpoint:
        check_same_gradients(checkpoint)
        regimes: Dict[int, Dict[str, Samples]] = {}
        for threads in dict.fromkeys(args.threads):
            print()
            regimes[threads] = run_regime(cfg, args.chunks, checkpoint, threads, args.rounds,
                                          args.warmup, max_foreign, args.max_rounds)
            report(cfg, args.chunks, checkpoint, threads, regimes[threads])
        best_of(cfg, args.chunks, checkpoint, regimes)
        if GPipe is not None:
            for t, r in regimes.items():
                ratios = {c: r[f"torchgpipe/c{c}"].median / r[f"seqpipe/c{c}"].median
                          for c in args.chunks}
                listed = ", ".join(f"c{c} {v:.2f}x" for c, v in ratios.items())
                missed = [f"c{c}" for c, v in ratios.items() if v < TARGET]
                verdict = f"MISSED at {', '.join(missed)}" if missed else "MET"
                print(f"seqpipe/torchgpipe, checkpoint={checkpoint!r}, threads={t}: {listed} "
                      f"(target >= {TARGET}x: {verdict})")
    print(f"\n# load average at the end: {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
