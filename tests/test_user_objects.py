"""The user's objects stay the user's, and a new user's first hour (session 13's hunt).

Each case compares a ``Pipe`` (two CPU partitions) or a converted model with the plain
model on the same batch, outputs and gradients in float64, or checks the error that names
the mend where seqpipe cannot match the plain model: hooks registered on the
``nn.Sequential`` itself before wrapping (``Pipe``, ``train_step``, ``DistributedPipe``),
``torch.func`` transforms over a pipe, a forward that branches on ``self.training`` outside
its units, hooks on the modules a conversion traces into the glue, a converted model's
pipeline called with the model's own arguments, a ``loss_fn`` that reads a ``ModelOutput``
attribute from the flat output, a model cast after converting. The ``DistributedPipe``
cases run in one launch of two gloo ranks.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from test_user_state import assert_same_grads, batch, mlp, piped
from torch import Tensor, nn

import seqpipe
from seqpipe import Pipe
from seqpipe.distributed import DistributedPipe

MODES = ["never", "always"]


# -- hooks on the nn.Sequential itself --------------------------------------------------------
def hooked(calls: List[str]) -> nn.Sequential:
    """The model with hooks of every kind on the Sequential itself, each changing what it
    sees (the input, the output, the gradient, the state dict's keys)."""
    model = mlp()
    model.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    model.register_forward_hook(lambda mod, args, kwargs, out: calls.append("post") or out + 1,
                                with_kwargs=True)
    model.register_full_backward_hook(
        lambda mod, gin, gout: calls.append("backward") or (gin[0] * 3,))
    model.register_full_backward_pre_hook(lambda mod, gout: (gout[0].clamp(-0.2, 0.2),))

    def renamed(mod: nn.Module, state: Dict[str, Any], prefix: str, meta: Any) -> None:
        state["head.weight"] = state.pop("4.weight")

    def back(mod: nn.Module, state: Dict[str, Any], prefix: str, *rest: Any) -> None:
        state["4.weight"] = state.pop("head.weight")

    model.register_state_dict_post_hook(renamed)
    model.register_load_state_dict_pre_hook(back)
    return model


@pytest.mark.parametrize("mode", MODES)
def test_hooks_on_the_sequential_itself_run_as_on_the_model(mode: str) -> None:
    """Hooks the user registered on the ``nn.Sequential`` before wrapping it (an input
    transform, an output hook, gradient-changing backward hooks, a state-dict key hook) were
    dropped silently: the pipe never calls that object. The pipe runs them now, once per
    call on the whole batch, as the model did."""
    want: List[str] = []
    got: List[str] = []
    plain, pipe = hooked(want), piped(hooked(got), mode)
    x = batch().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    out, expected = pipe(x2), plain(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    (out.square().sum()).backward()
    (expected.square().sum()).backward()
    assert got == want == ["post", "backward"]
    assert_same_grads(plain, pipe)
    torch.testing.assert_close(x2.grad, x.grad, rtol=0, atol=1e-12)
    state = pipe.state_dict()
    assert list(state) == list(plain.state_dict()) and "head.weight" in state
    with torch.no_grad():
        state["head.weight"].add_(1.0)
    pipe.load_state_dict(state)  # the key goes back through the load hook
    torch.testing.assert_close(pipe[4].weight, plain[4].weight + 1.0, rtol=0, atol=0)


def test_a_hook_registered_on_the_pipe_stays_off_the_users_sequential() -> None:
    """The pipe copies the Sequential's hooks: its own later hooks are not written into the
    user's object, which still runs the same layers when called."""
    model = mlp()
    pipe = piped(model)
    pipe.register_forward_hook(lambda mod, args, out: out * 0)
    x = batch()
    assert not model._forward_hooks
    assert model(x).abs().sum() > 0  # the Sequential still runs the same layers, unhooked
    assert pipe(x).abs().sum() == 0


@pytest.mark.parametrize("where", ["sequential", "pipe"])
def test_train_step_refuses_hooks_on_the_whole_model_by_name(where: str) -> None:
    """``train_step`` hands each micro-batch's output to ``loss_fn`` and never calls the
    pipe's forward on the whole batch: such hooks were skipped silently."""
    model = mlp()
    if where == "sequential":
        model.register_forward_hook(lambda mod, args, out: out * 2)
        pipe = piped(model)
    else:
        pipe = piped(model)
        pipe.register_full_backward_hook(lambda mod, gin, gout: None)
    with pytest.raises(RuntimeError, match=r"Pipe.train_step, .* cannot run the hooks registered "
                                           r"on the whole model \((forward|backward) hook .*"
                                           r"register them on the layers instead"):
        pipe.train_step(batch(), torch.zeros(8, 4, dtype=torch.float64), F.mse_loss)
    assert all(p.grad is None for p in pipe.parameters())


def test_distributed_pipe_refuses_hooks_on_the_sequential_by_name() -> None:
    """``DistributedPipe`` has no call of the whole model to run them in (checked before
    anything else, so without a process group)."""
    model = mlp()
    model.register_forward_pre_hook(lambda mod, args: None)
    with pytest.raises(RuntimeError, match=r"DistributedPipe, .* cannot run the hooks "
                                           r"registered on the whole model \(forward "
                                           r"pre-hook .*handle.remove\(\)"):
        DistributedPipe(model, chunks=2)


# -- autograd's per-thread flags ---------------------------------------------------------------
class Flags(nn.Module):
    """Records autograd's per-thread flags as a layer sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: List[Tuple[bool, bool]] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append((torch.autograd.is_multithreading_enabled(),
                          torch.autograd.is_view_replay_enabled()))
        return x * 1


def test_autograd_flags_set_around_the_call_reach_every_stage() -> None:
    """``torch.autograd.set_multithreading_enabled(False)`` and
    ``_force_original_view_tracking(True)`` are per thread: the stage on a worker thread
    saw the defaults (True, False)."""
    model = nn.Sequential(nn.Linear(6, 6), Flags(), nn.Linear(6, 6), Flags()).double()
    pipe = Pipe(model, chunks=2, balance=[2, 2], devices=["cpu", "cpu"])
    with torch.autograd.set_multithreading_enabled(False), \
            torch.autograd._force_original_view_tracking(True):
        pipe(batch()).sum().backward()
    assert set(model[1].seen) == set(model[3].seen) == {(False, True)}


# -- torch.func's transforms over a pipe -----------------------------------------------------
@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_torch_func_transforms_over_a_pipe_are_refused_by_name(transform: str) -> None:
    """They failed with torch's "In order to use an autograd.Function with functorch
    transforms ... it must override the setup_context staticmethod", naming neither seqpipe
    nor the mend; the unwrapped model (the same layers) takes them."""
    pipe, x = piped(mlp()), batch()
    params = dict(pipe.named_parameters())
    run = {"vmap": lambda net: torch.func.vmap(lambda row: net(row.unsqueeze(0)))(x),
           "grad": lambda net: torch.func.grad(
               lambda p: torch.func.functional_call(net, p, (x,)).sum())(params)}[transform]
    with pytest.raises(RuntimeError, match=r"torch.func's transforms \(vmap, grad, jacrev, "
                                           r"...\) cannot record a Pipe.*functional_call\("
                                           r"nn.Sequential\(\*pipe\), params, x\)"):
        run(pipe)
    run(nn.Sequential(*pipe))  # the mend
    assert pipe(x).shape == (8, 4)  # the pipe is still usable


# -- a forward that branches on self.training outside its units --------------------------------
class Aux(nn.Module):
    """torchvision's GoogLeNet/Inception pattern: an auxiliary head run (and returned) only
    in training."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.head = nn.Linear(8, 4)
        self.aux = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Any:
        h = F.relu(self.stem(x))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        if self.training:
            return self.head(h), self.aux(h)
        return self.head(h)


def aux_model() -> Aux:
    torch.manual_seed(0)
    return Aux().double()


def test_a_forward_branching_on_training_runs_only_in_the_converted_mode() -> None:
    """Converted in train mode, the model ran its training branch in eval mode too (the
    auxiliary head's output came back from an eval call), silently; converted in eval
    mode, it would never train the auxiliary head. Each converted model now refuses the
    other mode by name; one conversion per mode gives the plain model's results in both."""
    model, plain = aux_model(), aux_model()
    x = batch()
    trained = seqpipe.to_sequential(model, (x,))
    pipe = Pipe(trained, chunks=4, balance=[2, len(trained) - 2], devices=["cpu", "cpu"])
    out, want = pipe(x), plain(x)
    assert isinstance(out, tuple) and len(out) == 2
    (out[0].sum() + out[1].square().sum()).backward()
    (want[0].sum() + want[1].square().sum()).backward()
    assert_same_grads(plain, model)
    model.eval(), plain.eval()
    with pytest.raises(RuntimeError, match=r"Aux's forward branches on self.training outside "
                                           r"its units .* converted in train mode, and unit "
                                           r"'stem' is in eval mode now, .*"
                                           r"seqpipe.to_sequential\(model.eval\(\), ...\)"):
        pipe(x)
    evaluated = seqpipe.to_sequential(model, (x,))  # over the same parameters
    assert all(a is b for a, b in zip(evaluated.parameters(), model.parameters()))
    with torch.no_grad():
        torch.testing.assert_close(evaluated(x), plain(x), rtol=0, atol=1e-12)
    model.train()
    with pytest.raises(RuntimeError, match="converted in eval mode, and unit 'stem' is in "
                                           "train mode now"):
        evaluated(x)


def test_a_forward_that_reads_training_only_for_dropout_follows_the_mode() -> None:
    """Not every read of ``training`` is a branch: dropout in the glue follows the unit's
    mode (``seqpipe.graph.mode``), so such a model converts once for both modes."""
    class Drop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 4)

        def forward(self, x: Tensor) -> Tensor:
            return self.b(F.dropout(self.a(x), 0.5, self.training))

    torch.manual_seed(0)
    model = Drop().double()
    seq = seqpipe.to_sequential(model, (batch(),))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(seq(batch()), model(batch()), rtol=0, atol=0)


# -- hooks on the modules whose forward is traced into the glue ------------------------------
@pytest.mark.parametrize("kind", ["forward", "pre", "backward", "inside"])
def test_hooks_outside_the_units_are_refused_at_conversion(kind: str) -> None:
    """A hook on the model itself (or on a container above its units) was traced into the
    glue: run at conversion only (a logging hook never ran again) and what it changed kept
    in every call, even after ``handle.remove()``. A hook on a unit runs, as before."""
    model, (x, mask) = free()
    calls: List[int] = []
    where = model.embed if kind == "inside" else model
    if kind == "pre":
        handle = where.register_forward_pre_hook(lambda mod, args: None)
    elif kind == "backward":
        handle = where.register_full_backward_hook(lambda mod, gin, gout: None)
    else:
        handle = where.register_forward_hook(lambda mod, args, out: calls.append(1))
    if kind == "inside":
        seq = seqpipe.to_sequential(model, (x, mask))
        calls.clear()
        seq(x, mask)
        assert calls == [1]  # the unit's hook, once per call
        return
    with pytest.raises(seqpipe.graph.ConversionError,
                       match=r"the model itself \(Free\) has (forward|backward) "
                             r"(pre-)?hook .*traced into the glue between units: the hook would "
                             r"run at conversion only.*register it on a unit"):
        seqpipe.to_sequential(model, (x, mask))
    handle.remove()
    seqpipe.to_sequential(model, (x, mask))


# -- a new user's first hour with a converted model -------------------------------------------
class Free(nn.Module):
    """A model with keyword arguments: a mask and a flag."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.head = nn.Linear(8, 4)

    def forward(self, x: Tensor, mask: Tensor, scale: bool = False) -> Dict[str, Tensor]:
        h = self.embed(x) * mask.unsqueeze(-1)
        for block in self.blocks:
            h = h + F.relu(block(h))
        out = self.head(h)
        return OrderedDict(logits=out * 2 if scale else out)


def free() -> Tuple[nn.Module, Tuple[Tensor, Tensor]]:
    torch.manual_seed(0)
    return Free().double(), (batch(), torch.ones(8, dtype=torch.float64))


def test_a_converted_pipeline_called_with_the_models_arguments_says_how() -> None:
    """``pipe(x)`` for a model converted with ``(x, mask)`` raised the generated code's
    ``forward() missing 1 required positional argument: 'in_mask'``."""
    model, (x, mask) = free()
    seq = seqpipe.to_sequential(model, (x, mask))
    pipe = Pipe(seq, chunks=2, balance=[2, len(seq) - 2], devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match=r"takes 2 values, got 1\. A pipeline of a converted "
                                        r"model takes the flat tuple that seq.origin."
                                        r"pipeline_input"):
        pipe(x)
    out = pipe(seq.origin.pipeline_input(x, mask))
    torch.testing.assert_close(out["logits"], model(x, mask)["logits"], rtol=0, atol=1e-12)


def test_a_loss_fn_reading_the_models_output_structure_is_told_why() -> None:
    """``train_step``'s ``loss_fn`` gets the flat output (a tensor), while ``pipe(x)`` gives
    the model's structure: ``out["logits"]``/``out.logits`` failed with Python's message
    alone."""
    model, (x, mask) = free()
    seq = seqpipe.to_sequential(model, (x, mask))
    pipe = Pipe(seq, chunks=2, balance=[2, len(seq) - 2], devices=["cpu", "cpu"])
    with pytest.raises(AttributeError, match="no attribute 'logits'") as info:
        pipe.train_step(seq.origin.pipeline_input(x, mask), torch.zeros(8, 4),
                        lambda out, y: F.mse_loss(out.logits, y))
    assert any("loss_fn receives each micro-batch's output as the pipeline's last layer "
               "returns it" in note and "seq.origin.rebuild(out)" in note
               for note in info.value.__notes__)


# -- DistributedPipe: one launch ---------------------------------------------------------------
def _on_two_ranks(rank: int, world: int) -> None:
    # the Sequential's state_dict hooks are kept on every rank
    model = mlp()
    model.register_state_dict_post_hook(
        lambda mod, state, prefix, meta: state.update({"hooked": torch.tensor(rank)}))
    pipe = DistributedPipe(model, chunks=2, balance=[2, 3])
    assert pipe.state_dict()["hooked"] == rank
    assert set(pipe.state_dict()) - {"hooked"} == {n for n, _ in pipe.named_parameters()}
    # a converted model that branches on training: trains as the plain model, under zb_h1,
    # and refuses eval mode on every rank, by name
    converted, plain = aux_model(), aux_model()
    x, target = batch(), torch.zeros(8, 4, dtype=torch.float64)
    seq = seqpipe.to_sequential(converted, (x,))

    def loss_fn(out: Any, y: Tensor) -> Tensor:
        return F.mse_loss(out[0], y) + out[1].square().mean()

    pipe = DistributedPipe(seq, chunks=4, balance=[2, len(seq) - 2], schedule="zb_h1")
    loss = pipe.train_step(x if pipe.is_first else None, target if pipe.is_last else None,
                           loss_fn)
    expected = loss_fn(plain(x), target)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    ours = dict(converted.named_parameters())
    for name, param in plain.named_parameters():
        if ours[name].grad is not None:  # the layers this rank holds
            torch.testing.assert_close(ours[name].grad, param.grad, rtol=0, atol=1e-12,
                                       msg=name)
    assert any(p.grad is not None for p in pipe.parameters())
    converted.eval()
    with pytest.raises(RuntimeError, match="Aux's forward branches on self.training outside "
                                           "its units"):
        pipe(x if pipe.is_first else None)


def test_distributed_pipe_keeps_state_hooks_and_refuses_the_other_mode() -> None:
    """On two gloo ranks: the Sequential's ``state_dict`` hook kept; a model converted in
    train mode that branches on ``training`` trains as the plain model under ``zb_h1`` and
    refuses an eval call on every rank."""
    from distributed_harness import run_workers
    run_workers(_on_two_ranks, 2, timeout=120, pg_timeout=30)


class Upcast(nn.Module):
    """Glue that computes in float32 and casts back to the input's dtype (as mixed-precision
    code does): the trace fixes both dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x).float()).to(x.dtype))


def test_a_model_cast_after_converting_is_told_to_convert_again() -> None:
    """``model.to(torch.bfloat16)`` after ``to_sequential`` (GPT-2 too) failed with torch's
    bare "Tensor dtype mismatch! Expected: Float, Got: c10::BFloat16"; converted after the
    cast, it runs as the plain model."""
    torch.manual_seed(0)
    model, x = Upcast(), torch.randn(8, 6)
    seq = seqpipe.to_sequential(model, (x,))
    model.double()
    with pytest.raises(RuntimeError, match="Tensor dtype mismatch") as info:
        seq(x.double())
    assert any("Convert the model in the dtype it runs in: cast it first" in note
               for note in info.value.__notes__)
    again = seqpipe.to_sequential(model, (x.double(),))
    torch.testing.assert_close(again(x.double()), model(x.double()), rtol=0, atol=0)
