"""A 2-rank training script that imports seqpipe before or after ``init_process_group``.

Run under ``torchrun --nproc-per-node=2``; ``benchmarks/exit_soak.py`` runs it many times in
both orders (targets ``import-order-first`` and ``import-order-late``) and counts the runs
that do not exit 0:

    PYTHONPATH=$PWD python benchmarks/exit_soak.py --runs 40 --only import-order-{first,late}

``--seqpipe-import late`` is how test harnesses and notebooks often do it: the process
group first, then ``import seqpipe`` inside ``main()``. It trains two steps with activation
checkpointing (whose first call imports ``torch._dynamo``), ends with a collective
(``all_gather_object``, whose tensors a gloo worker thread lets go of afterwards), destroys
the process group and leaves through the interpreter's teardown, as a user's script does.
A default group that outlived ``destroy_process_group()`` aborts that teardown only now
and then (see "Ending a script" in docs/distributed.md), so the script also checks for it
directly: it exits 3 when a weak reference to the default group is still alive after
``destroy_process_group()``.
"""
from __future__ import annotations

import argparse
import os
import sys
import weakref
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqpipe-import", choices=("first", "late"), default="late",
                        help="import seqpipe before or after init_process_group (default late)")
    args = parser.parse_args(argv)
    if args.seqpipe_import == "first":
        import seqpipe.distributed  # noqa: F401
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    from seqpipe.distributed import DistributedPipe  # the first import, under "late"

    default = weakref.ref(dist.group.WORLD)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 4))
    pipe = DistributedPipe(model, chunks=2, balance=[2, 3], checkpoint="always")
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        optimizer.zero_grad()
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                               nn.functional.mse_loss)
        optimizer.step()
    losses: list = [None] * dist.get_world_size()
    dist.all_gather_object(losses, loss.item())
    dist.destroy_process_group()
    if default() is not None:  # no gc.collect() first: it gives gloo's threads time to finish
        print(f"rank {os.environ.get('RANK')}: the default process group outlived "
              f"destroy_process_group()", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
