"""A script ends cleanly whatever the order of ``import seqpipe`` and ``init_process_group``.

Imported after the group exists, ``torch.distributed.nn.functional`` (seqpipe imports it;
``torch._dynamo``, which activation checkpointing imports on its first call, does too)
binds the default group into its functions' default arguments, so the group outlives
``destroy_process_group()`` and a gloo worker thread of it can abort the interpreter's
teardown (issue 21, item 8; seqpipe/core/teardown.py). The abort is rare and timing-dependent;
its deterministic witness is the group itself: ``run_workers`` fails a worker whose default
group is still alive after ``destroy_process_group()``.

This module must not import seqpipe at its top: the workers unpickle their function from
it, and an import here would put seqpipe before ``init_process_group`` again. For the same
reason its workers are fresh interpreters (``fresh_interpreter=True``), which also end
through the interpreter's teardown: ``run_workers``'s default workers fork from a server
that imported seqpipe (and ``torch._dynamo``) before any group existed.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from distributed_harness import run_workers

KEPT: list = []
"""What a user's script still holds when it ends (its globals): alive past
``destroy_process_group()``, after which ``run_workers`` checks that the default group is gone."""


def _train_then_gather(rank: int) -> None:
    """Two 1F1B steps of a 2-stage ``DistributedPipe``, every micro-batch checkpointed (which
    imports ``torch._dynamo``), ending with a collective whose tensors gloo lets go of late."""
    from seqpipe.distributed import DistributedPipe

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    pipe = DistributedPipe(model, chunks=2, balance=[2, 1], checkpoint="always")
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    for _ in range(2):
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                        nn.functional.mse_loss)
    assert "torch._dynamo" in sys.modules, "checkpointing was meant to import torch._dynamo"
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rank)
    assert everyone == [0, 1]


def _seqpipe_imported_late(rank: int, world_size: int) -> None:
    assert "seqpipe" not in sys.modules, "the test needs seqpipe imported after the group"
    import seqpipe  # noqa: F401  (first import, the default group exists)

    functional = sys.modules["torch.distributed.nn.functional"]  # which seqpipe imported
    # Unbinding keeps these functions working, on the default group of the call.
    x = torch.full((2,), float(rank + 1), requires_grad=True)
    total = functional.all_reduce(x)
    torch.testing.assert_close(total, torch.full((2,), 3.0))
    total.sum().backward()  # the gradient of a sum over ranks is all-reduced back
    torch.testing.assert_close(x.grad, torch.full((2,), float(world_size)))
    _train_then_gather(rank)
    pipes_on_whole_world_meshes(world_size)
    replicas_on_the_whole_world(rank, world_size)
    the_kept_mesh_works_as_the_mesh(rank, world_size)
    # run_workers checks that the default group is gone after destroy_process_group().


def pipes_on_whole_world_meshes(world_size: int) -> None:
    """A pipeline on a ``DeviceMesh`` dimension that spans every rank, which is the default
    group object itself: a 1-D mesh's, and ``mesh_groups`` of a ``(world, 1)`` mesh. Each
    trains a step (its loss the plain model's) and stays alive to the end, as a script's
    globals do; a pipe that held its group would keep the default group alive past
    ``destroy_process_group()``. The meshes are dropped: torch's ``DeviceMesh`` keeps its
    groups (``benchmarks/exit_repro.py --cases mesh-held``; "Ending a script" in
    docs/distributed.md)."""
    from torch.distributed.device_mesh import init_device_mesh

    from seqpipe.distributed import DistributedPipe, mesh_groups

    line = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    grid = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("pp", "dp"))
    for group in (line.get_group("pp"), mesh_groups(grid)[0]):
        assert group is dist.group.WORLD, "the premise: the dimension is the default group"
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(world_size)])
        x, y = torch.randn(4, 4), torch.randn(4, 4)
        expected = nn.functional.mse_loss(model(x), y)
        pipe = DistributedPipe(model, chunks=2, group=group)
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                               nn.functional.mse_loss)
        torch.testing.assert_close(loss, expected.detach())
        KEPT.append(pipe)


def replicas_on_the_whole_world(rank: int, world_size: int) -> None:
    """A pipe whose ``data_parallel_group`` is the default group (the ``dp`` dimension of a
    ``(1, world)`` mesh: every rank a one-stage pipeline, replicas of each other), a
    ``PipeGradScaler`` built on it, and a pipe given a mesh with a dimension that spans every
    rank as ``mesh=``. Each trains a step whose loss and averaged gradients are the plain
    model's on the whole batch, and stays alive to the end (``KEPT``) while the meshes are
    dropped: neither may keep the default group past ``destroy_process_group()``."""
    from torch.distributed.device_mesh import init_device_mesh

    from seqpipe.distributed import DistributedPipe, PipeGradScaler, mesh_groups

    grid = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("pp", "dp"))
    line = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    pp, dp = mesh_groups(grid)
    assert dp is dist.group.WORLD, "the premise: the data-parallel dimension is the default group"
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x, y = torch.randn(2 * world_size, 4), torch.randn(2 * world_size, 2)
    reference = nn.functional.mse_loss(model(x), y)
    reference.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    pipe = DistributedPipe(model, chunks=2, group=pp, data_parallel_group=dp)
    scaler = PipeGradScaler(pipe, init_scale=4.0)
    assert pipe.data_parallel_group is scaler.data_parallel_group is dist.group.WORLD
    mine = slice(2 * rank, 2 * rank + 2)  # this replica's share of the batch
    loss = pipe.train_step(x[mine], y[mine], nn.functional.mse_loss, scaler=scaler)
    torch.testing.assert_close(loss, nn.functional.mse_loss(model(x[mine]), y[mine]).detach())
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    scaler.unscale_(optimizer)
    for param, grad in zip(pipe.parameters(), expected):
        torch.testing.assert_close(param.grad, grad)
    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Linear(4, 4) for _ in range(world_size)])
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    expected_loss = nn.functional.mse_loss(plain(x), y)
    given = DistributedPipe(plain, chunks=2, group=line.get_group("pp"), mesh=line)
    loss = given.train_step(x if given.is_first else None, y if given.is_last else None,
                            nn.functional.mse_loss)
    torch.testing.assert_close(loss, expected_loss.detach())
    KEPT.extend([pipe, scaler, given])


def the_kept_mesh_works_as_the_mesh(rank: int, world_size: int) -> None:
    """What a pipe keeps of a ``mesh=`` with a dimension spanning every rank
    (``seqpipe.distributed.mesh.kept_mesh``): a mesh equal to it (which is what lets
    ``DTensor``s on either mix), whose sub-meshes equal the mesh's and whose ``DTensor``s
    redistribute over both dimensions, including the one that is the default group. (No
    ``DTensor`` op runs on the mesh itself: the caches of ``DTensor``'s dispatch would then
    keep it, and with it the default group, to the end.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from seqpipe.distributed.mesh import kept_mesh

    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("pp", "tp"))
    copy = kept_mesh(mesh)
    assert copy is not mesh and copy == mesh and copy["tp"] == mesh["tp"]
    assert copy["pp"] == mesh["pp"] and copy["pp"].get_group() is dist.group.WORLD
    whole = torch.arange(2.0 * world_size).reshape(world_size, 2)
    mine = whole[rank:rank + 1]
    ours = DTensor.from_local(mine, copy["pp"], [Shard(0)], run_check=False)
    torch.testing.assert_close(ours.redistribute(copy["pp"], [Replicate()]).to_local(), whole)
    narrow = DTensor.from_local(mine, copy["tp"], [Shard(1)], run_check=False)
    torch.testing.assert_close(narrow.full_tensor(), mine)
    sub = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("pp", "tp"))["pp"]
    sub_copy = kept_mesh(sub)  # the sub-mesh's root holds the default group: copied too
    assert sub_copy == sub and sub_copy.get_group() is sub.get_group()
    assert all(g is not dist.group.WORLD for g in sub_copy._pg_registry.values())


def test_seqpipe_imported_after_init_process_group_frees_the_default_group() -> None:
    run_workers(_seqpipe_imported_late, 2, timeout=120, fresh_interpreter=True)


def _dynamo_imported_late_then_seqpipe(rank: int, world_size: int) -> None:
    import torch._dynamo  # noqa: F401  (as torch.compile or DDP would, before seqpipe)
    import torch.distributed.nn.functional as functional

    assert "seqpipe" not in sys.modules, "the test needs seqpipe imported after the group"
    assert dist.group.WORLD in functional.broadcast.__defaults__, (
        "torch no longer binds the default group at import: this test has no premise left")
    import seqpipe  # noqa: F401

    assert dist.group.WORLD not in functional.broadcast.__defaults__
    _train_then_gather(rank)


def test_seqpipe_imported_after_torch_dynamo_frees_the_default_group() -> None:
    run_workers(_dynamo_imported_late_then_seqpipe, 2, timeout=120, fresh_interpreter=True)


def test_the_default_group_stand_in_stays_one_object() -> None:
    """``DEFAULT_GROUP``, what a pipe keeps for a ``data_parallel_group`` that is the default
    group, copies and unpickles as itself: a second object would not be read as the default
    group (``resolved``) but passed to ``torch.distributed`` as a group."""
    import copy
    import pickle

    from seqpipe.distributed.mesh import DEFAULT_GROUP, held_group

    assert held_group(None) is None
    assert copy.deepcopy({"kept": DEFAULT_GROUP})["kept"] is DEFAULT_GROUP
    assert pickle.loads(pickle.dumps(DEFAULT_GROUP)) is DEFAULT_GROUP
