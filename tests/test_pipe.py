"""Pipe: construction, the Sequential face, state dicts, and outputs/gradients vs. the plain model.

Every comparison runs the same model twice: a deepcopy kept unwrapped (the reference) and
the original wrapped in a ``Pipe`` over ``k`` CPU partitions. Models are float64 so that
the only difference (the order in which micro-batch gradients are summed) stays far below
the tolerances.
"""
from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from seqpipe import Pipe

MODES = ["always", "except_last", "never"]
BALANCES = {1: [5], 2: [2, 3], 3: [1, 2, 2]}
CHUNKS = [1, 3, 4, 10, 16]  # with a batch of 10: even, uneven, one per sample, more than batch


def mlp() -> nn.Sequential:
    """Five layers, float64."""
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(),
                         nn.Linear(7, 3)).double()


def cpu_pipe(model: nn.Sequential, balance, **kwargs) -> Pipe:
    return Pipe(model, balance=balance, devices=["cpu"] * len(balance), **kwargs)


def weighted_sum(output: torch.Tensor) -> torch.Tensor:
    """A loss whose gradient differs per output element (a plain sum would hide mix-ups)."""
    weights = torch.linspace(-1.0, 2.0, output.numel(), dtype=output.dtype).view_as(output)
    return (output * weights).sum()


def assert_param_grads_equal(pipe: nn.Module, ref: nn.Module) -> None:
    got, want = dict(pipe.named_parameters()), dict(ref.named_parameters())
    assert got.keys() == want.keys()
    for name, param in want.items():
        if param.grad is None:
            assert got[name].grad is None, name
        else:
            assert got[name].grad is not None, f"{name} got no gradient"
            assert_close(got[name].grad, param.grad, msg=lambda m, n=name: f"{n}: {m}")


# -- outputs and gradients ---------------------------------------------------------------

@pytest.mark.parametrize("partitions", [1, 2, 3])
@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("mode", MODES)
def test_output_input_grad_and_param_grads_match_plain(mode, chunks, partitions):
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = cpu_pipe(model, BALANCES[partitions], chunks=chunks, checkpoint=mode)
    x = torch.randn(10, 5, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()

    y, y_ref = pipe(x), ref(x_ref)
    assert_close(y, y_ref)
    weighted_sum(y).backward()
    weighted_sum(y_ref).backward()

    assert_close(x.grad, x_ref.grad)
    assert_param_grads_equal(pipe, ref)


class WithIds(nn.Module):
    """Applies ``inner`` to the features of an ``(h, ids)`` pair and passes the ids along."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, pair):
        h, ids = pair
        return self.inner(h), ids


class AddEmbedding(nn.Module):
    """The first layer to use the token ids: ``(h, ids) -> h + embed(ids)``."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)

    def forward(self, pair):
        h, ids = pair
        return h + self.embed(ids)


class Split(nn.Module):
    """Returns a tuple: ``x -> (a(x), tanh(b(x)))``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)

    def forward(self, x):
        return self.a(x), torch.tanh(self.b(x))


class Merge(nn.Module):
    """Receives the tuple as one argument: ``(a, b) -> a * b``."""

    def forward(self, pair):
        a, b = pair
        return a * b


def tuple_model() -> nn.Sequential:
    """(x, ids) in; ids travel untouched until layer 2; layers 3 -> 4 pass a tuple; 5 layers."""
    return nn.Sequential(WithIds(nn.Linear(4, 6)), WithIds(nn.Tanh()), AddEmbedding(11, 6),
                         Split(6), Merge()).double()


@pytest.mark.parametrize("balance", [[5], [2, 2, 1], [1, 1, 1, 2], [4, 1]])
@pytest.mark.parametrize("chunks", [1, 3, 4])
@pytest.mark.parametrize("mode", MODES)
def test_tuple_input_with_token_ids_and_tuple_between_layers(mode, chunks, balance):
    model = tuple_model()
    ref = copy.deepcopy(model)
    pipe = cpu_pipe(model, balance, chunks=chunks, checkpoint=mode)
    x = torch.randn(10, 4, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 11, (10,))
    x_ref = x.detach().clone().requires_grad_()

    y, y_ref = pipe((x, ids)), ref((x_ref, ids))
    assert_close(y, y_ref)
    weighted_sum(y).backward()
    weighted_sum(y_ref).backward()

    assert_close(x.grad, x_ref.grad)
    assert ids.grad is None
    assert_param_grads_equal(pipe, ref)


class SplitWithIds(nn.Module):
    """``(h, ids) -> (a(h), tanh(b(h)), ids)``: a flat tuple output with an integer tensor."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.split = Split(dim)

    def forward(self, pair):
        h, ids = pair
        return (*self.split(h), ids)


@pytest.mark.parametrize("balance", [[3], [1, 2], [2, 1], [1, 1, 1]])
@pytest.mark.parametrize("mode", MODES)
def test_tuple_output_with_an_integer_tensor(mode, balance):
    model = nn.Sequential(WithIds(nn.Linear(4, 6)), WithIds(nn.Tanh()),
                          SplitWithIds(6)).double()
    ref = copy.deepcopy(model)
    pipe = cpu_pipe(model, balance, chunks=4, checkpoint=mode)
    x = torch.randn(10, 4, dtype=torch.float64, requires_grad=True)
    ids = torch.arange(10)
    x_ref = x.detach().clone().requires_grad_()

    a, b, out_ids = pipe((x, ids))
    a_ref, b_ref, _ = ref((x_ref, ids))
    assert_close((a, b), (a_ref, b_ref))
    assert torch.equal(out_ids, ids)
    assert out_ids.dtype == torch.int64 and not out_ids.requires_grad
    (weighted_sum(a) + b.pow(2).sum()).backward()
    (weighted_sum(a_ref) + b_ref.pow(2).sum()).backward()
    assert_close(x.grad, x_ref.grad)
    assert_param_grads_equal(pipe, ref)


def test_tuple_output_keeps_its_structure():
    pipe = cpu_pipe(nn.Sequential(nn.Linear(3, 3), Split(3)), [1, 1], chunks=2)
    out = pipe(torch.randn(4, 3))
    assert isinstance(out, tuple) and len(out) == 2
    assert all(t.shape == (4, 3) for t in out)


@pytest.mark.parametrize("partitions", [1, 3])
@pytest.mark.parametrize("mode", MODES)
def test_input_not_requiring_grad(mode, partitions):
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = cpu_pipe(model, BALANCES[partitions], chunks=3, checkpoint=mode)
    x = torch.randn(10, 5, dtype=torch.float64)

    y = pipe(x)
    assert y.requires_grad  # the parameters still need gradients
    weighted_sum(y).backward()
    weighted_sum(ref(x)).backward()
    assert x.grad is None
    assert_param_grads_equal(pipe, ref)


@pytest.mark.parametrize("partitions", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_frozen_parameters_get_no_grad(mode, partitions):
    model = mlp()
    for param in (*model[0].parameters(), model[4].bias):
        param.requires_grad_(False)
    ref = copy.deepcopy(model)
    pipe = cpu_pipe(model, BALANCES[partitions], chunks=4, checkpoint=mode)
    x = torch.randn(10, 5, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()

    weighted_sum(pipe(x)).backward()
    weighted_sum(ref(x_ref)).backward()
    assert pipe[0].weight.grad is None and pipe[0].bias.grad is None
    assert pipe[4].bias.grad is None
    assert pipe[2].weight.grad is not None
    assert_close(x.grad, x_ref.grad)
    assert_param_grads_equal(pipe, ref)


def test_everything_frozen_and_input_without_grad_gives_output_without_grad():
    model = mlp().requires_grad_(False)
    ref = copy.deepcopy(model)
    pipe = cpu_pipe(model, [2, 3], chunks=3)
    x = torch.randn(10, 5, dtype=torch.float64)
    y = pipe(x)
    assert not y.requires_grad
    assert_close(y, ref(x))


def test_frozen_model_still_gives_input_grad():
    model = mlp().requires_grad_(False)
    ref = copy.deepcopy(model)
    pipe = cpu_pipe(model, [1, 2, 2], chunks=4, checkpoint="always")
    x = torch.randn(10, 5, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    weighted_sum(pipe(x)).backward()
    weighted_sum(ref(x_ref)).backward()
    assert_close(x.grad, x_ref.grad)
    assert all(p.grad is None for p in pipe.parameters())


# -- training ----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_sgd_momentum_trajectory_matches_plain(mode):
    model = mlp()
    ref = copy.deepcopy(model)
    first_weight = model[0].weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # before wrapping
    ref_optimizer = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    pipe = cpu_pipe(model, [1, 2, 2], chunks=4, checkpoint=mode)
    assert pipe[0].weight is first_weight
    x = torch.randn(12, 5, dtype=torch.float64)
    target = torch.randn(12, 3, dtype=torch.float64)

    losses, ref_losses = [], []
    for _ in range(20):
        for net, opt, log in ((pipe, optimizer, losses), (ref, ref_optimizer, ref_losses)):
            opt.zero_grad()
            loss = nn.functional.mse_loss(net(x), target)
            loss.backward()
            opt.step()
            log.append(loss.item())

    assert_close(torch.tensor(losses, dtype=torch.float64),
                 torch.tensor(ref_losses, dtype=torch.float64))
    assert losses[-1] < 0.7 * losses[0]  # it did train
    assert_close(dict(pipe.named_parameters()), dict(ref.named_parameters()))


# -- grad modes --------------------------------------------------------------------------

def test_no_grad_forward_gives_output_without_grad():
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = cpu_pipe(model, [2, 3], chunks=4, checkpoint="always")
    x = torch.randn(10, 5, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        y = pipe(x)
    assert not y.requires_grad and y.grad_fn is None
    assert_close(y, ref(x).detach())


def test_eval_mode_matches_plain_eval_with_dropout_and_batchnorm():
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Dropout(0.5),
                          nn.Linear(6, 3)).double()
    model[1].running_mean.uniform_(-1, 1)
    model[1].running_var.uniform_(0.5, 2)
    ref = copy.deepcopy(model).eval()
    pipe = cpu_pipe(model, [2, 2], chunks=3).eval()
    assert not any(m.training for m in pipe.modules())
    x = torch.randn(10, 5, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = pipe(x), ref(x_ref)
    assert_close(y, y_ref)
    weighted_sum(y).backward()
    weighted_sum(y_ref).backward()
    assert_close(x.grad, x_ref.grad)
    assert_param_grads_equal(pipe, ref)


@pytest.mark.parametrize("mode", MODES)
def test_autograd_grad_wrt_input_leaves_param_grads_untouched(mode):
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = cpu_pipe(model, [1, 2, 2], chunks=4, checkpoint=mode)
    x = torch.randn(10, 5, dtype=torch.float64, requires_grad=True)

    (grad,) = torch.autograd.grad(weighted_sum(pipe(x)), x)
    (grad_ref,) = torch.autograd.grad(weighted_sum(ref(x)), x)
    assert_close(grad, grad_ref)
    assert x.grad is None
    assert all(p.grad is None for p in pipe.parameters())


def test_autograd_grad_wrt_parameters():
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = cpu_pipe(model, [2, 3], chunks=3, checkpoint="except_last")
    x = torch.randn(10, 5, dtype=torch.float64)
    grads = torch.autograd.grad(weighted_sum(pipe(x)), list(pipe.parameters()))
    grads_ref = torch.autograd.grad(weighted_sum(ref(x)), list(ref.parameters()))
    assert_close(grads, grads_ref)
    assert all(p.grad is None for p in pipe.parameters())


@pytest.mark.parametrize("mode", MODES)
def test_two_forwards_then_one_backward_of_the_summed_loss(mode):
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = cpu_pipe(model, [1, 2, 2], chunks=3, checkpoint=mode)
    x1 = torch.randn(10, 5, dtype=torch.float64, requires_grad=True)
    x2 = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    r1, r2 = (x.detach().clone().requires_grad_() for x in (x1, x2))

    (weighted_sum(pipe(x1)) + pipe(x2).pow(2).sum()).backward()
    (weighted_sum(ref(r1)) + ref(r2).pow(2).sum()).backward()
    assert_close(x1.grad, r1.grad)
    assert_close(x2.grad, r2.grad)
    assert_param_grads_equal(pipe, ref)


def test_dtype_change_with_to_works():
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    ref = copy.deepcopy(model).double()
    pipe = cpu_pipe(model, [2, 1], chunks=2)
    assert pipe.to(torch.float64) is pipe
    assert all(p.dtype == torch.float64 for p in pipe.parameters())
    x = torch.randn(6, 5, dtype=torch.float64)
    y = pipe(x)
    assert y.dtype == torch.float64
    assert_close(y, ref(x))


# -- construction and the Sequential face ------------------------------------------------

def test_placement_mode_puts_layers_already_on_cpu_in_one_partition():
    model = mlp()
    layers = list(model)
    pipe = Pipe(model, chunks=2)
    assert pipe.balance == [5]
    assert pipe.devices == [torch.device("cpu")]
    assert len(pipe.partitions) == 1
    assert list(pipe.partitions[0]) == layers


def test_placement_mode_with_parameterless_layers_only():
    pipe = Pipe(nn.Sequential(nn.ReLU(), nn.Tanh()))
    assert pipe.balance == [2] and pipe.devices == [torch.device("cpu")]
    x = torch.randn(3, 2)
    assert_close(pipe(x), torch.tanh(torch.relu(x)))


def test_defaults():
    pipe = Pipe(mlp())
    assert pipe.chunks == 1
    assert pipe.checkpoint == "except_last"


def test_balance_without_devices_defaults_to_cpu_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("the default devices are the GPUs here")
    pipe = Pipe(mlp(), balance=[2, 3])
    assert pipe.devices == [torch.device("cpu")] * 2


def test_sequential_face():
    model = mlp()
    layers = list(model)
    pipe = Pipe(model, chunks=4, checkpoint="always", balance=[1, 2, 2],
                devices=["cpu", torch.device("cpu"), "cpu"])
    assert len(pipe) == 5
    assert [pipe[i] for i in range(5)] == layers
    assert all(pipe[i] is layer for i, layer in enumerate(layers))
    assert pipe[-1] is layers[-1]
    assert list(pipe) == layers and all(a is b for a, b in zip(pipe, layers))
    assert pipe.balance == [1, 2, 2]
    assert pipe.devices == [torch.device("cpu")] * 3
    assert pipe.chunks == 4
    assert pipe.checkpoint == "always"
    assert len(pipe.partitions) == 3
    assert [len(p) for p in pipe.partitions] == [1, 2, 2]
    flattened = [layer for part in pipe.partitions for layer in part]
    assert all(a is b for a, b in zip(flattened, layers)) and len(flattened) == 5


def test_wrapping_keeps_parameter_identity_and_registers_each_once():
    model = mlp()
    params = list(model.parameters())
    pipe = cpu_pipe(model, [2, 3])
    assert len(list(pipe.parameters())) == len(params)
    assert all(a is b for a, b in zip(pipe.parameters(), params))


def named_model() -> nn.Sequential:
    return nn.Sequential(OrderedDict([
        ("embed", nn.Linear(4, 6)),
        ("norm", nn.BatchNorm1d(6)),
        ("act", nn.ReLU()),
        ("head", nn.Linear(6, 2)),
    ])).double()


def perturbed(model: nn.Module) -> nn.Module:
    """The same architecture with different values in every parameter and buffer."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.uniform_(0.5, 1.5)
            else:
                tensor.fill_(7)
    return model


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("make", [mlp, named_model], ids=["indexed", "named"])
def test_state_dict_keys_equal_the_sequentials(make, deferred):
    model = make()
    keys = list(model.state_dict())
    pipe = cpu_pipe(model, [2, len(model) - 2], deferred_batch_norm=deferred)
    assert list(pipe.state_dict()) == keys
    assert [name for name, _ in pipe.named_parameters()] == [
        name for name, _ in make().named_parameters()]


def test_named_children_are_reachable_by_name():
    model = named_model()
    head = model.head
    pipe = cpu_pipe(model, [2, 2])
    assert pipe.head is head
    assert "norm.running_var" in pipe.state_dict()


@pytest.mark.parametrize("make", [mlp, named_model], ids=["indexed", "named"])
def test_state_dict_loads_from_pipelined_into_plain(make):
    pipe = cpu_pipe(perturbed(make()), [1, len(make()) - 1], chunks=2,
                    deferred_batch_norm=True)
    plain = make()
    plain.load_state_dict(pipe.state_dict(), strict=True)
    assert_close(plain.state_dict(), pipe.state_dict())
    plain.eval(), pipe.eval()
    x = torch.randn(5, 4 if make is named_model else 5, dtype=torch.float64)
    assert_close(pipe(x), plain(x))


@pytest.mark.parametrize("make", [mlp, named_model], ids=["indexed", "named"])
def test_state_dict_loads_from_plain_into_pipelined(make):
    model = make()
    params = list(model.parameters())
    pipe = cpu_pipe(model, [1, len(model) - 1], chunks=2, deferred_batch_norm=True)
    plain = perturbed(make())
    pipe.load_state_dict(plain.state_dict(), strict=True)
    assert_close(pipe.state_dict(), plain.state_dict())
    assert all(a is b for a, b in zip(pipe.parameters(), params))  # loaded in place
    plain.eval(), pipe.eval()
    x = torch.randn(5, 4 if make is named_model else 5, dtype=torch.float64)
    assert_close(pipe(x), plain(x))


def _compile_case() -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 2))
    plain = copy.deepcopy(model)
    x = torch.randn(6, 4)
    plain(x).square().sum().backward()
    pipe = Pipe(model, chunks=3, balance=[3, 2], devices=["cpu", "cpu"])
    return pipe, plain, x


def _assert_matches_plain(pipe: Pipe, plain: nn.Sequential, out: torch.Tensor,
                          x: torch.Tensor) -> None:
    assert torch.allclose(out, plain(x), atol=1e-6)
    out.square().sum().backward()
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name


def test_pipe_compile_compiles_layers_in_place() -> None:
    pipe, plain, x = _compile_case()
    keys = list(pipe.state_dict())
    layers = list(pipe)
    pipe.compile(backend="eager")
    assert list(pipe) == layers and list(pipe.state_dict()) == keys
    assert all(layer._compiled_call_impl is not None for layer in pipe)
    _assert_matches_plain(pipe, plain, pipe(x), x)


def test_torch_compile_of_a_pipe_runs_it_uncompiled_and_says_so() -> None:
    pipe, plain, x = _compile_case()
    compiled = torch.compile(pipe, backend="eager")
    with pytest.warns(UserWarning, match=r"torch.compile\(pipe\) runs the Pipe as it is.*"
                                         r"pipe.compile\(\)"):
        out = compiled(x)
    _assert_matches_plain(pipe, plain, out, x)


@pytest.mark.parametrize("where", ["the pipe", "a function calling it"])
def test_one_partition_under_torch_compile_runs_uncompiled_with_the_plain_gradients(
        where: str) -> None:
    """One micro-batch of one partition skips the engine, and its call skips the wrapper
    that keeps dynamo out of the pipe unless dynamo traces it or compiles the frames it runs
    (``Pipe.forward``): compiled, it still runs the plain model's graph, eagerly."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    plain = copy.deepcopy(model)
    x = torch.randn(6, 4)
    plain(x).square().sum().backward()
    pipe = Pipe(model, chunks=1, balance=[3], devices=["cpu"])
    compiled = torch.compile(pipe if where == "the pipe" else (lambda t: pipe(t) * 1),
                             backend="eager")
    with pytest.warns(UserWarning, match=r"torch.compile\(pipe\) runs the Pipe as it is"):
        out = compiled(x)
    _assert_matches_plain(pipe, plain, out, x)
