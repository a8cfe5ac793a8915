"""Training runs of many steps on ``DistributedPipe``, 2 stages x 2 replicas, as a user runs them.

Session 14's hunt (docs/distributed.md, "A training loop"), each case compared after
every step with the plain model trained the same way on the global batch (float64, gloo,
one launch of 4 processes):

* **A tie whose copies drift apart** (bug: silent; now an error at the next step,
  ``seqpipe/distributed/tie_grads.py``): parameter groups built from
  ``pipe.named_parameters()`` names ("no weight decay on the embedding") put the copy of a
  tied weight on the last stage, which is named after its own layer there, in the other
  group: the copies took different optimizer steps and the model silently stopped being the
  tied one (every later loss off). The ranks now compare a few elements of every tie's
  copies in the step's existing all-gather and raise, naming the mend; with the mend (each
  name mapped to its tie's first one) the run is the plain model's.
* **A copy of the pipe** (``copy.deepcopy``, ``AveragedModel`` for an EMA) failed with
  ``cannot pickle 'ProcessGroup'``; refused now by name, with the EMA recipe it names,
  which is checked against ``AveragedModel`` of the plain model.
* **Already as in the plain model** (kept as guards): with dropout, a validation pass in
  ``eval()`` between steps changes nothing, and a run stopped and resumed through
  ``seqpipe.distributed.checkpoint`` (with the scheduler and each rank's RNG state) goes on
  bit for bit; a tied token model with a token mean (``count_fn``) whose replicas count
  different numbers of tokens in batches of different sizes, two ``train_step``s
  accumulated per optimizer step, ``clip_grad_norm_`` and AdamW with a warm-up, stopped
  and resumed in another layout (balance, ``chunks``, schedule).
"""
from __future__ import annotations

import copy
import io
import os
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from distributed_harness import Failures, run_workers

TOL = dict(atol=1e-12, rtol=1e-10)


def tied() -> nn.Sequential:
    """A token model whose output head is its embedding (both on the pipe's two stages)."""
    torch.manual_seed(0)
    embed = nn.Embedding(11, 8)
    head = nn.Linear(8, 11, bias=False)
    head.weight = embed.weight
    return nn.Sequential(embed, nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         head).double()


def dropped() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 8),
                         nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 6)).double()


def tokens(step: int, replica: int, n: int = 4) -> Tuple[Tensor, Tensor]:
    """``n`` sequences of 5 tokens and their labels; replica 1 pads (``-100``) far more."""
    gen = torch.Generator().manual_seed(1000 * step + replica)
    ids = torch.randint(11, (n, 5), generator=gen)
    labels = torch.randint(11, (n, 5), generator=gen)
    labels[torch.rand(n, 5, generator=gen) < 0.2 + 0.5 * replica] = -100
    return ids, labels


def token_sum(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                           reduction="sum")


def counted(labels: Tensor) -> int:
    return int((labels != -100).sum())


def features(step: int, replica: int) -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(100 * step + replica)
    return (torch.randn(8, 6, generator=gen, dtype=torch.float64),
            torch.randn(8, 6, generator=gen, dtype=torch.float64))


class Run:
    """This rank's place in the 2 x 2 mesh, and what every case needs."""

    def __init__(self, rank: int, root: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from seqpipe.distributed import mesh_groups
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        self.pp, self.dp = mesh_groups(mesh)
        self.replica = dist.get_rank(self.dp)
        self.root = root
        self.failures = Failures(rank, TOL)

    def pipe(self, model: nn.Sequential, **kwargs: Any) -> Any:
        from seqpipe.distributed import DistributedPipe
        kwargs.setdefault("balance", [3, 3] if len(model) == 6 else [3, 4])
        kwargs.setdefault("chunks", 4)
        return DistributedPipe(model, group=self.pp, data_parallel_group=self.dp, **kwargs)

    def step(self, pipe: Any, x: Tensor, y: Tensor, loss_fn: Any = F.mse_loss,
             **kwargs: Any) -> Tensor:
        return pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                               loss_fn, **kwargs)

    def same_params(self, pipe: nn.Module, plain: nn.Module, what: str) -> None:
        theirs = dict(plain.named_parameters(remove_duplicate=False))
        for name, param in pipe.named_parameters():
            self.failures.close(param.detach(), theirs[name].detach(), f"{what}: {name}")


def warmup(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))


# -- a tie's copies stepped differently ----------------------------------------------------
def groups_by_name(named: List[Tuple[str, nn.Parameter]], names: Dict[str, str]
                   ) -> List[Dict[str, Any]]:
    """No weight decay on the embedding (layer 0), chosen by name, as recipes do;
    ``names`` maps a tied copy's name to the one the rule reads."""
    embedding = [p for n, p in named if names.get(n, n).startswith("0.")]
    rest = [p for n, p in named if not names.get(n, n).startswith("0.")]
    return [{"params": rest, "weight_decay": 0.5}, {"params": embedding, "weight_decay": 0.0}]


def _tie_grouped_by_name(run: Run) -> None:
    plain = tied()
    pipe = run.pipe(tied())
    opt = torch.optim.AdamW(groups_by_name(list(pipe.named_parameters()), {}), lr=0.05)
    ids, labels = tokens(0, run.replica)
    for step in range(2):
        opt.zero_grad()
        try:
            run.step(pipe, ids, labels, token_sum, count_fn=counted)
        except RuntimeError as error:
            run.failures.expect(step == 1 and "drifted apart" in str(error)
                                and "first.get(name, name)" in str(error),
                                f"step {step}: {error}")
            break
        opt.step()
    else:
        run.failures.expect(False, "the copies of '0.weight' drifted apart silently")
    # the mend the error names: a copy's name mapped to its tie's first one
    pipe = run.pipe(tied())
    first = {name: tie.name for tie in pipe.ties for name in tie.names}
    opts = [torch.optim.AdamW(groups_by_name(list(net.named_parameters()), names), lr=0.05)
            for net, names in ((plain, {}), (pipe, first))]
    for step in range(3):
        for opt in opts:
            opt.zero_grad()
        both = [tokens(step, r) for r in range(2)]
        expected = sum(token_sum(plain(i), t) for i, t in both) / sum(counted(t) for _, t in both)
        expected.backward()
        run.step(pipe, *both[run.replica], token_sum, count_fn=counted)
        norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        run.failures.close(pipe.clip_grad_norm_(0.5), norm, f"grouped by first name: norm {step}")
        for opt in opts:
            opt.step()
        run.same_params(pipe, plain, f"grouped by first name, step {step}")
    pipe.check_ties()


# -- a copy of the pipe, and an EMA ----------------------------------------------------------
def _not_copied_and_an_ema(run: Run) -> None:
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    plain, pipe = dropped().eval(), run.pipe(dropped().eval())
    for copier in (copy.deepcopy, AveragedModel, lambda p: torch.save(p, io.BytesIO())):
        try:
            copier(pipe)
            run.failures.expect(False, "a DistributedPipe was copied")
        except TypeError as error:
            run.failures.expect("cannot be copied or pickled" in str(error)
                                and "lerp_" in str(error), f"copy: {error}")
    decay = 0.9
    averaged = AveragedModel(plain, multi_avg_fn=get_ema_multi_avg_fn(decay))
    ema: Dict[str, Tensor] = {}
    opts = [torch.optim.SGD(net.parameters(), lr=0.1) for net in (plain, pipe)]
    for step in range(3):
        both = [features(step, r) for r in range(2)]
        for opt in opts:
            opt.zero_grad()
        F.mse_loss(plain(torch.cat([x for x, _ in both])), torch.cat([y for _, y in both])
                   ).backward()
        run.step(pipe, *both[run.replica])
        for opt in opts:
            opt.step()
        averaged.update_parameters(plain)  # (its first update copies the weights)
        with torch.no_grad():
            started = bool(ema)
            for k, p in pipe.named_parameters():
                ema[k] = ema[k].lerp_(p, 1 - decay) if started else p.detach().clone()
    theirs = dict(averaged.module.named_parameters())
    for k, value in ema.items():
        run.failures.close(value, theirs[k], f"the EMA of {k}")


# -- stopped and resumed ---------------------------------------------------------------------
def _dropout_run(run: Run, stop: Optional[int], validate: bool) -> List[Tensor]:
    """Dropout, AdamW + warm-up; with ``stop``, everything saved there (DCP for the pipe
    and optimizer, the scheduler and this rank's RNG state besides) and loaded into a
    fresh pipe, optimizer and scheduler; with ``validate``, ``eval()`` + ``no_grad``
    passes between the steps."""
    from seqpipe.distributed.checkpoint import load, save
    pipe = run.pipe(dropped())
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01, weight_decay=0.1)
    sched = warmup(opt)
    torch.manual_seed(7 + dist.get_rank())
    losses = []
    for step in range(5):
        if step == stop:
            path = os.path.join(run.root, "dropout")
            save(pipe, opt, path)
            kept = {"sched": sched.state_dict(), "rng": torch.get_rng_state()}
            pipe = run.pipe(dropped())
            opt = torch.optim.AdamW(pipe.parameters(), lr=0.5)
            sched = warmup(opt)
            torch.manual_seed(123)  # a new process
            load(pipe, opt, path)
            sched.load_state_dict(kept["sched"])
            torch.set_rng_state(kept["rng"])
        opt.zero_grad()
        losses.append(run.step(pipe, *features(step, run.replica)))
        opt.step()
        sched.step()
        if validate:
            pipe.eval()
            with torch.no_grad():
                pipe(features(50 + step, run.replica)[0] if pipe.is_first else None)
            pipe.train()
    return losses + [p.detach() for p in pipe.parameters()]


def _dropout_resumed(run: Run) -> None:
    straight = _dropout_run(run, stop=None, validate=False)
    for n, (a, b) in enumerate(zip(_dropout_run(run, stop=3, validate=True), straight)):
        run.failures.expect(torch.equal(a, b), f"dropout, validated and resumed: value {n}")


def _tokens_resumed_elsewhere(run: Run) -> None:
    from seqpipe.distributed.checkpoint import load, save
    plain, pipe = tied(), run.pipe(tied())
    plain_opt, opt = (torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)
                      for net in (plain, pipe))
    plain_sched, sched = warmup(plain_opt), warmup(opt)
    sizes = [[4, 6, 2], [3, 4, 6]]  # per replica: batches of different sizes
    for step in range(5):
        if step == 3:
            path = os.path.join(run.root, "tokens")
            save(pipe, opt, path)
            kept = sched.state_dict()
            pipe = run.pipe(tied(), balance=[2, 4], chunks=2, schedule="zb_h1")
            opt = torch.optim.AdamW(pipe.parameters(), lr=0.5)
            sched = warmup(opt)
            load(pipe, opt, path)
            sched.load_state_dict(kept)
        # two train_steps per optimizer step, each weighted by the replica's count of both
        parts = [[tokens(2 * step + a, r, sizes[r][(step + a) % 3]) for a in range(2)]
                 for r in range(2)]
        total = sum(counted(t) for r in range(2) for _, t in parts[r])
        plain_opt.zero_grad()
        opt.zero_grad()
        (sum(token_sum(plain(i), t) for r in range(2) for i, t in parts[r]) / total).backward()
        mine = sum(counted(t) for _, t in parts[run.replica])
        for ids, labels in parts[run.replica]:
            run.step(pipe, ids, labels, token_sum, count_fn=lambda _, mine=mine: mine)
        norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        run.failures.close(pipe.clip_grad_norm_(0.5), norm, f"tokens: norm {step}")
        for o, s in ((plain_opt, plain_sched), (opt, sched)):
            o.step()
            s.step()
        run.same_params(pipe, plain, f"tokens, step {step}")


def _worker(rank: int, world: int, root: str) -> None:
    run = Run(rank, root)
    _tie_grouped_by_name(run)
    _not_copied_and_an_ema(run)
    _dropout_resumed(run)
    _tokens_resumed_elsewhere(run)
    run.failures.finish()


def test_training_runs_on_two_stages_by_two_replicas() -> None:
    """A tie stepped differently by parameter groups chosen by name raises at the next
    step (it drifted silently); a copy of the pipe is refused by name and the EMA recipe it
    gives is ``AveragedModel``'s; dropout runs validated in between and resumed go on bit
    for bit; a tied token model resumed in another layout is the plain model's."""
    with tempfile.TemporaryDirectory() as root:
        run_workers(_worker, 4, root, timeout=240, pg_timeout=90)
