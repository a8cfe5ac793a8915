"""``seqpipe.compat``: code written for torchgpipe or torch's removed ``Pipe`` ports by imports.

The central tests run one script text twice, with only its import lines substituted: once
for the peer (skipped where the peer cannot be imported: torch's ``Pipe`` is gone since
PyTorch 2.4, and torchgpipe is not a dependency) and once for seqpipe's stand-in, and
compare losses and parameters with the same model trained unpipelined. Models are float64,
so the only difference (the order micro-batch gradients are summed in) stays far below the
tolerances.
"""
from __future__ import annotations

import copy
import importlib.util
import re
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.testing import assert_close

import seqpipe
import seqpipe.compat.torch_pipe as torch_pipe
import seqpipe.compat.torchgpipe as torchgpipe
from distributed_harness import free_port
from seqpipe.compat._moving import MovingDenied
from seqpipe.compat.torch_pipe import LocalRRef, Pipe, WithDevice
from seqpipe.compat.torch_pipe.pipe import _Leaf, _placement, _torch_prefixes
from seqpipe.compat.torch_pipe.utils import partition_model
from seqpipe.compat.torchgpipe import GPipe


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package is missing, or a blocked module
        return False


def run_script(source: str, name: str) -> Dict[str, Any]:
    """Execute a script text as a module would run; return its globals."""
    namespace: Dict[str, Any] = {"__name__": name}
    exec(compile(source, f"<{name}>", "exec"), namespace)
    return namespace


def assert_same_training(pipelined: Dict[str, Any], plain_model: nn.Module) -> None:
    """The script's losses and trained parameters equal those of the plain model."""
    plain_losses = pipelined["train"](plain_model)
    assert_close(pipelined["losses"], plain_losses)
    got = [p.detach() for p in pipelined["model"].parameters()]
    want = [p.detach() for p in plain_model.parameters()]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert_close(a, b)


# --------------------------------------------------------------------------------------
# torchgpipe: the same script, `torchgpipe` or `seqpipe.compat.torchgpipe`
# --------------------------------------------------------------------------------------

TORCHGPIPE_SCRIPT = '''
import torch
import torch.nn.functional as F
from torch import nn

import {pkg} as torchgpipe
from {pkg} import GPipe
from {pkg}.balance import balance_by_time
from {pkg}.skip import Namespace, pop, skippable, stash


@skippable(stash=["skip"])
class Down(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        yield stash("skip", x)
        return torch.relu(self.lin(x))


@skippable(pop=["skip"])
class Up(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 8)

    def forward(self, x):
        skip = yield pop("skip")
        if not torchgpipe.is_recomputing():
            calls.append(torchgpipe.is_checkpointing())
        return self.lin(torch.cat([x, skip], dim=1))


calls = []


def build():
    torch.manual_seed(0)
    ns = Namespace()
    return nn.Sequential(nn.Linear(4, 8), Down().isolate(ns), nn.Tanh(), nn.Linear(8, 8),
                         nn.ReLU(), Up().isolate(ns), nn.Linear(8, 2)).double()


def train(model, steps=3):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 4, generator=gen, dtype=torch.float64)
        y = torch.randn(16, 2, generator=gen, dtype=torch.float64)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


model = build()
sample = torch.randn(16, 4, dtype=torch.float64)
balance = balance_by_time(2, model, sample, timeout=0.05, device="cpu")
model = GPipe(model, balance, devices=["cpu", "cpu"], chunks=4)
assert len(model) == 7 and sum(model.balance) == 7 and model.chunks == 4
assert model.devices == [torch.device("cpu")] * 2 and model.checkpoint == "except_last"
assert isinstance(model[1], nn.Module) and len(model.partitions) == 2
calls.clear()
losses = train(model)
assert calls.count(True) == 3 * 3  # 3 steps, all but the last of 4 micro-batches
'''

TORCHGPIPE_PACKAGES = [
    pytest.param("seqpipe.compat.torchgpipe", id="seqpipe"),
    pytest.param("torchgpipe", id="torchgpipe", marks=pytest.mark.skipif(
        not _importable("torchgpipe"), reason="torchgpipe is not installed")),
]


@pytest.mark.parametrize("package", TORCHGPIPE_PACKAGES)
def test_torchgpipe_script_runs_with_only_the_import_changed(package: str) -> None:
    script = run_script(TORCHGPIPE_SCRIPT.format(pkg=package), package)
    assert_same_training(script, script["build"]())


@pytest.mark.skipif(not _importable("torchgpipe"), reason="torchgpipe is not installed")
def test_torchgpipe_and_the_stand_in_train_alike() -> None:
    peer = run_script(TORCHGPIPE_SCRIPT.format(pkg="torchgpipe"), "torchgpipe")
    ours = run_script(TORCHGPIPE_SCRIPT.format(pkg="seqpipe.compat.torchgpipe"), "ours")
    assert_close(ours["losses"], peer["losses"])
    for a, b in zip(ours["model"].parameters(), peer["model"].parameters()):
        assert_close(a.detach(), b.detach())


def test_torchgpipe_names_are_seqpipes() -> None:
    assert torchgpipe.is_checkpointing is seqpipe.is_checkpointing
    assert torchgpipe.is_recomputing is seqpipe.is_recomputing
    assert torchgpipe.skip.stash is seqpipe.skip.stash
    assert torchgpipe.skip.Namespace is seqpipe.skip.Namespace
    assert issubclass(torchgpipe.batchnorm.DeferredBatchNorm, seqpipe.batchnorm.DeferredBatchNorm)
    assert issubclass(GPipe, seqpipe.Pipe)
    assert set(torchgpipe.skip.__all__) == {"skippable", "stash", "pop", "verify_skippables",
                                            "Namespace"}


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.Tanh(),
                         nn.Linear(6, 2)).double()


def test_gpipe_signature_balance_second_and_keyword_only_rest() -> None:
    pipe = GPipe(_mlp(), [2, 3], devices=["cpu", "cpu"], chunks=2, checkpoint="never",
                 deferred_batch_norm=False)
    assert pipe.balance == [2, 3] and pipe.chunks == 2 and pipe.checkpoint == "never"
    assert GPipe(_mlp(), balance=(1, 4), devices=["cpu"] * 2).balance == [1, 4]
    with pytest.raises(TypeError):
        GPipe(_mlp(), [2, 3], ["cpu", "cpu"])  # type: ignore[misc]  # devices is keyword-only


def test_gpipe_without_balance_says_how_to_get_one() -> None:
    with pytest.raises(ValueError, match="balance_by_time"):
        GPipe(_mlp())


def test_gpipe_devices_default_to_cpu_without_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only default")
    assert GPipe(_mlp(), [2, 3]).devices == [torch.device("cpu")] * 2


def test_gpipe_refuses_moves_with_a_type_error_and_allows_dtype() -> None:
    pipe = GPipe(_mlp(), [2, 3], devices=["cpu"] * 2)
    for move in (pipe.cpu, lambda: pipe.cuda(), lambda: pipe.to("cpu"),
                 lambda: pipe.to(torch.zeros(1))):
        with pytest.raises(TypeError, match="devices="):
            move()
    with pytest.raises(RuntimeError):  # seqpipe's own exception type still catches it
        pipe.cpu()
    assert issubclass(MovingDenied, TypeError) and issubclass(MovingDenied, RuntimeError)
    assert pipe.to(torch.float32) is pipe and pipe[0].weight.dtype == torch.float32


def _plain_keys(state: Dict[str, Any]) -> Dict[str, Any]:
    """torchgpipe keys with the ``partitions.<j>.`` prefix dropped: the model's own keys."""
    return {re.sub(r"^partitions\.\d+\.", "", key): value for key, value in state.items()}


def test_gpipe_module_structure_and_keys_are_torchgpipes() -> None:
    model = _mlp()
    layers = list(model)
    pipe = GPipe(model, [2, 3], devices=["cpu"] * 2)
    assert [name for name, _ in pipe.named_children()] == ["partitions"]
    assert isinstance(pipe.partitions, nn.ModuleList)
    assert [list(p._modules) for p in pipe.partitions] == [["0", "1"], ["2", "3", "4"]]
    assert list(pipe) == layers and len(pipe) == 5 and pipe[-1] is layers[-1]
    assert list(pipe.state_dict()) == [
        "partitions.0.0.weight", "partitions.0.0.bias", "partitions.1.2.weight",
        "partitions.1.2.bias", "partitions.1.4.weight", "partitions.1.4.bias"]
    plain = _mlp()
    plain.load_state_dict(_plain_keys(pipe.state_dict()))
    with torch.no_grad():
        for param in plain.parameters():
            param.add_(1.0)
    assert not pipe.load_state_dict(plain.state_dict(), strict=True).missing_keys  # plain keys
    for key, value in plain.state_dict().items():
        assert_close(_plain_keys(pipe.state_dict())[key], value, msg=key)
    again = GPipe(_mlp(), [3, 2], devices=["cpu"] * 2)  # another balance: its own keys
    again.load_state_dict(pipe.state_dict(), strict=True)
    assert_close(again[4].weight, plain[4].weight)


def _skip_model(skip: Any) -> nn.Sequential:
    @skip.skippable(stash=["s"])
    class Stash(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> Any:
            yield skip.stash("s", x)
            return self.lin(x)

    @skip.skippable(pop=["s"])
    class Pop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> Any:
            s = yield skip.pop("s")
            return self.lin(x) + s

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), Stash(), nn.BatchNorm1d(4), nn.ReLU(), Pop(),
                         nn.Linear(4, 2)).double()


def _torchgpipe_checkpoint(model: nn.Sequential, balance: List[int]) -> Dict[str, torch.Tensor]:
    """The state dict torchgpipe 0.0.7 saves for ``model`` (skippables wrapped, deferred BN).

    Written out by hand so the test needs no torchgpipe: ``partitions.<i>.<name>.`` before
    each layer, ``module.`` inside a skippable wrapper, and the ``sum``/``sum_squares``
    buffers of torchgpipe's DeferredBatchNorm.
    """
    saved: Dict[str, torch.Tensor] = {}
    names = iter(model._modules.items())
    for index, count in enumerate(balance):
        for _ in range(count):
            name, layer = next(names)
            inner = "module." if seqpipe.skip.is_skippable(layer) else ""
            for key, value in layer.state_dict().items():
                saved[f"partitions.{index}.{name}.{inner}{key}"] = value.clone()
            if isinstance(layer, nn.BatchNorm1d):
                saved[f"partitions.{index}.{name}.sum"] = torch.zeros(4, dtype=torch.float64)
                saved[f"partitions.{index}.{name}.sum_squares"] = torch.zeros(
                    4, dtype=torch.float64)
    return saved


def test_gpipe_loads_a_torchgpipe_checkpoint_saved_with_another_balance() -> None:
    source = _skip_model(torchgpipe.skip)
    with torch.no_grad():
        for param in source.parameters():
            param.add_(1.0)
    saved = _torchgpipe_checkpoint(source, [1, 5])
    pipe = GPipe(_skip_model(torchgpipe.skip), [3, 3], devices=["cpu"] * 2, chunks=2,
                 deferred_batch_norm=True)
    result = pipe.load_state_dict(saved, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for key, value in source.state_dict().items():
        assert_close(_plain_keys(pipe.state_dict())[key], value, msg=key)


def test_legacy_loading_leaves_other_keys_to_strict() -> None:
    pipe = GPipe(_mlp(), [2, 3], devices=["cpu"] * 2)
    state = dict(pipe.state_dict())
    state["partitions.0.9.weight"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match="partitions.0.9.weight"):
        pipe.load_state_dict(state)
    result = pipe.load_state_dict(state, strict=False)
    assert result.unexpected_keys == ["partitions.0.9.weight"]
    assert result.missing_keys == []


def test_torchgpipe_deferred_batch_norm_conversion() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).double()
    reference = copy.deepcopy(model)
    bn = model[1]
    assert torchgpipe.batchnorm.convert_deferred_batch_norm(model, 4) is model
    assert model[1] is bn and isinstance(bn, torchgpipe.batchnorm.DeferredBatchNorm)
    pipe = GPipe(model, [1, 1], devices=["cpu"] * 2, chunks=4)
    x = torch.randn(16, 4, dtype=torch.float64)
    pipe(x)
    reference(x)
    assert_close(bn.running_mean, reference[1].running_mean)
    assert_close(bn.running_var, reference[1].running_var)


# --------------------------------------------------------------------------------------
# torch.distributed.pipeline.sync: the same script, torch's or seqpipe.compat.torch_pipe
# --------------------------------------------------------------------------------------

TORCH_PIPE_SCRIPT = '''
import torch
import torch.nn.functional as F
from torch import nn

from {pkg} import Pipe, WithDevice
from {pkg}.skip import pop, skippable, stash


@skippable(stash=["residual"])
class Save(nn.Module):
    def forward(self, x):
        yield stash("residual", x)
        return x


@skippable(pop=["residual"])
class Add(nn.Module):
    def forward(self, x):
        residual = yield pop("residual")
        return x + residual


def build():
    torch.manual_seed(0)
    fc1 = nn.Linear(16, 8).to("cpu")
    block = nn.Sequential(Save(), nn.Linear(8, 8), nn.Tanh()).to("cpu")
    fc2 = nn.Linear(8, 4).to("cpu")
    dropout = nn.Dropout(p=0.0)
    return nn.Sequential(fc1, block, Add(), WithDevice(dropout, "cpu"), fc2).double()


def train(model, steps=3):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.rand(16, 16, generator=gen, dtype=torch.float64)
        y = torch.rand(16, 4, generator=gen, dtype=torch.float64)
        optimizer.zero_grad()
        output = model(x)
        if not isinstance(output, torch.Tensor):
            output = output.local_value()
        loss = F.mse_loss(output, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


model = Pipe(build(), chunks=4)
losses = train(model)
output_rref = model(torch.rand(16, 16, dtype=torch.float64))
assert output_rref.to_here().shape == (16, 4)
assert output_rref.local_value() is output_rref.to_here()
'''

TORCH_PIPE_PACKAGES = [
    pytest.param("seqpipe.compat.torch_pipe", id="seqpipe"),
    pytest.param("torch.distributed.pipeline.sync", id="torch", marks=pytest.mark.skipif(
        not _importable("torch.distributed.pipeline.sync"),
        reason="torch.distributed.pipeline.sync was removed in PyTorch 2.4")),
]


@pytest.mark.parametrize("package", TORCH_PIPE_PACKAGES)
def test_torch_pipe_script_runs_with_only_the_import_changed(package: str) -> None:
    script = run_script(TORCH_PIPE_SCRIPT.format(pkg=package), package)
    assert_same_training(script, script["build"]())


def test_torch_pipe_names() -> None:
    assert torch_pipe.is_checkpointing is seqpipe.is_checkpointing
    assert torch_pipe.is_recomputing is seqpipe.is_recomputing
    assert torch_pipe.skip.stash is seqpipe.skip.stash
    assert torch_pipe.skip.pop is seqpipe.skip.pop
    assert torch_pipe.pipe.Pipe is Pipe  # `from ...sync.pipe import WithDevice` works too
    assert issubclass(Pipe, seqpipe.Pipe)


@pytest.mark.filterwarnings("ignore:You are using a Backend")  # from rpc.shutdown()
def test_init_rpc_may_stay() -> None:
    """The torch tutorial's opening, init_rpc and all, with only its import changed."""
    if not dist.is_available() or not dist.rpc.is_available():
        pytest.skip("torch.distributed.rpc is not available")
    from torch.distributed import rpc

    if rpc.api._is_current_rpc_agent_set():
        pytest.skip("an RPC agent is already running in this process")
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{free_port()}")
    rpc.init_rpc("worker", rank=0, world_size=1, rpc_backend_options=options)
    try:
        fc1 = nn.Linear(16, 8)
        fc2 = nn.Linear(8, 4)
        model = nn.Sequential(fc1, fc2)
        model = Pipe(model, chunks=8)
        input = torch.rand(16, 16)
        output_rref = model(input)
        assert output_rref.local_value().shape == (16, 4)
    finally:
        rpc.shutdown()


def test_forward_returns_a_local_rref_through_which_gradients_flow() -> None:
    model = _mlp()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out = Pipe(model, chunks=4)(x)
    assert isinstance(out, LocalRRef) and out.is_owner()
    out.local_value().sum().backward()
    reference(x_ref).sum().backward()
    assert_close(x.grad, x_ref.grad)
    for a, b in zip(model.parameters(), reference.parameters()):
        assert_close(a.grad, b.grad)


def test_pipe_takes_torchs_arguments_only() -> None:
    with pytest.raises(TypeError):
        Pipe(_mlp(), chunks=2, balance=[2, 3])  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="nn.Sequential"):
        Pipe(nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunks"):
        Pipe(_mlp(), chunks=0)
    with pytest.raises(TypeError, match="WithDevice"):
        Pipe(_mlp()).cuda()


def test_with_device_keeps_the_models_keys_and_moves_its_module() -> None:
    torch.manual_seed(0)
    inner = nn.Linear(4, 4)
    model = nn.Sequential(nn.Linear(4, 4), WithDevice(inner, "cpu"), nn.ReLU()).double()
    keys = list(model.state_dict())
    assert keys == ["0.weight", "0.bias", "1._module.weight", "1._module.bias"]
    reference = copy.deepcopy(model)
    pipe = Pipe(model, chunks=2)
    # torch's keys: every CPU layer its own partition, WithDevice unwrapped.
    assert list(pipe.state_dict()) == ["partitions.0.0.weight", "partitions.0.0.bias",
                                       "partitions.1.0.weight", "partitions.1.0.bias"]
    assert pipe[1] is inner and len(pipe) == 3 and inner.weight.device == torch.device("cpu")
    x = torch.randn(6, 4, dtype=torch.float64)
    assert_close(pipe(x).local_value(), reference(x))
    with torch.no_grad():
        reference[1].module.weight.mul_(2.0)
    pipe.load_state_dict(reference.state_dict(), strict=True)  # the model's own keys load
    assert_close(inner.weight, reference[1].module.weight)


def test_with_device_may_wrap_a_skippable_or_a_sequential() -> None:
    @seqpipe.skip.skippable(stash=["s"])
    class Keep(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            yield seqpipe.skip.stash("s", x)
            return x * 2

    @seqpipe.skip.skippable(pop=["s"])
    class Use(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            s = yield seqpipe.skip.pop("s")
            return x - s

    model = nn.Sequential(nn.Linear(3, 3), WithDevice(Keep(), "cpu"),
                          WithDevice(nn.Sequential(nn.Tanh(), Use()), "cpu")).double()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 3, dtype=torch.float64)
    assert_close(Pipe(model, chunks=2)(x).local_value(), reference(x))


def test_placement_rules() -> None:
    """Pins win; a layer without parameters joins the one before; runs of a device group."""
    pinned = [_Leaf("a", nn.Linear(1, 1), torch.device("cuda", 0)),
              _Leaf("b", nn.ReLU(), None),
              _Leaf("c", nn.ReLU(), torch.device("cuda", 1)),
              _Leaf("d", nn.Dropout(), None),
              _Leaf("e", nn.Linear(1, 1), torch.device("cuda", 1)),
              _Leaf("f", nn.Linear(1, 1), None)]  # on the CPU, where it was built
    balance, devices = _placement(pinned)
    assert balance == [2, 3, 1]
    assert devices == [torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")]
    leading = [_Leaf("a", nn.ReLU(), None), _Leaf("b", nn.Linear(1, 1), None)]
    assert _placement(leading) == ([2], [torch.device("cpu")])
    assert _placement([_Leaf("a", nn.ReLU(), None)]) == ([1], [torch.device("cpu")])


def test_nested_sequentials_are_looked_into_and_keep_their_keys() -> None:
    """A skip crossing two nested Sequentials works, as with torch's flattening Pipe."""
    script = run_script(TORCH_PIPE_SCRIPT.format(pkg="seqpipe.compat.torch_pipe"), "nested")
    model = script["build"]()
    assert "1.1.weight" in model.state_dict()
    pipe = Pipe(model, chunks=2)
    assert "partitions.1.1.weight" in pipe.state_dict()  # torch flattened the block
    assert len(pipe) == 7 and sum(pipe.balance) == 7  # its three layers counted one by one
    assert [len(p) for p in pipe.partitions] == [1, 3, 1, 1, 1]


def test_a_sequential_with_its_own_forward_runs_as_one_layer() -> None:
    class Doubled(nn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return super().forward(x) * 2

    torch.manual_seed(0)
    model = nn.Sequential(Doubled(nn.Linear(3, 3), nn.Tanh()), nn.Linear(3, 1)).double()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 3, dtype=torch.float64)
    pipe = Pipe(model, chunks=2)
    assert pipe.balance == [2]
    assert_close(pipe(x).local_value(), reference(x))


def _torch_pipe_checkpoint(source: nn.Sequential) -> Dict[str, Any]:
    """The state dict torch's Pipe (1.9-2.3) saved: ``partitions.<i>.<j>.`` keys.

    For the all-CPU model of the script: every top-level layer its own partition, nested
    Sequentials flattened, WithDevice unwrapped, skippables wrapped (``module.``).
    """
    saved: Dict[str, Any] = {}
    state = source.state_dict()
    saved["partitions.0.0.weight"] = state["0.weight"]
    saved["partitions.0.0.bias"] = state["0.bias"]
    saved["partitions.1.1.weight"] = state["1.1.weight"]  # block: Save, Linear, Tanh
    saved["partitions.1.1.bias"] = state["1.1.bias"]
    saved["partitions.4.0.weight"] = state["4.weight"]
    saved["partitions.4.0.bias"] = state["4.bias"]
    return saved


def test_pipe_loads_a_torch_pipe_checkpoint() -> None:
    script = run_script(TORCH_PIPE_SCRIPT.format(pkg="seqpipe.compat.torch_pipe"), "ckpt")
    source = script["build"]()
    with torch.no_grad():
        for param in source.parameters():
            param.mul_(-3.0)
    model = script["build"]()
    pipe = Pipe(model, chunks=2)
    pipe.load_state_dict(_torch_pipe_checkpoint(source), strict=True)
    for key, value in source.state_dict().items():
        assert_close(model.state_dict()[key], value, msg=key)
    assert list(pipe.state_dict()) == list(_torch_pipe_checkpoint(source))


def test_torch_prefixes_follow_torchs_split() -> None:
    """torch split at every device change and at every CPU layer, pins included."""
    model = nn.Sequential(nn.Linear(1, 1), nn.ReLU(),
                          WithDevice(nn.Sequential(nn.Linear(1, 1), nn.ReLU()), "cuda:1"),
                          WithDevice(nn.Linear(1, 1), "cuda:1"), nn.Linear(1, 1))
    assert _torch_prefixes(model) == {
        "partitions.0.0.": "0.", "partitions.1.0.": "1.",
        "partitions.2.0.": "2._module.0.", "partitions.2.1.": "2._module.1.",
        "partitions.2.2.": "3._module.", "partitions.3.0.": "4."}


def test_multiple_inputs_are_spread_over_the_first_layer_like_torch() -> None:
    class Combine(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
            return self.lin(x) + y, y

    class Second(nn.Module):
        def forward(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return h * y

    torch.manual_seed(0)
    model = nn.Sequential(Combine(), Second(), nn.Tanh()).double()
    x, y = (torch.randn(6, 3, dtype=torch.float64) for _ in range(2))
    want = torch.tanh(Second()(*model[0](x, y)))
    assert_close(Pipe(model, chunks=3)(x, y).local_value(), want)


def test_partition_model_groups_layers_for_pipe() -> None:
    grouped = partition_model(_mlp(), [2, 3], devices=["cpu", "cpu"])
    assert [len(group) for group in grouped] == [2, 3]
    assert list(grouped.state_dict())[:2] == ["0.0.weight", "0.0.bias"]
    reference = _mlp()
    x = torch.randn(4, 4, dtype=torch.float64)
    assert_close(Pipe(grouped, chunks=2)(x).local_value(), reference(x))
    if not torch.cuda.is_available():
        assert partition_model(_mlp(), [5])[0][0].weight.device == torch.device("cpu")
    with pytest.raises(ValueError, match="sums to"):
        partition_model(_mlp(), [2, 2])


def test_ddp_sees_through_the_local_rref(tmp_path: Any) -> None:
    """DDP found tensors in torch's RRef; it does in LocalRRef, even hunting unused ones.

    An output DDP cannot see into makes ``find_unused_parameters=True`` mark every
    parameter unused, then fail in backward ("marked as ready twice"). One rank suffices.
    """
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        for find_unused in (False, True):
            reference = _mlp()
            pipe = Pipe(_mlp(), chunks=2, checkpoint="always")
            ddp = DistributedDataParallel(pipe, find_unused_parameters=find_unused)
            for _ in range(2):
                x = torch.randn(8, 4, dtype=torch.float64)
                ddp(x).local_value().pow(2).mean().backward()
                reference(x).pow(2).mean().backward()
            for p, q in zip(pipe.parameters(), reference.parameters()):
                assert_close(p.grad, q.grad)
    finally:
        dist.destroy_process_group()
