"""The demo behind ``python -m seqpipe``: a short pipelined training run of a small CNN.

The data is synthetic but learnable (each class is a fixed random image plus noise), so the
loss visibly falls without any download. The model is split over the default devices — every
GPU if there are several, else two ``cpu`` partitions — with a balance chosen by profiling,
and its step time is shown beside the same model's, unpipelined, whose steps are taken
between the pipelined ones (``seqpipe.demo_baseline.Beside``). With the same ``--seed``,
devices and thread count every run prints the same losses, bit for bit.
"""
from __future__ import annotations

import argparse
import pathlib
import time
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seqpipe.balance import balance_by_params, balance_by_size, balance_by_time
from seqpipe.demo_baseline import Beside, make_data, unpipelined_rate
from seqpipe.pipe import Pipe
from seqpipe.schedule import SCHEDULES, get_schedule, placement_of, simulate
from seqpipe.trace import Recorder, record

__all__ = ["build_model", "local_devices", "local_pipe", "make_data", "main", "parse_args",
           "run_distributed", "run_gpt2", "sample_batch", "train_locally"]


def build_model(num_classes: int = 10, width: int = 16) -> nn.Sequential:
    """A small VGG-style CNN for 3×32×32 images, written as one ``nn.Sequential``."""
    w = width
    return nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(inplace=True),
        nn.Conv2d(w, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(w, 2 * w, 3, padding=1), nn.BatchNorm2d(2 * w), nn.ReLU(inplace=True),
        nn.Conv2d(2 * w, 2 * w, 3, padding=1), nn.BatchNorm2d(2 * w), nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(2 * w, 4 * w, 3, padding=1), nn.BatchNorm2d(4 * w), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(4 * w, num_classes),
    )


def sample_batch(batch: int, seed: int = 0) -> Tensor:
    """The first mini-batch's images, to profile the balance on."""
    return next(make_data(1, batch, seed=seed))[0]


def default_split() -> Tuple[int, List[str]]:
    """Every visible GPU when there are two or more; two ``cpu`` partitions otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 1:
        n = torch.cuda.device_count()
        return n, [f"cuda:{i}" for i in range(n)]
    if torch.cuda.is_available():
        return 1, ["cuda:0"]
    return 2, ["cpu", "cpu"]


def num_stages(schedule: str, ranks: int) -> int:
    """How many stages ``schedule`` runs on ``ranks`` devices or processes (2 per rank for
    the interleaved and V-shaped ones)."""
    return placement_of(get_schedule(schedule), ranks).num_stages


def choose_balance(how: str, partitions: int, model: nn.Sequential, sample: Tensor,
                   chunks: int) -> List[int]:
    """Pick the balance the way the user asked on the command line.

    ``size`` (the default) is the same on every run; ``time`` measures, so on a machine
    with other work it can differ from run to run (the layers' times move with the load).
    """
    if how == "params":
        return balance_by_params(partitions, model)
    if how == "size":
        return balance_by_size(partitions, model, sample, chunks=chunks)
    return balance_by_time(partitions, model, sample[: max(1, len(sample) // chunks)],
                           timeout=0.5)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default, except ``None`` (the help says what happens then)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action) or ""


LOCAL_SCHEDULES = [name for name in SCHEDULES if name != "gpipe"]  # gpipe = fill_drain
"""What ``--schedule`` offers: every built-in; ``auto`` too with ``--processes``."""


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line of ``python -m seqpipe`` (``--help`` lists every option)."""
    parser = argparse.ArgumentParser(prog="python -m seqpipe", description=__doc__,
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--model", default="cnn", choices=["cnn", "gpt2-tiny"],
                        help="the demo model: a CNN written as an nn.Sequential, or a small "
                             "GPT written freely and converted by seqpipe.to_sequential "
                             "(local Pipe only)")
    parser.add_argument("--steps", type=_positive, default=30, help="training steps")
    parser.add_argument("--batch", type=_positive, default=32, help="mini-batch size")
    parser.add_argument("--chunks", type=_positive, default=4,
                        help="micro-batches per mini-batch")
    parser.add_argument("--partitions", type=_positive, default=None,
                        help="partitions of the local Pipe (default: the GPUs, or 2 on CPU)")
    parser.add_argument("--checkpoint", default="except_last",
                        choices=["always", "except_last", "never"],
                        help="which micro-batches recompute their activations in backward")
    parser.add_argument("--balance-by", default="size", choices=["size", "time", "params"],
                        help="how the layers are split over the partitions: by the memory "
                             "training keeps (the same every run), by measured time (the "
                             "fastest split, but it follows the machine's load, so it can "
                             "differ between runs) or by parameter count")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    parser.add_argument("--seed", type=int, default=0, help="random seed of model and data")
    parser.add_argument("--processes", type=_positive, default=None,
                        help="run DistributedPipe over this many local processes, one stage "
                             "each (gloo on CPU, NCCL when every process gets a GPU) instead "
                             "of the local Pipe")
    parser.add_argument("--schedule", default="1f1b", choices=[*LOCAL_SCHEDULES, "auto"],
                        help="the clock of each training step (Pipe.train_step, or "
                             "DistributedPipe.train_step with --processes); the interleaved "
                             "and V-shaped ones run 2 stages per device or process; auto "
                             "(measure, then pick) needs --processes")
    parser.add_argument("--trace", metavar="DIR", type=pathlib.Path, default=None,
                        help="write the last step's measured timeline to DIR/trace.json "
                             "(Chrome trace: Perfetto, chrome://tracing) and DIR/trace.svg, "
                             "and print its summary (without it: a one-line summary)")
    args = parser.parse_args(argv)
    layers = len(build_model())
    if args.model != "cnn" and args.processes is not None:
        parser.error(f"--model {args.model} runs in the local Pipe; leave out --processes")
    if args.processes is not None and args.partitions is not None:
        parser.error("--partitions is for the local Pipe; with --processes every process "
                     "is one stage: give one of them")
    if args.schedule == "auto" and args.processes is None:
        parser.error("--schedule auto measures the first step and picks a schedule, which "
                     "only DistributedPipe does: add --processes N, or name a schedule")
    for option in ("processes", "partitions"):
        count = getattr(args, option)
        if count is not None and num_stages(args.schedule, count) > layers:
            parser.error(f"--{option} {count}: with --schedule {args.schedule} that is "
                         f"{num_stages(args.schedule, count)} stages, but the demo model has "
                         f"{layers} layers, so at most {layers} stages")
    return args


def _print_schedule(schedule: str, ranks: int, chunks: int, row: str) -> None:
    """The clock the run used, as the simulator draws it with equal costs per stage; its
    rows are ``row``s (a local Pipe's threads, or processes' ranks)."""
    plan = simulate(schedule, ranks, chunks)
    print(f"schedule {schedule!r}, {num_stages(schedule, ranks)} stages x {chunks} "
          f"micro-batches (equal stages; a column is a forward, a backward takes two; "
          f"bubble {plan.bubble_fraction:.0%}):")
    print(plan.chart(label=row))


def _describe_stages(model: nn.Sequential, balance: Sequence[int],
                     devices: Sequence[object], noun: str) -> None:
    layers, start = list(model), 0
    for i, (count, device) in enumerate(zip(balance, devices)):
        names = ", ".join(getattr(layer, "unit", type(layer).__name__)  # a converted unit
                          for layer in layers[start:start + count])
        print(f"  {noun} {i} on {device}: {names}")
        start += count


StepFn = Callable[[Tensor, Tensor], float]


def _train(step_fn: StepFn, data: Iterator[Tuple[Tensor, Tensor]], steps: int,
           talk: bool, baseline: float = float("nan"), beside: Optional[Beside] = None
           ) -> Tuple[float, Recorder, List[float]]:
    """Run ``step_fn(images, labels) -> loss`` over ``data``; print the loss and the rate
    so far, beside the ``baseline`` rate of the unpipelined model, or, with ``beside``, let
    its copies take a step after each pipelined one. The last step runs inside
    ``seqpipe.trace.record()``: its recorder is returned, and every step's seconds."""
    seen, loss_value, times = 0, float("nan"), []
    recorder = record()
    for step, (images, labels) in enumerate(data, 1):
        start = time.perf_counter()
        if step == steps:
            with recorder:
                loss_value = step_fn(images, labels)
        else:
            loss_value = step_fn(images, labels)
        times.append(time.perf_counter() - start)
        if beside is not None:
            beside.step(images, labels)
        seen += len(images)
        if talk and (step == 1 or step % 5 == 0 or step == steps):
            rate = seen / sum(times)
            against = "" if beside is not None else f"; unpipelined {baseline:.1f}"
            print(f"step {step:3d}/{steps}  loss {loss_value:.4f}  {rate:8.1f} samples/s "
                  f"(running average{against})", flush=True)
    elapsed = sum(times)
    if talk:
        against = "" if beside is not None else f" against {baseline:.1f} unpipelined"
        print(f"done: {seen} samples in {elapsed:.2f} s, {seen / elapsed:.1f} samples/s "
              f"pipelined{against}; final loss {loss_value:.4f}", flush=True)
    return loss_value, recorder, times


def _show_trace(recorder: Recorder, directory: Optional[pathlib.Path]) -> None:
    """The last step's summary: in full, with its JSON and SVG in ``directory`` if given,
    else in one line."""
    summary = recorder.summary()
    if directory is None:
        print(summary.oneline(), flush=True)
        return
    directory.mkdir(parents=True, exist_ok=True)
    recorder.to_chrome(directory / "trace.json")
    recorder.to_svg(directory / "trace.svg")
    print(f"last step traced: {directory / 'trace.json'} (open in https://ui.perfetto.dev "
          f"or chrome://tracing), {directory / 'trace.svg'}")
    print(summary, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> float:
    """Train for a few steps and print the split, the loss, the throughput and the clock."""
    args = parse_args(argv)
    if args.processes is not None:
        from seqpipe.launch import spawn_local

        torch.manual_seed(args.seed)
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        args.baseline = unpipelined_rate(build_model(), device, args)  # with every core
        spawn_local(args.processes, run_distributed, args)
        return float("nan")
    if args.model == "gpt2-tiny":
        return run_gpt2(args)
    torch.manual_seed(args.seed)
    partitions, devices = local_devices(args)
    model = build_model()

    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=args.lr, momentum=0.9)

    beside = Beside(model, torch.device(devices[0]), args, sgd, nn.CrossEntropyLoss())
    pipe = local_pipe(model, sample_batch(args.batch, args.seed), partitions, devices, args,
                      deferred_batch_norm=True)
    print(f"seqpipe demo: {len(model)} layers split as balance={pipe.balance} "
          f"(by {args.balance_by}) over {[str(d) for d in pipe.devices]}, chunks={args.chunks}, "
          f"checkpoint={args.checkpoint!r}, schedule={args.schedule!r}")
    _describe_stages(model, pipe.balance, pipe.devices, "partition")
    return train_locally(pipe, sgd(pipe.parameters()), nn.CrossEntropyLoss(),
                         make_data(args.steps, args.batch, seed=args.seed), args,
                         threads=partitions, beside=beside)


def local_pipe(model: nn.Sequential, sample: Tensor, partitions: int, devices: List[str],
               args: argparse.Namespace, **options: Any) -> Pipe:
    """``model`` in a ``Pipe`` over ``partitions`` threads on ``devices``, as many stages as
    ``args.schedule`` places on them, balanced the way ``args.balance_by`` says."""
    placement = placement_of(get_schedule(args.schedule), partitions)
    balance = choose_balance(args.balance_by, placement.num_stages, model, sample, args.chunks)
    return Pipe(model, chunks=args.chunks, checkpoint=args.checkpoint, balance=balance,
                devices=[devices[placement.rank_of(s)] for s in range(placement.num_stages)],
                **options)


def local_devices(args: argparse.Namespace) -> Tuple[int, List[str]]:
    """The number of local partitions and their devices, from ``--partitions`` or the
    default split."""
    partitions, devices = default_split()
    if args.partitions is not None:
        partitions = args.partitions
        devices = (devices * partitions)[:partitions] if devices[0] == "cpu" else devices
    return partitions, devices[:partitions]


def train_locally(pipe: Pipe, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., Tensor],
                  data: Iterator[Tuple[Tensor, Tensor]], args: argparse.Namespace, *,
                  threads: int, beside: Beside) -> float:
    """``args.steps`` steps of ``pipe.train_step`` under ``args.schedule`` (on ``threads``
    threads), each followed by a step of the unpipelined copies ``beside``; print the
    loss, the step times beside theirs, the clock and the last step's trace; return the
    last loss."""

    def step(inputs: Tensor, targets: Tensor) -> float:
        optimizer.zero_grad()
        loss = pipe.train_step(inputs, targets.to(pipe.devices[-1]), loss_fn,
                               schedule=args.schedule)
        optimizer.step()
        return loss.item()

    loss_value, recorder, times = _train(step, data, args.steps, talk=True, beside=beside)
    beside.report(times, pipe.devices)
    _print_schedule(args.schedule, threads, min(args.chunks, args.batch), "thread")
    _show_trace(recorder, args.trace)
    return loss_value


def run_gpt2(args: argparse.Namespace) -> float:
    """``--model gpt2-tiny``: ``TinyGPT`` converted by ``to_sequential``, in a ``Pipe``."""
    from seqpipe.demo_gpt2 import TinyGPT, make_tokens
    from seqpipe.graph import to_sequential

    torch.manual_seed(args.seed)
    partitions, devices = local_devices(args)
    model = TinyGPT()
    sample = next(make_tokens(1, max(2, args.batch), args.seed))[0]
    seq = to_sequential(model, (sample,))
    device = torch.device(devices[0])

    def loss_fn(logits: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2)

    beside = Beside(model, device, args, adamw, loss_fn)
    pipe = local_pipe(seq, sample, partitions, devices, args)
    print(f"seqpipe demo: TinyGPT converted by to_sequential into {len(seq)} layers, "
          f"balance={pipe.balance} (by {args.balance_by}) over "
          f"{[str(d) for d in pipe.devices]}, chunks={args.chunks}, "
          f"checkpoint={args.checkpoint!r}, schedule={args.schedule!r}")
    _describe_stages(seq, pipe.balance, pipe.devices, "partition")
    return train_locally(pipe, adamw(model.parameters()), loss_fn,
                         make_tokens(args.steps, args.batch, args.seed), args,
                         threads=partitions, beside=beside)


def run_distributed(args: argparse.Namespace) -> float:
    """The same training with ``DistributedPipe``: call on every rank of an initialised group.

    Rank 0 chooses the balance (profiling is not bit-identical between processes) and
    shares it; stage 0 reads the images, the last stage the labels.
    """
    import torch.distributed as dist

    from seqpipe.distributed import DistributedPipe

    rank, world = dist.get_rank(), dist.get_world_size()
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    torch.manual_seed(args.seed)
    model = build_model()
    balance = torch.zeros(num_stages(args.schedule, world), dtype=torch.int64, device=device)
    baseline = getattr(args, "baseline", float("nan"))  # measured by the launcher, if any
    if rank == 0:
        chosen = choose_balance(args.balance_by, len(balance), model,
                                sample_batch(args.batch, args.seed), args.chunks)
        balance.copy_(torch.tensor(chosen))
    dist.broadcast(balance, src=0)
    if rank == 0:
        noun = "process" if world == 1 else "processes"
        print(f"seqpipe distributed demo: {len(model)} layers over {world} {noun} "
              f"({dist.get_backend()}), balance={balance.tolist()}, chunks={args.chunks}, "
              f"schedule={args.schedule!r}, checkpoint={args.checkpoint!r}", flush=True)
        ranks = [f"rank {placement_of(get_schedule(args.schedule), world).rank_of(s)}"
                 for s in range(len(balance))]
        _describe_stages(model, balance.tolist(), ranks, "stage")
    pipe = DistributedPipe(model, chunks=args.chunks, balance=balance.tolist(),
                           schedule=args.schedule, checkpoint=args.checkpoint,
                           deferred_batch_norm=True, device=device)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step(images: Tensor, labels: Tensor) -> float:
        optimizer.zero_grad()
        loss = pipe.train_step(images if pipe.is_first else None,
                               labels.to(device) if pipe.is_last else None, loss_fn)
        optimizer.step()
        return loss.item()

    loss_value, recorder, _ = _train(step, make_data(args.steps, args.batch, seed=args.seed),
                                     args.steps, talk=rank == 0, baseline=baseline)
    if rank == 0:  # holds every rank's events, gathered when the last step's block ended
        ran = pipe.auto_choice.name if pipe.auto_choice is not None else args.schedule
        _print_schedule(ran, world, min(args.chunks, args.batch), "rank")
        _show_trace(recorder, args.trace)
    return loss_value
