"""``DistributedPipe`` across gloo processes gives what the unpipelined model gives.

Every worker builds the whole model twice from the same seed: once wrapped in a
``DistributedPipe`` (one stage per rank), once as a plain single-process reference, and
compares the loss (on every rank) and every local parameter's gradient by name. Models are
float64 so micro-batching changes nothing beyond rounding.

Spawning a process group costs seconds, so each test runs one group and loops over its
configurations inside it. Checks never raise between two collective operations (a rank
that raised early would leave the others waiting): mismatches are collected, gathered on
every rank at the end of the worker, and raised together, naming rank and configuration.
Failure injection (exceptions, dead ranks) lives in ``test_distributed_failures.py``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from distributed_harness import Failures, run_workers
from seqpipe.distributed import DistributedPipe
from seqpipe.distributed.transport import Kind, Transport
from seqpipe.schedule import B, OneFOneB, ScheduleError
from seqpipe.schedule import F as Fwd
from seqpipe.skip import pop, skippable, stash

CLOCKS = ("fill_drain", "1f1b")
MODES = ("always", "except_last", "never")
DTYPE = torch.float64


# --------------------------------------------------------------------------- helpers


def own_keys(pipe: DistributedPipe) -> List[str]:
    """The original Sequential indices of this rank's layers."""
    start = sum(pipe.balance[:pipe.stage_index])
    return [str(i) for i in range(start, start + pipe.balance[pipe.stage_index])]


def data(seed: int, batch: int, features: int, classes: Optional[int] = None,
         out: int = 4) -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, features, generator=gen, dtype=DTYPE)
    if classes is not None:
        return x, torch.randint(classes, (batch,), generator=gen)
    return x, torch.randn(batch, out, generator=gen, dtype=DTYPE)


def step(pipe: DistributedPipe, rank: int, world: int, x: Any, y: Any,
         loss_fn: Callable[[Any, Any], Tensor]) -> Tensor:
    """``train_step`` with the input only on the first rank and the target only on the last."""
    return pipe.train_step(x if rank == 0 else None, y if rank == world - 1 else None, loss_fn)


def reference(build: Callable[[], nn.Sequential], seed: int, x: Any, y: Any,
              loss_fn: Callable[[Any, Any], Tensor]) -> Tuple[nn.Sequential, Tensor]:
    torch.manual_seed(seed)
    ref = build()
    loss = loss_fn(ref(x), y)
    loss.backward()
    return ref, loss.detach()


def pipe_of(build: Callable[[], nn.Sequential], seed: int, **kwargs: Any) -> DistributedPipe:
    torch.manual_seed(seed)
    return DistributedPipe(build(), **kwargs)


def mlp() -> nn.Sequential:
    """Seven layers, an in-place ReLU at the head of the second of three stages."""
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.ReLU(inplace=True),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 12),
                         nn.Linear(12, 4)).to(DTYPE)


def dropout_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 16),
                         nn.Dropout(0.3), nn.Linear(16, 4)).to(DTYPE)


class ForwardOrderDrain:
    """Fill-drain, but every stage runs its backwards in forward order (B0, B1, ...)."""

    def actions(self, stage: int, num_stages: int, num_microbatches: int) -> list:
        m = num_microbatches
        return [Fwd(i) for i in range(m)] + [B(i) for i in range(m)]


class EagerOneFOneB:
    """1F1B with one extra warm-up forward per stage (more in flight, same result)."""

    def actions(self, stage: int, num_stages: int, num_microbatches: int) -> list:
        m = num_microbatches
        warmup = min(num_stages - stage, m)
        order = [Fwd(i) for i in range(warmup)]
        for j in range(m - warmup):
            order += [Fwd(warmup + j), B(j)]
        return order + [B(j) for j in range(m - warmup, m)]


class Deadlocking:
    """Stage 0 runs B0 before F1, stage 1 runs F1 before B0: a cycle."""

    def actions(self, stage: int, num_stages: int, num_microbatches: int) -> list:
        m = num_microbatches
        if stage == 0:
            return [a for i in range(m) for a in (Fwd(i), B(i))]
        return [Fwd(i) for i in range(m)] + [B(i) for i in range(m)]


def _match_reference(rank: int, world: int, balance: List[int], loss_fn: Callable,
                     classes: Optional[int], failures: Failures) -> None:
    """Built-in clocks in every checkpoint mode, and user schedule objects."""
    configs: List[Tuple[int, int, str, Any, str]] = [
        (8, 4, clock, clock, mode) for clock in CLOCKS for mode in MODES]
    configs += [(8, 4, type(s).__name__, s, "except_last")
                for s in (OneFOneB(), ForwardOrderDrain(), EagerOneFOneB())]
    configs += [(9, 3, "fill_drain", "fill_drain", "always"), (9, 3, "1f1b", "1f1b", "never"),
                (2, 4, "1f1b", "1f1b", "always")]  # only 2 micro-batches
    refs: Dict[int, Tuple[Any, Any, nn.Sequential, Tensor]] = {}
    for batch, chunks, label, schedule, mode in configs:
        if batch not in refs:
            x, y = data(10 + batch, batch, 8, classes)
            refs[batch] = (x, y, *reference(mlp, 1, x, y, loss_fn))
        x, y, ref, ref_loss = refs[batch]
        what = f"{label}/{mode}/batch {batch}/chunks {chunks}"
        pipe = pipe_of(mlp, 1, chunks=chunks, balance=balance, schedule=schedule,
                       checkpoint=mode)
        loss = step(pipe, rank, world, x, y, loss_fn)
        failures.close(loss, ref_loss, f"{what}: loss")
        failures.grads(pipe, ref, what, own_keys(pipe))


def _dropout(rank: int, world: int, balance: List[int], failures: Failures) -> None:
    """Checkpointing replays each micro-batch's dropout mask: same grads as no checkpoint."""
    x, y = data(3, 8, 8)
    for clock in CLOCKS:
        grads: Dict[Tuple[str, int], Dict[str, Tensor]] = {}
        losses: Dict[Tuple[str, int], Tensor] = {}
        for mode, rng in (("never", 7), ("always", 7), ("except_last", 7), ("never", 8)):
            pipe = pipe_of(dropout_mlp, 2, chunks=4, balance=balance, schedule=clock,
                           checkpoint=mode)
            torch.manual_seed(rng)
            losses[mode, rng] = step(pipe, rank, world, x, y, F.mse_loss)
            grads[mode, rng] = {n: p.grad.clone() for n, p in pipe.named_parameters()}
        for mode in ("always", "except_last"):
            failures.close(losses[mode, 7], losses["never", 7], f"dropout {clock}/{mode}: loss")
            for name, grad in grads["never", 7].items():
                failures.close(grads[mode, 7][name], grad, f"dropout {clock}/{mode}: {name}")
        failures.expect(not torch.equal(losses["never", 7], losses["never", 8]),
                        f"dropout {clock}: another seed gave the same loss (dropout inactive?)")


def two_stages(rank: int, world: int) -> None:
    failures = Failures(rank)
    _match_reference(rank, world, [3, 4], F.mse_loss, None, failures)
    _dropout(rank, world, [3, 3], failures)
    failures.finish()


def three_stages(rank: int, world: int) -> None:
    failures = Failures(rank)
    _match_reference(rank, world, [2, 2, 3], F.cross_entropy, 4, failures)
    _dropout(rank, world, [2, 2, 2], failures)
    failures.finish()


def test_two_stages_match_single_process() -> None:
    """Both clocks, a built-in and two user schedule objects, every checkpoint mode."""
    run_workers(two_stages, 2, timeout=180, pg_timeout=60)


def test_three_stages_match_single_process() -> None:
    run_workers(three_stages, 3, timeout=180, pg_timeout=60)


# --------------------------------------------------------------------------- skips


@skippable(stash=["s"])
class StashS(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Any:
        h = self.lin(x)
        yield stash("s", h)
        return torch.tanh(h)


@skippable(pop=["s"])
class PopS(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Any:
        s = yield pop("s")
        return self.lin(x) * torch.sigmoid(s)


@skippable(stash=["ids"])
class Embed(nn.Module):
    """Stashes the integer token ids it embeds."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)

    def forward(self, ids: Tensor) -> Any:
        yield stash("ids", ids)
        return self.emb(ids).sum(1)


@skippable(pop=["ids"])
class MaskByIds(nn.Module):
    """Weights its input by a learned per-token score of the popped ids."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Embedding(10, 6)

    def forward(self, x: Tensor) -> Any:
        ids = yield pop("ids")
        return x * self.score(ids).mean(1)


def skip_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 6), StashS(), nn.Linear(6, 6), nn.Tanh(), PopS(),
                         nn.Linear(6, 3)).to(DTYPE)


def token_model() -> nn.Sequential:
    return nn.Sequential(Embed(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), MaskByIds(),
                         nn.Linear(6, 3)).to(DTYPE)


def skips(rank: int, world: int) -> None:
    failures = Failures(rank)
    # (from stage, to stage, kind, grad flags, which tensors are present)
    sent: List[Tuple[int, int, Kind, Tuple[bool, ...], Tuple[bool, ...]]] = []
    original = Transport.send

    def recording(self: Transport, stage: int, kind: Kind, microbatch: int, tensors: Any,
                  flags: Any = None, **options: Any) -> None:
        sent.append((dist.get_rank(self.group), stage, kind, tuple(flags or ()),
                     tuple(t is not None for t in tensors)))
        original(self, stage, kind, microbatch, tensors, flags, **options)

    Transport.send = recording  # type: ignore[method-assign]
    try:
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(8, 6, generator=gen, dtype=DTYPE)
        ids = torch.randint(10, (8, 5), generator=gen)
        y = torch.randn(8, 3, generator=gen, dtype=DTYPE)
        for build, inp, name in ((skip_model, x, "float skip"), (token_model, ids, "id skip")):
            ref, ref_loss = reference(build, 3, inp, y, F.mse_loss)
            for clock in CLOCKS:
                for mode in ("always", "never"):
                    what = f"{name} {clock}/{mode}"
                    del sent[:]
                    pipe = pipe_of(build, 3, chunks=4, balance=[2, 2, 2], schedule=clock,
                                   checkpoint=mode)
                    loss = step(pipe, rank, world, inp, y, F.mse_loss)
                    failures.close(loss, ref_loss, f"{what}: loss")
                    failures.grads(pipe, ref, what, own_keys(pipe))
                    everyone: List[Any] = [None] * world
                    dist.all_gather_object(everyone, list(sent))
                    routes = [r for records in everyone for r in records]
                    skip_routes = {(s, d, k) for s, d, k, _, _ in routes
                                   if k in (Kind.SKIP, Kind.SKIP_GRAD)}
                    failures.expect(not {r for r in skip_routes if 1 in r[:2]},
                                    f"{what}: stage 1 sent or received a skip: {skip_routes}")
                    skip_sends = [r for r in routes if r[2] is Kind.SKIP]
                    failures.expect(len(skip_sends) == 4 and all(r[:2] == (0, 2)
                                                                for r in skip_sends),
                                    f"{what}: expected 4 SKIP messages 0 -> 2, got {skip_sends}")
                    grad_sends = [r for r in routes if r[2] is Kind.SKIP_GRAD]
                    if build is skip_model:
                        failures.expect(len(grad_sends) == 4 and all(r[:2] == (2, 0)
                                                                    for r in grad_sends),
                                        f"{what}: expected 4 SKIP_GRAD 2 -> 0, got {grad_sends}")
                    else:  # integer ids: no gradient wanted, none sent back
                        failures.expect(all(r[3] == (False,) for r in skip_sends),
                                        f"{what}: ids skip flagged as wanting a grad")
                        # The engine may acknowledge with a header-only message, but no
                        # gradient tensor travels back for integer ids.
                        failures.expect(all(r[:2] == (2, 0) and not any(r[4])
                                            for r in grad_sends),
                                        f"{what}: sent back {grad_sends}")
    finally:
        Transport.send = original  # type: ignore[method-assign]
    failures.finish()


def test_skip_goes_directly_from_stage_0_to_stage_2() -> None:
    """A float skip (with gradient) and an integer skip (without), routed 0 -> 2 directly."""
    run_workers(skips, 3, timeout=180, pg_timeout=60)


# --------------------------------------------------------------------------- training


def small() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4)).to(DTYPE)


def batch_sizes(rank: int, world: int) -> None:
    failures = Failures(rank)
    # Uneven micro-batches (10 in 4 -> 3, 3, 2, 2), then a batch size that changes between
    # steps of the same pipe: 10, 7, 3 (-> 3 micro-batches of 1).
    for clock in CLOCKS:
        torch.manual_seed(4)
        ref = small()
        pipe = pipe_of(small, 4, chunks=4, balance=[2, 3], schedule=clock)
        for n, batch in enumerate((10, 7, 3)):
            what = f"{clock} step {n} (batch {batch})"
            x, y = data(20 + n, batch, 8)
            pipe.zero_grad()
            ref.zero_grad()
            loss = step(pipe, rank, world, x, y, F.mse_loss)
            ref_loss = F.mse_loss(ref(x), y)
            ref_loss.backward()
            failures.close(loss, ref_loss.detach(), f"{what}: loss")
            failures.grads(pipe, ref, what, own_keys(pipe))
    # Five SGD steps (with momentum) over pipe.parameters() follow the reference's losses.
    torch.manual_seed(6)
    ref = small()
    pipe = pipe_of(small, 6, chunks=3, balance=[3, 2], schedule="1f1b")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x, y = data(30, 12, 8)
    for n in range(5):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = step(pipe, rank, world, x, y, F.mse_loss)
        ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward()
        opt.step()
        ref_opt.step()
        failures.close(loss, ref_loss.detach(), f"SGD step {n}: loss")
    theirs = dict(ref.named_parameters())
    for name, param in pipe.named_parameters():
        failures.close(param.detach(), theirs[name].detach(), f"after 5 SGD steps: {name}")
    failures.finish()


def test_uneven_and_changing_batch_sizes_and_sgd_trajectory() -> None:
    run_workers(batch_sizes, 2, timeout=180, pg_timeout=60)


# --------------------------------------------------------------------------- inference, state


def inference_and_state(rank: int, world: int) -> None:
    failures = Failures(rank)
    x, _ = data(40, 10, 8)
    torch.manual_seed(9)
    ref = small()
    with torch.no_grad():
        expected = ref(x)
    torch.manual_seed(9)
    model = small()
    layers = list(model)
    pipe = DistributedPipe(model, chunks=4, balance=[2, 3])
    keys = own_keys(pipe)
    for name, layer in zip(map(str, range(len(layers))), layers):
        if name in keys:  # this rank's layers are the model's own objects, on cpu
            failures.expect(pipe.get_submodule(name) is layer, f"layer {name} was replaced")
        failures.expect(all(p.is_meta != (name in keys) for p in layer.parameters()),
                        f"layer {name}: meta {[p.is_meta for p in layer.parameters()]}")
    out = pipe(x if rank == 0 else None)
    if rank == world - 1:
        failures.close(out, expected, "forward output on the last stage")
    else:
        failures.expect(out is None, f"forward returned {type(out).__name__} off the last stage")
    failures.expect(all(p.grad is None for p in pipe.parameters()), "forward() made grads")

    # state_dict: exactly the reference's keys for this rank's layers; together, all of them.
    ref_state = ref.state_dict()
    state = pipe.state_dict()
    mine = sorted(k for k in ref_state if k.split(".")[0] in keys)
    failures.expect(sorted(state) == mine, f"state_dict keys {sorted(state)} != {mine}")
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, {k: v.clone() for k, v in state.items()})
    union: Dict[str, Tensor] = {}
    for part in everyone:
        union.update(part)
    failures.expect(sorted(union) == sorted(ref_state),
                    f"union of state_dicts {sorted(union)} != {sorted(ref_state)}")
    for k, v in ref_state.items():
        failures.close(union.get(k), v, f"union state_dict[{k}]")
    # Every rank's state dict, loaded into a differently initialised plain model, gives the
    # pipe's output.
    torch.manual_seed(123)
    plain = small()
    for part in everyone:
        plain.load_state_dict(part, strict=False)
    with torch.no_grad():
        failures.close(plain(x), expected, "plain model loaded from the ranks' state dicts")
    # And back: the plain model's keys for this rank load strictly into the pipe.
    torch.manual_seed(321)
    other = small()
    with torch.no_grad():
        other_out = other(x)
    try:
        pipe.load_state_dict({k: v for k, v in other.state_dict().items() if k in mine})
    except RuntimeError as exc:
        failures.expect(False, f"load_state_dict of the plain model's slice: {exc}")
    out = pipe(x if rank == 0 else None)
    if rank == world - 1:
        failures.close(out, other_out, "pipe output after loading another model's weights")
    failures.finish()


def test_inference_and_state_dict() -> None:
    run_workers(inference_and_state, 2, timeout=180, pg_timeout=60)


# --------------------------------------------------------------------------- meta, BatchNorm


def bn_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.BatchNorm1d(16),
                         nn.Tanh(), nn.Linear(16, 4)).to(DTYPE)


def meta_and_batchnorm(rank: int, world: int) -> None:
    failures = Failures(rank)
    # A model built on the meta device: this rank's layers get real, initialised storage.
    with torch.device("meta"):
        model = small()
    pipe = DistributedPipe(model, chunks=2, balance=[2, 3])
    tensors = [*pipe.parameters(), *pipe.buffers()]
    failures.expect(bool(tensors), "no parameters on this stage")
    failures.expect(all(t.device.type == "cpu" for t in tensors),
                    f"devices {[t.device for t in tensors]}")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05)
    x, y = data(50, 6, 8)
    for n in range(2):
        opt.zero_grad()
        loss = step(pipe, rank, world, x, y, F.mse_loss)
        failures.expect(bool(torch.isfinite(loss)), f"meta model step {n}: loss {loss}")
        for name, param in pipe.named_parameters():
            failures.expect(param.grad is not None and bool(torch.isfinite(param.grad).all()),
                            f"meta model step {n}: grad of {name}")
        opt.step()

    # Deferred BatchNorm on stage 1: running stats after each step as a plain BatchNorm's on
    # the whole batch (10 samples in micro-batches of 3, 3, 2, 2), checkpointed or not.
    for clock in CLOCKS:
        for mode in ("always", "never"):
            torch.manual_seed(11)
            ref = bn_model()
            pipe = pipe_of(bn_model, 11, chunks=4, balance=[2, 4], schedule=clock,
                           checkpoint=mode, deferred_batch_norm=True)
            for n in range(2):
                x, y = data(60 + n, 10, 8)
                step(pipe, rank, world, x, y, F.mse_loss)
                with torch.no_grad():
                    ref(x)
                if rank == 1:
                    bn, ref_bn = pipe.get_submodule("3"), ref[3]
                    what = f"deferred BN {clock}/{mode} step {n}"
                    failures.close(bn.running_mean, ref_bn.running_mean, f"{what}: mean")
                    failures.close(bn.running_var, ref_bn.running_var, f"{what}: var")
                    failures.expect(int(bn.num_batches_tracked) == n + 1,
                                    f"{what}: num_batches_tracked {int(bn.num_batches_tracked)}")
    failures.finish()


def test_meta_model_and_deferred_batch_norm() -> None:
    run_workers(meta_and_batchnorm, 2, timeout=180, pg_timeout=60)


# --------------------------------------------------------------------------- construction


def _raises(failures: Failures, kind: type, texts: Sequence[str], what: str,
            make: Callable[[], Any]) -> None:
    """Like ``pytest.raises``, but records a miss instead of leaving the other ranks waiting."""
    try:
        make()
    except Exception as caught:  # noqa: BLE001 - the type is checked below
        exc = caught
    else:
        failures.expect(False, f"{what}: nothing raised")
        return
    failures.expect(isinstance(exc, kind), f"{what}: {type(exc).__name__}: {exc}")
    for text in texts:
        failures.expect(text in str(exc), f"{what}: {text!r} not in {str(exc)!r}")


def construction_errors(rank: int, world: int) -> None:
    failures = Failures(rank)
    _raises(failures, ValueError, ["3 entries", "2 ranks"], "balance too long",
            lambda: DistributedPipe(mlp(), 2, balance=[2, 2, 3]))
    _raises(failures, ValueError, ["1 entries", "2 ranks"], "balance too short",
            lambda: DistributedPipe(mlp(), 2, balance=[7]))
    _raises(failures, ValueError, ["sums to 6", "7 layers"], "balance sum",
            lambda: DistributedPipe(mlp(), 2, balance=[3, 3]))
    _raises(failures, ValueError, ["'zigzag'", "'fill_drain'", "'1f1b'"], "unknown schedule",
            lambda: DistributedPipe(mlp(), 2, balance=[3, 4], schedule="zigzag"))
    _raises(failures, TypeError, ["nn.Sequential"], "non-Sequential",
            lambda: DistributedPipe(nn.ModuleList([nn.Linear(2, 2)]), 2))  # type: ignore
    _raises(failures, ScheduleError, ["deadlock"], "deadlocking schedule",
            lambda: DistributedPipe(mlp(), 2, balance=[3, 4], schedule=Deadlocking()))
    _raises(failures, ValueError, ["2 entries", "4 stages", "2 ranks"],
            "balance with one entry per rank under a two-stages-per-rank schedule",
            lambda: DistributedPipe(mlp(), 2, balance=[3, 4], schedule="zbv"))

    # Ranks that disagree raise on every rank (after one all_gather) and name the odd ones.
    def differing() -> DistributedPipe:
        hidden = 32 if rank == 1 else 16
        model = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 4))
        return DistributedPipe(model, 2, balance=[2, 1])

    _raises(failures, ValueError, ["stages [1]"], "model differs on rank 1", differing)
    _raises(failures, ValueError, ["stages [1]"], "chunks differ on rank 1",
            lambda: DistributedPipe(mlp(), 2 + rank, balance=[3, 4]))
    # The group is still usable afterwards.
    x, y = data(70, 4, 8)
    ref, ref_loss = reference(mlp, 12, x, y, F.mse_loss)
    pipe = pipe_of(mlp, 12, chunks=2, balance=[3, 4])
    failures.close(step(pipe, rank, world, x, y, F.mse_loss), ref_loss, "step after errors")
    failures.finish()


def test_construction_errors() -> None:
    run_workers(construction_errors, 2, timeout=180, pg_timeout=60)
