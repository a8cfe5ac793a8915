"""How ``Pipe.train_step`` weighs its micro-batch losses (``seqpipe.core.loss_weights``).

A mean over samples is weighted by each micro-batch's share of the samples, read from the
tensors of the target that are cut (a ``NoChunk`` given whole never sets it); a mean over
counted items (padded tokens) is exact with ``count_fn``: ``loss_fn`` returns the sum and
the step divides by the whole mini-batch's count. Both are checked against the plain model
on the whole batch; the multi-process cases are in ``test_loss_weights_distributed.py``.
"""
from __future__ import annotations

import warnings
from typing import List, Sequence, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seqpipe import NoChunk, Pipe
from seqpipe.core import loss_weights as loss_weights_module

VOCAB, WIDTH, SEQ = 11, 8, 6
LENGTHS = (6, 6, 1, 1, 4, 2, 6, 0)  # tokens counted per sample: the micro-batches differ


def token_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, VOCAB)).double()


def padded(seed: int, lengths: Sequence[int] = LENGTHS) -> Tuple[Tensor, Tensor]:
    """Token ids and labels, each sample's labels ``-100`` past its length."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(VOCAB, (len(lengths), SEQ), generator=gen)
    labels = torch.randint(VOCAB, (len(lengths), SEQ), generator=gen)
    for i, n in enumerate(lengths):
        labels[i, n:] = -100
    return tokens, labels


def token_sum(output: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(output.flatten(0, 1), labels.flatten(), ignore_index=-100,
                           reduction="sum")


def token_mean(output: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(output.flatten(0, 1), labels.flatten(), ignore_index=-100)


def counted(labels: Tensor) -> Tensor:
    return (labels != -100).sum()


def grads(module: nn.Module) -> List[Tensor]:
    return [p.grad.clone() for p in module.parameters()]


def reference(tokens: Tensor, labels: Tensor) -> Tuple[Tensor, List[Tensor]]:
    """The plain model's whole-batch token mean and its gradients."""
    plain = token_model()
    loss = token_mean(plain(tokens), labels)
    loss.backward()
    return loss.detach(), grads(plain)


@pytest.fixture
def fresh_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """The uneven-count warning is given once per process: let this test see it."""
    monkeypatch.setattr(loss_weights_module, "_warned", False)


@pytest.mark.parametrize("schedule,balance", [("fill_drain", [3, 3]), ("1f1b", [3, 3]),
                                              ("zb_h1", [2, 2, 2]),
                                              ("interleaved_1f1b", [2, 1, 2, 1])])
def test_a_summed_token_loss_with_count_fn_is_the_whole_batch_token_mean(
        schedule: str, balance: List[int], fresh_warning: None) -> None:
    tokens, labels = padded(1)
    expected_loss, expected = reference(tokens, labels)
    pipe = Pipe(token_model(), chunks=4, balance=balance, devices=["cpu"] * len(balance))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # count_fn given: nothing to warn about
        loss = pipe.train_step(tokens, labels, token_sum, count_fn=counted, schedule=schedule)
    torch.testing.assert_close(loss, expected_loss, atol=1e-12, rtol=0)
    for got, want in zip(grads(pipe), expected):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    # The data tells the two apart: the mean per micro-batch, weighted by samples, is off.
    pipe.zero_grad()
    with pytest.warns(UserWarning, match="different numbers of counted labels per sample"):
        off = pipe.train_step(tokens, labels, token_mean, schedule=schedule)
    assert abs(off - expected_loss) > 1e-3
    assert max((g - w).abs().max() for g, w in zip(grads(pipe), expected)) > 1e-3


def test_a_mean_over_uneven_counts_warns_once_and_even_ones_not_at_all(
        fresh_warning: None) -> None:
    pipe = Pipe(token_model(), chunks=4, balance=[3, 3], devices=["cpu"] * 2)
    tokens, labels = padded(2, lengths=(3, 5, 3, 5, 4, 4, 6, 2))  # 8 per pair: even
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.train_step(tokens, labels, token_mean)
        pipe.train_step(tokens, labels.clamp(min=0), token_mean)  # nothing ignored
    tokens, labels = padded(2)
    with pytest.warns(UserWarning) as caught:
        pipe.train_step(tokens, labels, token_mean)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "[12, 2, 6, 6] in micro-batches of [2, 2, 2, 2] samples" in message
    assert "pass count_fn=lambda target: (target != -100).sum()" in message
    assert caught[0].filename == __file__  # names the caller's line, not seqpipe's
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        pipe.train_step(tokens, labels, token_mean)


def test_a_mini_batch_that_counts_nothing_has_loss_zero_and_zero_gradients() -> None:
    pipe = Pipe(token_model(), chunks=4, balance=[3, 3], devices=["cpu"] * 2)
    tokens, labels = padded(3, lengths=(0,) * 8)
    loss = pipe.train_step(tokens, labels, token_sum, count_fn=counted)
    assert loss.item() == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in grads(pipe))


@pytest.mark.parametrize("count_fn,error,message", [
    (lambda labels: (labels != -100).sum(1), TypeError,
     r"count_fn must return one number .* got a tensor of shape \(8,\); reduce it"),
    (lambda labels: "many", TypeError,
     "count_fn must return a number or a one-element tensor .* got str"),
    (lambda labels: -1, ValueError, "count_fn returned -1, but a count is finite and not "
                                    "negative"),
    (3, TypeError, "count_fn must be callable as count_fn\\(target\\), got int"),
])
def test_a_wrong_count_fn_is_refused_naming_the_mend(count_fn: object, error: type,
                                                     message: str) -> None:
    pipe = Pipe(token_model(), chunks=4, balance=[3, 3], devices=["cpu"] * 2)
    tokens, labels = padded(4)
    with pytest.raises(error, match=message):
        pipe.train_step(tokens, labels, token_sum, count_fn=count_fn)  # type: ignore[arg-type]


def class_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3)).double()


def weighted_ce(output: Tensor, target: Tuple[Tensor, Tensor]) -> Tensor:
    """A mean over samples, each sample's loss times its class's weight."""
    class_weights, labels = target
    return (F.cross_entropy(output, labels, reduction="none") * class_weights[labels]).mean()


def scaled_ce(output: Tensor, target: Tuple[Tensor, Tensor]) -> Tensor:
    scale, labels = target
    return F.cross_entropy(output, labels) * scale


@pytest.mark.parametrize("schedule", ["1f1b", "fill_drain"])
@pytest.mark.parametrize("loss_fn,given", [
    (weighted_ce, torch.tensor([0.2, 1.0, 3.0], dtype=torch.float64)),
    (scaled_ce, torch.tensor(2.5, dtype=torch.float64)),  # 0-dim: an IndexError before
])
def test_a_nochunk_first_in_the_target_does_not_set_the_loss_weights(
        schedule: str, loss_fn: object, given: Tensor) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 5, generator=gen, dtype=torch.float64)  # 4 micro-batches: 2, 2, 2, 1
    labels = torch.randint(3, (7,), generator=gen)
    plain = class_model()
    expected_loss = loss_fn(plain(x), (given, labels))  # type: ignore[operator]
    expected_loss.backward()
    pipe = Pipe(class_model(), chunks=4, balance=[3, 2], devices=["cpu"] * 2)
    loss = pipe.train_step(x, (NoChunk(given), labels), loss_fn,  # type: ignore[arg-type]
                           schedule=schedule)
    torch.testing.assert_close(loss, expected_loss.detach(), atol=1e-12, rtol=0)
    for got, want in zip(grads(pipe), grads(plain)):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
