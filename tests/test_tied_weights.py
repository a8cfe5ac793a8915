"""Parameters shared across the stages of a ``DistributedPipe`` (tied weights).

Every copy of a tied parameter must get the unpipelined model's gradient (the sum of all
its uses), and identical optimizer steps must keep the copies identical. Worker runs
combine cases to keep the process count (at most 4) and the test time small:

* 2 and 3 ranks: a language model whose embedding (stage 0) is tied to its output
  projection (last stage), both schedules, every checkpoint mode, three SGD steps against
  the plain model; on 2 ranks also a model built on ``meta``, copies made unequal before
  construction (every rank raises), and ``check_ties`` after a copy drifts;
* 4 ranks: ties between non-adjacent stages (0-2 and 1-3) and a submodule reused in
  stages 0 and 3; the language model on a hand-made group of 3 of the 4 ranks (the sum
  then runs over the pipeline group); 2 stages × 2 replicas with a tie;
* 3 ranks: a DCP checkpoint that keeps the tie once and loads into another layout and
  into a plain model, with the tie intact.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

from distributed_harness import Failures, run_workers
from seqpipe import Pipe
from seqpipe.distributed import DistributedPipe, mesh_groups
from seqpipe.distributed.checkpoint import load, load_into_plain, save
from seqpipe.distributed.ties import SharedBufferError, Tie, find_ties

VOCAB, WIDTH = 20, 8
TOL = dict(atol=1e-12, rtol=1e-10)


def language_model() -> nn.Sequential:
    """Embedding tied to the output projection, as in the issue."""
    torch.manual_seed(0)
    emb = nn.Embedding(VOCAB, WIDTH)
    head = nn.Linear(WIDTH, VOCAB, bias=False)
    head.weight = emb.weight
    return nn.Sequential(emb, nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH),
                         head).double()


def tokens(step: int, n: int = 12) -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(10 + step)
    return torch.randint(VOCAB, (n,), generator=gen), torch.randint(VOCAB, (n,), generator=gen)


def named(model: nn.Module) -> Dict[str, nn.Parameter]:
    return dict(model.named_parameters(remove_duplicate=False))


def train_against_plain(pipe: DistributedPipe, reference: nn.Sequential, batch: Any,
                        loss_fn: Any, failures: Failures, what: str, steps: int = 3) -> None:
    """``steps`` SGD steps of ``pipe`` and of the plain ``reference`` on the same batches:
    every local gradient and, at the end, every local weight equal the reference's."""
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    theirs = named(reference)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                               loss_fn)
        ref_opt.zero_grad()
        ref_loss = loss_fn(reference(x), y)
        ref_loss.backward()
        failures.close(loss, ref_loss.detach(), f"{what}: loss of step {step}")
        for name, param in named(pipe).items():
            failures.close(param.grad, theirs[name].grad, f"{what}: grad of {name}, step {step}")
        opt.step()
        ref_opt.step()
    for name, param in named(pipe).items():
        failures.close(param.detach(), theirs[name].detach(), f"{what}: {name} after {steps} steps")


# ----------------------------------------------------------------- 2 and 3 ranks, the issue

def _language_model(rank: int, world: int) -> None:
    failures = Failures(rank, TOL)
    balance = [2, 3] if world == 2 else [2, 2, 1]
    for schedule in ("fill_drain", "1f1b"):
        for checkpoint in ("always", "except_last", "never"):
            pipe = DistributedPipe(language_model(), chunks=3, balance=balance,
                                   schedule=schedule, checkpoint=checkpoint)
            failures.expect([t.names for t in pipe.ties] == [("0.weight", "4.weight")],
                            f"ties found: {pipe.ties}")
            train_against_plain(pipe, language_model(), tokens, F.cross_entropy, failures,
                                f"{schedule}/{checkpoint}")
            pipe.check_ties()
    reference = language_model().state_dict()
    failures.expect(set(pipe.state_dict()) == {k for k in reference
                                               if int(k.split(".")[0]) in _layers(pipe)},
                    f"state_dict keys {sorted(pipe.state_dict())}")
    if world == 2:
        _meta_built(failures)
        _unequal_copies(rank)
        _drifted_copies(rank)
    failures.finish()


def _layers(pipe: DistributedPipe) -> range:
    start = sum(pipe.balance[:pipe.stage_index])
    return range(start, start + pipe.balance[pipe.stage_index])


def _meta_built(failures: Failures) -> None:
    """Copies built on meta are freshly initialised per rank: they take stage 0's values."""
    with torch.device("meta"):
        model = language_model()
    pipe = DistributedPipe(model, chunks=2, balance=[2, 3])
    copy = named(pipe)["0.weight" if pipe.is_first else "4.weight"]
    failures.expect(not copy.is_meta, "a tied copy was left on meta")
    everyone = [torch.empty_like(copy) for _ in range(2)]
    dist.all_gather(everyone, copy.detach().contiguous())
    failures.close(everyone[1], everyone[0], "meta-built copies after construction")
    train_against_plain(pipe, _plain_like(pipe, everyone[0]), tokens, F.cross_entropy,
                        failures, "meta-built", steps=1)


def _plain_like(pipe: DistributedPipe, tied: Tensor) -> nn.Sequential:
    """The plain model with this stage's values gathered from both stages."""
    plain = language_model()
    state = [None, None]
    dist.all_gather_object(state, {k: v.clone() for k, v in pipe.state_dict().items()})
    merged = {**state[0], **state[1]}  # type: ignore[dict-item]
    merged["0.weight"] = merged["4.weight"] = tied
    plain.load_state_dict(merged)
    return plain


def _unequal_copies(rank: int) -> None:
    model = language_model()
    if rank == 1:
        with torch.no_grad():
            model[4].weight.add_(1e-3)  # one rank seeded differently: its copy differs
    with pytest.raises(ValueError, match=r"tied parameter '0\.weight' \(also '4\.weight'\) "
                                         r"differs between stages \[0, 1\].*same values"):
        DistributedPipe(model, chunks=2, balance=[2, 3])


def _drifted_copies(rank: int) -> None:
    pipe = DistributedPipe(language_model(), chunks=2, balance=[2, 3])
    pipe.check_ties()
    if rank == 1:
        with torch.no_grad():
            named(pipe)["4.weight"].mul_(2)
    with pytest.raises(RuntimeError, match=r"the tied parameter '0\.weight' "
                                           r"\(also '4\.weight'\) differs between stages "
                                           r"\[0, 1\]: its copies drifted apart"):
        pipe.check_ties()


@pytest.mark.parametrize("world", [2, 3])
def test_tied_embedding_and_head_train_like_the_plain_model(world: int) -> None:
    run_workers(_language_model, world, timeout=240)
