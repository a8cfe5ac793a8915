"""Two-rank training on transformer blocks: seqpipe's DistributedPipe against torch pipelining.

Real compute on the model people train, as opposed to ``dist_vs_torch_pipelining.py``'s MLP
(a few big matmuls) and ``dist_schedules.py``'s sleep-timed layers (no compute at all): a
small GPT-style stack, written here (no ``transformers``), as one ``nn.Sequential``:

* ``Embed``: token embedding plus a learned position embedding;
* ``--blocks`` × ``Block``: pre-norm, ``x + attn(ln(x))`` with causal self-attention
  (``F.scaled_dot_product_attention(is_causal=True)``) then ``x + mlp(ln(x))`` (4× GELU);
* ``Head``: a final LayerNorm and the logits ``x @ E.T`` with the embedding's own matrix
  ``E`` (tied weights: the same ``nn.Parameter`` in the first and the last layer).

Loss: cross-entropy of the next-token logits against target tokens (mean per micro-batch),
so every variant computes the mini-batch's mean loss and the same gradients (checked against
the unpipelined model before timing, to ``GRAD_TOLERANCE``).

Each schedule (``--schedules``; default ``1f1b``, ``zb_h1``, ``interleaved_1f1b``) runs the
identical model and split under both runtimes, 2 processes on loopback, gloo, one intra-op
thread each, ``M`` (``--chunks``, default 8) micro-batches of ``--micro-batch`` sequences:

* seqpipe: ``DistributedPipe(model, chunks=M, balance=..., schedule=<name>,
  checkpoint="never", device="cpu")``, ``train_step(x, y, loss_fn)``; the copies of the tied
  embedding are summed by the pipe at the end of the step;
* torch: ``PipelineStage`` s built by hand from the same layers (same stages, same
  placement: stage ``s`` on rank ``s mod 2`` for the interleaved schedule), the schedule class
  ``TORCH_OF[name]`` (torch has no ZB-H1 class: ``ScheduleInterleavedZeroBubble`` given one
  stage per rank is its zero-bubble schedule for that placement), ``loss_fn=loss_fn``,
  defaults otherwise (``scale_grads=True``), then the tied embedding's gradient summed over
  the two ranks with one ``all_reduce`` (torch pipelining leaves ties to the user; this is
  what seqpipe does too).

The balance: stage 0 holds ``Embed`` and the first blocks, the last stage the last blocks and
``Head``, blocks spread evenly (``balance_of``).

Timing. Every step starts after a barrier; each rank reads ``time.perf_counter`` before and
after; a step lasts from the first start to the last end. Round ``r`` runs every variant once
in an order that rotates each round (so load hits all alike); the first ``--warmup`` rounds
are not timed. Figures are medians over the rounds; seqpipe/torch is the median of the
per-round ratios torch ms / seqpipe ms (> 1: seqpipe faster). Beside them: ``1 process``, the
whole model on rank 0 (rank 1 idle), one thread, the same ``M`` micro-batches one after the
other (gradient accumulation), time ``T1``; the 2-core ideal of a pipeline, ``T1 / 2`` (no
bubble), and of a 2-stage 1F1B, ``T1 (M + 1) / 2M``; and ``compute floor``: each rank runs
its half of the 2-stage split (forward and backward of M micro-batches, rank 1 from what
rank 0 would send) with no communication and no schedule, at the same time as the other,
so on the same contended cores. The floor times ``(M + 1) / M`` (a 2-stage 1F1B's bubble)
is the fastest any runtime could run this split on this machine at that moment, and torch
ms over it the *ceiling* of runtime/torch: a ratio target above it cannot be met. Each
round also records the machine's foreign load (busy CPU of other processes, in cores) and
each rank's main-thread CPU time per step (``time.thread_time``: the Python and compute of
the thread that runs the step; gloo's I/O threads excluded), the figure issue 24 compares.

Run: ``PYTHONPATH=. python benchmarks/dist_transformer_vs_torch.py`` (``--help`` for sizes).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
import torch.nn.functional as F
from _common import pin_malloc
from dist_vs_torch_pipelining import _init, machine_line, spawn, time_rounds
from torch import Tensor, nn

from seqpipe.distributed import DistributedPipe
from seqpipe.schedule import get_schedule, placement_of

SCHEDULES = ("1f1b", "zb_h1", "interleaved_1f1b")
TORCH_OF = {"fill_drain": "ScheduleGPipe", "1f1b": "Schedule1F1B",
            "zb_h1": "ScheduleInterleavedZeroBubble", "auto": "ScheduleInterleavedZeroBubble",
            "interleaved_1f1b": "ScheduleInterleaved1F1B", "looped_bfs": "ScheduleLoopedBFS",
            "interleaved_zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}
_SINGLE = (pipelining.ScheduleGPipe, pipelining.Schedule1F1B)  # take one stage, not a list
# seqpipe's schedule -> the torch variant it is timed against (``auto`` against torch's
# zero-bubble one: it runs zb_h1, or zb_h1 with some backwards joined, or 1f1b)
AGAINST = {"auto": "zb_h1"}
ONE = "1 process"
FLOOR = "compute floor"
RATIO_TARGET = 1.05
GRAD_TOLERANCE = 1e-4  # relative; float32 sums in another order


# -- the model -------------------------------------------------------------------------
class Embed(nn.Module):
    """Token plus learned position embedding: ``(b, t)`` tokens to ``(b, t, d)``."""

    def __init__(self, vocab: int, width: int, length: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.randn(length, width) * 0.02)

    def forward(self, x: Tensor) -> Tensor:
        return self.tokens(x) + self.positions[:x.shape[1]]


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then a 4× GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Head(nn.Module):
    """Final LayerNorm and logits against the embedding matrix (the tied weight)."""

    def __init__(self, embed: Embed, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.weight = embed.tokens.weight  # the same Parameter: a tie across stages

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(self.ln(x), self.weight)


def make_gpt(vocab: int, width: int, heads: int, blocks: int, length: int,
             seed: int = 0) -> nn.Sequential:
    """``Embed``, ``blocks`` × ``Block``, ``Head``: a GPT-style stack as one Sequential."""
    torch.manual_seed(seed)
    embed = Embed(vocab, width, length)
    return nn.Sequential(embed, *(Block(width, heads) for _ in range(blocks)),
                         Head(embed, width))


def balance_of(blocks: int, stages: int) -> List[int]:
    """Layers per stage: blocks spread evenly, ``Embed`` on the first stage, ``Head`` on the
    last."""
    balance = [blocks // stages] * stages
    balance[0] += 1
    balance[-1] += 1
    return balance


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


# -- the variants ----------------------------------------------------------------------
class Variants:
    """Every variant's step on this rank (same weights everywhere) and its parameters."""

    def __init__(self, model: nn.Sequential, rank: int, args: argparse.Namespace) -> None:
        self.rank, self.chunks = rank, args.chunks
        gen = torch.Generator().manual_seed(1234)
        shape = (args.chunks * args.micro_batch, args.length)
        self.x = torch.randint(args.vocab, shape, generator=gen)
        self.y = torch.randint(args.vocab, shape, generator=gen)
        self.steps: Dict[str, Callable[[], None]] = {}
        self.params: Dict[str, Dict[str, nn.Parameter]] = {}  # by state-dict name
        self.model = model
        self.picks: Dict[str, str] = {}  # schedule="auto": what it picked, and why
        for name in args.schedules:
            if f"torch {AGAINST.get(name, name)}" not in self.steps:
                self._torch(AGAINST.get(name, name), args.blocks)
            self._seqpipe(name, args.blocks)
        self._floor(args.blocks)
        whole = copy.deepcopy(model)
        self.params[ONE] = dict(whole.named_parameters(remove_duplicate=False))
        self.reference = self._one_step(whole)
        self._add(ONE, self.params[ONE], self.reference if rank == 0 else (lambda: None))

    def _add(self, name: str, params: Dict[str, nn.Parameter], step: Callable[[], None]) -> None:
        def run() -> None:
            for p in params.values():
                p.grad = None
            step()
        self.steps[name], self.params[name] = run, params

    def _seqpipe(self, name: str, blocks: int) -> None:
        stages = placement_of(get_schedule(name), 2).num_stages
        pipe = DistributedPipe(copy.deepcopy(self.model), chunks=self.chunks,
                               balance=balance_of(blocks, stages), schedule=name,
                               checkpoint="never", device="cpu")
        x, y = self.x, self.y  # each rank's pipe reads what its placement needs
        def step() -> None:
            pipe.train_step(x, y, loss_fn)
            if pipe.auto_choice is not None:  # the first step measured: the pick from now on
                costs = pipe.auto_choice.costs
                rows = (costs.forward, getattr(costs, "backward", None), costs.input,
                        costs.weight)  # (main before session 14: no measured B)
                shown = "; ".join(
                    f"{kind} " + " / ".join(f"{t * 1e3:.2f}" for t in row)
                    for kind, row in zip("FBIW", rows) if row is not None)
                self.picks[name] = (f"{pipe.auto_choice.describe(None)}; measured ms per "
                                    f"micro-batch, stage 0 / 1: {shown}")
        self._add(f"seqpipe {name}", dict(pipe.named_parameters(remove_duplicate=False)),
                  step)

    def _torch(self, name: str, blocks: int) -> None:
        placement = placement_of(get_schedule(name), 2)
        balance = balance_of(blocks, placement.num_stages)
        model = copy.deepcopy(self.model)
        bounds = [sum(balance[:s]) for s in range(len(balance) + 1)]
        stages, params = [], {}
        for s in placement.stages_of(self.rank):
            part = model[bounds[s]:bounds[s + 1]]
            stages.append(pipelining.PipelineStage(part, s, placement.num_stages,
                                                   torch.device("cpu")))
            params.update(part.named_parameters(remove_duplicate=False))  # slices keep names
        cls = getattr(pipelining, TORCH_OF[name])
        schedule = cls(stages[0] if cls in _SINGLE else stages, n_microbatches=self.chunks,
                       loss_fn=loss_fn)
        first, last = 0 in placement.stages_of(self.rank), \
            placement.num_stages - 1 in placement.stages_of(self.rank)
        args = (self.x,) if first else ()
        kwargs: Dict[str, Any] = {"target": self.y, "losses": [], "return_outputs": False} \
            if last else {}
        tied = model[0].tokens.weight
        across = placement.rank_of(0) != placement.rank_of(placement.num_stages - 1)

        def step() -> None:
            schedule.step(*args, **kwargs)
            if across:  # the tie's copies: sum their gradients (torch leaves it to the user)
                if tied.grad is None:
                    tied.grad = torch.zeros_like(tied)
                dist.all_reduce(tied.grad)
        self._add(f"torch {name}", params, step)

    def _floor(self, blocks: int) -> None:
        """This rank's 2-stage half alone, M forwards and backwards, no communication, no
        schedule: the compute a zero-overhead 2-stage pipeline could not go below."""
        balance = balance_of(blocks, 2)
        part = copy.deepcopy(self.model)[:balance[0]] if self.rank == 0 \
            else copy.deepcopy(self.model)[balance[0]:]
        xs, ys = self.x.chunk(self.chunks), self.y.chunk(self.chunks)
        with torch.no_grad():  # stage 1's input: what stage 0 would send
            hidden = [self.model[:balance[0]](x) for x in xs]

        def step() -> None:
            for x, h, y in zip(xs, hidden, ys):
                if self.rank == 0:
                    part(x).backward(torch.ones_like(h))
                else:
                    (loss_fn(part(h.requires_grad_()), y) / self.chunks).backward()
        self.steps[FLOOR], self.params[FLOOR] = step, {}

    def _one_step(self, whole: nn.Sequential) -> Callable[[], None]:
        xs, ys = self.x.chunk(self.chunks), self.y.chunk(self.chunks)

        def step() -> None:
            for x, y in zip(xs, ys):
                (loss_fn(whole(x), y) / self.chunks).backward()
        return step


def check_gradients(variants: Variants) -> Dict[str, float]:
    """Per variant, the largest relative difference of its gradients from the unpipelined
    model's (every rank runs the reference)."""
    for step in variants.steps.values():
        dist.barrier()
        step()
    if variants.rank != 0:
        variants.reference()
    reference = variants.params[ONE]
    worst: Dict[str, float] = {}
    for name, params in variants.params.items():
        if name in (ONE, FLOOR):
            continue
        diff = 0.0
        for key, p in params.items():
            ref = reference[key].grad
            assert p.grad is not None and ref is not None, f"{name}: no gradient for {key}"
            diff = max(diff, float((p.grad - ref).abs().max() / ref.abs().max()))
        worst[name] = diff
    return worst


def bench_rank(rank: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    pin_malloc()
    _init(rank, port)
    try:
        model = make_gpt(args.vocab, args.width, args.heads, args.blocks, args.length)
        variants = Variants(model, rank, args)
        worst = check_gradients(variants)
        bad = {n: d for n, d in worst.items() if not d <= GRAD_TOLERANCE}
        if bad:
            raise AssertionError(f"rank {rank}: gradients differ from the unpipelined "
                                 f"model's: {bad}")
        rounds = argparse.Namespace(rounds=args.rounds, warmup=args.warmup,
                                    max_rounds=args.rounds, max_foreign=float("inf"))
        timed = time_rounds(variants, rounds, clock=time.thread_time)  # main thread
        everyone = [None, None]
        dist.all_gather_object(everyone, worst)
        if rank == 0:
            timed["grad_error"] = max(d for w in everyone for d in w.values())  # type: ignore
            timed["picks"] = variants.picks
            queue.put(("timing", rank, timed))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# -- report ----------------------------------------------------------------------------
def _med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report(timed: Dict[str, Any], args: argparse.Namespace) -> List[str]:
    m = args.chunks
    one = _med(timed[ONE]["wall"])
    bound, one_f_one_b = one / 2, one * (m + 1) / (2 * m)
    floor = _med(timed[FLOOR]["wall"])
    ceiling = floor * (m + 1) / m  # the floor plus a 2-stage 1F1B's bubble
    lines = [f"M={m}: {args.rounds} rounds; foreign load median "
             f"{_med(timed['foreign']):.2f} cores (max {max(timed['foreign']):.2f}); "
             f"gradients agree with the unpipelined model's to {timed['grad_error']:.1e}.",
             f"1 process: {one * 1e3:.1f} ms/step; 2-core ideal: {bound * 1e3:.1f} ms "
             f"(no bubble), {one_f_one_b * 1e3:.1f} ms (2-stage 1F1B bubble).",
             f"Compute floor (each rank its 2-stage half, no communication): "
             f"{floor * 1e3:.1f} ms; with a 2-stage 1F1B bubble, {ceiling * 1e3:.1f} ms: the "
             f"fastest any runtime could run this split here, so the ceiling of "
             f"runtime/torch is torch ms / {ceiling * 1e3:.1f}.", "",
             "| schedule | torch class | torch ms | seqpipe ms | seqpipe/torch speed | "
             "ceiling (torch / floor with bubble) | torch / ideal 1F1B | seqpipe / ideal 1F1B | "
             "main-thread CPU ms per step, rank 0 / 1: torch | seqpipe |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    summary = []
    for name in args.schedules:
        ours, theirs = timed[f"seqpipe {name}"], timed[f"torch {AGAINST.get(name, name)}"]
        s, t = _med(ours["wall"]), _med(theirs["wall"])
        speed = _med([b / a for a, b in zip(ours["wall"], theirs["wall"])])
        cpu_t = " / ".join(f"{_med(c) * 1e3:.1f}" for c in theirs["ranks"])
        cpu_s = " / ".join(f"{_med(c) * 1e3:.1f}" for c in ours["ranks"])
        lines.append(f"| {name} | {TORCH_OF[name]} | {t * 1e3:.1f} | {s * 1e3:.1f} | "
                     f"**{speed:.3f}×** | {t / ceiling:.3f}× | {t / one_f_one_b:.3f} | "
                     f"{s / one_f_one_b:.3f} | "
                     f"{cpu_t} | {cpu_s} |")
        verdict = "meets" if speed >= RATIO_TARGET else "misses"
        summary.append(f"- {name}: seqpipe/torch {speed:.3f}× ({verdict} {RATIO_TARGET}×)")
    if "1f1b" in args.schedules:  # seqpipe's own schedules against its 1f1b, paired per round
        own = timed["seqpipe 1f1b"]["wall"]
        for name in args.schedules:
            if name != "1f1b":
                ratio = _med([a / b for a, b in zip(timed[f"seqpipe {name}"]["wall"], own)])
                summary.append(f"- seqpipe {name} / seqpipe 1f1b: {ratio:.3f} (step time; "
                               "> 1: slower)")
    picks = [f"- {name}: {line}" for name, line in timed.get("picks", {}).items()]
    return lines + ["", "Targets:", *summary] + (["", "Picks:", *picks] if picks else [])


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=8, help="transformer blocks")
    parser.add_argument("--length", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches per step (M)")
    parser.add_argument("--schedules", nargs="*", default=list(SCHEDULES),
                        choices=sorted(TORCH_OF))
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds")
    args = parser.parse_args(argv)
    if args.width % args.heads:
        parser.error("--width must be a multiple of --heads")
    for name in args.schedules:
        stages = placement_of(get_schedule(name), 2).num_stages
        if args.blocks % stages:
            parser.error(f"--blocks {args.blocks} does not split into the {stages} stages "
                         f"of {name}")
    print(f"# {machine_line()} (at start)", file=sys.stderr, flush=True)
    started = time.perf_counter()
    timed = next(r for kind, _, r in spawn(bench_rank, args) if kind == "timing")
    params = sum(p.numel() for p in make_gpt(args.vocab, args.width, args.heads, args.blocks,
                                             args.length).parameters())
    print(f"Command: python {' '.join(sys.argv)}")
    print(f"Machine: {machine_line()} (at end); {time.perf_counter() - started:.0f} s")
    print(f"Model: GPT-style, vocab {args.vocab}, width {args.width}, {args.heads} heads, "
          f"{args.blocks} blocks, {args.length} tokens, tied head "
          f"({params / 1e6:.2f} M parameters); micro-batch {args.micro_batch} sequences; "
          f"cross-entropy; no optimizer")
    print()
    print("\n".join(report(timed, args)))


if __name__ == "__main__":
    main()
