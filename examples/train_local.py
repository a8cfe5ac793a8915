"""Pipelined training in one process with seqpipe.Pipe: the pattern to copy.

    python examples/train_local.py            # two partitions: two GPUs, or two CPU threads

Model, pipe, optimizer, loop; swap in your own nn.Sequential and data.
"""
import torch
from torch import nn

from seqpipe import Pipe


def main(steps: int = 20, batch: int = 32) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(                                   # any nn.Sequential
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
        nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    devices = ["cuda:0", "cuda:1"] if torch.cuda.device_count() >= 2 else ["cpu", "cpu"]
    pipe = Pipe(model, chunks=4, balance=[4, 3], devices=devices)  # 4 micro-batches
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    prototypes = torch.randn(10, 64)                         # learnable synthetic data

    for step in range(1, steps + 1):
        labels = torch.randint(10, (batch,))
        inputs = prototypes[labels] + 0.5 * torch.randn(batch, 64)
        optimizer.zero_grad()
        # One step under the 1F1B schedule (or: loss_fn(pipe(inputs), ...).backward())
        loss = pipe.train_step(inputs, labels.to(pipe.devices[-1]), loss_fn, schedule="1f1b")
        optimizer.step()
        if step % 5 == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    return loss.item()


if __name__ == "__main__":
    main()
