"""``seqpipe.to_sequential``: what the conversion costs, without any pipeline.

For each model, one training step (forward, loss, backward) of the converted
``nn.Sequential`` called as the model (``seq(*args, **kwargs)``: flatten the inputs, run
the layers, rebuild the output) against the same step of the eager model, interleaved
(``_common.interleave``), as the median of the per-round ratios of wall time and of process
CPU time (steadier on a shared machine); and the tracing time (``to_sequential`` from
start to end, one call, wall and process CPU time). Target (issue 23): <= 1.03x for units
of at least 1 ms. The models:

* ``gpt2-tiny``: the test config (n_layer 2, n_embd 32; units of ~0.1 ms: what tiny
  units cost; here the traced glue also builds GPT-2's attention mask, which the eager
  model skips when the mask has no padding: the trace cannot read the mask's values);
* ``gpt2``: Hugging Face GPT-2, n_layer 4, n_embd 256, 4 heads, batch 8 x 128 tokens;
* ``resnet``: the tests' ResNet at width 32 on 32x32 images, batch 32, train mode;

and, first, the cost of one layer itself: a loop over 8 ``Linear(8, 8)`` units, forward
under ``no_grad``, best of 5 runs of 3000 calls in process CPU time (what a unit adds:
the skip driver, the generated glue, the pytree plumbing around the call).

    PYTHONPATH=$PWD python benchmarks/graph_overhead.py [--rounds 21] [--models gpt2 resnet]
        [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from _common import interleave, load_average, machine, paired_ratio, pin_malloc  # noqa: E402
from graph_models import ResNet  # noqa: E402

from seqpipe.graph import to_sequential  # noqa: E402


def _gpt2(layers: int, width: int, heads: int, batch: int, length: int
          ) -> Tuple[nn.Module, Tuple[Any, ...], Dict[str, Any], Callable[[Any], Any]]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging
    logging.set_verbosity_error()
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=512,
                        n_positions=length, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(512, (batch, length))
    mask = torch.ones(batch, length, dtype=torch.long)
    return model, (ids,), {"attention_mask": mask, "use_cache": False}, \
        lambda out: F.cross_entropy(out.logits.flatten(0, 1), ids.flatten())


def build(name: str) -> Tuple[nn.Module, Tuple[Any, ...], Dict[str, Any], Callable[[Any], Any]]:
    torch.manual_seed(0)
    if name == "gpt2-tiny":
        return _gpt2(2, 32, 2, 8, 16)
    if name == "gpt2":
        return _gpt2(4, 256, 4, 8, 128)
    model = ResNet(width=32)
    x, y = torch.randn(32, 3, 32, 32), torch.randint(5, (32,))
    return model, (x,), {}, lambda out: F.cross_entropy(out, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--models", nargs="*", default=["gpt2-tiny", "gpt2", "resnet"])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared machine, several threads "
                             "per process spin against the load and drown the comparison)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pin_malloc()
    print(machine([args.threads]), flush=True)
    layer_overhead()
    for name in args.models:
        measure(name, args.rounds, args.warmup)
    print(f"load average at the end {load_average()}", flush=True)


class _Loop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def layer_overhead(calls: int = 3000) -> None:
    """Microseconds one converted layer adds to its unit (see the module doc)."""
    model, x = _Loop(), torch.randn(4, 8)
    seq = to_sequential(model, (x,))

    def best(fn: Callable[[], Any]) -> float:
        times = []
        for _ in range(5):
            start = time.process_time()
            for _ in range(calls):
                fn()
            times.append((time.process_time() - start) / calls)
        return min(times)

    with torch.no_grad():
        eager, converted = best(lambda: model(x)), best(lambda: seq(x))
    print(f"8 Linear(8, 8) units, forward: eager {eager * 1e6:.1f} us, converted "
          f"{converted * 1e6:.1f} us: {(converted - eager) / 8 * 1e6:.1f} us per layer",
          flush=True)


def measure(name: str, rounds: int, warmup: int) -> None:
    """Trace ``name`` once, then time eager and converted steps interleaved; print a row."""
    model, inputs, kwargs, loss_of = build(name)
    start, start_cpu = time.perf_counter(), time.process_time()
    seq = to_sequential(model, inputs, kwargs)
    traced, traced_cpu = time.perf_counter() - start, time.process_time() - start_cpu

    def eager() -> None:
        model.zero_grad(set_to_none=True)
        loss_of(model(*inputs, **kwargs)).backward()

    def converted() -> None:
        model.zero_grad(set_to_none=True)
        loss_of(seq(*inputs, **kwargs)).backward()

    samples = interleave({"eager": eager, "converted": converted}, rounds=rounds,
                         warmup=warmup)
    ratio = paired_ratio(samples["converted"], samples["eager"])
    cpu = paired_ratio(samples["converted"], samples["eager"], cpu=True)
    eager_ms = statistics.median(samples["eager"].wall) * 1e3
    print(f"{name:10s} units {len(seq):3d}  eager {eager_ms:8.2f} ms  converted "
          f"{statistics.median(samples['converted'].wall) * 1e3:8.2f} ms  "
          f"ratio wall {ratio:.3f} cpu {cpu:.3f}  ({eager_ms / len(seq):.2f} ms per unit)  "
          f"tracing {traced:.2f} s (CPU {traced_cpu:.2f} s)", flush=True)


if __name__ == "__main__":
    main()
