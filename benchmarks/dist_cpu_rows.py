"""Each rank's main-thread CPU per 1F1B step, row by row: seqpipe against torch pipelining.

The model, ranks and variants of ``dist_vs_torch_pipelining.py`` (``seqpipe 1f1b`` and
``torch 1F1B``, the MLP of 8 × Linear(1024) + ReLU, 2 ranks, M = 8, gloo), or with
``--model transformer`` those of ``dist_transformer_vs_torch.py`` (its default GPT). Both
variants run alternately in the same processes; only the main thread's CPU counts
(``time.thread_time``: gloo's I/O threads excluded). Docs: docs/benchmarks.md,
"Main-thread CPU per 1F1B step"; docs/benchmark-history.md, "Session 13: hot3".

By default (unprofiled) a few functions are wrapped and timed exclusively (a call's time
less that of the timed calls inside it): what both runtimes run alike (the layers'
``nn.Sequential.forward``, ``loss_fn``, autograd's engine with the backward kernels, the
split backward's node calls, gloo's ``send``/``recv`` at the process group, the waits) and
each runtime's own parts (seqpipe's receiving, sending, stage forward and backward around
the layers and the engine, the loss around ``loss_fn``, the dispatch per action, the
opening and the close; torch's ``forward_one_chunk``, ``backward_one_chunk``, p2p posting,
``scale_grads``); the rest of the step is what none of them took. Medians per step.

With ``--profile`` every step runs under ``cProfile`` (``time.thread_time`` as its clock)
and every function's self time goes to a row: the forward kernels, ``run_backward``
(engine and backward kernels), gloo's calls, every other built-in by name, and every Python
function by file. A profiler inflates Python per call, so each row shows its calls per
step: use it for *where*, the timers for *how much*.

Run: ``PYTHONPATH=. python benchmarks/dist_cpu_rows.py --rounds 20 --ranks 1 0``;
``--profile --top 40 [--dump DIR]``; ``--model transformer --rounds 6``.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections import defaultdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist
from _common import make_model, pin_malloc
from dist_breakdown import Clock
from dist_vs_torch_pipelining import SEQ, TORCH, Variants, _init, machine_line, spawn

NAMES = (SEQ[1], TORCH[1])
Key = Tuple[str, int, str]

GPT = {"vocab": 512, "width": 128, "heads": 4, "blocks": 8, "length": 64}  # its defaults
FORWARD = ("linear", "relu", "mse_loss", "addmm", "matmul")
GLOO = ("_distributed_c10d",)


def row_of(key: Key) -> str:
    """The row a profiled function's self time goes to (see the module docstring)."""
    path, _, name = key
    if path == "~":  # a built-in
        if "run_backward" in name:
            return "backward (autograd engine + kernels)"
        if any(g in name for g in GLOO):
            return f"gloo: {name}"
        if "torch._C._nn" in name or any(f"method {f}" in name or f"torch.{f}" in name
                                          for f in FORWARD):
            return "forward kernels"
        return f"C: {name}"
    for lib, short in (("seqpipe/", "seqpipe/"), ("torch/distributed/pipelining/",
                                                 "torch pipelining/"), ("torch/", "torch/")):
        at = path.rfind(lib)
        if at >= 0:
            return f"py {short}{path[at + len(lib):]}:{name}"
    return f"py {path.rsplit('/', 1)[-1]}:{name}"


def collect(stats: pstats.Stats, steps: int) -> Dict[str, List[float]]:
    """Row -> [self ms per step, calls per step]."""
    rows: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0.0])
    for key, (_, ncalls, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        row = rows[row_of(key)]
        row[0] += tottime * 1e3 / steps
        row[1] += ncalls / steps
    return dict(rows)


# -- unprofiled: a few functions timed (exclusive thread CPU), the rest by subtraction ------
class Timers(Clock):
    """``dist_breakdown.Clock`` on the thread's CPU: exclusive main-thread CPU per label."""

    def __init__(self) -> None:
        super().__init__(time.thread_time)

    def take(self) -> Dict[str, List[float]]:
        """Each label's seconds and calls since the last ``take``."""
        out = {k: [v, float(self.counts[k])] for k, v in self.totals.items()}
        self.reset()
        return out


class _Engine:
    """Autograd's engine, its ``run_backward`` timed (``_engine_run_backward`` looks it up
    on ``Variable`` at each call)."""

    def __init__(self, engine: Any, timers: Timers) -> None:
        self._engine = engine
        self.run_backward = timers.wrap("autograd engine + backward kernels",
                                        engine.run_backward)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def instrument(timers: Timers) -> None:
    """Wrap what both runtimes call (kernels, engine, gloo) and each one's own parts."""
    import dist_vs_torch_pipelining as bench
    import torch.distributed.pipelining.schedules as tsched
    from torch import nn
    from torch.autograd.variable import Variable
    from torch.distributed.pipelining.stage import _PipelineStageBase

    import seqpipe.core.split_backward as split
    from seqpipe.core.stage import Stage
    from seqpipe.core.tasks import Tasks
    from seqpipe.distributed.lifecycle import CallLifecycle
    from seqpipe.distributed.step import Call
    from seqpipe.distributed.transport import Transport

    Variable._execution_engine = _Engine(Variable._execution_engine, timers)
    for name in ("send", "recv"):  # at the group: both runtimes' wrappers stay their own
        setattr(dist.ProcessGroup, name,
                timers.wrap("gloo send/recv (ProcessGroup)", getattr(dist.ProcessGroup, name)))
    bench.loss_fn = timers.wrap("loss_fn (kernels)", bench.loss_fn)
    import dist_transformer_vs_torch as gpt
    gpt.loss_fn = timers.wrap("loss_fn (kernels)", gpt.loss_fn)
    patches = [
        (nn.Sequential, "forward", "layers (forward kernels)"),
        (split.SplitBackward, "input", "split backward I (node calls)"),
        (split.SplitBackward, "weight", "split backward W (node calls)"),
        (Transport, "_wait", "waits (gloo)"), (Transport, "_complete", "waits (gloo)"),
        (tsched, "_wait_batch_p2p", "waits (gloo)"),
        (Call, "need", "seqpipe: receiving (Call.need)"),
        (Call, "send", "seqpipe: sending (Call.send)"),
        (Stage, "forward", "seqpipe: stage forward, around the layers"),
        (Stage, "loss", "seqpipe: the loss, around loss_fn"),
        (Stage, "backward", "seqpipe: stage backward, around the engine"),
        (Stage, "backward_input", "seqpipe: stage backward, around the engine"),
        (Stage, "backward_weight", "seqpipe: stage backward, around the engine"),
        (Tasks, "run", "seqpipe: Tasks/Call dispatch per action"),
        (CallLifecycle, "open", "seqpipe: opening the call (STEP)"),
        (CallLifecycle, "close", "seqpipe: closing the call (LOSS, DONE, flush)"),
        (_PipelineStageBase, "forward_one_chunk", "torch: forward_one_chunk, around the layers"),
        (_PipelineStageBase, "backward_one_chunk", "torch: backward_one_chunk, around the engine"),
        (tsched.PipelineScheduleSingle, "_maybe_compute_loss", "torch: the loss, around loss_fn"),
        (tsched, "_batch_p2p", "torch: posting p2p (_batch_p2p)"),
        (_PipelineStageBase, "scale_grads", "torch: scale_grads (div_ by M)"),
    ]
    for owner, name, label in patches:
        setattr(owner, name, timers.wrap(label, getattr(owner, name)))


def rank_main(rank: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    pin_malloc()
    _init(rank, port)
    timers = Timers()
    if not args.profile:
        instrument(timers)
    try:
        if args.model == "mlp":
            model = make_model(args.width, args.depth)
            variants = Variants(model, rank, args.chunks, args.micro_batch, args.width,
                                only=NAMES)
        else:  # dist_transformer_vs_torch.py's GPT-style model, its 1f1b variants by our names
            import dist_transformer_vs_torch as gpt
            options = argparse.Namespace(**{**vars(args), **GPT, "schedules": ["1f1b"],
                                            "micro_batch": 4})
            variants = gpt.Variants(gpt.make_gpt(GPT["vocab"], GPT["width"], GPT["heads"],
                                                 GPT["blocks"], GPT["length"]), rank, options)
            variants.steps = {NAMES[0]: variants.steps["seqpipe 1f1b"],
                              NAMES[1]: variants.steps["torch 1f1b"]}
        for _ in range(args.warmup):
            for name in NAMES:
                dist.barrier()
                variants.steps[name]()
        profiles = {name: cProfile.Profile(time.thread_time) for name in NAMES}
        plain: Dict[str, List[float]] = {name: [] for name in NAMES}
        rows: Dict[str, List[Dict[str, List[float]]]] = {name: [] for name in NAMES}
        for r in range(args.rounds):
            order = NAMES if r % 2 == 0 else NAMES[::-1]
            for name in order:
                dist.barrier()
                if args.profile:
                    profiles[name].enable()
                timers.take()
                t0 = time.thread_time()
                variants.steps[name]()
                plain[name].append(time.thread_time() - t0)
                rows[name].append(timers.take())
                if args.profile:
                    profiles[name].disable()
        dist.barrier()
        out = {}
        for name in NAMES:
            if args.profile:
                if args.dump:
                    profiles[name].dump_stats(
                        f"{args.dump}/{name.replace(' ', '_')}.{rank}.prof")
                found = collect(pstats.Stats(profiles[name]), args.rounds)
            else:
                found = medians(rows[name], plain[name])
            out[name] = {"rows": found, "plain": statistics.median(plain[name]) * 1e3}
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def medians(rounds: List[Dict[str, List[float]]], totals: List[float]
            ) -> Dict[str, List[float]]:
    """Each timed label's median ms and calls per step, and the rest of the step (what no
    wrapped function took: the runtime's own Python outside them)."""
    labels = {k for r in rounds for k in r}
    out = {k: [statistics.median(r.get(k, [0.0, 0.0])[0] for r in rounds) * 1e3,
               statistics.median(r.get(k, [0.0, 0.0])[1] for r in rounds)] for k in labels}
    rest = [t - sum(v[0] for v in r.values()) for r, t in zip(rounds, totals)]
    out["the rest of the step (own Python outside the timed parts)"] = \
        [statistics.median(rest) * 1e3, 0.0]
    return out


def timer_table(result: Dict[str, Any]) -> List[str]:
    """The unprofiled rows of one rank: shared work first, then each runtime's own."""
    seq, tor = (result[n]["rows"] for n in NAMES)
    lines = [f"main-thread CPU per step (median): seqpipe {result[NAMES[0]]['plain']:.2f} ms, "
             f"torch {result[NAMES[1]]['plain']:.2f} ms, difference "
             f"{result[NAMES[0]]['plain'] - result[NAMES[1]]['plain']:+.2f} ms", "",
             "| row | seqpipe ms (calls) | torch ms (calls) | seqpipe − torch ms |",
             "|---|---|---|---|"]
    shared = [k for k in sorted(set(seq) | set(tor)) if not k.startswith(("seqpipe:", "torch:"))
              and not k.startswith("the rest")]
    own = sorted(k for k in set(seq) | set(tor) if k.startswith(("seqpipe:", "torch:")))
    for k in shared + own + ["the rest of the step (own Python outside the timed parts)"]:
        a, b = seq.get(k, [0.0, 0.0]), tor.get(k, [0.0, 0.0])
        lines.append(f"| {k} | {a[0]:.2f} ({a[1]:.0f}) | {b[0]:.2f} ({b[1]:.0f}) | "
                     f"{a[0] - b[0]:+.2f} |")
    return lines


def table(result: Dict[str, Any], top: int) -> List[str]:
    """The rows of one rank, largest difference first."""
    seq, tor = (result[n]["rows"] for n in NAMES)
    lines = [f"unprofiled main-thread CPU per step: seqpipe {result[NAMES[0]]['plain']:.1f} ms, "
             f"torch {result[NAMES[1]]['plain']:.1f} ms",
             f"profiled: seqpipe {sum(v[0] for v in seq.values()):.1f} ms "
             f"({sum(v[1] for v in seq.values()):.0f} calls), torch "
             f"{sum(v[0] for v in tor.values()):.1f} ms "
             f"({sum(v[1] for v in tor.values()):.0f} calls)",
             "", "| row | seqpipe ms (calls) | torch ms (calls) | seqpipe − torch ms |",
             "|---|---|---|---|"]
    keys = set(seq) | set(tor)

    def ms(d: Dict[str, List[float]], k: str) -> float:
        return d.get(k, [0.0, 0.0])[0]

    big = ["forward kernels", "backward (autograd engine + kernels)"]
    gloo = sorted(k for k in keys if k.startswith("gloo"))
    rest = sorted((k for k in keys if k not in big and k not in gloo),
                  key=lambda k: -abs(ms(seq, k) - ms(tor, k)))
    groups: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for k in keys:
        g = ("seqpipe Python" if k.startswith("py seqpipe/") else
             "torch pipelining Python" if k.startswith("py torch pipelining/") else
             "other torch Python" if k.startswith("py torch/") else
             "gloo calls" if k in gloo else k if k in big else
             "other C calls" if k.startswith("C: ") else "other Python")
        for j, d in enumerate((seq, tor)):
            v = d.get(k, [0.0, 0.0])
            groups[g][2 * j] += v[0]
            groups[g][2 * j + 1] += v[1]
    for g, (a, ac, b, bc) in sorted(groups.items(), key=lambda kv: -abs(kv[1][0] - kv[1][2])):
        lines.append(f"| **{g}** | {a:.2f} ({ac:.0f}) | {b:.2f} ({bc:.0f}) | {a - b:+.2f} |")
    for k in gloo + rest[:top]:
        a, b = seq.get(k, [0.0, 0.0]), tor.get(k, [0.0, 0.0])
        lines.append(f"| {k} | {a[0]:.2f} ({a[1]:.0f}) | {b[0]:.2f} ({b[1]:.0f}) | "
                     f"{a[0] - b[0]:+.2f} |")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mlp", "transformer"), default="mlp",
                        help="the MLP of dist_vs_torch_pipelining.py (--width/--depth/"
                        "--micro-batch), or dist_transformer_vs_torch.py's default GPT")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10, help="profiled steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=40, help="rows listed by difference")
    parser.add_argument("--ranks", type=int, nargs="*", default=[1])
    parser.add_argument("--profile", action="store_true",
                        help="cProfile every function (else: time a few, unprofiled)")
    parser.add_argument("--dump", help="with --profile, a folder: the pstats files")
    args = parser.parse_args(argv)
    t0 = time.time()
    answers = dict(spawn(rank_main, args))
    print(f"Command: python {' '.join(sys.argv)}")
    print(f"Machine: {machine_line()}; {time.time() - t0:.0f} s")
    for rank in args.ranks:
        print(f"\n## rank {rank}, ms of main-thread CPU per 1F1B step (M={args.chunks})\n")
        print("\n".join(table(answers[rank], args.top) if args.profile
                        else timer_table(answers[rank])))


if __name__ == "__main__":
    main()
