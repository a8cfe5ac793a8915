"""``seqpipe.to_sequential``'s opaque units: what checking their outputs costs at each call.

After every call of an opaque unit the converted model checks its outputs against what the
conversion learned (``seqpipe/graph/opaque_check.py``: each tensor output's sizes, dtype
and device, each non-tensor output's value). Two measures:

* ``check_outputs`` alone, per call, in thread CPU time (median of 15 runs of 20000
  calls): one ``(3, 16)`` tensor output, the same and an ``int``, three tensor outputs;
* a tiny Llama (4 layers, hidden 64, batch 4 x 32 tokens) converted twice, its decoder
  layers traced, and opaque (``opaque=[LlamaDecoderLayer]``): the same modules run eagerly
  either way, so the difference is the opaque path (the check); a no-grad forward and a
  training step, interleaved (``_common.interleave``), median paired ratio, wall and
  process CPU time.

    PYTHONPATH=$PWD python benchmarks/opaque_check.py [--rounds 41]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Dict, List

import torch
import torch.nn.functional as F
from _common import interleave, machine, paired_ratio, pin_malloc

from seqpipe.graph import to_sequential
from seqpipe.graph.opaque_check import check_outputs


def check_alone(calls: int = 20000, runs: int = 15) -> Dict[str, float]:
    """Microseconds per ``check_outputs`` call, median of ``runs``, for three plans."""
    h, mask = torch.randn(3, 16), torch.ones(3, 1)
    out = torch.randn(3, 16)
    one = ((0, ((0, 0), 16), torch.float32),)
    cases: Dict[str, Any] = {
        "1 tensor": ([out], (one, (), 0)),
        "1 tensor + int": ([out, 0], (one, ((1, 0),), 0)),
        "3 tensors": ([out] * 3, (tuple((i, ((0, 0), 16), torch.float32) for i in range(3)),
                                  (), 0)),
    }
    found = {}
    for name, (flat, plan) in cases.items():
        times: List[float] = []
        for _ in range(runs):
            start = time.thread_time()
            for _ in range(calls):
                check_outputs(flat, [h, mask], plan, "unit")
            times.append((time.thread_time() - start) / calls * 1e6)
        found[name] = statistics.median(times)
    return found


def llama_steps() -> Dict[str, Callable[[], None]]:
    """A no-grad forward and a training step of the tiny Llama, traced and opaque."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.utils import logging
    logging.set_verbosity_error()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    ids = torch.randint(256, (4, 32))
    kwargs = {"attention_mask": torch.ones_like(ids), "use_cache": False}
    traced = to_sequential(model, (ids,), kwargs)
    opaque = to_sequential(model, (ids,), kwargs, opaque=[LlamaDecoderLayer])
    assert sum(layer.opaque for layer in opaque) == 4 and not any(u.opaque for u in traced)

    def forward(seq: torch.nn.Module) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                seq(ids, **kwargs)
        return run

    def step(seq: torch.nn.Module) -> Callable[[], None]:
        def run() -> None:
            model.zero_grad(set_to_none=True)
            logits = seq(ids, **kwargs).logits
            F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        return run

    return {"forward traced": forward(traced), "forward opaque": forward(opaque),
            "step traced": step(traced), "step opaque": step(opaque)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    args = parser.parse_args()
    pin_malloc()
    torch.set_num_threads(1)
    print(machine([1]))
    for name, us in check_alone().items():
        print(f"check_outputs alone, {name}: {us:.2f} us per call")
    variants = llama_steps()
    samples = interleave(variants, rounds=args.rounds, warmup=3)
    for kind in ("forward", "step"):
        a, b = samples[f"{kind} opaque"], samples[f"{kind} traced"]
        print(f"Llama {kind}, opaque / traced layers: wall {paired_ratio(a, b):.3f}, cpu "
              f"{paired_ratio(a, b, cpu=True):.3f} (traced: "
              f"{statistics.median(b.cpu) * 1e3:.2f} ms cpu)")
    print(machine([1]))


if __name__ == "__main__":
    main()
