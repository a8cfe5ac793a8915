"""Every pipeline schedule, seqpipe's DistributedPipe against torch.distributed.pipelining.

Default (the benchmark of seqpipe issue 10): a **sleep-timed model** (``sleep_model.py``:
each layer sleeps ``F`` ms in its forward, ``I`` ms in its input-gradient node and ``W`` ms
in its weight-gradient node, so a split backward runs only its part and the cores stay
free), ``--ranks`` K processes (default 4) on gloo over loopback, one intra-op thread each.
Per schedule name, the identical model runs under

* seqpipe: ``DistributedPipe(model, chunks=M, balance=<layers per stage, one entry per
  rank; None with several stages per rank>, schedule=<name>, checkpoint="never",
  device="cpu")``, ``train_step(x, y, mse_loss)`` with ``x`` and ``y`` on every rank;
  ``checkpoint="never"`` because torch does not recompute, so both do the same work;
* torch: the schedule class of the same name (``TORCH_OF``; for ``zb_h1`` and ``zb_h2``,
  which torch lacks, ``ScheduleInterleavedZeroBubble`` with one stage per rank) over
  ``PipelineStage`` s built by hand from the same layers, with the same stage placement
  (stage ``s`` on rank ``s mod K`` for the looped schedules, rank ``r`` holding ``r`` and
  ``2K-1-r`` for the V-shaped ones), ``loss_fn=mse_loss``, defaults otherwise
  (``scale_grads=True``).

F = I = W = ``--ms`` per stage (default 10) with one stage per rank, ``--ms / 2`` each when
a rank holds two stages, so every rank has the same work. Stage 0 has no input gradient (its
input is the data), so its ``I`` costs nothing, in both runtimes and in the simulation.

Timing. Every step starts after a barrier; each rank reads ``time.perf_counter`` (the
system-wide monotonic clock) before and after; a step lasts from the first start to the
last end. Round ``r`` runs every schedule once under each runtime, schedules in an order
that rotates every round, torch first in even rounds and seqpipe first in odd ones; the
first ``--warmup`` rounds are not timed. Figures are medians over the timed rounds; the
seqpipe/torch speed ratio is the median of the per-round ratios torch ms / seqpipe ms.
Each schedule is compared with ``seqpipe.schedule.simulate`` of the same name and the same
per-stage costs (communication is not modelled, so measured / simulated is the runtime's
overhead), and with the no-bubble bound ``M * (F + I + W)`` per rank.

Gradients. Before timing, with sleeping off, one step of every variant is compared with
the unpipelined model (the same micro-batches, ``(loss / M).backward()`` each) and, where
both ran, seqpipe's gradients with torch's of the same schedule: they must run the same math.

Memory (``--memory-chunks``, 0 to skip): one step per variant inside a
``saved_tensors_hooks`` counter (``dist_vs_torch_pipelining.SavedBytes``): the peak bytes
autograd holds for backward on each rank, in units of one stage's activations for one
micro-batch (what ``simulate`` counts as a live micro-batch), next to simulate's
``peak_live_microbatches``. The last stage also holds its loss's saved output (+1 unit).

``--real``: the real-compute 2-rank benchmark of issue 10: ``zb_h1`` against ``1f1b`` on a
small MLP (``_common.make_model``, Linear+ReLU), no sleeping; no simulation column.

A schedule seqpipe cannot run yet (``DistributedPipe`` refuses it at construction) is
reported as "not run" with the first line of its error; torch's side still runs.

Run: ``PYTHONPATH=. python benchmarks/dist_schedules.py`` (``--help`` for the flags; the
full run of docs/benchmarks.md is ``--rounds 15 --warmup 3``).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
import torch.multiprocessing as mp
import torch.nn.functional as F
from _common import load_average, make_model
from dist_vs_torch_pipelining import SavedBytes, seqpipe_version
from sleep_model import make_sleep_model, overrun, sleeping, stage_costs
from torch import Tensor, nn

from seqpipe.distributed import DistributedPipe
from seqpipe.schedule import Placement, ScheduleError, get_schedule, placement_of, simulate

SCHEDULES = ("fill_drain", "1f1b", "zb_h1", "zb_h2", "interleaved_1f1b", "looped_bfs",
             "interleaved_zb", "zbv", "dualpipev")
TORCH_OF = {"fill_drain": "ScheduleGPipe", "1f1b": "Schedule1F1B",
            "zb_h1": "ScheduleInterleavedZeroBubble", "zb_h2": "ScheduleInterleavedZeroBubble",
            "interleaved_1f1b": "ScheduleInterleaved1F1B", "looped_bfs": "ScheduleLoopedBFS",
            "interleaved_zb": "ScheduleInterleavedZeroBubble",
            "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
"""torch's schedule of the same name. torch has no ZB-H1 / ZB-H2 class; its interleaved zero
bubble schedule given one stage per rank is its zero-bubble schedule for that placement
(warm-up forwards, then F, I, W in turn; its W fill the cool-down), so it is their peer."""
SIM_TARGET, PEER_TARGET, FASTEST_TARGET = 1.05, 1.0, 1.15
GRAD_TOLERANCE = 1e-5  # relative; float32 sums in another order differ by ~1e-7


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(output, target)


# -- one configuration ------------------------------------------------------------------
@dataclass
class Config:
    """One schedule's model and placement at K ranks (sleep-timed or real)."""

    name: str
    ranks: int
    placement: Placement
    layers_per_stage: int
    model: nn.Sequential
    costs: Optional[Tuple[float, List[float], float]]  # F, I per stage, W (ms); None: real

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    def layers_of(self, stage: int) -> range:
        return range(stage * self.layers_per_stage, (stage + 1) * self.layers_per_stage)


def make_config(name: str, args: argparse.Namespace) -> Config:
    placement = placement_of(get_schedule(name), args.ranks)
    stages = placement.num_stages
    if args.real:
        if args.depth % stages:
            raise SystemExit(f"--depth {args.depth} does not split into {stages} stages")
        model = make_model(args.width, args.depth)  # depth × (Linear, ReLU)
        return Config(name, args.ranks, placement, len(model) // stages, model, None)
    stage_ms = args.ms * args.ranks / stages  # equal work per rank
    return Config(name, args.ranks, placement, args.layers_per_stage,
                  make_sleep_model(stages, args.layers_per_stage, stage_ms, args.width),
                  stage_costs(stages, stage_ms))


# -- the variants -----------------------------------------------------------------------
@dataclass
class Variant:
    """One runtime's step for one schedule on this rank, and the parameters it trains."""

    step: Callable[[], None]
    params: Dict[int, List[nn.Parameter]]  # layer index -> its parameters on this rank
    error: str = ""

    def run(self) -> None:
        for ps in self.params.values():
            for p in ps:
                p.grad = None
        self.step()


@dataclass
class Rank:
    """This rank's data and its variants, per schedule: ``(torch, seqpipe)``."""

    rank: int
    chunks: int
    x: Tensor
    y: Tensor
    variants: Dict[str, Tuple[Optional[Variant], Variant]] = field(default_factory=dict)


def torch_variant(config: Config, rank: int, chunks: int, x: Tensor, y: Tensor) -> Variant:
    mine = config.placement.stages_of(rank)
    model = copy.deepcopy(config.model)
    stages, params = [], {}
    for s in mine:
        part = nn.Sequential(*(model[i] for i in config.layers_of(s)))
        stages.append(pipelining.PipelineStage(part, s, config.num_stages, torch.device("cpu")))
        params.update({i: list(model[i].parameters()) for i in config.layers_of(s)})
    cls = getattr(pipelining, TORCH_OF[config.name])
    schedule = cls(stages[0] if len(stages) == 1 and cls in _SINGLE else stages,
                   n_microbatches=chunks, loss_fn=loss_fn)
    first, last = 0 in mine, config.num_stages - 1 in mine
    args = (x,) if first else ()
    kwargs: Dict[str, Any] = {"target": y, "losses": [], "return_outputs": False} if last else {}
    return Variant(lambda: schedule.step(*args, **kwargs) and None, params)


_SINGLE = (pipelining.ScheduleGPipe, pipelining.Schedule1F1B)


def seqpipe_variant(config: Config, chunks: int, x: Tensor, y: Tensor) -> Variant:
    """``DistributedPipe`` for the schedule, or a variant that says why it cannot run.

    Construction validates the schedule against what the engine runs before any
    communication, on every rank alike, so a refusal (``ScheduleError``) is the same
    everywhere. With several stages per rank the balance is left to the engine
    (``balance=None``: by parameters, which splits the equal sleep layers evenly), because
    an engine that runs one stage per rank refuses a K·V-entry balance with a plain
    ``ValueError`` before it looks at the schedule; the split is checked below.
    """
    one_each = config.placement.num_stages == config.ranks
    balance = [config.layers_per_stage] * config.num_stages if one_each else None
    try:
        pipe = DistributedPipe(copy.deepcopy(config.model), chunks=chunks, balance=balance,
                               schedule=config.name, checkpoint="never", device="cpu")
    except ScheduleError as error:  # a schedule this engine does not run (yet)
        return Variant(lambda: None, {}, error=str(error).splitlines()[0])
    params: Dict[int, List[nn.Parameter]] = {}
    for name, p in pipe.named_parameters():
        params.setdefault(int(name.split(".")[0]), []).append(p)
    rank = dist.get_rank()
    mine = {i for s in config.placement.stages_of(rank) for i in config.layers_of(s)}
    if not set(params) <= mine:
        raise RuntimeError(f"{config.name}: rank {rank} got layers {sorted(params)}, "
                           f"expected those of stages {config.placement.stages_of(rank)}: "
                           f"{sorted(mine)}")
    # input and target on every rank: the engine reads them where its placement needs them
    return Variant(lambda: pipe.train_step(x, y, loss_fn) and None, params)


def build(configs: Dict[str, Config], rank: int, chunks: int,
          args: argparse.Namespace) -> Rank:
    gen = torch.Generator().manual_seed(1234 + chunks)
    x = torch.randn(chunks * args.micro_batch, args.width, generator=gen)
    y = torch.randn(chunks * args.micro_batch, args.width, generator=gen)
    here = Rank(rank, chunks, x, y)
    for name, config in configs.items():
        theirs = torch_variant(config, rank, chunks, x, y) if name in TORCH_OF else None
        here.variants[name] = (theirs, seqpipe_variant(config, chunks, x, y))
    return here


# -- gradients --------------------------------------------------------------------------
def reference_grads(config: Config, x: Tensor, y: Tensor, chunks: int) -> List[Tensor]:
    """Every parameter's gradient in the unpipelined model (flattened per layer)."""
    model = copy.deepcopy(config.model)
    for xi, yi in zip(x.chunk(chunks), y.chunk(chunks)):
        (loss_fn(model(xi), yi) / chunks).backward()
    return [_flat(layer.parameters()) for layer in model]


def _flat(params: Any) -> Tensor:
    """A layer's gradients as one vector (empty for a layer without parameters)."""
    grads = [p.grad.flatten() for p in params]
    return torch.cat(grads) if grads else torch.zeros(0)


def _diff(a: Tensor, b: Tensor) -> float:
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check_gradients(here: Rank, configs: Dict[str, Config]) -> Dict[str, List[float]]:
    """Per schedule on this rank: [torch vs plain, seqpipe vs plain, seqpipe vs torch]
    (NaN where a side did not run)."""
    out: Dict[str, List[float]] = {}
    with sleeping(False):
        for name, (theirs, ours) in here.variants.items():
            ref = reference_grads(configs[name], here.x, here.y, here.chunks)
            got = []
            for v in (theirs, ours):
                if v is None or v.error:
                    got.append(None)
                    continue
                dist.barrier()
                v.run()
                got.append({i: _flat(ps) for i, ps in v.params.items()})
            t, s = got
            out[name] = [max((_diff(g, ref[i]) for i, g in t.items()), default=0.0)
                         if t else float("nan"),
                         max((_diff(g, ref[i]) for i, g in s.items()), default=0.0)
                         if s else float("nan"),
                         max((_diff(s[i], t[i]) for i in s), default=0.0)
                         if s and t else float("nan")]
    return out


# -- timing -----------------------------------------------------------------------------
def _timed(variant: Optional[Variant]) -> Tuple[float, float]:
    if variant is None or variant.error:
        return float("nan"), float("nan")
    dist.barrier()
    t0 = time.perf_counter()
    variant.run()
    return t0, time.perf_counter()


def time_rounds(here: Rank, args: argparse.Namespace) -> Tensor:
    """``[round, schedule, runtime (torch, seqpipe), start/end]`` on this rank."""
    names = list(here.variants)
    rows = []
    for r in range(args.warmup + args.rounds):
        row = [[(0.0, 0.0)] * 2 for _ in names]
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            theirs, ours = here.variants[name]
            k = names.index(name)
            for side in ((0, 1) if r % 2 == 0 else (1, 0)):
                row[k][side] = _timed((theirs, ours)[side])
        if r >= args.warmup:
            rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


def _busy_seconds() -> float:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _gather(t: Tensor, world: int) -> List[Tensor]:
    out = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return out


# -- memory -----------------------------------------------------------------------------
def measure_memory(here: Rank) -> Dict[str, List[float]]:
    """Per schedule on this rank: peak saved-for-backward bytes [torch, seqpipe] of a step."""
    out = {}
    with sleeping(False):
        for name, pair in here.variants.items():
            peaks = []
            for v in pair:
                if v is None or v.error:
                    peaks.append(float("nan"))
                    continue
                exclude = [p for ps in v.params.values() for p in ps] + [here.x, here.y]
                counter = SavedBytes(exclude)
                dist.barrier()
                with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                    v.run()
                peaks.append(float(counter.peak))
            out[name] = peaks
    return out


# -- the ranks --------------------------------------------------------------------------
def bench_rank(rank: int, args: argparse.Namespace, store: str, queue: Any) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=args.ranks, timeout=datetime.timedelta(seconds=300))
    try:
        configs = {name: make_config(name, args) for name in args.schedules}
        for m in args.chunks:
            here = build(configs, rank, m, args)
            grads = check_gradients(here, configs)
            busy0, w0 = _busy_seconds(), time.perf_counter()
            overrun()
            times = time_rounds(here, args)
            load = (_busy_seconds() - busy0) / (time.perf_counter() - w0)
            late = _gather(torch.tensor([overrun()], dtype=torch.float64), args.ranks)
            everyone = _gather(times, args.ranks)
            worst = _gather(torch.tensor([grads[n] for n in here.variants]), args.ranks)
            if rank == 0:
                start = torch.stack([t[..., 0] for t in everyone]).amin(0)
                end = torch.stack([t[..., 1] for t in everyone]).amax(0)
                errors = {n: v.error for n, (_, v) in here.variants.items()}
                queue.put(("timing", m, {"ms": ((end - start) * 1e3).tolist(),
                                         "names": list(here.variants), "errors": errors,
                                         "grads": torch.stack(worst).nan_to_num(
                                             -1.0).amax(0).tolist(),
                                         "load": load,
                                         "overrun": float(torch.cat(late).nanmean())}))
                print(f"  M={m}: done ({load:.2f} busy cores on the machine while timing)",
                      file=sys.stderr, flush=True)
            del here
        if args.memory_chunks:
            here = build(configs, rank, args.memory_chunks, args)
            check_gradients(here, configs)  # a warm-up (torch infers shapes on its 1st step)
            queue.put(("memory", rank, measure_memory(here)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(args: argparse.Namespace) -> List[Any]:
    """Run ``bench_rank`` on ``args.ranks`` processes; return what they queued."""
    folder = tempfile.mkdtemp(prefix="seqpipe-bench-pg-")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    context = mp.start_processes(bench_rank, args=(args, os.path.join(folder, "store"), queue),
                                 nprocs=args.ranks, join=False, start_method="spawn")
    out: List[Any] = []
    deadline = time.monotonic() + args.timeout
    try:
        while not context.join(timeout=0.2):
            while not queue.empty():  # drain as we go: a full pipe would block the sender
                out.append(queue.get())
            if time.monotonic() > deadline:
                raise TimeoutError(f"the ranks did not finish within {args.timeout} s")
        while not queue.empty():
            out.append(queue.get())
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
        shutil.rmtree(folder, ignore_errors=True)
    return out


# -- report -----------------------------------------------------------------------------
def _med(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def _f(v: float, spec: str = ".0f", suffix: str = "") -> str:
    return "-" if v != v else f"{v:{spec}}{suffix}"


def timing_table(results: Dict[int, Dict[str, Any]], configs: Dict[str, Config],
                 args: argparse.Namespace) -> Tuple[List[str], List[str]]:
    lines = ["| M | schedule | torch class | torch ms | seqpipe ms | seqpipe/torch speed | "
             "simulate ms | seqpipe / simulate | torch / simulate | no-bubble bound ms | "
             "grad diff torch, seqpipe vs plain; seqpipe vs torch |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    summary, notes = [], {}
    for m, res in results.items():
        ms = torch.tensor(res["ms"])  # [round, schedule, side]
        best: Dict[str, Tuple[float, str]] = {}
        for k, name in enumerate(res["names"]):
            torch_ms, seq_ms = _med(ms[:, k, 0].tolist()), _med(ms[:, k, 1].tolist())
            speed = _med((ms[:, k, 0] / ms[:, k, 1]).tolist())
            config = configs[name]
            sim = bound = float("nan")
            if config.costs is not None:
                fwd, inp, wgt = config.costs
                sim = simulate(name, args.ranks, m, forward_cost=fwd, input_cost=inp,
                               weight_cost=wgt).makespan
                bound = m * args.ms * 3
            g = res["grads"][k]
            grads = ", ".join("-" if v < 0 else f"{v:.0e}" for v in g[:2]) + \
                    "; " + ("-" if g[2] < 0 else f"{g[2]:.0e}")
            error = res["errors"][name]
            if error:
                notes.setdefault(name, error)
            seq_cell = (f"not run [{list(notes).index(name) + 1}]" if error
                        else _f(seq_ms, ".1f"))
            lines.append(f"| {m} | {name} | {TORCH_OF.get(name, '(none)')} "
                         f"| {_f(torch_ms, '.1f')} | {seq_cell} | {_f(speed, '.3f', '×')} "
                         f"| {_f(sim, '.0f')} | {_f(seq_ms / sim, '.3f')} "
                         f"| {_f(torch_ms / sim, '.3f')} | {_f(bound, '.0f')} | {grads} |")
            for side, value in (("torch", torch_ms), ("seqpipe", seq_ms)):
                if value == value and value < best.get(side, (float("inf"), ""))[0]:
                    best[side] = (value, name)
            if seq_ms == seq_ms and sim == sim:
                summary.append(f"M={m} {name}: seqpipe / simulate {seq_ms / sim:.3f} "
                               f"({'meets' if seq_ms <= SIM_TARGET * sim else 'misses'} "
                               f"<= {SIM_TARGET})")
            if speed == speed:
                summary.append(f"M={m} {name}: seqpipe/torch {speed:.3f}× "
                               f"({'meets' if speed >= PEER_TARGET else 'misses'} "
                               f">= {PEER_TARGET})")
        if "torch" in best and "seqpipe" in best:
            ratio = best["torch"][0] / best["seqpipe"][0]
            summary.append(f"M={m} fastest: seqpipe {best['seqpipe'][1]} "
                           f"{best['seqpipe'][0]:.1f} ms vs torch {best['torch'][1]} "
                           f"{best['torch'][0]:.1f} ms: {ratio:.3f}× "
                           f"({'meets' if ratio >= FASTEST_TARGET else 'misses'} "
                           f">= {FASTEST_TARGET})")
        summary += _split_vs_full(res, "zb_h1", "1f1b", m)
        worst = max(max(g) for g in res["grads"])
        summary.append(f"M={m} gradients: largest relative difference {worst:.1e} "
                       f"({'agree' if worst <= GRAD_TOLERANCE else 'DIFFER'}: tolerance "
                       f"{GRAD_TOLERANCE:g})")
    lines.append("")
    lines += [f"[{n + 1}] {name}: DistributedPipe refused it: {error}"
              for n, (name, error) in enumerate(notes.items())]
    return lines, summary


def _split_vs_full(res: Dict[str, Any], split: str, full: str, m: int) -> List[str]:
    """Per runtime that ran both: the speed of ``split`` over ``full`` (paired median)."""
    names = res["names"]
    if split not in names or full not in names:
        return []
    ms = torch.tensor(res["ms"])
    a, b = names.index(split), names.index(full)
    out = []
    for side, runtime in enumerate(("torch", "seqpipe")):
        speed = _med((ms[:, b, side] / ms[:, a, side]).tolist())
        if speed == speed:
            out.append(f"M={m} {runtime}: {split} is {speed:.3f}× as fast as {full}")
    return out


def memory_table(memory: Dict[int, Dict[str, List[float]]], configs: Dict[str, Config],
                 args: argparse.Namespace) -> List[str]:
    m = args.memory_chunks
    what = "Linear+ReLU block" if args.real else "layer"
    lines = [f"Peak bytes saved for backward per rank in one step at M={m}, in units of one "
             f"stage's activations for one micro-batch (one {args.micro_batch}×{args.width} "
             f"float tensor per {what} of the stage); ranks 0..K-1. simulate: its "
             f"peak_live_microbatches (the last stage also keeps its loss's saved output, +1"
             + (" block; stage 0's first input is the caller's, not counted" if args.real
                else "") + ").", "",
             "| schedule | torch | seqpipe | simulate |", "|---|---|---|---|"]
    for name, config in configs.items():
        blocks = config.layers_per_stage // (2 if args.real else 1)
        unit = blocks * args.micro_batch * args.width * 4
        cells = []
        for side in range(2):
            peaks = [memory[r][name][side] for r in sorted(memory)]
            cells.append("-" if any(p != p for p in peaks) else
                         " / ".join(f"{p / unit:.1f}" for p in peaks))
        sim = simulate(name, args.ranks, m).peak_live_microbatches  # order only: no costs
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {' / '.join(map(str, sim))} |")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=None, help="K (default 4; 2 with --real)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[8, 16], help="M values")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds per M (default 5; 20 with --real)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds per M")
    parser.add_argument("--ms", type=float, default=10.0,
                        help="F = I = W per rank and micro-batch (ms)")
    parser.add_argument("--schedules", nargs="+", default=None, choices=SCHEDULES,
                        help="default: all nine (--real: 1f1b zb_h1)")
    parser.add_argument("--layers-per-stage", type=int, default=1)
    parser.add_argument("--width", type=int, default=None,
                        help="activation width (default 64; 512 with --real)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="samples per micro-batch (default 4; 32 with --real)")
    parser.add_argument("--memory-chunks", type=int, default=8, help="M of the memory step "
                        "(0: skip)")
    parser.add_argument("--real", action="store_true",
                        help="real compute: small MLP, 2 ranks, zb_h1 against 1f1b")
    parser.add_argument("--depth", type=int, default=8, help="--real: Linear+ReLU blocks")
    parser.add_argument("--timeout", type=float, default=1800.0, help="kill the ranks after")
    args = parser.parse_args(argv)
    args.ranks = args.ranks or (2 if args.real else 4)
    args.rounds = args.rounds or (20 if args.real else 5)
    args.width = args.width or (512 if args.real else 64)
    args.micro_batch = args.micro_batch or (32 if args.real else 4)
    args.schedules = args.schedules or (["1f1b", "zb_h1"] if args.real else list(SCHEDULES))
    configs = {name: make_config(name, args) for name in args.schedules}
    print(f"# {seqpipe_version()}, load average {load_average()} (at start)",
          file=sys.stderr, flush=True)
    began = time.perf_counter()
    answers = spawn(args)
    timing = {m: r for kind, m, r in answers if kind == "timing"}
    memory = {rank: r for kind, rank, r in answers if kind == "memory"}
    print(f"Command: python {' '.join(sys.argv)}")
    print(f"Machine: torch {torch.__version__}, {os.cpu_count()} CPUs, {args.ranks} ranks × 1 "
          f"intra-op thread, gloo on 127.0.0.1, {seqpipe_version()}, load average "
          f"{load_average()} (at end); {time.perf_counter() - began:.0f} s; busy cores while "
          f"timing: " + ", ".join(f"M={m}: {r['load']:.2f}" for m, r in timing.items())
          + ("" if args.real else "; sleeps took longer than asked by: "
             + ", ".join(f"M={m}: {r['overrun']:.3f}×" for m, r in timing.items())))
    model = (f"{args.depth} × (Linear({args.width}) + ReLU)" if args.real else
             f"sleep layers, F = I = W = {args.ms:g} ms per rank and micro-batch "
             f"({args.layers_per_stage} layer(s) per stage), activations "
             f"{args.micro_batch}×{args.width}")
    print(f"Model: {model}; MSE loss; {args.rounds} timed rounds after {args.warmup} warm-up "
          f"rounds; medians")
    print()
    lines, summary = timing_table(timing, configs, args)
    print("\n".join(lines))
    print("Targets:")
    print("\n".join(f"- {line}" for line in summary))
    if memory:
        print()
        print("\n".join(memory_table(memory, configs, args)))


if __name__ == "__main__":
    main()
