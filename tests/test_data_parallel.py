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
                                 ("1f1b", "never")]:
        reference = _model()
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        pipe = DistributedPipe(_model(), chunks=4, balance=[3, 4], schedule=schedule,
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
