"""What trains: torch's ``pipeline()`` against ``seqpipe.to_sequential`` + ``DistributedPipe``.

Two free-form models of the tests (``tests/graph_models.py``), each split the same way
by both libraries and trained one step on the same batch, on CPU processes over gloo:

* ``unet`` on 3 ranks: the tests' U-Net in double precision, stages ``down1, down2 | mid,
  up2 | up1, out`` (``unet-b``: ``down1 | down2, mid, up2 | up1, out``); ``down1``'s output
  is used on stage 2 only (a long skip over stage 1), its pooled copy on the next stage;
* ``block-unet`` on 3 ranks: the same U-Net written with the pooling inside the encoder
  blocks (``inc | down1, down2 | up1, up2, outc``), so ``inc``'s output goes both to
  stage 1 (``down1``) and to stage 2 (``up2``);
* ``gpt2`` on 2 ranks: Hugging Face GPT-2 from the tests' small config (2 blocks, float32,
  ``wte`` tied to ``lm_head``, an attention mask as a keyword), stages ``wte, wpe, drop,
  h.0 | h.1, ln_f, lm_head``: the tie spans both stages.

torch: ``pipeline(model, mb_args, mb_kwargs, split_spec={...: SplitPoint.BEGINNING})``,
``build_stage``, ``ScheduleGPipe(stage, M, loss_fn)``, ``step``. seqpipe:
``to_sequential(model, args, kwargs)``, ``DistributedPipe(seq, M, balance=...,
checkpoint="never")`` (no recomputation, like torch), ``train_step``. Both take the mean
of the ``M`` micro-batch losses; the reference is the plain model's gradient of that loss
on the same batch. Each rank compares the gradients of its parameters, by their names in
the plain model (a tied parameter: its full gradient, the sum of both uses), and the
table prints the largest absolute error over all ranks, or the error that stopped the
step. Each library runs in its own launch, so a failure of one cannot disturb the other.
Not a test (torch's behaviour is what is measured); see docs/models.md.

    PYTHONPATH=$PWD python benchmarks/graph_vs_torch_pipeline.py [--chunks 2] [--timeout 300]
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from graph_models import build, example


class Down(nn.Module):
    """Pool, then convolve: a U-Net's encoder block as commonly written (the pooling
    inside the block, as in milesial/Pytorch-UNet), so the block before it hands its
    output, unpooled, both to it and to the decoder."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.conv(F.max_pool2d(x, 2)))


class Up(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)

    def forward(self, x: Tensor, skip: Tensor) -> Tensor:
        return torch.relu(self.conv(torch.cat([F.interpolate(x, scale_factor=2.0), skip], 1)))


class BlockUNet(nn.Module):
    """The tests' U-Net with the pooling inside the encoder blocks (see ``Down``)."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.inc = nn.Conv2d(3, c, 3, padding=1)
        self.down1, self.down2 = Down(c, 2 * c), Down(2 * c, 2 * c)
        self.up1, self.up2 = Up(4 * c, c), Up(2 * c, c)
        self.outc = nn.Conv2d(c, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        x1 = torch.relu(self.inc(x))
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        return self.outc(self.up2(self.up1(x3, x2), x1))


def make(model: str) -> nn.Module:
    if model != "block-unet":
        return build(model)
    torch.manual_seed(0)
    return BlockUNet().double()


def data(model: str, chunks: int) -> tuple[tuple[Any, ...], dict[str, Any], Tensor]:
    """``(args, kwargs, target)``: a batch of 2 samples per micro-batch."""
    return example("unet" if model == "block-unet" else model, batch=2 * chunks)


CASES = {  # case: (model, ranks, torch's split points, seqpipe's balance over units)
    "unet": ("unet", 3, ["mid", "up1"], [2, 2, 2]),
    "unet-b": ("unet", 3, ["down2", "up1"], [1, 3, 2]),
    "block-unet": ("block-unet", 3, ["down1", "up1"], [1, 2, 3]),
    "gpt2": ("gpt2", 2, ["transformer.h.1"], [4, 3]),
}


def logits(output: Any) -> Tensor:
    """The tensor a loss reads from a stage's or a model's output (GPT-2: the logits)."""
    if isinstance(output, Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, dict):
        return next(iter(output.values()))
    return logits(output[0])


def loss_of(name: str, output: Any, target: Tensor) -> Tensor:
    out = logits(output)
    if name == "gpt2":
        return F.cross_entropy(out.flatten(0, 1), target.flatten())
    return F.mse_loss(out, target)


def reference(name: str, chunks: int) -> dict[str, Tensor | None]:
    """The plain model's gradients of the mean micro-batch loss, by every parameter name
    (both names of a tied parameter)."""
    model = make(name)
    args, kwargs, target = data(name, chunks)
    loss = torch.zeros(())
    for i in range(chunks):
        cut = [torch.tensor_split(a, chunks)[i] for a in args]
        kw = {k: torch.tensor_split(v, chunks)[i] if isinstance(v, Tensor) else v
              for k, v in kwargs.items()}
        loss = loss + loss_of(name, model(*cut, **kw), torch.tensor_split(target, chunks)[i])
    (loss / chunks).backward()
    return {k: p.grad for k, p in model.named_parameters(remove_duplicate=False)}


def run_torch(case: str, rank: int, world: int, chunks: int) -> dict[str, nn.Parameter]:
    """One step with ``torch.distributed.pipelining``; the rank's parameters by name."""
    from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline
    name = CASES[case][0]
    model = make(name)
    args, kwargs, target = data(name, chunks)
    mb_args = tuple(a[:2] for a in args)
    mb_kwargs = {k: v[:2] if isinstance(v, Tensor) else v for k, v in kwargs.items()}
    split = {point: SplitPoint.BEGINNING for point in CASES[case][2]}
    pipe = pipeline(model, mb_args=mb_args, mb_kwargs=mb_kwargs, split_spec=split)
    stage = pipe.build_stage(rank, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, chunks, loss_fn=lambda out, y: loss_of(name, out, y))
    if rank == 0:  # the non-tensor arguments are constants of the export
        schedule.step(*args, **{k: v for k, v in kwargs.items() if isinstance(v, Tensor)})
    elif rank == world - 1:
        schedule.step(target=target, losses=[])
    else:
        schedule.step()
    return dict(stage.submod.named_parameters(remove_duplicate=False))


def run_seqpipe(case: str, rank: int, world: int, chunks: int) -> dict[str, nn.Parameter]:
    """One step with ``to_sequential`` + ``DistributedPipe``; parameters by model name."""
    from seqpipe.distributed import DistributedPipe
    from seqpipe.graph import to_sequential
    name = CASES[case][0]
    args, kwargs, target = data(name, chunks)
    seq = to_sequential(make(name), args, kwargs)
    pipe = DistributedPipe(seq, chunks, balance=CASES[case][3], checkpoint="never")
    pipe.train_step(seq.origin.pipeline_input(*args, **kwargs) if pipe.is_first else None,
                    target if pipe.is_last else None,
                    lambda out, y: loss_of(name, seq.origin.rebuild(out), y))
    return {seq.origin.original_key(k): p
            for k, p in pipe.named_parameters(remove_duplicate=False)}


def worker(rank: int, world: int, engine: str, case: str, chunks: int, port: int,
           timeout: float, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))
    try:
        run = run_torch if engine == "torch" else run_seqpipe
        params = run(case, rank, world, chunks)
        want = reference(CASES[case][0], chunks)
        errors = [(0.0, "")]
        for key, param in params.items():
            if key not in want:
                raise KeyError(f"stage parameter {key!r} is not a parameter of the model")
            grad = torch.zeros_like(param) if param.grad is None else param.grad
            wanted = torch.zeros_like(param) if want[key] is None else want[key]
            errors.append(((grad.double() - wanted.double()).abs().max().item(), key))
        results.put((engine, case, rank, "trains", max(errors)))
    except Exception as exc:  # noqa: BLE001 - what stopped the step is the measurement
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        results.put((engine, case, rank, "fails", f"{type(exc).__name__}: {text}"[:160]))
        traceback.print_exc()
    dist.destroy_process_group()


def launch(engine: str, case: str, chunks: int, timeout: float) -> list[tuple[Any, ...]]:
    """Run ``engine`` on ``case`` in its own processes; one result per rank (a rank that
    neither finished nor failed within ``timeout`` reports a hang)."""
    world = CASES[case][1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, engine, case, chunks, port, timeout,
                                              results)) for r in range(world)]
    for p in procs:
        p.start()
    got: list[tuple[Any, ...]] = []
    for p in procs:
        p.join(timeout + 120)
    while not results.empty():
        got.append(results.get())
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    done = {r[2] for r in got}
    got += [(engine, case, r, "fails", "hung") for r in range(world) if r not in done]
    return got


def summary(rows: list[tuple[Any, ...]]) -> str:
    failures = sorted({r[4] for r in rows if r[3] == "fails" and r[4] != "hung"})
    if failures:
        ranks = [r[2] for r in rows if r[3] == "fails"]
        return f"no: {failures[0]} (ranks {sorted(ranks)})"
    error, key = max(r[4] for r in rows)
    return f"yes, max gradient error {error:.1e}" + (f" (`{key}`)" if error > 1e-6 else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    print(f"torch {torch.__version__}, micro-batches {args.chunks}, gloo on CPU", flush=True)
    print("| case | ranks | stages | torch `pipeline()` trains? | seqpipe `to_sequential` "
          "trains? |")
    print("|---|---|---|---|---|")
    for case in args.cases:
        cells = [summary(launch(engine, case, args.chunks, args.timeout))
                 for engine in ("torch", "seqpipe")]
        _, ranks, points, _ = CASES[case]
        print(f"| {case} | {ranks} | split before {', '.join(points)} | {cells[0]} | "
              f"{cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
