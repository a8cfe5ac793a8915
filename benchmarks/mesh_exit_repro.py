"""A DeviceMesh dimension that spans every rank keeps the default group alive: PyTorch alone.

Each run is a 2-rank gloo script under ``torchrun``: ``init_process_group``,
``init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))`` (its one dimension is every
rank, so ``mesh.get_group("pp")`` *is* the default group), one all-reduce over that
dimension, ``destroy_process_group()``, the interpreter's teardown. With the mesh still
held at ``destroy_process_group()`` (case ``held``, as a script's global mesh is), the
default group outlives it: the mesh keeps every dimension's group in its ``_pg_registry``
(torch 2.13), the default one included, and with it the group's gloo worker threads, which
then reach the interpreter's finalisation (the abort of "Ending a script" in
docs/distributed.md, rare). With ``del mesh`` first (case ``dropped``) it is freed. Every run
says whether the default group outlived ``destroy_process_group()`` (a weak reference to it
is alive) and the script counts the runs that exit non-zero.

    PYTHONPATH=$PWD python benchmarks/mesh_exit_repro.py --runs 10

seqpipe's side: a ``DistributedPipe`` keeps such a pipeline group as ``None``
(``seqpipe.distributed.mesh.kept``); ``tests/test_exit.py`` checks it in either import order.
"""
from __future__ import annotations

import argparse
import sys
import weakref
from typing import Optional, Sequence

from exit_soak import TORCHRUN, Target, run_once

OUTLIVED = "the default group outlived destroy_process_group()"


def worker(case: str) -> None:
    """One rank of the repro."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    default = weakref.ref(dist.group.WORLD)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("pp",))
    total = torch.ones(1)
    dist.all_reduce(total, group=mesh.get_group("pp"))
    if case == "dropped":
        del mesh
    dist.destroy_process_group()
    if default() is not None:  # no gc.collect() first: it gives gloo's threads time to finish
        print(OUTLIVED, file=sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per case (default 10)")
    parser.add_argument("--worker", choices=("held", "dropped"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    for case in ("held", "dropped"):
        target = Target(case, [*TORCHRUN, __file__, f"--worker={case}"])
        failed = outlived = 0
        for _ in range(args.runs):
            done = run_once(target, timeout=300.0)
            failed += done.returncode != 0
            outlived += OUTLIVED in done.stderr
        print(f"mesh {case:7s}: {failed:3d} of {args.runs} runs exited non-zero; the default "
              f"group outlived destroy_process_group() in {outlived}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
