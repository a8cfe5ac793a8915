"""Tests for seqpipe.balance: the optimal solver, the per-layer profilers and the helpers."""
from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Generator, Sequence

import pytest
import torch
from torch import nn

from seqpipe.balance import (
    balance_by_params,
    balance_by_size,
    balance_by_time,
    balance_by_type,
    balance_uniform,
    solve,
)
from seqpipe.balance.profile import param_counts, profile_sizes, profile_times
from seqpipe.pipe import Pipe
from seqpipe.skip import pop, skippable, stash
from seqpipe.skip.tracker import current_skip_tracker

# --------------------------------------------------------------------------- solver


def _splits(n: int, partitions: int) -> list[list[int]]:
    """Every way to cut ``n`` layers into ``partitions`` contiguous non-empty parts."""
    return [[b - a for a, b in itertools.pairwise((0, *cuts, n))]
            for cuts in itertools.combinations(range(1, n), partitions - 1)]


def _parts(costs: Sequence[float], counts: list[int]) -> list[list[float]]:
    bounds = list(itertools.accumulate(counts, initial=0))
    return [list(costs[a:b]) for a, b in itertools.pairwise(bounds)]


def _brute_force(costs: Sequence[int], partitions: int) -> list[int]:
    """solve()'s documented answer, by enumeration: optimal, then its tie-breaks in order."""
    def key(counts: list[int]) -> tuple:
        parts = _parts(costs, counts)
        largest = max((sum(p), len(p)) for p in parts)
        spread = (sum(sum(p) ** 2 for p in parts), sum(len(p) ** 2 for p in parts))
        return largest, spread, counts[::-1]

    return min(_splits(len(costs), partitions), key=key)


def _random_cases(seed: int, count: int, draw_cost: Callable[[random.Random], float],
                  ) -> list[tuple[list[float], int]]:
    """Seeded random (costs, partitions) cases: 1-10 layers, 1-5 partitions."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        costs = [draw_cost(rng) for _ in range(rng.randint(1, 10))]
        cases.append((costs, rng.randint(1, min(5, len(costs)))))
    return cases


def _integer_cost(rng: random.Random) -> float:
    return rng.choice([0, 0, 1, 2, 3, 5, 8])  # zeros and ties on purpose


def _float_cost(rng: random.Random) -> float:
    return rng.choice([0.0, rng.uniform(0, 1), rng.uniform(0, 1e6)])


def test_solve_matches_brute_force_on_integer_costs() -> None:
    for costs, partitions in _random_cases(0, 400, _integer_cost):
        assert solve(costs, partitions) == _brute_force(costs, partitions), (costs, partitions)


def test_solve_is_optimal_on_float_costs() -> None:
    for costs, partitions in _random_cases(1, 200, _float_cost):
        counts = solve(costs, partitions)
        assert len(counts) == partitions and sum(counts) == len(costs) and min(counts) >= 1

        def largest(split: list[int], costs: list[float] = costs) -> float:
            return max(math.fsum(part) for part in _parts(costs, split))

        best = min(largest(split) for split in _splits(len(costs), partitions))
        assert math.isclose(largest(counts), best, rel_tol=1e-12, abs_tol=1e-300), costs


@pytest.mark.parametrize("costs, partitions, expected", [
    ([0] * 5, 2, [3, 2]),                     # all zero: even, extra layer up front
    ([0] * 6, 3, [2, 2, 2]),
    ([1] * 7, 3, [3, 2, 2]),                  # equal costs: most even, not [3, 3, 1]
    ([1, 0, 1, 0], 2, [2, 2]),                # activation stays with its layer
    ([5, 0, 0, 0], 2, [1, 3]),                # free layers leave the bottleneck
    ([100, 1, 1, 1, 1, 1, 1], 3, [1, 3, 3]),  # one huge layer: the rest still even
    ([3, 1, 1, 1], 1, [4]),
    ([3, 1, 1, 1], 4, [1, 1, 1, 1]),
])
def test_solve_tie_breaks(costs: list[int], partitions: int, expected: list[int]) -> None:
    assert solve(costs, partitions) == expected


def test_solve_is_fast_on_deep_models() -> None:
    started = time.perf_counter()
    assert sum(solve([float(i % 7) for i in range(500)], 8)) == 500
    assert time.perf_counter() - started < 5


@pytest.mark.parametrize("costs, partitions, error, match", [
    ([1, 2, 3], 0, ValueError, "partitions must be at least 1, got 0"),
    ([1, 2, 3], 4, ValueError, "cannot split 3 layers into 4 non-empty partitions; use at most 3"),
    ([], 1, ValueError, "cannot split 0 layers"),
    ([1, -1], 1, ValueError, "non-negative, but layer 1 has cost -1"),
    ([1, float("nan")], 1, ValueError, "finite and non-negative, but layer 1 has cost nan"),
    ([float("inf")], 1, ValueError, "layer 0 has cost inf"),
    ([1, 2], 1.5, TypeError, "partitions must be an int, got float"),
])
def test_solve_errors(costs: list[float], partitions: int, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        solve(costs, partitions)


# --------------------------------------------------------------------------- test layers


class Sleep(nn.Module):
    """A layer that is slow without using the CPU, so timing is robust on a busy machine."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return x * 2


class Widen(nn.Module):
    """A parameter-free layer that saves an activation 64 times wider than its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.sigmoid(x.repeat(1, 64))  # sigmoid saves its output for backward
        return wide.view(x.shape[0], 64, -1).mean(1)


class Split(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple:
        return x[:, :4], x[:, 4:] * 2


class Join(nn.Module):
    def forward(self, pair: tuple) -> torch.Tensor:
        first, second = pair
        return torch.cat([first * second, second], dim=1)


class Shape(nn.Module):
    """Returns something a pipeline cannot carry between partitions."""

    def forward(self, x: torch.Tensor) -> torch.Size:
        return x.shape


def _linears(count: int, width: int = 8) -> list[nn.Module]:
    return [nn.Linear(width, width) for _ in range(count)]


# --------------------------------------------------------------------------- helpers


def test_balance_by_params_isolates_a_huge_layer() -> None:
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(8, 8), nn.ReLU(), *_linears(2))
    assert param_counts(model) == [256 * 257, 72, 0, 72, 72]
    assert balance_by_params(2, model) == [1, 4]


def test_balance_by_time_isolates_a_slow_layer() -> None:
    model = nn.Sequential(*_linears(2), Sleep(), *_linears(2))
    assert balance_by_time(3, model, torch.randn(4, 8), timeout=0.1) == [2, 1, 2]


def test_profile_times_runs_at_least_one_pass() -> None:
    model = nn.Sequential(nn.Linear(8, 8), Sleep())
    times = profile_times(model, torch.randn(4, 8), timeout=0)
    assert len(times) == 2 and 0 <= times[0] < 0.02 <= times[1]


def test_balance_by_size_isolates_a_layer_with_large_activations() -> None:
    model = nn.Sequential(*_linears(2, 16), Widen(), *_linears(2, 16))
    assert balance_by_size(3, model, torch.randn(64, 16), chunks=2) == [2, 1, 2]


def test_profile_sizes_counts_saved_activations_of_the_largest_micro_batch() -> None:
    # 10 rows in 3 chunks: the largest micro-batch has 4 rows. Linear saves its input
    # (4 x 16 floats) and its weight, which is counted with the parameters instead.
    params = (16 * 16 + 16) * 4
    model = nn.Sequential(nn.Linear(16, 16))
    sizes = profile_sizes(model, torch.randn(10, 16), chunks=3, param_scale=3)
    assert sizes == [4 * 16 * 4 + params * 3]
    model.requires_grad_(False)  # frozen: nothing saved, parameters counted once
    assert profile_sizes(model, torch.randn(10, 16), chunks=3, param_scale=3) == [params]


def test_profiling_leaves_model_rng_sample_and_tracker_untouched() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8), nn.BatchNorm1d(8),
                          nn.Dropout(0.5), nn.ReLU(inplace=True), nn.Linear(8, 8))
    sample = torch.randn(16, 8)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    sample_before, rng_before = sample.clone(), torch.get_rng_state()
    tracker = current_skip_tracker()

    balance_by_time(2, model, sample, timeout=0.05)
    balance_by_size(2, model, sample, chunks=2)

    after = model.state_dict()
    assert "2.num_batches_tracked" in after and after.keys() == before.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert torch.equal(sample, sample_before)
    assert current_skip_tracker() is tracker and not tracker.tensors


@pytest.mark.parametrize("model", [
    nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8)),
    nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8)),  # in place on the sample
])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_in_place_layers_profile(model: nn.Sequential, requires_grad: bool) -> None:
    sample = torch.randn(4, 8, requires_grad=requires_grad)
    assert len(profile_times(model, sample, timeout=0)) == len(model)
    assert len(profile_sizes(model, sample)) == len(model)
    assert sample.grad is None


def test_tuples_flow_between_layers() -> None:
    model = nn.Sequential(nn.Linear(8, 8), Split(), Join(), nn.Linear(8, 8), Split())
    sample = torch.randn(4, 8)
    assert len(profile_times(model, sample, timeout=0)) == 5
    assert balance_by_size(2, model, sample) == balance_by_size(2, model, sample)
    pair = (torch.randn(4, 4), torch.randn(4, 4))  # a tuple sample goes in as one argument
    assert len(profile_sizes(nn.Sequential(Join(), nn.Linear(8, 8)), pair, chunks=2)) == 2


def test_skippable_layers_profile() -> None:
    @skippable(stash=["skip"])
    class Keep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> Generator[object, object, torch.Tensor]:
            hidden = self.lin(x)
            yield stash("skip", hidden)
            return torch.relu(hidden)

    @skippable(pop=["skip"])
    class Multiply(nn.Module):
        def forward(self, x: torch.Tensor) -> Generator[object, object, torch.Tensor]:
            skip = yield pop("skip")
            return x * skip

    # Keep's backward frees the graph behind the stashed tensor before Multiply runs, so
    # Multiply must get the popped tensor cut off from it.
    model = nn.Sequential(nn.Linear(8, 8), Keep(), nn.ReLU(inplace=True), *_linears(2),
                          Multiply())
    sample = torch.randn(4, 8)
    tracker = current_skip_tracker()
    assert len(profile_times(model, sample, timeout=0)) == 6
    sizes = profile_sizes(model, sample)
    assert sizes[-1] == 2 * 4 * 8 * 4  # mul saves both operands: the popped one counts here
    assert sum(balance_by_time(3, model, sample, timeout=0)) == 6
    assert current_skip_tracker() is tracker and not tracker.tensors


def test_profiling_works_under_no_grad() -> None:
    model = nn.Sequential(*_linears(3))
    with torch.no_grad():
        assert min(profile_sizes(model, torch.randn(4, 8))[1:]) > (8 * 8 + 8) * 4 * 2
        assert len(profile_times(model, torch.randn(4, 8), timeout=0)) == 3


def test_balance_feeds_pipe() -> None:
    model = nn.Sequential(*_linears(2, 16), Widen(), *_linears(2, 16))
    x = torch.randn(8, 16)
    balance = balance_by_size(2, model, x, chunks=2)
    expected = model(x)
    assert torch.allclose(Pipe(model, chunks=2, balance=balance)(x), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profiling_on_cuda_keeps_rng() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(), Sleep(), nn.Linear(8, 8))
    cuda_rng, cpu_rng = torch.cuda.get_rng_state(), torch.get_rng_state()
    assert balance_by_time(3, model, torch.randn(4, 8), timeout=0.1, device="cuda") == [2, 1, 1]
    assert len(profile_sizes(model, torch.randn(4, 8), device="cuda")) == 4
    assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)
    assert torch.equal(torch.get_rng_state(), cpu_rng)
    assert next(model.parameters()).device.type == "cpu"


# --------------------------------------------------------------------------- errors

_TINY = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
_HELPERS = {
    "params": lambda partitions, module: balance_by_params(partitions, module),
    "time": lambda partitions, module: balance_by_time(partitions, module, torch.randn(2, 4),
                                                       timeout=0),
    "size": lambda partitions, module: balance_by_size(partitions, module, torch.randn(2, 4)),
}


@pytest.mark.parametrize("helper", _HELPERS.values(), ids=_HELPERS.keys())
def test_helpers_check_module_and_partitions(helper: Callable[[int, nn.Module], list[int]],
                                             ) -> None:
    with pytest.raises(TypeError,
                       match=r"nn\.Sequential, got Linear; convert .*seqpipe\.to_sequential"):
        helper(1, nn.Linear(4, 4))
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 non-empty partitions"):
        helper(3, _TINY)
    with pytest.raises(ValueError, match="partitions must be at least 1, got 0"):
        helper(0, _TINY)


def test_partitions_are_checked_before_the_sample() -> None:
    with pytest.raises(ValueError, match="cannot split 2 layers into 5"):
        balance_by_time(5, _TINY, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("call, error, match", [
    (lambda: balance_by_time(1, _TINY, torch.randn(0, 4)), ValueError, "batch is empty"),
    (lambda: balance_by_size(1, _TINY, torch.randn(0, 4)), ValueError, "batch is empty"),
    (lambda: balance_by_size(1, _TINY, torch.tensor(1.0)), ValueError, "batch dimension"),
    (lambda: balance_by_size(1, _TINY, torch.randn(2, 4), chunks=0), ValueError,
     "chunks must be at least 1, got 0"),
    (lambda: balance_by_size(1, _TINY, torch.randn(2, 4), param_scale=-1), ValueError,
     "param_scale must be a non-negative number, got -1"),
    (lambda: balance_by_time(1, _TINY, torch.randn(2, 4), timeout=-1), ValueError,
     "timeout must be a non-negative number of seconds, got -1"),
    (lambda: balance_by_time(1, nn.Sequential(Shape()), torch.randn(2, 4)), TypeError,
     "layer 0 \\(Shape\\) cannot be profiled"),
])
def test_sample_and_option_errors(call: Callable[[], object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        call()


class _ModeRecorder(nn.Module):
    """Records, in a list shared by its deep copies, the mode each forward ran in."""

    def __init__(self, seen: list) -> None:
        super().__init__()
        self.seen = seen
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.training)
        return self.lin(x)

    def __deepcopy__(self, memo: dict) -> "_ModeRecorder":
        twin = _ModeRecorder(self.seen)
        twin.load_state_dict(self.state_dict())
        twin.train(self.training)
        return twin


@pytest.mark.parametrize("helper", ["time", "size"])
def test_profiling_runs_layers_in_training_mode(helper: str) -> None:
    """A balance is for training: dropout and BatchNorm are profiled as they will run,
    even when the model is in eval mode now; the model's own mode is left as it was."""
    seen: list = []
    model = nn.Sequential(_ModeRecorder(seen), nn.Dropout(0.5), _ModeRecorder(seen)).eval()
    sample = torch.randn(8, 4)
    if helper == "time":
        balance_by_time(2, model, sample, timeout=0.01)
    else:
        balance_by_size(2, model, sample)
    assert seen and all(seen), seen
    assert not any(layer.training for layer in model.modules())


class _Broken(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ArithmeticError("broken layer")


@pytest.mark.parametrize("helper", ["time", "size"])
def test_profiling_errors_name_the_layer(helper: str) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), _Broken())
    with pytest.raises(ArithmeticError, match="broken layer") as info:
        if helper == "time":
            balance_by_time(2, model, torch.randn(8, 4), timeout=0.01)
        else:
            balance_by_size(2, model, torch.randn(8, 4))
    assert "raised by layer 2 (_Broken) while profiling" in " ".join(info.value.__notes__)


class TransformerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _largest(counts: Sequence[int], costs: Sequence[int]) -> int:
    parts, start = [], 0
    for count in counts:
        parts.append(sum(costs[start:start + count]))
        start += count
    return max(parts)


@pytest.mark.parametrize("seed", range(20))
def test_balance_by_type_matches_brute_force(seed: int) -> None:
    """The matched blocks are spread as evenly as any split can: the fullest partition holds
    the fewest blocks possible (checked against every split), and every layer is placed."""
    rng = random.Random(seed)
    layers = [TransformerBlock() if rng.random() < 0.6 else nn.ReLU()
              for _ in range(rng.randint(2, 9))]
    layers[rng.randrange(len(layers))] = TransformerBlock()  # at least one match
    model = nn.Sequential(*layers)
    partitions = rng.randint(1, min(4, len(layers)))
    balance = balance_by_type(partitions, model, "transformer")
    costs = [int(isinstance(layer, TransformerBlock)) for layer in layers]
    assert len(balance) == partitions and sum(balance) == len(layers) and min(balance) >= 1
    best = min(_largest(split, costs) for split in _splits(len(layers), partitions))
    assert _largest(balance, costs) == best
    Pipe(model, balance=balance, devices=["cpu"] * partitions)  # usable as is


def test_balance_by_type_ignores_other_layers_and_case() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), *[TransformerBlock() for _ in range(6)],
                          nn.LayerNorm(4), nn.Linear(4, 10))
    balance = balance_by_type(3, model, "transformerBLOCK|nothing")
    blocks = [int(isinstance(layer, TransformerBlock)) for layer in model]
    per_partition = [sum(blocks[sum(balance[:j]):sum(balance[:j + 1])]) for j in range(3)]
    assert per_partition == [2, 2, 2]


def test_balance_by_type_with_a_pattern_that_matches_nothing() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"no layer's class name matches 'Block' \(the classes "
                                         r"are \['Linear', 'ReLU'\]\)"):
        balance_by_type(2, model, "Block")


@pytest.mark.parametrize(("layers", "partitions", "expected"),
                         [(7, 3, [3, 2, 2]), (6, 3, [2, 2, 2]), (4, 4, [1, 1, 1, 1]),
                          (5, 1, [5])])
def test_balance_uniform(layers: int, partitions: int, expected: list) -> None:
    model = nn.Sequential(*[nn.ReLU() for _ in range(layers)])
    assert balance_uniform(partitions, model) == expected


def test_type_and_uniform_check_their_arguments() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match="cannot split 2 layers into 3"):
        balance_uniform(3, model)
    with pytest.raises(TypeError, match="nn.Sequential"):
        balance_by_type(1, nn.ModuleList([nn.ReLU()]), "ReLU")  # type: ignore[arg-type]
