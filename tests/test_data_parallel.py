"""Pipeline × data parallelism: 2 stages × 2 replicas on 4 gloo processes."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from distributed_harness import run_workers
from seqpipe.distributed import DistributedPipe, mesh_groups
from seqpipe.distributed.mesh import reverse_group


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)).double()


def _batch(step: int) -> tuple:
    gen = torch.Generator().manual_seed(10 + step)
    return (torch.randn(16, 6, generator=gen, dtype=torch.float64),
            torch.randn(16, 3, generator=gen, dtype=torch.float64))


def _two_by_two(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh_groups(mesh)
    stage, replica = dist.get_rank(pp), dist.get_rank(dp)
    assert (stage, replica) == (rank // 2, rank % 2)
    back = reverse_group(pp)  # the pipeline's second group: same ranks, made by mesh_groups
    assert back is not None and back is not pp
    assert dist.get_process_group_ranks(back) == dist.get_process_group_ranks(pp)
    for schedule, checkpoint in [("1f1b", "except_last"), ("fill_drain", "always"),
                                 ("1f1b", "never"), ("zb_h1", "always"), ("zbv", "never")]:
        reference = _model()
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        balance = [2, 2, 2, 1] if schedule == "zbv" else [3, 4]  # zbv: two stages per rank
        pipe = DistributedPipe(_model(), chunks=4, balance=balance, schedule=schedule,
                               checkpoint=checkpoint, group=pp, data_parallel_group=dp)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        names = dict(reference.named_parameters())
        for step in range(2):
            x, y = _batch(step)
            half = slice(replica * 8, replica * 8 + 8)
            opt.zero_grad()
            loss = pipe.train_step(x[half] if pipe.is_first else None,
                                   y[half] if pipe.is_last else None, nn.functional.mse_loss)
            ref_opt.zero_grad()
            ref_loss = nn.functional.mse_loss(reference(x), y)
            ref_loss.backward()
            losses = [torch.zeros_like(loss) for _ in range(2)]
            dist.all_gather(losses, loss, group=dp)  # the replicas' halves average to the whole
            assert torch.allclose(sum(losses) / 2, ref_loss), (schedule, step)
            for name, param in pipe.named_parameters():
                assert torch.allclose(param.grad, names[name].grad, atol=1e-12), (
                    schedule, checkpoint, step, name)
            opt.step()
            ref_opt.step()


def test_two_stages_by_two_replicas_match_one_process_on_the_global_batch() -> None:
    run_workers(_two_by_two, 4, timeout=180)


def _mixed(rank: int, world: int) -> None:
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    crossed = [dist.new_group([0, 3]), dist.new_group([1, 2])]  # stage 0 with stage 1
    pp = pipelines[rank // 2]
    dp = crossed[0] if rank in (0, 3) else crossed[1]
    with pytest.raises(ValueError, match="mixes pipeline stages"):
        DistributedPipe(_model(), chunks=2, balance=[3, 4], group=pp, data_parallel_group=dp)


def test_a_data_parallel_group_that_mixes_stages_is_rejected() -> None:
    run_workers(_mixed, 4, timeout=120)


# -- replicas that use different parameters; freezing; buffers (2 replicas of 1 stage) -----
class _Drop(nn.Module):
    """A layer that a replica may skip (LayerDrop, or a branch taken on one replica only)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.skip else self.inner(x)


def _droppable() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[_Drop(nn.Linear(6, 6)) for _ in range(4)]).double()


def _replicas() -> dist.ProcessGroup:
    """Two one-stage pipelines (replicas) on two ranks; the data-parallel group."""
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "dp"))
    return mesh_groups(mesh)


def _mean_over(group: dist.ProcessGroup, tensor: torch.Tensor) -> torch.Tensor:
    total = tensor.clone()
    dist.all_reduce(total, group=group)
    return total / dist.get_world_size(group)


def _local_grads(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Each parameter's gradient in the plain model on this replica's data (zeros if none)."""
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
            for n, p in model.named_parameters()}


def _different_parameters(rank: int, world: int) -> None:
    pp, dp = _replicas()
    replica = dist.get_rank(dp)
    reference = _droppable()
    pipe = DistributedPipe(_droppable(), chunks=4, group=pp, data_parallel_group=dp)
    layer_bytes = sum(p.numel() * p.element_size() for p in pipe.partition[0].parameters())
    pipe._reducer.bucket_bytes = layer_bytes  # one bucket per layer
    for model in (reference, pipe.partition):
        model[3].skip = replica == 1  # replica 1 skips its last layer: one bucket less
        model[1].skip = True  # no replica uses layer 1: its .grad stays None
    for step in range(2):
        x, y = _batch(step)
        x, y = x[:, :6] + replica, y.repeat(1, 2)[:, :6]
        expected = _local_grads(reference, x, y)
        pipe.zero_grad(set_to_none=True)
        pipe.train_step(x, y, nn.functional.mse_loss)
        assert len(pipe._reducer.buckets) == 4
        for name, param in pipe.named_parameters():
            if name.startswith("1."):
                assert param.grad is None, name
                continue
            mean = _mean_over(dp, expected[name])
            assert torch.allclose(param.grad, mean, atol=1e-12), (step, name)


def test_replicas_that_use_different_parameters_average_the_right_gradients() -> None:
    """One replica skips its last layer, so it has one bucket fewer to reduce: buckets
    started as they became ready would be reduced against another replica's bucket."""
    run_workers(_different_parameters, 2, timeout=120)


def _freezing(rank: int, world: int) -> None:
    pp, dp = _replicas()
    replica = dist.get_rank(dp)
    reference = _droppable()
    model = _droppable()
    model[0].requires_grad_(False)  # frozen at construction, unfrozen later
    pipe = DistributedPipe(model, chunks=2, group=pp, data_parallel_group=dp)
    pipe._reducer.bucket_bytes = 1  # a bucket per parameter
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.1, weight_decay=0.5)
    for step in range(4):
        if step == 2:
            pipe.partition[0].requires_grad_(True)  # unfreeze layer 0
            pipe.partition[2].requires_grad_(False)  # freeze layer 2
        frozen = [n for n, p in pipe.named_parameters() if not p.requires_grad]
        x, y = _batch(step)
        x, y = x[:, :6] * (1 + replica), y.repeat(1, 2)[:, :6]
        reference.load_state_dict(pipe.state_dict())
        expected = _local_grads(reference, x, y)
        before = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        opt.zero_grad(set_to_none=True)
        pipe.train_step(x, y, nn.functional.mse_loss)
        assert len(pipe._reducer.buckets) == 6, step  # 4 layers x (weight, bias), 1 frozen
        for name, param in pipe.named_parameters():
            if name in frozen:  # a zero .grad would let AdamW decay it
                assert param.grad is None, (step, name)
            else:
                mean = _mean_over(dp, expected[name])
                assert torch.allclose(param.grad, mean, atol=1e-12), (step, name)
        opt.step()
        for name, param in pipe.named_parameters():
            everyone = [torch.empty_like(param) for _ in range(2)]
            dist.all_gather(everyone, param.detach(), group=dp)
            assert torch.equal(everyone[0], everyone[1]), (step, name)  # replicas agree
            if name in frozen:
                assert torch.equal(param, before[name]), (step, name)


def test_freezing_or_unfreezing_after_construction_is_followed() -> None:
    run_workers(_freezing, 2, timeout=120)


def _bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _buffers(rank: int, world: int, broadcast: bool) -> None:
    pp, dp = _replicas()
    replica = dist.get_rank(dp)
    reference = _bn_model()
    pipe = DistributedPipe(_bn_model(), chunks=1, group=pp, data_parallel_group=dp,
                           broadcast_buffers=broadcast)
    gen = torch.Generator().manual_seed(replica)  # each replica reads other data
    for _ in range(2):
        x, y = torch.randn(8, 6, generator=gen) * (1 + replica), torch.randn(8, 3, generator=gen)
        pipe.train_step(x, y, nn.functional.mse_loss)
        reference(x)  # this replica's running statistics on its own
    for name, buffer in pipe.named_buffers():
        everyone = [torch.empty_like(buffer) for _ in range(2)]
        dist.all_gather(everyone, buffer, group=dp)
        own = reference.get_buffer(name)
        if broadcast:  # every replica holds the first replica's statistics
            assert torch.equal(buffer, everyone[0]), name
        if replica == 0 or not broadcast:  # the replica's own statistics
            assert torch.allclose(buffer, own), name
        if name.endswith("running_mean"):
            assert torch.equal(everyone[0], everyone[1]) == broadcast, name


@pytest.mark.parametrize("broadcast", [True, False])
def test_buffers_are_broadcast_from_the_first_replica_unless_turned_off(broadcast: bool) -> None:
    run_workers(_buffers, 2, broadcast, timeout=120)


def _mismatched(rank: int, world: int) -> None:
    pp, dp = _replicas()
    with pytest.raises(ValueError, match="replicas in data_parallel_group built different "
                                         "models or pipeline settings"):
        DistributedPipe(_bn_model(), group=pp, data_parallel_group=dp,
                        broadcast_buffers=dist.get_rank(dp) == 0)


def test_replicas_that_disagree_on_broadcast_buffers_are_rejected() -> None:
    """One replica broadcasting while another does not would leave a collective unmatched."""
    run_workers(_mismatched, 2, timeout=120)
