"""The abort at exit, reproduced with PyTorch alone (no seqpipe): evidence for its cause.

Each run is a 2-rank gloo script under ``torchrun``: ``init_process_group``, then (order
``late``) ``import torch.distributed.nn.functional``, which binds the default group into
that module's default arguments (``group=group.WORLD`` is evaluated at import), or (order
``first``) the same import before ``init_process_group``; one ``all_gather_object``;
``destroy_process_group()``; the interpreter's teardown. Every run also says whether the
default group outlived ``destroy_process_group()`` (a weak reference to it is alive).
Under ``late`` it always does, and some runs abort at exit (``terminate called without an
active exception``, SIGABRT): a gloo worker thread of the surviving group lets go of the
all-gather's tensors during finalisation, needs the interpreter lock, and is ended by
``pthread_exit`` inside a ``noexcept`` destructor. Under ``first`` the group is freed (its
threads joined) in ``destroy_process_group()``.

    PYTHONPATH=$PWD python benchmarks/exit_repro.py --runs 40

The cases ``mesh-held`` and ``mesh-dropped`` show another holder: a ``DeviceMesh`` whose
one dimension spans every rank (``init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))``:
``mesh.get_group("pp")`` *is* the default group), one all-reduce over it, and
``destroy_process_group()`` with the mesh still held (as a script's global mesh is) or
after ``del mesh``. The mesh keeps its dimensions' groups in its ``_pg_registry`` (torch
2.13), the default one included, so under ``mesh-held`` it outlives
``destroy_process_group()``:

    PYTHONPATH=$PWD python benchmarks/exit_repro.py --runs 10 --cases mesh-held mesh-dropped

seqpipe's side of it: seqpipe/core/teardown.py, ``seqpipe.distributed.mesh.kept`` (a pipe
keeps such a pipeline group as ``None``), and "Ending a script" in docs/distributed.md.
"""
from __future__ import annotations

import argparse
import sys
import weakref
from typing import Optional, Sequence

from exit_soak import TORCHRUN, Target, run_once

OUTLIVED = "the default group outlived destroy_process_group()"


CASES = ("first", "late", "mesh-held", "mesh-dropped")


def worker(case: str) -> None:
    """One rank of the repro."""
    import torch
    import torch.distributed as dist

    if case == "first":
        import torch.distributed.nn.functional  # noqa: F401
    dist.init_process_group("gloo")
    if case == "late":
        import torch.distributed.nn.functional  # noqa: F401
    default = weakref.ref(dist.group.WORLD)
    if case.startswith("mesh"):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("pp",))
        dist.all_reduce(torch.ones(1), group=mesh.get_group("pp"))
        if case == "mesh-dropped":
            del mesh
    else:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, dist.get_rank())
    dist.destroy_process_group()
    if default() is not None:  # no gc.collect() first: it gives gloo's threads time to finish
        print(OUTLIVED, file=sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40, help="runs per case (default 40)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=["first", "late"],
                        help="import orders first/late (default), or a world mesh held/dropped")
    parser.add_argument("--worker", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    for case in args.cases:
        target = Target(case, [*TORCHRUN, __file__, f"--worker={case}"])
        aborted = outlived = 0
        for _ in range(args.runs):
            done = run_once(target, timeout=300.0)
            aborted += done.returncode != 0
            outlived += OUTLIVED in done.stderr
        print(f"{case:12s}: {aborted:3d} of {args.runs} runs exited non-zero; "
              f"the default group outlived destroy_process_group() in {outlived}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
