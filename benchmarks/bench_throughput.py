"""pytest-benchmark form of ``throughput.py``: two cpu partitions, chunks 2/4/8.

``pytest benchmarks/bench_throughput.py --benchmark-only``. One benchmark per
(thread setting, variant): ``plain``, ``seqpipe/cN`` and, when installed, ``torchgpipe/cN``,
grouped by thread setting so pytest-benchmark's relative column compares them.
Samples/s is in each benchmark's ``extra_info``. pytest-benchmark runs variants one after
the other, not interleaved; ``throughput.py`` is the careful measurement (interleaved,
quiet-round filtering, best-of-regime comparison) and the one the docs quote.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List

import pytest
import torch
from throughput import DEFAULT_THREADS, Config, build_variants, impls

CHUNKS = (2, 4, 8)
CHECKPOINT = "except_last"  # both libraries' default
CFG = Config()
ROUNDS = 5
WARMUP = 1

VARIANTS: List[str] = ["plain"] + [f"{impl}/c{c}" for impl in impls() for c in CHUNKS]
THREADS = sorted({1, DEFAULT_THREADS})


@pytest.fixture(scope="module")
def variants() -> Dict[str, Callable[[], None]]:
    return build_variants(CFG, CHUNKS, CHECKPOINT)


@pytest.fixture(params=THREADS, ids=lambda t: f"threads{t}")
def threads(request: Any) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("variant", VARIANTS)
def test_train_step(benchmark: Any, variants: Dict[str, Callable[[], None]], threads: int,
                    variant: str) -> None:
    benchmark.group = (f"throughput: threads={threads}, {CFG.depth} x Linear({CFG.width}), "
                       f"batch {CFG.batch}, checkpoint={CHECKPOINT}")
    benchmark.pedantic(variants[variant], rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    benchmark.extra_info["samples_per_s"] = CFG.batch / benchmark.stats.stats.median
