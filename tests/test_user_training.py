"""A user's training loop on ``DistributedPipe`` and ``Pipe``, against the plain model.

Session 12's hunt (docs/distributed.md, "A training loop"): what a user's loop does
around ``train_step``, each compared with the unpipelined model trained the same way, in
float64:

* **The caller's graph** (bugs fixed, ``seqpipe/core/caller_grads.py``): an input computed
  by a module outside the pipe (an embedding on the first rank) got no gradient from
  ``DistributedPipe.train_step`` (silently: ``Pipe.train_step`` gave it); a target computed
  by a module outside the pipe (a head on the last rank) failed on both engines with
  autograd's "Trying to backward through the graph a second time", since every
  micro-batch's backward ran through the caller's graph on its own. Also one tensor that is
  both input and target (under ``zbv`` both on rank 0).
* **A real optimizer loop** (already correct; kept as a guard): AdamW with weight decay, a
  learning-rate schedule, ``clip_grad_norm_``, ``zero_grad(set_to_none=False)``, part of
  the model frozen from the third step on, and batches of 8, 7, 3, 1 and 5 samples over 4
  micro-batches (ragged, smaller than ``chunks``, a single sample), under every built-in
  schedule on 2 ranks; then inference after training (``eval()``, ``no_grad``).
* **A converted BERT** with a padded attention mask under ``zb_h1``, three AdamW steps with
  clipping (already correct).
* **A model's own loss from padded ``labels=``** (converted T5 and Llama): the count recipe
  docs/models.md now gives is the plain model's token mean (``out[0]`` alone is not).
* **A micro-batch whose loss is a constant** (``loss_fn`` returning ``new_zeros(())`` for a
  micro-batch that counts nothing) failed the step with an autograd error on both engines
  (fixed, ``seqpipe/core/loss_weights.py``: ``joined``); now it adds nothing.
* **Dropout masks** with one seed: the same under another clock or checkpoint mode (what
  docs/checkpointing.md promises, now that it no longer says ``balance`` keeps them).

All ``DistributedPipe`` cases run in one launch of 2 ranks.
"""
from __future__ import annotations

import copy
from typing import Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distributed_harness import Failures, run_workers
from seqpipe import Pipe

SCHEDULES = ["fill_drain", "1f1b", "zb_h1", "interleaved_1f1b", "zbv", "dualpipev"]
TOL = dict(atol=1e-12, rtol=1e-10)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 6), nn.Identity()).double()


def batch(step: int, n: int) -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(step)
    return (torch.randn(n, 6, generator=gen, dtype=torch.float64),
            torch.randn(n, 6, generator=gen, dtype=torch.float64))


def twins(make: Callable[[], nn.Module]) -> Tuple[nn.Module, nn.Module]:
    """Two copies of one freshly made module: the plain model's and the pipe's."""
    one = make()
    return one, copy.deepcopy(one)


def outside() -> Tuple[nn.Module, nn.Module]:
    """A module outside the pipe (the plain run's and the pipe's): makes an input or a
    target of 6 features from 3."""
    torch.manual_seed(5)
    return twins(lambda: nn.Linear(3, 6).double())


def _grads_equal(mine: nn.Module, theirs: nn.Module, what: str,
                 expect: Callable[[Tensor, Tensor, str], None]) -> None:
    reference = dict(theirs.named_parameters())
    for name, param in mine.named_parameters():
        want = reference[name].grad
        if (param.grad is None) != (want is None):
            expect(torch.tensor(param.grad is None), torch.tensor(want is None),
                   f"{what}: {name}'s grad is None")
        elif want is not None:
            expect(param.grad, want, f"{what}: grad of {name}")


# -- the caller's graph, on the local Pipe ---------------------------------------------------
@pytest.mark.parametrize("schedule", ["fill_drain", "1f1b", "zb_h1"])
def test_a_target_from_the_callers_graph_gets_the_plain_gradient_on_pipe(schedule: str
                                                                         ) -> None:
    """A target made by a module outside the pipe (``head(z)``): every micro-batch's
    backward ran through the head's graph on its own and the second raised "Trying to
    backward through the graph a second time"; now the head's gradient is the plain
    model's. With the same tensor as input and target (``enc(raw)``: an autoencoder),
    the encoder gets both gradients."""
    def expect(a: Tensor, b: Tensor, what: str) -> None:
        torch.testing.assert_close(a, b, **TOL, msg=what)
    plain, model = twins(mlp)
    pipe = Pipe(model, chunks=4, balance=[4, 4], devices=["cpu", "cpu"])
    head, head2 = outside()
    x, _ = batch(0, 7)
    z = torch.randn(7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    expected = F.mse_loss(plain(x), head(z))
    expected.backward()
    loss = pipe.train_step(x, head2(z), F.mse_loss, schedule=schedule)
    expect(loss, expected.detach(), "loss")
    _grads_equal(head2, head, "the target's head", expect)
    _grads_equal(pipe, plain, "the pipe", expect)
    for net in (plain, pipe, head, head2):
        net.zero_grad()
    F.mse_loss(plain(head(z)), head(z)).backward()
    shared = head2(z)
    pipe.train_step(shared, shared, F.mse_loss, schedule=schedule)
    _grads_equal(head2, head, "an encoder making input and target", expect)
    _grads_equal(pipe, plain, "the pipe, input and target one tensor", expect)


# -- a micro-batch that counts nothing ----------------------------------------------------
def masked_sum(output: Tensor, target: Tensor) -> Tensor:
    """The squared error summed over the rows whose target is not masked (``-100`` in
    column 0), and a constant zero for a micro-batch with none: a common way to write it."""
    keep = target[:, 0] > -50
    if not keep.any():
        return output.new_zeros(())
    return ((output[keep] - target[keep]) ** 2).sum()


def masked_batch(step: int) -> Tuple[Tensor, Tensor]:
    """8 samples whose second quarter (micro-batch 1 of 4) is all masked."""
    x, y = batch(step, 8)
    y[2:4, 0] = -100
    return x, y


def masked_count(target: Tensor) -> int:
    """How many values ``masked_sum`` adds over in the whole batch (its ``count_fn``)."""
    return int((target[:, 0] > -50).sum()) * target.shape[1]


@pytest.mark.parametrize("schedule", ["fill_drain", "1f1b", "zb_h1"])
def test_a_micro_batch_whose_loss_is_a_constant_adds_nothing(schedule: str) -> None:
    """A ``loss_fn`` returning a constant for a micro-batch that counts nothing (the whole
    batch, which the plain model sees, counts something): the step failed with autograd's
    "It is not possible to get the gradient edge for a Tensor that does not require
    gradients"; now that micro-batch adds nothing, as in the plain model."""
    plain, model = twins(mlp)
    pipe = Pipe(model, chunks=4, balance=[4, 4], devices=["cpu", "cpu"])
    x, y = masked_batch(0)
    expected = masked_sum(plain(x), y) / masked_count(y)
    expected.backward()
    loss = pipe.train_step(x, y, masked_sum, schedule=schedule, count_fn=masked_count)
    torch.testing.assert_close(loss, expected.detach(), **TOL)
    _grads_equal(pipe, plain, schedule,
                 lambda a, b, what: torch.testing.assert_close(a, b, **TOL, msg=what))


# -- a loss that couples the samples -------------------------------------------------------
def info_nce(z: Tensor, keys: Tensor) -> Tensor:
    """Each sample's positive is its own key, the other samples' keys its negatives."""
    logits = F.normalize(z, dim=1) @ F.normalize(keys, dim=1).T / 0.1
    return F.cross_entropy(logits, torch.arange(len(z)))


def test_a_loss_coupling_the_samples_is_exact_on_the_whole_output() -> None:
    """A contrastive loss over in-batch negatives cannot be cut into micro-batch losses
    (``train_step`` trains another objective: docs/distributed.md, ``train_step``); the way
    docs name for ``Pipe``, the loss on ``pipe(x)``'s whole output, is the plain model's."""
    plain, model = twins(mlp)
    pipe = Pipe(model, chunks=4, balance=[4, 4], devices=["cpu", "cpu"])
    x, keys = batch(4, 8)
    info_nce(plain(x), keys).backward()
    info_nce(pipe(x), keys).backward()
    _grads_equal(pipe, plain, "in-batch negatives",
                 lambda a, b, what: torch.testing.assert_close(a, b, **TOL, msg=what))


# -- a model's own loss from padded labels ---------------------------------------------------
def padded_labels(name: str, size: int = 6) -> Tuple[tuple, dict, Tensor]:
    """``name``'s example with ``labels=`` padded with ``-100`` unevenly over the rows."""
    from graph_models import example
    args, kwargs, labels = example("t5-labels" if name == "t5" else name, batch=size)
    labels = labels.clone()
    labels[0, 3:] = -100
    labels[1, 1:] = -100
    labels[size - 2, 6:] = -100
    return args, {**kwargs, "labels": labels}, labels


def label_count(name: str) -> Callable[[Tensor], Tensor]:
    """The tokens Hugging Face's loss averages over: a causal LM predicts from the second
    label on (it shifts them), T5's decoder every label."""
    if name == "t5":
        return lambda labels: (labels != -100).sum()
    return lambda labels: (labels[:, 1:] != -100).sum()


@pytest.mark.parametrize("name", ["t5", "llama"])
def test_a_models_own_loss_from_padded_labels_trains_with_count_fn(name: str) -> None:
    """A converted model computing its own loss from ``labels=`` padded with ``-100``: its
    per-micro-batch token mean, weighted by samples (``loss_fn=lambda out, y: out[0]``,
    the recipe docs/models.md gave), is not the batch's token mean (gradients off by up to
    30 %); the mean times the micro-batch's count, with ``count_fn``, is the plain model's
    loss on the whole batch, exactly (docs/models.md, "A model's own loss from padded labels")."""
    from graph_models import build

    from seqpipe.graph import to_sequential
    args, kwargs, labels = padded_labels(name)
    plain, model = build(f"{name}-labels" if name == "t5" else name), \
        build(f"{name}-labels" if name == "t5" else name)
    expected = plain(*args, **kwargs).loss
    expected.backward()
    seq = to_sequential(model, args, kwargs)
    n = len(seq)
    pipe = Pipe(seq, chunks=4, balance=[n // 2, n - n // 2], devices=["cpu", "cpu"])
    count = label_count(name)
    loss = pipe.train_step(seq.origin.pipeline_input(*args, **kwargs), labels,
                           lambda out, y: out[0] * count(y), count_fn=count)
    torch.testing.assert_close(loss, expected.detach(), atol=1e-6, rtol=1e-6)
    theirs = dict(plain.named_parameters(remove_duplicate=False))
    for key, param in seq.named_parameters():
        torch.testing.assert_close(param.grad, theirs[seq.origin.original_key(key)].grad,
                                   **TOL, msg=key)


# -- DistributedPipe, one launch -------------------------------------------------------------
def _balance(schedule: str) -> List[int]:
    return [2, 2, 2, 2] if schedule in ("interleaved_1f1b", "zbv", "dualpipev") else [4, 4]


def _callers_graph(schedule: str, failures: Failures) -> None:
    """An input from an embedding outside the pipe (its gradient was dropped) and a target
    from a head outside it (the step failed), then one tensor as both (V-shaped schedules:
    on one rank)."""
    from seqpipe.distributed import DistributedPipe
    plain = mlp()
    pipe = DistributedPipe(mlp(), chunks=4, balance=_balance(schedule), schedule=schedule)
    torch.manual_seed(5)
    embed, embed2 = twins(lambda: nn.Embedding(10, 6).double())
    head, head2 = outside()
    ids = torch.randint(10, (7,), generator=torch.Generator().manual_seed(1))
    z = torch.randn(7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    x, y = batch(0, 7)
    for what, plain_in, plain_target, make_in, make_target in [
            ("the input's embedding", embed, None, embed2, None),
            ("the target's head", None, head, None, head2)]:
        for net in (plain, pipe):
            net.zero_grad()
        expected = F.mse_loss(plain(plain_in(ids) if plain_in else x),
                              plain_target(z) if plain_target else y)
        expected.backward()
        loss = pipe.train_step((make_in(ids) if make_in else x) if pipe.is_first else None,
                               (make_target(z) if make_target else y) if pipe.is_last
                               else None, F.mse_loss)
        failures.close(loss, expected.detach(), f"{schedule}, {what}: loss")
        failures.grads(pipe, plain, f"{schedule}, {what}: the pipe")
        if make_in is not None and pipe.is_first:
            _grads_equal(make_in, plain_in, f"{schedule}: {what}", failures.close)
        if make_target is not None and pipe.is_last:
            _grads_equal(make_target, plain_target, f"{schedule}: {what}", failures.close)
    if schedule in ("zbv", "dualpipev"):  # rank 0 holds the first and the last stage:
        for net in (plain, pipe, head, head2):  # one tensor as input and target there
            net.zero_grad()
        F.mse_loss(plain(head(z)), head(z)).backward()
        shared = head2(z)
        pipe.train_step(shared if pipe.is_first else None, shared if pipe.is_last else None,
                        F.mse_loss)
        failures.grads(pipe, plain, f"{schedule}: the pipe, input and target one tensor")
        if pipe.is_first:
            failures.expect(pipe.is_last, f"{schedule}: rank 0 holds the last stage too")
            _grads_equal(head2, head, f"{schedule}: input and target one tensor",
                         failures.close)


def _optimizer_loop(schedule: str, failures: Failures) -> None:
    """AdamW + weight decay + StepLR + clipping + ``zero_grad(set_to_none=False)``, two
    layers frozen from step 3 on, ragged batches, then inference in eval mode."""
    from seqpipe.distributed import DistributedPipe
    plain = mlp()
    pipe = DistributedPipe(mlp(), chunks=4, balance=_balance(schedule), schedule=schedule)
    optimizers = [torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)
                  for net in (plain, pipe)]
    lr = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in optimizers]
    # dualpipev needs as many micro-batches as stages (its error names that)
    sizes = [8, 7, 3, 1, 5] if schedule != "dualpipev" else [8, 7, 4, 5, 6]
    for step, n in enumerate(sizes):
        x, y = batch(step, n)
        for opt in optimizers:
            opt.zero_grad(set_to_none=False)
        expected = F.mse_loss(plain(x), y)
        expected.backward()
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                               F.mse_loss)
        failures.close(loss, expected.detach(), f"{schedule}: loss of step {step}")
        norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
        failures.close(pipe.clip_grad_norm_(0.05), norm.double(), f"{schedule}: norm {step}")
        failures.grads(pipe, plain, f"{schedule}: step {step}")
        for opt, sched in zip(optimizers, lr):
            opt.step()
            sched.step()
        if step == 2:  # frozen: their zero .grad stays, so AdamW still decays them
            for net in (plain, pipe):
                for name, param in net.named_parameters():
                    if name.split(".")[0] in ("2", "6"):
                        param.requires_grad_(False)
    reference = dict(plain.named_parameters())
    for name, param in pipe.named_parameters():
        failures.close(param.detach(), reference[name].detach(), f"{schedule}: {name}")
    plain.eval()
    pipe.eval()
    x, _ = batch(9, 7)
    with torch.no_grad():
        out = pipe(x if pipe.is_first else None)
        if pipe.is_last:
            failures.close(out, plain(x), f"{schedule}: eval output")


def _converted_bert(failures: Failures) -> None:
    """A converted BERT, left-padded attention mask, ``zb_h1``: three AdamW steps with
    clipping, ragged micro-batches (6, 5, 4 samples over 4)."""
    from graph_models import build, example, loss_of, model_loss

    from seqpipe.distributed import DistributedPipe
    from seqpipe.graph import to_sequential
    seq = to_sequential(build("bert"), *example("bert")[:2])
    n = len(seq)
    pipe = DistributedPipe(seq, chunks=4, balance=[n // 2, n - n // 2], schedule="zb_h1")
    params: Dict[str, nn.Parameter] = {seq.origin.original_key(k): p
                                       for k, p in pipe.named_parameters()}
    plain = build("bert")
    theirs = dict(plain.named_parameters())
    optimizers = [torch.optim.AdamW(list(params.values()), lr=0.01, weight_decay=0.1),
                  torch.optim.AdamW(plain.parameters(), lr=0.01, weight_decay=0.1)]
    for step, size in enumerate((6, 5, 4)):
        args, kwargs, target = example("bert", batch=size, step=step)
        for opt in optimizers:
            opt.zero_grad()
        given = seq.origin.pipeline_input(*args, **kwargs)
        loss = pipe.train_step(given if pipe.is_first else None,
                               target if pipe.is_last else None, loss_of("bert"))
        expected = model_loss("bert", plain(*args, **kwargs), target)
        expected.backward()
        failures.close(loss, expected.detach(), f"bert: loss of step {step}")
        norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        failures.close(pipe.clip_grad_norm_(1.0), norm.double(), f"bert: norm {step}")
        for key, param in params.items():
            failures.close(param.grad, theirs[key].grad, f"bert: grad of {key}, step {step}")
        for opt in optimizers:
            opt.step()
    for key, param in params.items():
        failures.close(param.detach(), theirs[key].detach(), f"bert: {key} after the steps")


def _llama_padded_labels(failures: Failures) -> None:
    """A converted Llama's own loss from ``labels=`` padded with ``-100``, under ``zb_h1``
    with the count recipe: the plain model's token mean over the whole batch."""
    from graph_models import build

    from seqpipe.distributed import DistributedPipe
    from seqpipe.graph import to_sequential
    args, kwargs, labels = padded_labels("llama")
    plain = build("llama")
    expected = plain(*args, **kwargs).loss
    expected.backward()
    seq = to_sequential(build("llama"), args, kwargs)
    n = len(seq)
    pipe = DistributedPipe(seq, chunks=4, balance=[n // 2, n - n // 2], schedule="zb_h1")
    count = label_count("llama")
    given = seq.origin.pipeline_input(*args, **kwargs)
    loss = pipe.train_step(given if pipe.is_first else None, labels if pipe.is_last else None,
                           lambda out, y: out[0] * count(y), count_fn=count)
    gap = (loss.double() - expected.detach().double()).abs().item()  # Hugging Face's loss
    failures.expect(gap < 1e-6, f"llama labels: loss {loss} != {expected}")  # is float32
    theirs = dict(plain.named_parameters(remove_duplicate=False))
    for key, param in pipe.named_parameters():
        failures.close(param.grad, theirs[seq.origin.original_key(key)].grad,
                       f"llama labels: grad of {key}")


def _dropout_masks(failures: Failures) -> None:
    """With Dropout and the same seed, the clock and the checkpoint mode draw the same
    masks (docs/checkpointing.md; ``balance`` and ``chunks`` do not, as it now says)."""
    from seqpipe.distributed import DistributedPipe

    def grads(schedule: str, checkpoint: str) -> Dict[str, Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 16),
                              nn.Dropout(0.5), nn.Linear(16, 16), nn.Dropout(0.5),
                              nn.Linear(16, 6), nn.Identity()).double()
        pipe = DistributedPipe(model, chunks=4, balance=[4, 4], schedule=schedule,
                               checkpoint=checkpoint)
        x, y = batch(3, 8)
        torch.manual_seed(123)
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                        F.mse_loss)
        return {name: param.grad for name, param in pipe.named_parameters()}

    first = grads("1f1b", "except_last")
    for schedule, checkpoint in [("1f1b", "never"), ("1f1b", "always"),
                                 ("fill_drain", "except_last"), ("zb_h1", "always")]:
        for name, grad in grads(schedule, checkpoint).items():
            failures.close(grad, first[name], f"dropout, {schedule}/{checkpoint}: {name}")


def _constant_loss(schedule: str, failures: Failures) -> None:
    """A micro-batch whose ``loss_fn`` returns a constant adds nothing (the step failed)."""
    from seqpipe.distributed import DistributedPipe
    plain = mlp()
    pipe = DistributedPipe(mlp(), chunks=4, balance=_balance(schedule), schedule=schedule)
    x, y = masked_batch(1)
    expected = masked_sum(plain(x), y) / masked_count(y)
    expected.backward()
    loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                           masked_sum, count_fn=masked_count)
    failures.close(loss, expected.detach(), f"{schedule}, a constant loss: loss")
    failures.grads(pipe, plain, f"{schedule}, a constant loss")


def _on_two_ranks(rank: int, world: int) -> None:
    failures = Failures(rank, TOL)
    for schedule in SCHEDULES:
        _callers_graph(schedule, failures)
        _optimizer_loop(schedule, failures)
        if schedule in ("1f1b", "zb_h1", "zbv"):
            _constant_loss(schedule, failures)
    _converted_bert(failures)
    _llama_padded_labels(failures)
    _dropout_masks(failures)
    failures.finish()


def test_distributed_pipe_trains_a_users_loop_like_the_plain_model() -> None:
    """Every built-in schedule on 2 ranks: the gradients of an input and a target made
    outside the pipe (both were wrong: dropped, or a failed step), an AdamW loop with a
    learning-rate schedule, clipping, freezing and ragged batches, eval inference; a
    converted BERT with a padding mask and a Llama's own loss from padded labels under
    ``zb_h1``."""
    run_workers(_on_two_ranks, 2, timeout=240, pg_timeout=60)
