"""A layer sees its own parameters, hooks and settings exactly as without seqpipe.

Cases a user meets with the objects and settings of their own model (session 11's hunt):
each compares a ``Pipe`` (two CPU partitions) with the plain model on the same batch,
outputs and gradients in float64, or checks the error that names the mend where seqpipe
cannot match the plain model.
"""
from __future__ import annotations

import contextvars
import copy
import io
import pickle
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.utils.parametrize as parametrize
from test_skip_pipe import PopA, StashA
from torch import Tensor, nn
from torch.nn.utils import parametrizations

from seqpipe import Pipe

MODES = ["never", "except_last", "always"]


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 4)).double()


def batch() -> Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def piped(model: nn.Sequential, mode: str = "except_last", chunks: int = 4) -> Pipe:
    half = len(model) // 2
    return Pipe(model, chunks=chunks, checkpoint=mode, balance=[half, len(model) - half],
                devices=["cpu", "cpu"])


def assert_same_grads(plain: nn.Module, pipe: nn.Module) -> None:
    for (name, a), b in zip(plain.named_parameters(), pipe.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-12, msg=name)


# -- copy.deepcopy, pickle, torch.save of a whole Pipe ----------------------------------------
def _deepcopy(pipe: Pipe) -> Pipe:
    return copy.deepcopy(pipe)


def _pickle(pipe: Pipe) -> Pipe:
    return pickle.loads(pickle.dumps(pipe))


def _torch_save(pipe: Pipe) -> Pipe:
    buffer = io.BytesIO()
    torch.save(pipe, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("copier", [_deepcopy, _pickle, _torch_save])
def test_a_pipe_copies_whole_and_the_copy_trains_its_own_layers(copier: Callable) -> None:
    """``copy.deepcopy(pipe)`` (an EMA model, a frozen teacher) and ``torch.save(pipe)``: the
    skip layout's read-only index could not be pickled, so both raised ``TypeError``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), StashA(), nn.Tanh(), nn.Linear(6, 6), PopA(),
                          nn.Linear(6, 4)).double()
    pipe = Pipe(model, chunks=4, balance=[2, 2, 2], devices=["cpu"] * 3)
    x = batch()
    pipe(x).sum().backward()
    twin = copier(pipe)
    assert all(a is not b for a, b in zip(twin.parameters(), pipe.parameters()))
    assert twin.partitions[1][0] is twin[2]  # the copy's stages run the copy's layers
    with torch.no_grad():
        twin[0].weight.add_(0.5)
    reference = nn.Sequential(*copy.deepcopy(list(twin)))
    pipe.zero_grad(), twin.zero_grad()
    out = twin(x)
    torch.testing.assert_close(out, reference(x), rtol=0, atol=1e-12)
    out.sum().backward()
    reference(x).sum().backward()
    assert_same_grads(reference, twin)
    assert all(p.grad is None for p in pipe.parameters())  # the original is untouched


# -- a parameter hook registered after the forward ------------------------------------------
def _clip(calls: List[int]) -> Callable[[Tensor], Tensor]:
    def hook(grad: Tensor) -> Tensor:
        calls.append(1)
        return grad.clamp(-0.05, 0.05)  # not linear: a share clipped is not the sum clipped
    return hook


def _scale_after(calls: List[int]) -> Callable[[Tensor], None]:
    def hook(param: Tensor) -> None:
        calls.append(1)
        assert param.grad is not None
        param.grad.mul_(3.0)
    return hook


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["register_hook", "post_accumulate", "inside_forward"])
def test_a_hook_registered_after_the_forward_fires_once_with_the_whole_gradient(
        mode: str, kind: str) -> None:
    """A hook that appears between the forward and the backward (registered by the user, or
    by a layer in its forward) fired once per micro-batch with a share of the gradient
    (and once more with ``None``): a clipping hook clipped each share."""
    plain, model = mlp(), mlp()
    pipe = piped(model, mode)
    calls: Dict[str, List[int]] = {"plain": [], "pipe": []}

    def register(net: nn.Module, key: str) -> None:
        if kind == "post_accumulate":
            net[2].weight.register_post_accumulate_grad_hook(_scale_after(calls[key]))
        else:
            net[2].weight.register_hook(_clip(calls[key]))

    if kind == "inside_forward":  # a layer that hooks its own parameter as it first runs
        for net, key in [(plain, "plain"), (model, "pipe")]:
            def pre_hook(module: nn.Module, args: Any, net: nn.Module = net,
                         key: str = key) -> None:
                if not getattr(module, "hooked", False):
                    module.hooked = True
                    register(net, key)
            net[2].register_forward_pre_hook(pre_hook)
    for step in range(2):  # the second adds to .grad
        x = batch()
        expected, got = plain(x), pipe(x)
        if kind != "inside_forward" and step == 0:
            register(plain, "plain")
            register(model, "pipe")
        expected.square().sum().backward()
        got.square().sum().backward()
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
        assert_same_grads(plain, model)
        assert len(calls["pipe"]) == len(calls["plain"]) == step + 1


@pytest.mark.parametrize("mode", ["never", "always"])
def test_a_hook_registered_after_the_forward_fires_once_under_autograd_grad(mode: str) -> None:
    plain, model = mlp(), mlp()
    pipe = piped(model, mode)
    x = batch()
    expected, got = plain(x), pipe(x)
    calls: Dict[str, List[int]] = {"plain": [], "pipe": []}
    plain[2].weight.register_hook(_clip(calls["plain"]))
    model[2].weight.register_hook(_clip(calls["pipe"]))
    want = torch.autograd.grad(expected.square().sum(), [plain[2].weight, plain[0].weight])
    have = torch.autograd.grad(got.square().sum(), [model[2].weight, model[0].weight])
    for a, b in zip(have, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert len(calls["pipe"]) == len(calls["plain"]) == 1
    assert all(p.grad is None for p in model.parameters())


def test_hooks_hidden_during_a_failed_backward_are_back_afterwards() -> None:
    class Fails(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return _Raise.apply(x)

    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), Fails(), nn.Linear(8, 4)).double()
    pipe = piped(model, "never")
    out = pipe(batch())
    calls: List[int] = []
    model[0].weight.register_hook(_clip(calls))
    with pytest.raises(RuntimeError, match="backward failed on purpose"):
        out.sum().backward()
    assert len(model[0].weight._backward_hooks) == 1
    model[0](batch()).sum().backward()  # the layer on its own: the hook fires
    assert calls == [1]


class _Raise(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        raise RuntimeError("backward failed on purpose")


# -- parametrize.cached() around the call ---------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_parametrize_cached_around_the_call_gives_the_plain_gradients(mode: str) -> None:
    """Under ``cached()``, every micro-batch shared the first one's parametrized weight:
    the second micro-batch's backward failed ("backward through the graph a second
    time"), and a recomputation met another graph than its forward's."""
    def build() -> nn.Sequential:
        model = mlp()
        parametrizations.orthogonal(model[2])
        parametrizations.weight_norm(model[4])
        return model

    plain, model = build(), build()
    pipe = piped(model, mode)
    x = batch()
    with parametrize.cached():
        expected, got = plain(x), pipe(x)
        expected.square().sum().backward()
        got.square().sum().backward()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert_same_grads(plain, model)
    with parametrize.cached():  # train_step too
        loss = pipe.train_step(x, torch.zeros(8, 4, dtype=torch.float64),
                               nn.functional.mse_loss)
    plain.zero_grad()
    torch.testing.assert_close(loss, nn.functional.mse_loss(plain(x), torch.zeros(8, 4)))


# -- forward-mode AD ------------------------------------------------------------------------
def test_forward_mode_ad_is_refused_by_name() -> None:
    """A dual parameter's tangent was dropped silently (the output had none); a dual input
    failed inside torch with a message about custom autograd Functions."""
    model = mlp()
    pipe = piped(model)
    x = batch()
    with fwAD.dual_level():
        with pytest.raises(RuntimeError, match="input tensor 0 is a dual tensor"):
            pipe(fwAD.make_dual(x, torch.ones_like(x)))
        weight = model[2].weight
        del model[2].weight
        model[2].weight = fwAD.make_dual(weight.detach(), torch.ones_like(weight))
        with pytest.raises(RuntimeError, match=r"'2\.weight' is a dual tensor.*unwrapped model"):
            pipe(x)
    assert pipe(x).shape == (8, 4)  # outside the dual level: no check


def test_a_layer_reads_its_parameters_hook_dictionaries_under_the_alias_mode() -> None:
    """With hooks, a layer reading ``self.weight._backward_hooks`` (to register a hook once)
    saw the alias's (``None``) and registered another hook at every micro-batch."""
    class HooksOnce(nn.Linear):
        def forward(self, x: Tensor) -> Tensor:
            self.seen.append((self.weight._backward_hooks is not None,
                              self.bias._post_accumulate_grad_hooks is not None))
            return super().forward(x)

    layer = HooksOnce(8, 8).double()
    layer.seen = []
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), layer, nn.Linear(8, 4)).double()
    layer.weight.register_hook(lambda grad: grad)
    layer.bias.register_post_accumulate_grad_hook(lambda param: None)
    piped(model, "always")(batch()).sum().backward()
    assert layer.seen == [(True, True)] * 8  # 4 forwards, 4 recomputations


# -- a layer that differentiates inside its forward, checkpointed ---------------------------
class Force(nn.Module):
    """The gradient of an energy w.r.t. the input, taken inside the forward (a force field,
    a gradient penalty inside the model), with dropout before it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: Tensor) -> Tensor:
        x = self.drop(x)
        with torch.enable_grad():
            if not x.requires_grad:
                x = x.requires_grad_()
            energy = self.lin(x).tanh().sum()
            (force,) = torch.autograd.grad(energy, x, create_graph=True)
        return force


def force_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), Force(), nn.Tanh(), Force(),
                         nn.Linear(8, 4)).double()


@pytest.mark.parametrize("checkpoint_every", [None, 1])
def test_a_layer_calling_autograd_grad_in_its_forward_trains_checkpointed(
        checkpoint_every: Any) -> None:
    """Its forward recomputes what the checkpoint dropped, and the backward recomputes
    again: the recomputation's context was a one-use generator, and the second raised
    "'_GeneratorContextManager' object has no attribute 'args'". Every recomputation
    must also replay the forward's dropout masks: all modes give the same bits."""
    x, y = batch(), torch.zeros(8, 4, dtype=torch.float64)
    results = {}
    for mode in MODES:
        model = force_model()
        pipe = Pipe(model, chunks=4, checkpoint=mode, balance=[2, 4], devices=["cpu"] * 2,
                    checkpoint_every=checkpoint_every)
        torch.manual_seed(5)
        out = pipe(x)
        out.square().sum().backward()
        results[mode] = (out, [p.grad for p in model.parameters()])
        model.zero_grad()
        torch.manual_seed(5)
        pipe.train_step(x, y, nn.functional.mse_loss, schedule="zb_h1")  # recomputed by hand
        torch.manual_seed(5)
        results[mode + "/zb_h1"] = [p.grad for p in model.parameters()]
    for mode in MODES:
        torch.testing.assert_close(results[mode][0], results["never"][0], rtol=0, atol=0)
        for a, b in zip(results[mode][1], results["never"][1]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for a, b in zip(results[mode + "/zb_h1"], results["never/zb_h1"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["except_last", "always"])
def test_a_layer_calling_autograd_grad_in_its_forward_matches_the_plain_model(mode: str) -> None:
    plain, model = force_model(), force_model()
    for layer in [*plain, *model]:
        if isinstance(layer, Force):
            layer.drop.p = 0.0  # masks are the pipe's own: compare without
    pipe = piped(model, mode)
    x = batch().requires_grad_()
    expected, got = plain(x), pipe(x)
    expected.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert_same_grads(plain, model)


# -- DistributedPipe: the same objects, on two ranks (one launch) ---------------------------
def _dist_model() -> nn.Sequential:
    """Hooks, parametrizations and a differentiating layer, over four stages' worth."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), Force(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 8), Force(), nn.Linear(8, 4)).double()
    for layer in model:
        if isinstance(layer, Force):
            layer.drop.p = 0.0
    parametrizations.weight_norm(model[3])
    parametrizations.orthogonal(model[5])
    model[3].register_full_backward_hook(lambda mod, gin, gout: (gin[0] * 2,))
    model[5].register_full_backward_pre_hook(lambda mod, gout: (gout[0] * 3,))
    model[7].register_forward_hook(lambda mod, args, kwargs, out: out * 1.5,
                                   with_kwargs=True, always_call=True)
    return model


def _user_objects_on_two_ranks(rank: int, world: int) -> None:
    from seqpipe.distributed import DistributedPipe
    target = torch.zeros(8, 4, dtype=torch.float64)
    for schedule, checkpoint in [("1f1b", "except_last"), ("zb_h1", "always"),
                                 ("interleaved_1f1b", "always")]:
        balance = [4, 4] if schedule != "interleaved_1f1b" else [2, 2, 2, 2]
        plain = _dist_model()
        pipe = DistributedPipe(_dist_model(), chunks=4, balance=balance, schedule=schedule,
                               checkpoint=checkpoint)
        if schedule == "1f1b":  # refused before anything runs: the pipe stays usable
            for disabled in (torch.no_grad, torch.inference_mode):
                with disabled(), pytest.raises(RuntimeError, match="gradients are disabled"):
                    pipe.train_step(batch() if pipe.is_first else None,
                                    target if pipe.is_last else None, nn.functional.mse_loss)
        for step in range(3):
            x = batch() * (step + 1)
            if step == 1:  # a parameter replaced after wrapping, and a hook on it
                for net in (plain, pipe):
                    if hasattr(net, "0"):
                        layer = net.get_submodule("0")
                        layer.weight = nn.Parameter(torch.full((8, 6), 0.1,
                                                               dtype=torch.float64))
                        layer.weight.register_hook(lambda grad: grad.clamp(-0.05, 0.05))
            if step == 2:  # part of the model frozen between steps
                for net in (plain, pipe):
                    if hasattr(net, "7"):
                        net.get_submodule("7").requires_grad_(False)
            if step == 2 and hasattr(pipe, "7"):
                with pytest.raises(TypeError, match="layer '7' of this DistributedPipe cannot "
                                                    "be replaced"):
                    pipe.add_module("7", nn.Linear(8, 4))
            plain.zero_grad(set_to_none=True)
            pipe.zero_grad(set_to_none=True)
            expected = nn.functional.mse_loss(plain(x), target)
            expected.backward()
            loss = pipe.train_step(x if pipe.is_first else None,
                                   target if pipe.is_last else None, nn.functional.mse_loss)
            torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
            reference = dict(plain.named_parameters())
            for name, param in pipe.named_parameters():
                want = reference[name].grad
                assert (param.grad is None) == (want is None), (schedule, step, name)
                if want is not None:
                    torch.testing.assert_close(param.grad, want, rtol=0, atol=1e-12,
                                               msg=f"{schedule} step {step} {name}")


def test_distributed_pipe_trains_the_users_objects_as_the_plain_model() -> None:
    """Module hooks (gradient-modifying backward hooks, a kwargs forward hook), weight norm
    and orthogonal parametrizations, a layer calling ``autograd.grad`` in its forward
    (checkpointed: it raised before), a parameter replaced after wrapping with a clipping
    hook, and ``requires_grad_(False)`` between steps, under three schedules; a layer
    replaced after wrapping is refused by name (it was silently not run), and so is
    ``train_step`` under ``no_grad``/``inference_mode`` (it failed in a weight backward
    and left the pipe failed for every later call)."""
    from distributed_harness import run_workers
    run_workers(_user_objects_on_two_ranks, 2, timeout=180, pg_timeout=60)


# -- tracing a Pipe -------------------------------------------------------------------------
def test_jit_trace_and_export_of_a_pipe_are_refused_by_name() -> None:
    """The tracers record the calling thread only: ``torch.jit.trace`` failed on a private
    tensor of the engine ("Cannot insert a Tensor that requires grad as a constant"),
    ``torch.export`` on a data-dependent guard inside it."""
    pipe = piped(mlp()).eval()
    x = batch()
    with pytest.raises(RuntimeError, match=r"torch\.jit\.trace cannot record a Pipe.*"
                                           r"nn\.Sequential\(\*pipe\)"):
        torch.jit.trace(pipe, x)
    with pytest.raises(RuntimeError, match=r"torch\.export cannot record a Pipe"):
        torch.export.export(pipe, (x,))


# -- replacing a layer after wrapping -------------------------------------------------------
@pytest.mark.parametrize("how", ["setattr", "add_module", "register_module", "delattr",
                                 "convert_sync_batchnorm"])
def test_replacing_a_layer_after_wrapping_is_refused_by_name(how: str) -> None:
    """The pipe's ``parameters()`` and ``state_dict()`` showed the new layer (an optimizer
    trained it) while the partitions kept running the old one: silently."""
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 4)).double()
    pipe = piped(model)
    head = nn.Linear(8, 2).double()
    with pytest.raises(TypeError, match=r"layer '(4|1)' of this Pipe cannot be (replaced|removed)"
                                        r" after the pipe is built.*before wrapping"):
        if how == "setattr":
            setattr(pipe, "4", head)
        elif how == "add_module":
            pipe.add_module("4", head)
        elif how == "register_module":
            pipe.register_module("4", head)
        elif how == "delattr":
            delattr(pipe, "4")
        else:
            nn.SyncBatchNorm.convert_sync_batchnorm(pipe)
    assert pipe[4] is model[4] and pipe.partitions[1][-1] is model[4]
    pipe[2].weight = nn.Parameter(torch.zeros(8, 8, dtype=torch.float64))  # in place: fine
    pipe.extra = 3  # any other attribute: fine
    assert pipe(batch()).shape == (8, 4)


# -- torch.utils.checkpoint around a pipe -----------------------------------------------------
def test_a_non_reentrant_checkpoint_around_a_pipe_is_refused_by_name() -> None:
    """Its stages save tensors on several threads in an order that changes between the
    forward and the recomputation: the checkpoint's match failed at random (or, with two
    tensors of one shape swapped, would pass with the wrong values)."""
    from torch.utils.checkpoint import checkpoint
    plain, model = mlp(), mlp()
    pipe = piped(model, "never")
    x = batch().requires_grad_()
    with pytest.raises(RuntimeError, match=r"around a Pipe of several partitions.*"
                                           r"checkpoint='always'"):
        checkpoint(pipe, x, use_reentrant=False)
    out = checkpoint(pipe, x, use_reentrant=True)  # the reentrant form recomputes the call
    out.square().sum().backward()
    plain(x.detach()).square().sum().backward()
    assert_same_grads(plain, model)


# -- a ContextVar set around the call ---------------------------------------------------------
SCALE: "contextvars.ContextVar[float]" = contextvars.ContextVar("SCALE", default=1.0)


class ScaledByContext(nn.Linear):
    """Reads a library-style setting held in a ``ContextVar`` (in forward, recomputation and
    backward alike)."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * SCALE.get()


@pytest.mark.parametrize("mode", MODES)
def test_a_context_variable_set_around_the_call_reaches_every_stage(mode: str) -> None:
    """The stages after the first run on worker threads, which saw the variable's default."""
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(ScaledByContext(6, 8), nn.Tanh(), ScaledByContext(8, 8),
                             nn.Tanh(), ScaledByContext(8, 4)).double()

    plain, model = build(), build()
    pipe = piped(model, mode)
    x = batch()
    token = SCALE.set(3.0)
    try:
        expected, got = plain(x), pipe(x)
        expected.square().sum().backward()
        got.square().sum().backward()
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
        assert_same_grads(plain, model)
        target = torch.zeros(8, 4, dtype=torch.float64)
        loss = pipe.train_step(x, target, nn.functional.mse_loss)
        torch.testing.assert_close(loss, nn.functional.mse_loss(plain(x), target))
    finally:
        SCALE.reset(token)
