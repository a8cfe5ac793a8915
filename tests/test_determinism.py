"""Determinism: same seed, data and layout give bit-identical training; other layouts round.

What is asserted is what seqpipe guarantees:

* two runs of the same layout (same seed, same data) give bit-identical loss histories
  and gradients: the local ``Pipe`` (2 CPU partitions, 4 micro-batches, Dropout,
  checkpoint ``"always"``) and ``DistributedPipe`` (2 ranks: ``fill_drain``, ``1f1b``,
  ``zb_h1``, and ``interleaved_1f1b`` with 4 stages); at torch's default thread count
  and with tied weights, ``tests/test_local_reproducible.py``;
* other layouts (chunks, balance, clock, checkpoint mode) and the unpipelined model agree
  to float32 rounding: relative differences of gradients and of the loss over 10 SGD
  steps below ``1e-5``.

The tests also print a table of the differences measured (``pytest -s``, or run this file
as a script); ``docs/checkpointing.md`` ("Numerics") discusses it.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from distributed_harness import run_workers
from seqpipe import Pipe
from seqpipe.distributed import DistributedPipe

STEPS = 10
RERUN_STEPS = 5
LR = 0.05
REL_TOL = 1e-5  # float32: cross-layout differences must stay at rounding level
CLOCKS = ("fill_drain", "1f1b")
RERUN_CLOCKS = {"fill_drain": [2, 3], "1f1b": [2, 3], "zb_h1": [2, 3],  # balance each runs
                "interleaved_1f1b": [1, 1, 1, 2]}

Grads = Dict[str, Tensor]
Run = Tuple[Tensor, Grads, Grads]  # loss history, first-step gradients, final parameters


def smooth() -> nn.Sequential:
    """Five float32 layers, no randomness: layouts can only differ by rounding."""
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 16))


def with_dropout() -> nn.Sequential:
    return nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.3), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 16))


def with_batchnorm() -> nn.Sequential:
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 16))


def batch(step: int) -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(32, 32, generator=gen), torch.randn(32, 16, generator=gen)


# --------------------------------------------------------------------------- local


def train_local(build: Callable[[], nn.Sequential], steps: int,
                wrap: Optional[Callable[[nn.Sequential], nn.Module]] = None,
                seed: int = 3) -> Run:
    """SGD on ``build()`` (wrapped by ``wrap``, e.g. in a Pipe); fixed seeds and data."""
    torch.manual_seed(seed)
    model: nn.Module = build()
    if wrap is not None:
        model = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    torch.manual_seed(seed + 1)  # the stream dropout draws from
    losses, first = [], {}
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if step == 0:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), first, {n: p.detach().clone() for n, p in model.named_parameters()}


def pipe(balance: Sequence[int], chunks: int, checkpoint: str = "except_last"
         ) -> Callable[[nn.Sequential], nn.Module]:
    return lambda m: Pipe(m, chunks, checkpoint, balance=list(balance),
                          devices=["cpu"] * len(balance))


def test_pipe_reruns_are_bit_identical() -> None:
    """Pipe, 2 CPU partitions, 4 micro-batches, Dropout, checkpoint "always": twice."""
    wrap = pipe([2, 3], 4, "always")
    (losses1, grads1, params1), (losses2, grads2, params2) = (
        train_local(with_dropout, RERUN_STEPS, wrap) for _ in range(2))
    assert torch.equal(losses1, losses2), (losses1, losses2)
    for name, grad in grads1.items():
        assert torch.equal(grad, grads2[name]), name
        assert torch.equal(params1[name], params2[name]), name
    other = train_local(with_dropout, RERUN_STEPS, wrap, seed=4)[0]
    assert not torch.equal(other, losses1), "another seed gave the same losses"


# --------------------------------------------------------------------------- comparing


def compare(a: Run, b: Run) -> Dict[str, Any]:
    """Largest absolute and relative differences: first-step gradients, losses, parameters."""
    (la, ga, pa), (lb, gb, pb) = a, b
    assert ga.keys() == gb.keys() == pa.keys() == pb.keys()
    g_abs = max(float((ga[n] - gb[n]).abs().max()) for n in ga)
    g_rel = max(float((ga[n] - gb[n]).abs().max() / gb[n].abs().max().clamp_min(1e-30))
                for n in ga)
    l_abs = float((la - lb).abs().max())
    l_rel = float(((la - lb).abs() / lb.abs()).max())
    return {"grads_equal": all(torch.equal(ga[n], gb[n]) for n in ga), "grad_abs": g_abs,
            "grad_rel": g_rel, "losses_equal": torch.equal(la, lb), "loss_abs": l_abs,
            "loss_rel": l_rel, "params_equal": all(torch.equal(pa[n], pb[n]) for n in pa),
            "param_abs": max(float((pa[n] - pb[n]).abs().max()) for n in pa)}


def table(rows: List[Tuple[str, Dict[str, Any]]]) -> str:
    head = (f"{'comparison (float32, batch 32, 10 SGD steps)':<52} {'grads ==':>8} "
            f"{'grad abs':>9} {'grad rel':>9} {'losses ==':>9} {'loss abs':>9} {'loss rel':>9} "
            f"{'params ==':>9} {'param abs':>9}")
    lines = [head, "-" * len(head)]
    for label, r in rows:
        lines.append(f"{label:<52} {str(r['grads_equal']):>8} {r['grad_abs']:9.1e} "
                     f"{r['grad_rel']:9.1e} {str(r['losses_equal']):>9} {r['loss_abs']:9.1e} "
                     f"{r['loss_rel']:9.1e} {str(r['params_equal']):>9} {r['param_abs']:9.1e}")
    return "\n".join(lines)


def local_rows() -> List[Tuple[str, Dict[str, Any]]]:
    plain = train_local(smooth, STEPS)
    runs = {(tuple(b), c, mode): train_local(smooth, STEPS, pipe(b, c, mode))
            for b, c, mode in [([2, 3], 1, "never"), ([2, 3], 4, "never"), ([2, 3], 8, "never"),
                               ([4, 1], 4, "never"), ([2, 3], 4, "always")]}
    rows = [(f"Pipe [2,3] chunks {c} vs plain", compare(runs[(2, 3), c, "never"], plain))
            for c in (1, 4, 8)]
    rows += [("Pipe chunks 4 vs chunks 8", compare(runs[(2, 3), 4, "never"],
                                                   runs[(2, 3), 8, "never"])),
             ("Pipe chunks 4 [2,3] vs [4,1]", compare(runs[(2, 3), 4, "never"],
                                                      runs[(4, 1), 4, "never"])),
             ("Pipe chunks 4 checkpoint always vs never", compare(
                 runs[(2, 3), 4, "always"], runs[(2, 3), 4, "never"]))]
    return rows


def batchnorm_rows() -> List[Tuple[str, Dict[str, Any]]]:
    """Not rounding: BatchNorm normalises each micro-batch with its own statistics."""
    plain = train_local(with_batchnorm, STEPS)
    return [(f"BatchNorm model: Pipe chunks {c} vs plain",
             compare(train_local(with_batchnorm, STEPS, pipe([2, 3], c, "never")), plain))
            for c in (1, 4)]


def check_rounding_only(rows: List[Tuple[str, Dict[str, Any]]]) -> None:
    bad = [label for label, r in rows if not (r["grad_rel"] < REL_TOL and r["loss_rel"] < REL_TOL)]
    assert not bad, f"differences above {REL_TOL} relative:\n{table(rows)}"


def test_local_layouts_differ_only_by_rounding() -> None:
    rows = local_rows()
    print("\n" + table(rows + batchnorm_rows()))
    check_rounding_only(rows)


# --------------------------------------------------------------------------- distributed


def train_distributed(rank: int, world: int, build: Callable[[], nn.Sequential], steps: int,
                      seed: int = 3, **kwargs: Any) -> Run:
    """As ``train_local``, on a DistributedPipe; the first-step gradients of every stage."""
    torch.manual_seed(seed)
    stage = DistributedPipe(build(), **kwargs)
    opt = torch.optim.SGD(stage.parameters(), lr=LR)
    torch.manual_seed(seed + 1)
    losses, mine = [], {}
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = stage.train_step(x if rank == 0 else None, y if rank == world - 1 else None,
                                F.mse_loss)
        if step == 0:
            mine = {n: p.grad.clone() for n, p in stage.named_parameters()}
        opt.step()
        losses.append(loss.detach())
    params = {n: p.detach().clone() for n, p in stage.named_parameters()}
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, (mine, params))  # test code: pickled dicts are fine here
    return (torch.stack(losses), {k: v for part, _ in everyone for k, v in part.items()},
            {k: v for _, part in everyone for k, v in part.items()})


def distributed_worker(rank: int, world: int, out: str) -> None:
    results: Dict[Any, Any] = {}
    for clock, balance in RERUN_CLOCKS.items():
        results["rerun", clock] = [train_distributed(
            rank, world, with_dropout, RERUN_STEPS, chunks=4, balance=balance, schedule=clock,
            checkpoint="always") for _ in range(2)]
        results["other seed", clock] = train_distributed(
            rank, world, with_dropout, RERUN_STEPS, seed=4, chunks=4, balance=balance,
            schedule=clock, checkpoint="always")
    for clock in CLOCKS:
        for balance in ([2, 3], [4, 1]):
            for chunks in (4, 8):
                results[clock, tuple(balance), chunks] = train_distributed(
                    rank, world, smooth, STEPS, chunks=chunks, balance=balance,
                    schedule=clock, checkpoint="never")
    if rank == 0:
        torch.save(results, out)


def distributed_rows(results: Dict[Any, Any]) -> List[Tuple[str, Dict[str, Any]]]:
    plain = train_local(smooth, STEPS)
    fd, ob = "fill_drain", "1f1b"
    rows = [(f"DistributedPipe {clock} [2,3] chunks {c} vs plain",
             compare(results[clock, (2, 3), c], plain)) for clock in CLOCKS for c in (4, 8)]
    rows += [(f"DistributedPipe fill_drain vs 1f1b, {list(b)} chunks {c}",
              compare(results[fd, b, c], results[ob, b, c]))
             for b in ((2, 3), (4, 1)) for c in (4, 8)]
    rows += [(f"DistributedPipe {clock} chunks 4 [2,3] vs [4,1]",
              compare(results[clock, (2, 3), 4], results[clock, (4, 1), 4])) for clock in CLOCKS]
    local = train_local(smooth, STEPS, pipe([2, 3], 4, "never"))
    rows += [(f"DistributedPipe {clock} vs Pipe, [2,3] chunks 4",
              compare(results[clock, (2, 3), 4], local)) for clock in CLOCKS]
    return rows


def check_reruns(results: Dict[Any, Any]) -> None:
    for clock in RERUN_CLOCKS:
        (l1, g1, p1), (l2, g2, p2) = results["rerun", clock]
        assert torch.equal(l1, l2), f"{clock}: rerun losses differ: {l1} vs {l2}"
        assert g1.keys() == g2.keys()
        for name, grad in g1.items():
            assert torch.equal(grad, g2[name]), f"{clock}: rerun gradient of {name} differs"
            assert torch.equal(p1[name], p2[name]), f"{clock}: rerun parameter {name} differs"
        assert not torch.equal(results["other seed", clock][0], l1), "dropout inactive?"


def test_distributed_reruns_identical_and_layouts_round(tmp_path: Any) -> None:
    """2 ranks: reruns bit-identical for every clock; clocks/balances/chunks only round."""
    out = str(tmp_path / "results.pt")
    run_workers(distributed_worker, 2, out, timeout=150, pg_timeout=60)
    results = torch.load(out)
    check_reruns(results)
    rows = distributed_rows(results)
    print("\n" + table(rows))
    check_rounding_only(rows)


if __name__ == "__main__":  # python tests/test_determinism.py: print the whole table
    import tempfile

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "results.pt")
        run_workers(distributed_worker, 2, path, timeout=300, pg_timeout=120)
        print(table(local_rows() + batchnorm_rows() + distributed_rows(torch.load(path))))
