"""Every error Pipe raises: its type and a message that says what is wrong."""
from __future__ import annotations

import threading
import traceback

import pytest
import torch
from torch import nn

from seqpipe import Pipe


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def cpu_pipe(model: nn.Sequential, balance, **kwargs) -> Pipe:
    return Pipe(model, balance=balance, devices=["cpu"] * len(balance), **kwargs)


def stage_threads() -> list:
    return [t.name for t in threading.enumerate() if t.name.startswith("seqpipe-stage-")]


# -- construction ------------------------------------------------------------------------

@pytest.mark.parametrize("module, mend", [
    (nn.Linear(2, 2), r"seqpipe\.to_sequential\(model, \(example_input,\)\) \(docs/models\.md\)"),
    (nn.ModuleList([nn.Linear(2, 2)]), r"put its layers in nn\.Sequential\(\*layers\)$")])
def test_module_must_be_a_sequential(module, mend):
    """A model with its own forward is pointed at ``to_sequential``; a list of layers at
    ``nn.Sequential``."""
    with pytest.raises(TypeError, match=rf"needs an nn\.Sequential, got {type(module).__name__}; "
                                        rf".*{mend}"):
        Pipe(module)


def test_empty_sequential():
    with pytest.raises(ValueError, match="nn.Sequential is empty"):
        Pipe(nn.Sequential())


@pytest.mark.parametrize("balance", [[1, 1], [2, 2], [4]])
def test_balance_must_sum_to_the_number_of_layers(balance):
    with pytest.raises(ValueError, match=rf"sums to {sum(balance)} but the module has 3 layers"):
        cpu_pipe(mlp(), balance)


@pytest.mark.parametrize("balance", [[0, 3], [3, 0], [-1, 4], [1.5, 1.5]])
def test_balance_entries_must_be_positive_ints(balance):
    with pytest.raises(ValueError, match="every entry of balance must be a positive int"):
        cpu_pipe(mlp(), balance)


def test_empty_balance():
    with pytest.raises(ValueError, match="balance is empty"):
        Pipe(mlp(), balance=[], devices=[])


def test_fewer_devices_than_partitions():
    with pytest.raises(IndexError, match="3 partitions need 3 devices, got 2"):
        Pipe(mlp(), balance=[1, 1, 1], devices=["cpu", "cpu"])


def test_devices_without_balance():
    with pytest.raises(ValueError, match="devices is given without balance"):
        Pipe(mlp(), devices=["cpu"])


def test_layer_whose_parameters_span_devices():
    layer = nn.Linear(2, 2)
    layer.bias = nn.Parameter(torch.zeros(2, device="meta"))
    with pytest.raises(ValueError, match=r"layer '1' \(Linear\) has parameters on several "
                                         r"devices \(cpu, meta\)"):
        Pipe(nn.Sequential(nn.ReLU(), layer))


@pytest.mark.parametrize("chunks", [0, -1, 1.5, True, "4", None])
def test_invalid_chunks(chunks):
    with pytest.raises(ValueError, match=r"chunks must be a positive int .* got " +
                       repr(chunks).replace(".", r"\.")):
        Pipe(mlp(), chunks=chunks)


@pytest.mark.parametrize("mode", ["sometimes", "ALWAYS", "", None, True])
def test_invalid_checkpoint(mode):
    with pytest.raises(ValueError, match="checkpoint must be one of 'always', 'except_last', "
                                         "'never'"):
        Pipe(mlp(), checkpoint=mode)


@pytest.mark.parametrize("kwargs", [{}, {"balance": [1, 1], "devices": ["cpu", "cpu"]}],
                         ids=["placement", "balance"])
def test_the_same_layer_object_twice(kwargs):
    layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="layers '0' and '1' are the same module object"):
        Pipe(nn.Sequential(layer, layer), **kwargs)


# -- inputs ------------------------------------------------------------------------------

@pytest.fixture
def pipe() -> Pipe:
    return cpu_pipe(mlp(), [2, 1], chunks=2)


def test_empty_batch(pipe):
    with pytest.raises(ValueError, match=r"the input batch is empty \(size 0 on dim 0\)"):
        pipe(torch.empty(0, 3))


def test_zero_dim_input(pipe):
    with pytest.raises(ValueError, match="needs a batch dimension .* 0-dim tensor"):
        pipe(torch.tensor(1.0))


def test_mismatched_batch_sizes_in_a_tuple_input():
    pipe = cpu_pipe(nn.Sequential(nn.Identity(), nn.Identity()), [1, 1], chunks=2)
    with pytest.raises(ValueError, match=r"share the batch size on dim 0, got sizes \[3, 4\]"):
        pipe((torch.randn(4, 2), torch.randn(3, 2)))


@pytest.mark.parametrize("value, described", [
    ("abc", "a str"),
    ({"x": 1}, "a dict"),
])
def test_non_tensor_input(pipe, value, described):
    with pytest.raises(TypeError, match="tensor or a tuple of tensors.*, got " +
                       described.replace("(", r"\(").replace(")", r"\)")):
        pipe(value)


def test_input_with_no_tensor_to_cut(pipe):
    """Non-tensor items ride along; an input made only of them has nothing to cut."""
    with pytest.raises(TypeError, match=r"needs a tensor to cut into micro-batches .*got a "
                                        r"list of \(float, float\) with none; pass at least one"):
        pipe([1.0, 2.0])


def test_empty_tuple_input(pipe):
    with pytest.raises(TypeError, match="empty tuple"):
        pipe(())


def test_layer_returning_a_non_tensor_at_a_boundary():
    class ReturnsDict(nn.Module):
        def forward(self, x):
            return {"x": x}

    pipe = cpu_pipe(nn.Sequential(ReturnsDict(), nn.Identity()), [1, 1])
    with pytest.raises(TypeError, match="tensor or a tuple of tensors.* got a dict") as info:
        pipe(torch.randn(2, 2))
    assert any("stage 0" in note for note in info.value.__notes__)


class ReturnsOutput(nn.Module):
    """Ends a model the way a Hugging Face model does: a ModelOutput (a dict) of tensors."""

    class ModelOutput(dict):
        pass

    def forward(self, x):
        return self.ModelOutput(logits=x, hidden_states=(x,))


@pytest.mark.parametrize("balance", [[2], [1, 1]], ids=["one partition", "two partitions"])
def test_last_layer_returning_a_model_output_names_the_pipelines_output(balance):
    """Even with one partition, there is no partition boundary to blame: the pipeline's
    output is what is wrong, and the mend is a last layer that picks the tensors out."""
    pipe = cpu_pipe(nn.Sequential(nn.Linear(2, 2), ReturnsOutput()), balance)
    with pytest.raises(TypeError) as info:
        pipe(torch.randn(2, 2))
    message = str(info.value)
    assert message.startswith("the pipeline's output (what the model's last layer "
                              "(ReturnsOutput) returns) must be a tensor or a tuple of tensors")
    assert "got a ModelOutput with keys (logits, hidden_states)" in message
    assert "end the nn.Sequential with a layer that returns the tensors you need" in message
    assert "partition boundary" not in message


def test_a_middle_layer_returning_a_dict_names_the_partition_boundary():
    class ReturnsDict(nn.Module):
        def forward(self, x):
            return {"x": x}

    pipe = cpu_pipe(nn.Sequential(ReturnsDict(), nn.Identity()), [1, 1])
    with pytest.raises(TypeError, match=r"what passes between partitions \(the output of "
                                        r"the layer \(ReturnsDict\) before the partition "
                                        r"boundary\) must be .* got a dict with keys \(x\); "
                                        r"return tensors from that layer"):
        pipe(torch.randn(2, 2))


class Total(nn.Module):
    def forward(self, x):
        return x.sum()


def test_last_layer_returning_a_scalar():
    pipe = cpu_pipe(nn.Sequential(nn.Identity(), Total()), [1, 1], chunks=1)
    with pytest.raises(ValueError, match="0-dim tensor.*compute the loss outside the pipeline"):
        pipe(torch.randn(2, 2))


# -- moving ------------------------------------------------------------------------------

@pytest.mark.parametrize("move", [
    lambda p: p.cuda(),
    lambda p: p.cpu(),
    lambda p: p.to("cpu"),
    lambda p: p.to(torch.device("cpu")),
    lambda p: p.to("cpu", torch.float64),
    lambda p: p.to(torch.empty(1)),
], ids=["cuda", "cpu", "to-str", "to-device", "to-device-dtype", "to-tensor"])
def test_moving_the_whole_pipe_is_refused(pipe, move):
    with pytest.raises(RuntimeError, match="moving the whole Pipe would undo that"):
        move(pipe)


def test_dtype_change_is_allowed(pipe):
    assert pipe.to(torch.float64) is pipe
    assert pipe.to(dtype=torch.float64) is pipe
    assert all(p.dtype == torch.float64 for p in pipe.parameters())
    assert pipe(torch.randn(4, 3, dtype=torch.float64)).dtype == torch.float64


# -- backward twice ----------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
def test_backward_twice_through_the_same_output(mode):
    pipe = cpu_pipe(mlp(), [2, 1], chunks=2, checkpoint=mode)
    loss = pipe(torch.randn(4, 3, requires_grad=True)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already backpropagated"):
        loss.backward()


def test_backward_twice_without_retain_graph():
    pipe = cpu_pipe(mlp(), [2, 1], chunks=2)
    out = pipe(torch.randn(4, 3, requires_grad=True))
    out.sum().backward()
    with pytest.raises(RuntimeError, match="already backpropagated"):
        out.sum().backward()


# -- exceptions raised inside the workers ------------------------------------------------

class FailInForward(nn.Module):
    """Raises on its ``call``-th forward (the micro-batch of that index, in forward order)."""

    def __init__(self, call: int) -> None:
        super().__init__()
        self.call, self.calls = call, 0

    def forward(self, x):
        index, self.calls = self.calls, self.calls + 1
        if index == self.call:
            raise KeyError(f"layer failed on micro-batch {index}")
        return x


def assert_raised_from(exc: BaseException, function: str, stage: int, phase: str,
                       microbatch: int) -> None:
    frames = traceback.extract_tb(exc.__traceback__)
    assert any(f.filename == __file__ and f.name == function for f in frames), frames
    notes = getattr(exc, "__notes__", [])
    assert any(f"stage {stage}" in note and f"{phase} of micro-batch {microbatch}" in note
               for note in notes), notes
    assert not stage_threads()


@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("stage, position", [(1, 3), (0, 1), (2, 4)])
def test_exception_in_a_worker_forward_reaches_the_caller(mode, stage, position):
    layers = [nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3), nn.Linear(3, 3), nn.ReLU()]
    layers.insert(position, FailInForward(call=2))
    pipe = cpu_pipe(nn.Sequential(*layers), [2, 2, 2], chunks=4, checkpoint=mode)
    with pytest.raises(KeyError, match="layer failed on micro-batch 2") as info:
        pipe(torch.randn(8, 3, requires_grad=True))
    assert type(info.value) is KeyError
    assert_raised_from(info.value, "forward", stage, "forward", 2)


def test_pipe_works_again_after_a_failure():
    failing = FailInForward(call=1)
    pipe = cpu_pipe(nn.Sequential(nn.Linear(3, 3), failing, nn.Linear(3, 3)), [1, 1, 1],
                    chunks=4)
    with pytest.raises(KeyError):
        pipe(torch.randn(8, 3))
    failing.call = -1
    out = pipe(torch.randn(8, 3))
    out.sum().backward()
    assert out.shape == (8, 3) and pipe[0].weight.grad is not None


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, tag, fail_on):
        ctx.tag, ctx.fail_on = tag, fail_on
        return h.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.tag == ctx.fail_on:
            raise ArithmeticError(f"backward failed on micro-batch {ctx.tag}")
        return grad, None, None


class FailInBackward(nn.Module):
    """Takes ``(h, ids)`` in micro-batches of 2 rows; its backward raises for one of them."""

    def __init__(self, microbatch: int) -> None:
        super().__init__()
        self.microbatch = microbatch

    def forward(self, pair):
        h, ids = pair
        return _RaiseInBackward.apply(h, int(ids[0]) // 2, self.microbatch), ids


class Features(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, pair):
        h, ids = pair
        return self.linear(h), ids


@pytest.mark.parametrize("mode", ["always", "never"])
def test_exception_in_a_worker_backward_reaches_the_caller(mode):
    model = nn.Sequential(Features(), Features(), FailInBackward(microbatch=1), Features())
    pipe = cpu_pipe(model, [1, 2, 1], chunks=4, checkpoint=mode)
    h, ids = pipe((torch.randn(8, 3, requires_grad=True), torch.arange(8)))
    with pytest.raises(ArithmeticError, match="backward failed on micro-batch 1") as info:
        h.sum().backward()
    assert type(info.value) is ArithmeticError
    assert_raised_from(info.value, "backward", 1, "backward", 1)


def test_higher_order_gradients_raise_instead_of_silently_dropping_the_graph() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    pipe = Pipe(model, chunks=2, balance=[2, 1], devices=["cpu", "cpu"])
    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(pipe(x).sum(), x, create_graph=True)


def test_lazy_modules_must_be_initialized_first():
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(2))
    with pytest.raises(ValueError, match=r"0\.weight, 0\.bias, 2\.weight and others not "
                                         r"initialized yet .*run the model once"):
        Pipe(model, chunks=2, balance=[2, 1], devices=["cpu", "cpu"])
    model(torch.randn(1, 3))  # initialized: now it pipelines
    pipe = Pipe(model, chunks=2, balance=[2, 1], devices=["cpu", "cpu"])
    pipe(torch.randn(4, 3)).sum().backward()
    assert all(p.grad is not None for p in pipe.parameters())


def test_counts_accept_index_types():
    """numpy integers (from a config file, say) are counts like Python ints."""
    np = pytest.importorskip("numpy")
    pipe = Pipe(mlp(), chunks=np.int64(2), balance=[np.int64(2), np.int32(1)],
                devices=["cpu", "cpu"])
    assert (pipe.chunks, pipe.balance) == (2, [2, 1])
    assert type(pipe.chunks) is int and all(type(b) is int for b in pipe.balance)
    x = torch.randn(4, 3)
    assert torch.allclose(pipe(x), nn.Sequential(*pipe)(x))
    from seqpipe.balance import balance_by_params
    assert balance_by_params(np.int64(2), mlp()) == balance_by_params(2, mlp())


def test_balance_that_is_not_a_sequence():
    with pytest.raises(TypeError, match=r"balance must be a sequence of layer counts, one per "
                                        r"partition, got 5; .*balance_by_params"):
        Pipe(mlp(), balance=5)


def test_bad_balance_entry_is_named():
    with pytest.raises(ValueError, match=r"entry 1 of \[2, 1\.0\] is 1\.0"):
        cpu_pipe(mlp(), [2, 1.0])


def test_more_devices_than_partitions_uses_the_first():
    """As torchgpipe: extra devices are not an error; pipe.devices lists the ones used."""
    pipe = Pipe(mlp(), balance=[2, 1], devices=["cpu", "cpu", "meta"])
    assert pipe.devices == [torch.device("cpu")] * 2
    x = torch.randn(4, 3)
    assert torch.allclose(pipe(x), nn.Sequential(*pipe)(x))


def test_layers_on_meta_are_refused_with_the_mend():
    with torch.device("meta"):
        model = mlp()
    for kwargs in ({}, {"balance": [2, 1], "devices": ["cpu", "cpu"]}):
        with pytest.raises(ValueError, match=r"0.weight, 0.bias, 2.weight and others are on "
                                             r"the meta device and hold no values; .*"
                                             r"DistributedPipe"):
            Pipe(model, **kwargs)


def test_a_meta_device_is_refused_before_any_layer_moves():
    model = mlp()
    with pytest.raises(ValueError, match=r"devices \['cpu', 'meta'\] include meta"):
        Pipe(model, balance=[2, 1], devices=["cpu", "meta"])
    assert not any(p.is_meta for p in model.parameters())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_cuda_device_without_cuda_is_refused_up_front_with_the_mend():
    """torch alone fails late, with a bare AssertionError; the check names the fix, and
    nothing has moved when it does."""
    model = mlp()
    first = model[0].weight
    built = torch.backends.cuda.is_built()
    message = (r"devices \['cpu', 'cuda:0'\] include CUDA devices, but this PyTorch build "
               r"has no CUDA support .*; install a CUDA build of torch, or use \"cpu\" for "
               r"every partition \(e.g. devices=\['cpu', 'cpu'\]\)" if not built else
               r"devices \['cpu', 'cuda:0'\] include cuda:0, but no CUDA device is visible")
    with pytest.raises(ValueError, match=message):
        Pipe(model, balance=[2, 1], devices=["cpu", "cuda:0"])
    with pytest.raises(ValueError, match=message.replace("'cpu', 'cuda:0'", "'cpu', 'cuda:1'")
                       .replace("include cuda:0", "include cuda:1")):
        Pipe(model, balance=[2, 1], devices=["cpu", 1])
    assert model[0].weight is first and first.device.type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_distributed_pipe_refuses_a_cuda_device_without_cuda(tmp_path):
    import torch.distributed as dist

    from seqpipe.distributed import DistributedPipe

    if dist.is_initialized():
        pytest.skip("needs no process group in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        with pytest.raises(ValueError, match=r"device \['cuda:0'\] include"):
            DistributedPipe(mlp(), device="cuda:0")
    finally:
        dist.destroy_process_group()


def test_a_list_is_taken_as_a_tuple_everywhere():
    """A list where a tuple of tensors is expected is read as that tuple, by the pipeline,
    between partitions and by the balancers alike."""
    from seqpipe.balance import balance_by_size

    class Two(nn.Module):
        def forward(self, pair):  # receives a tuple either way
            assert isinstance(pair, tuple)
            a, b = pair
            return [a + b, a - b]  # a list between partitions

    class Sum(nn.Module):
        def forward(self, pair):
            assert isinstance(pair, tuple)
            return pair[0] * pair[1]

    model = nn.Sequential(Two(), Sum())
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    pipe = Pipe(model, chunks=2, balance=[1, 1], devices=["cpu", "cpu"])
    assert torch.allclose(pipe([x, y]), pipe((x, y)))
    assert balance_by_size(2, nn.Sequential(Two(), Sum()), [x, y]) == [1, 1]
