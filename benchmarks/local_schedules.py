"""``Pipe.train_step`` under each schedule: saved activations of the first partition, step time.

Model: ``K`` partitions (2 and 4) × ``depth`` (Linear(width) + ReLU) on ``cpu``, batch cut
into ``M = 8`` micro-batches, ``checkpoint="never"`` (so every micro-batch's activations are
kept until its backward, which is what a schedule changes). Per schedule:

Under ``interleaved_1f1b`` and ``zbv`` (two stages per rank) the same layers are cut into
``2K`` partitions run on ``K`` threads, and the figures are those of rank 0's thread
(partitions 0 and 2, or 0 and ``2K - 1``), which holds the same layers as partition 0
elsewhere.

* ``saved``: the peak bytes of saved activations alive on partition 0 during one step.
  Measured with ``torch.autograd.graph.saved_tensors_hooks``, which ``Pipe`` carries into
  its stage threads: each saved tensor's bytes are counted (a tensor saved by two nodes,
  say a ReLU's output kept by the ReLU and the next Linear, counts once) from when
  autograd saves it until autograd frees it, on the partition whose thread saved it;
  tensors that view a parameter's storage are left out. Exact, no
  sampling, independent of the machine's load.
* ``micro-batches``: ``saved`` over the bytes one micro-batch saves on partition 0 (from
  the same count), i.e. how many micro-batches' activations were alive at once. Theory:
  ``M`` under fill-drain, ``K`` under 1F1B.
* ``step``: the median wall time of a training step without the hooks (``--rounds``
  steps per schedule, interleaved round-robin after a warm-up), and its ratio to
  fill-drain's in the same rounds. On a loaded machine the times move; the ratios less so.

Run: ``PYTHONPATH=. python benchmarks/local_schedules.py`` (``--help`` for sizes).
"""
from __future__ import annotations

import argparse
import statistics
import threading
import weakref
from typing import Callable, Dict, List, Tuple

import torch
from _common import interleave, machine, make_model, paired_ratio
from torch import Tensor, nn

from seqpipe import Pipe

SCHEDULES = ("fill_drain", "1f1b", "zb_h1", "zb_h2", "interleaved_1f1b", "zbv")
STAGES_PER_RANK = {"interleaved_1f1b": 2, "zbv": 2}  # the others: 1
MiB = float(1 << 20)


def _stage_of_thread() -> int:
    name = threading.current_thread().name  # stage 0 runs on the caller's thread
    return int(name.rsplit("-", 1)[1]) if name.startswith("seqpipe-stage-") else 0


class SavedBytes:
    """Saved-tensor hooks counting, per partition, the bytes of storages autograd holds."""

    def __init__(self, pipe: Pipe, k: int) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in pipe.parameters()}
        self.lock = threading.Lock()
        self.refs: List[Dict[int, Tuple[int, int]]] = [{} for _ in range(k)]  # ptr: n, bytes
        self.live = [0] * k
        self.peak = [0] * k
        self.total = [0] * k  # bytes ever saved, per partition

    def pack(self, tensor: Tensor) -> object:
        ptr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        s = _stage_of_thread()
        token = _Token(tensor)  # lives as long as autograd keeps the tensor saved
        if tensor.untyped_storage().data_ptr() in self.params:
            return token
        with self.lock:
            count, _ = self.refs[s].get(ptr, (0, size))
            if count == 0:
                self.live[s] += size
                self.total[s] += size
                self.peak[s] = max(self.peak[s], self.live[s])
            self.refs[s][ptr] = (count + 1, size)
        weakref.finalize(token, self._release, s, ptr)
        return token

    def _release(self, s: int, ptr: int) -> None:
        with self.lock:
            count, size = self.refs[s][ptr]
            if count == 1:
                del self.refs[s][ptr]
                self.live[s] -= size
            else:
                self.refs[s][ptr] = (count - 1, size)

    @staticmethod
    def unpack(token: "_Token") -> Tensor:
        return token.tensor


class _Token:
    """Stands for one saved tensor in autograd's graph.

    It keeps the tensor detached: a tensor that is its own node's output (a ReLU's)
    refers to that node, which refers to the token, a reference cycle that would keep
    the graph alive past its backward until a garbage collection (where a backward
    leaves nodes it did not run, as a split ``W`` does).
    """

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor.detach()


def build(k: int, schedule: str, width: int, depth: int, chunks: int) -> Pipe:
    """``k`` ranks of ``depth`` Linear+ReLU each: ``k`` partitions, or ``k * V`` under a
    schedule with ``V`` stages per rank (the same layers per rank)."""
    stages = k * STAGES_PER_RANK.get(schedule, 1)
    model = make_model(width, k * depth)
    return Pipe(model, chunks=chunks, checkpoint="never",
                balance=[2 * depth * k // stages] * stages, devices=["cpu"] * stages)


def measure_saved(k: int, schedule: str, args: argparse.Namespace) -> Tuple[float, float]:
    """Peak saved bytes of partition 0 in one step, and that in micro-batches."""
    pipe = build(k, schedule, args.width, args.depth, args.chunks)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    pipe.train_step(x, y, nn.functional.mse_loss, schedule=schedule)  # warm-up
    counter = SavedBytes(pipe, len(pipe.partitions))  # threads: named after a partition
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        pipe.train_step(x, y, nn.functional.mse_loss, schedule=schedule)
    per_microbatch = counter.total[0] / args.chunks
    return counter.peak[0], counter.peak[0] / per_microbatch


def step_times(k: int, args: argparse.Namespace) -> Dict[str, Tuple[float, float]]:
    """Per schedule: median step seconds, and its paired ratio to fill-drain's."""
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    pipes = {s: build(k, s, args.width, args.depth, args.chunks) for s in SCHEDULES}

    def step(schedule: str) -> Callable[[], None]:
        def run() -> None:
            pipe = pipes[schedule]
            pipe.zero_grad(set_to_none=True)
            pipe.train_step(x, y, nn.functional.mse_loss, schedule=schedule)
        return run

    samples = interleave({s: step(s) for s in SCHEDULES}, rounds=args.rounds, warmup=2)
    return {s: (statistics.median(samples[s].wall),
                paired_ratio(samples[s], samples["fill_drain"])) for s in SCHEDULES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4, help="Linear+ReLU pairs per partition")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--partitions", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    print(machine([torch.get_num_threads()]))
    print(f"width {args.width}, {args.depth} Linear+ReLU per partition, batch {args.batch}, "
          f"M = {args.chunks}, checkpoint='never'")
    for k in args.partitions:
        times = step_times(k, args)
        print(f"\nK = {k}")
        print(f"{'schedule':<17} {'saved MiB':>10} {'micro-batches':>14} {'step ms':>9} "
              f"{'vs fill_drain':>14}")
        for schedule in SCHEDULES:
            saved, microbatches = measure_saved(k, schedule, args)
            median, ratio = times[schedule]
            print(f"{schedule:<17} {saved / MiB:>10.2f} {microbatches:>14.2f} "
                  f"{median * 1e3:>9.1f} {ratio:>13.2f}x")


if __name__ == "__main__":
    main()
