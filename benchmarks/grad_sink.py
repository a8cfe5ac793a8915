"""Cost of ``GradSink``'s parameter substitution: a training step with and without it.

In a local ``Pipe`` training call, every partition runs under the sink's
``TorchFunctionMode``, which hands autograd each parameter's alias (see
``seqpipe/core/sink.py``): one Python call per torch operation of the forward. This script
times the same model's training step plainly and under ``GradSink.call`` (backward into
the aliases, sums handed to ``.grad``), interleaved, so the difference is the sink alone
(no threads, no micro-batches).

Two models: ``mlp``, ``benchmarks/overhead.py``'s (8 × (Linear(1024) + ReLU), batch 128:
few, large operations) and ``transformer``, four ``TransformerEncoderLayer(64, 4, 128)``
on an 8 × 32 × 64 batch (many small operations: the worst case for a per-operation cost).

Target: none of its own (``overhead.py`` holds the ≤ 2 % target for ``Pipe`` as a
whole); the figures are quoted in docs/pipe.md. Run:
``PYTHONPATH=. python benchmarks/grad_sink.py --model mlp`` (or ``--model transformer``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from typing import List, Optional, Tuple

import torch
from _common import clone, interleave, make_model, paired_ratio, paired_ratios, pin_malloc
from torch import Tensor, nn

from seqpipe.core.sink import GradSink


def model_and_batch(name: str) -> Tuple[nn.Module, Tensor]:
    if name == "mlp":
        return make_model(1024, 8), torch.randn(128, 1024)
    torch.manual_seed(0)
    layers = [nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
              for _ in range(4)]
    return nn.Sequential(*layers), torch.randn(8, 32, 64)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    pin_malloc()
    torch.set_num_threads(1)
    model, x = model_and_batch(args.model)
    plain, sunk = clone(model), clone(model)

    def plain_step() -> None:
        for p in plain.parameters():
            p.grad = None
        plain(x).sum().backward()

    def sink_step() -> None:
        sink = GradSink([sunk])
        out = sink.call(0, sunk, x)
        torch.autograd.backward([out.sum()], inputs=sink.leaves(0))
        for param, grad in sink.take():
            param.grad = grad

    samples = interleave({"plain": plain_step, "sink": sink_step}, rounds=args.rounds,
                         warmup=args.warmup)
    cpu = paired_ratio(samples["sink"], samples["plain"], cpu=True)
    wall = statistics.median(paired_ratios(samples["sink"], samples["plain"]))
    print(f"# {args.model}, {args.rounds} interleaved rounds, one intra-op thread")
    for name, s in samples.items():
        print(f"{name:<6} median {s.median * 1e3:8.2f} ms  "
              f"cpu {statistics.median(s.cpu) * 1e3:8.2f} ms")
    print(f"sink / plain: CPU time {cpu:.4f}, wall {wall:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
