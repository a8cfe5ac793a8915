"""U-Net skips in ``Pipe``: routed directly (``@skippable``) vs. carried through every layer.

The model is a small convolutional U-Net of depth 4 written as an ``nn.Sequential``::

    Stem, Down0, Down1, Down2, Down3, Mid, Up3, Up2, Up1, Up0, Head

``Down{l}`` stashes its input (the level-``l`` encoder feature) and ``Up{l}`` pops it, each
level in its own ``Namespace``; these are the long skips. Two variants compute exactly the
same function from the same weights:

* **direct** — the skippable model as written. Inside ``Pipe`` a skip that crosses
  partitions goes straight from the stashing partition to the popping one.
* **tuple** — every layer is wrapped so that it takes and returns ``(x, *skips)``: the
  skips that are alive at that point of the network ride along with the activation and are
  passed on, untouched, by every layer (and every partition) that does not use them. The
  wrapper runs the very same layer object (a deep copy, same weights) against a private
  skip tracker, so the arithmetic is identical; the script asserts equal outputs and
  gradients once before timing.

For each partition count (2 and 3 ``cpu`` partitions, ``chunks=4``) it reports the median
time of a training step (zero grads, forward, ``sum().backward()``), the paired ratio
``tuple / direct`` (median over rounds of the per-round ratio) of wall time and of process
CPU time (which other processes on the same cores disturb less), and two memory figures.

Memory: why a subprocess per variant, and what is counted
---------------------------------------------------------
``torch.autograd.graph.saved_tensors_hooks`` are thread-local and ``Pipe`` runs each stage
on its own worker thread, so hooks installed around the training step see nothing. Each
variant therefore runs in a fresh subprocess (``--child``) that measures

* **saved peak**: the peak of the bytes autograd keeps for backward, from pack hooks
  installed *inside every layer's forward* (so on whatever thread runs the layer). A
  saved tensor is counted by storage (views and aliases of one buffer count once) from
  its pack until autograd drops it; parameters are excluded. Hooks are not installed while
  a micro-batch runs under checkpointing (``seqpipe.is_checkpointing()`` /
  ``is_recomputing()``): there the checkpoint's own hooks must stay innermost, and they save
  nothing but a placeholder, so checkpointed micro-batches contribute no saved bytes.
  This figure leaves out what the pipeline itself holds (mailboxes, skip trackers,
  checkpoint inputs), which is exactly where the two routings could differ, hence:
* **RSS peak**: after warm-up steps, before each measured step, the heap is trimmed
  (``malloc_trim``) and the kernel's peak-RSS mark reset (``/proc/self/clear_refs``); the
  figure is the step's peak resident memory (``ru_maxrss``) minus the resident memory
  before it, median over ``--memory-steps`` steps: what a step adds at its worst,
  everything included (the pipeline's references, checkpoint inputs, kernel workspaces,
  allocator slack). It is noisy (allocator reuse of pages not trimmed; several MiB from
  run to run), so compare it only across large differences. A subprocess per variant
  keeps one variant's high-water mark and heap from hiding or inflating the other's.

On CPU a "move" between partitions is an alias, not a copy, so relaying a skip through a
partition costs no extra activation memory there; the difference direct routing makes on
accelerators (one copy per skip instead of one per partition crossed, and no skip held on
the partitions in between) cannot show up on this machine.

Run: ``PYTHONPATH=. python benchmarks/unet_skips.py`` (``--help`` for sizes).
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import resource
import statistics
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as nnf
from _common import interleave, machine, paired_ratio, pin_malloc
from torch import Tensor, nn

from seqpipe import Pipe, is_checkpointing, is_recomputing
from seqpipe.skip import (
    Namespace,
    SkipTracker,
    inspect_skip_layout,
    iter_pops,
    iter_stashes,
    pop,
    skippable,
    stash,
    use_skip_tracker,
)

DEPTH = 4
BALANCES = {2: [5, 6], 3: [4, 3, 4]}  # 11 layers; long skips cross partitions either way

# --------------------------------------------------------------------------- the U-Net


def conv_block(c_in: int, c_out: int) -> nn.Sequential:
    """Two 3×3 convolutions with ReLU, resolution kept."""
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(c_out, c_out, 3, padding=1), nn.ReLU())


@skippable(stash=["skip"])
class Down(nn.Module):
    """Stashes its input (the encoder feature), then halves the resolution."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.block = conv_block(c_in, c_out)

    def forward(self, x: Tensor) -> Any:
        yield stash("skip", x)
        return self.block(nnf.max_pool2d(x, 2))


@skippable(pop=["skip"])
class Up(nn.Module):
    """Doubles the resolution and concatenates the matching encoder feature."""

    def __init__(self, c_in: int, c_skip: int, c_out: int) -> None:
        super().__init__()
        self.block = conv_block(c_in + c_skip, c_out)

    def forward(self, x: Tensor) -> Any:
        skip = yield pop("skip")
        x = nnf.interpolate(x, scale_factor=2.0, mode="nearest")
        return self.block(torch.cat([x, skip], dim=1))


def unet(base: int = 16, in_channels: int = 3, seed: int = 0) -> nn.Sequential:
    """Depth-4 U-Net; channels ``base·(1, 2, 4, 8)`` capped at 128, as an nn.Sequential."""
    torch.manual_seed(seed)
    chans = [min(base * 2**level, 128) for level in range(DEPTH + 1)]
    levels = [Namespace() for _ in range(DEPTH)]
    downs = [Down(chans[lv], chans[lv + 1]).isolate(levels[lv]) for lv in range(DEPTH)]
    # Up{lv} gets chans[lv + 1] channels from below (Mid or Up{lv + 1}) and the skip
    ups = [Up(chans[lv + 1], chans[lv], chans[lv]).isolate(levels[lv])
           for lv in reversed(range(DEPTH))]
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(in_channels, chans[0], 3, padding=1), nn.ReLU()),
        *downs,
        conv_block(chans[DEPTH], chans[DEPTH]),
        *ups,
        nn.Conv2d(chans[0], in_channels, 1),
    )


# --------------------------------------------------------------------------- tuple variant


class CarrySkips(nn.Module):
    """Runs ``layer`` on ``(x, *skips)``: feeds it the skips it pops, passes the rest on.

    ``carried_in`` are the skip keys that arrive with ``x`` (in order) and ``carried_out``
    the keys that leave with the output. The layer stashes and pops against a private
    tracker preloaded with the incoming skips, so a skippable layer runs unchanged.
    """

    def __init__(self, layer: nn.Module, carried_in: Sequence[Any],
                 carried_out: Sequence[Any]) -> None:
        super().__init__()
        self.layer = layer
        self.carried_in = tuple(carried_in)
        self.carried_out = tuple(carried_out)

    def forward(self, inputs: Tensor | tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
        x, *skips = (inputs,) if isinstance(inputs, Tensor) else inputs
        tracker = SkipTracker()
        tracker.tensors = dict(zip(self.carried_in, skips, strict=True))
        with use_skip_tracker(tracker):
            y = self.layer(x)
        if not self.carried_out:
            return y
        return (y, *(tracker.tensors[key] for key in self.carried_out))


def carry_through_every_layer(model: nn.Sequential) -> nn.Sequential:
    """The same network (a deep copy, same weights) with skips carried as tuples."""
    model = copy.deepcopy(model)
    stashed_at = {(s.ns, s.name): s.index for s in iter_stashes(model)}
    popped_at = {(s.ns, s.name): s.index for s in iter_pops(model)}
    order = sorted(stashed_at, key=stashed_at.__getitem__)

    def alive_after(i: int) -> list[Any]:
        return [k for k in order if stashed_at[k] <= i < popped_at[k]]

    return nn.Sequential(*(CarrySkips(layer, alive_after(i - 1), alive_after(i))
                           for i, layer in enumerate(model)))


# --------------------------------------------------------------------------- measurement


class SavedBytes:
    """Live and peak bytes saved for backward, counted per storage, across threads."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude  # storages of parameters
        self.lock = threading.Lock()
        self.live: dict[int, list[int]] = {}  # storage ptr -> [handles, nbytes]
        self.bytes = 0
        self.peak = 0

    def pack(self, tensor: Tensor) -> Any:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.exclude or storage.nbytes() == 0:
            return tensor
        handle = _Handle(tensor.detach())
        with self.lock:
            entry = self.live.setdefault(ptr, [0, storage.nbytes()])
            if entry[0] == 0:
                self.bytes += entry[1]
                self.peak = max(self.peak, self.bytes)
            entry[0] += 1
        weakref.finalize(handle, self._release, ptr)
        return handle

    def _release(self, ptr: int) -> None:
        with self.lock:
            entry = self.live[ptr]
            entry[0] -= 1
            if entry[0] == 0:
                self.bytes -= entry[1]
                del self.live[ptr]

    @staticmethod
    def unpack(packed: Any) -> Tensor:
        return packed.tensor if isinstance(packed, _Handle) else packed


class _Handle:
    """What the pack hook returns: it owns the saved tensor; its death frees the count."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


def count_saved_tensors(model: nn.Module, counter: SavedBytes) -> None:
    """Install ``counter``'s hooks inside the forward of every direct child of ``model``."""
    for layer in model.children():
        forward = layer.forward

        def hooked(*args: Any, _forward: Callable[..., Any] = forward, **kwargs: Any) -> Any:
            if is_checkpointing() or is_recomputing():
                return _forward(*args, **kwargs)
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                return _forward(*args, **kwargs)

        layer.forward = hooked  # instance attribute: nn.Module.__call__ picks it up


def _status_kib(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (Linux), in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> int:
    """Hand freed heap memory back, reset the peak-RSS mark; return the RSS in bytes.

    ``malloc_trim(0)`` returns the allocator's free pages to the kernel, so the RSS left is
    what is really in use; writing ``5`` to ``/proc/self/clear_refs`` resets the kernel's
    high-water mark (``VmHWM``, which ``ru_maxrss`` also reads) to it.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return _status_kib("VmRSS") * 1024


def build(variant: str, partitions: int, args: argparse.Namespace) -> Pipe:
    """The ``variant`` U-Net wrapped in a Pipe over ``partitions`` cpu partitions."""
    model = unet(args.base)
    if variant == "tuple":
        model = carry_through_every_layer(model)
    return Pipe(model, chunks=args.chunks, checkpoint=args.checkpoint,
                balance=BALANCES[partitions])


def train_step(pipe: Pipe, x: Tensor) -> None:
    """Zero grads, forward, ``sum().backward()``."""
    for p in pipe.parameters():
        p.grad = None
    pipe(x).sum().backward()


def sample_input(args: argparse.Namespace) -> Tensor:
    """A fixed random batch of images."""
    return torch.randn(args.batch, 3, args.size, args.size,
                       generator=torch.Generator().manual_seed(1))


def child(args: argparse.Namespace) -> None:
    """Measure one variant's memory in this fresh process; print one JSON line."""
    variant, partitions = args.child.split(":")
    pipe = build(variant, int(partitions), args)
    counter = SavedBytes({p.untyped_storage().data_ptr() for p in pipe.parameters()})
    count_saved_tensors(pipe, counter)
    x = sample_input(args)
    for _ in range(max(args.warmup, 1)):  # one-time allocations: kernels, thread pools
        train_step(pipe, x)
    counter.peak = counter.bytes
    growth = []
    for _ in range(args.memory_steps):
        base = reset_peak_rss()
        train_step(pipe, x)
        growth.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base)
    print(json.dumps({"saved_peak": counter.peak, "rss_peak": statistics.median(growth),
                      "rss_steps": growth}))


def measure_memory(variant: str, partitions: int, argv: list[str]) -> dict[str, int]:
    """Run :func:`child` in a subprocess."""
    out = subprocess.run([sys.executable, __file__, *argv, "--child", f"{variant}:{partitions}"],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- main


@dataclass
class Row:
    """One line of the table."""

    partitions: int
    direct_ms: float
    tuple_ms: float
    ratio: float
    cpu_ratio: float
    memory: dict[str, dict[str, int]]


def check_same(args: argparse.Namespace, partitions: int) -> None:
    """Both variants give the same outputs and gradients on the same batch."""
    direct, carried = build("direct", partitions, args), build("tuple", partitions, args)
    x = sample_input(args)
    outs = []
    for pipe in (direct, carried):
        out = pipe(x)
        out.sum().backward()
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0])
    for (name, a), b in zip(direct.named_parameters(), carried.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, msg=lambda m, n=name: f"{n}: {m}")


def describe_routes(partitions: int, args: argparse.Namespace) -> str:
    """``stash partition -> pop partition`` of every long skip."""
    layout = inspect_skip_layout(unet(args.base), BALANCES[partitions])
    return ", ".join(f"{s.stash_partition}->{s.pop_partition}" for s in layout)


def mib(n: float) -> str:
    """Bytes as MiB."""
    return f"{n / 2**20:8.1f}"


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, measure, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=32, help="image height and width")
    parser.add_argument("--base", type=int, default=16, help="channels at the top level")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--checkpoint", default="except_last",
                        choices=["always", "except_last", "never"])
    parser.add_argument("--partitions", type=int, nargs="+", default=[2, 3],
                        choices=sorted(BALANCES))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch.set_num_threads (intra-op threads; 0 leaves the default)")
    parser.add_argument("--memory-steps", type=int, default=5,
                        help="steps measured per memory subprocess (median reported)")
    parser.add_argument("--no-memory", action="store_true", help="skip the subprocesses")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    raw = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(raw)
    pin_malloc()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        child(args)
        return
    passthrough = [a for a in raw if a != "--no-memory"]

    rows = []
    for partitions in args.partitions:
        check_same(args, partitions)
        x = sample_input(args)
        pipes = {v: build(v, partitions, args) for v in ("direct", "tuple")}
        samples = interleave({v: (lambda p=p, x=x: train_step(p, x)) for v, p in pipes.items()},
                             rounds=args.rounds, warmup=args.warmup)
        memory = {} if args.no_memory else {
            v: measure_memory(v, partitions, passthrough) for v in ("direct", "tuple")}
        rows.append(Row(partitions, samples["direct"].median * 1e3,
                        samples["tuple"].median * 1e3,
                        paired_ratio(samples["tuple"], samples["direct"]),
                        paired_ratio(samples["tuple"], samples["direct"], cpu=True), memory))
        del pipes

    print(f"U-Net depth {DEPTH}, {args.size}x{args.size} images, batch {args.batch}, "
          f"base channels {args.base}, chunks {args.chunks}, checkpoint={args.checkpoint!r}, "
          f"{args.rounds} interleaved rounds after {args.warmup} warm-up")
    print(machine([torch.get_num_threads()]))
    header = (f"{'parts':>5} {'balance':>10} {'skip routes':>24} {'direct ms':>10} "
              f"{'tuple ms':>9} {'t/d wall':>9} {'t/d cpu':>8}")
    if not args.no_memory:
        header += (f" {'saved MiB d/t':>19} {'RSS MiB d/t':>19}")
    print(header)
    for row in rows:
        line = (f"{row.partitions:>5} {str(BALANCES[row.partitions]):>10} "
                f"{describe_routes(row.partitions, args):>24} {row.direct_ms:10.1f} "
                f"{row.tuple_ms:9.1f} {row.ratio:9.3f} {row.cpu_ratio:8.3f}")
        if row.memory:
            d, t = row.memory["direct"], row.memory["tuple"]
            line += (f" {mib(d['saved_peak'])} /{mib(t['saved_peak'])}"
                     f" {mib(d['rss_peak'])} /{mib(t['rss_peak'])}")
        print(line)


if __name__ == "__main__":
    main()
