"""A call's actions are compiled once, before any of them runs (``Tasks.steps``).

What a call fixes for all its actions (the gradients' destination, the random seed, the
checkpoint mode, whether anything traces or times them) is decided in one pass before the
first stage computation, not again at each action between layers, where the same
bookkeeping costs several times as much (cold code: docs/benchmark-history.md, "Session 14:
plan4"). The steps run the
same work: loss and gradients equal the plain model's. The distributed engine's side is
checked in ``tests/test_transport.py``'s launch (``_fast_path``: a profiled step).
"""
from __future__ import annotations

import copy
from typing import Any, Iterator, List

import pytest
import torch
import torch.nn.functional as F
from test_pipe_train_step import W, plain_model
from torch import nn

import seqpipe.trace
from seqpipe import Pipe
from seqpipe.core.stage import Stage
from seqpipe.core.tasks import Tasks
from seqpipe.skip import SkipTracker, use_skip_tracker


@pytest.fixture(autouse=True)
def fresh_tracker() -> Iterator[None]:
    with use_skip_tracker(SkipTracker()):
        yield


def _model() -> nn.Sequential:
    """A skip from the first partition's first layer to the last one's last."""
    return plain_model(skips=True, layers=5)


def _events(monkeypatch: pytest.MonkeyPatch) -> List[str]:
    """Record, in order, each stage computation and each per-call decision ``Tasks``
    asks of the engine (where gradients go, the seed, the computation's span)."""
    events: List[str] = []
    for owner, name in ((Stage, "forward"), (Stage, "backward"), (Stage, "backward_input"),
                        (Stage, "backward_weight"), (Tasks, "_computing"),
                        (Tasks, "rng_seed")):
        original = getattr(owner, name)

        def spy(*args: Any, _name: str = name, _original: Any = original,
                **kwargs: Any) -> Any:
            events.append(_name)
            return _original(*args, **kwargs)
        monkeypatch.setattr(owner, name, spy)
    from seqpipe.local.step import LocalStep
    original_sink = LocalStep._sink

    def sink(self: LocalStep, s: int, i: int) -> Any:
        events.append("_sink")
        return original_sink(self, s, i)
    monkeypatch.setattr(LocalStep, "_sink", sink)
    return events


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_a_train_steps_decisions_are_made_before_its_first_computation(
        monkeypatch: pytest.MonkeyPatch, schedule: str) -> None:
    model = _model()
    plain = copy.deepcopy(model)
    pipe = Pipe(model, chunks=4, balance=[2, 3], devices=["cpu"] * 2, checkpoint="always")
    x, y = torch.randn(8, W, dtype=torch.float64), torch.randn(8, W, dtype=torch.float64)
    events = _events(monkeypatch)
    loss = pipe.train_step(x, y, F.mse_loss, schedule=schedule)
    computing = [n for n, e in enumerate(events) if e not in ("_sink", "rng_seed")]
    asked = [n for n, e in enumerate(events) if e in ("_sink", "rng_seed")]
    assert asked and computing and max(asked) < min(computing), events
    assert "_computing" not in events  # nothing traces or times: no span asked for
    expected = F.mse_loss(plain(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_traced_step_still_records_every_computation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``seqpipe.trace.record()`` (decided for the call when it is compiled) every
    stage computation is a span, as before."""
    pipe = Pipe(_model(), chunks=2, balance=[2, 3], devices=["cpu"] * 2, checkpoint="never")
    x, y = torch.randn(4, W, dtype=torch.float64), torch.randn(4, W, dtype=torch.float64)
    with seqpipe.trace.record() as rec:
        pipe.train_step(x, y, F.mse_loss, schedule="1f1b")
    spans = sorted((e.kind.value, e.stage, e.microbatch) for e in rec.recording.events
                   if e.kind.value in ("F", "B", "loss"))
    assert spans == sorted([(kind, s, i) for kind in "FB" for s in (0, 1) for i in (0, 1)] +
                           [("loss", 1, i) for i in (0, 1)]), spans
