"""The model and data of ``python -m seqpipe --model gpt2-tiny``: a small GPT written as a
free-form model, which ``seqpipe.demo`` converts with ``seqpipe.to_sequential`` and trains
in a ``Pipe``.

The model is what people write (a Python loop over a ``ModuleList`` of blocks, positions
made in ``forward``, the output head tied to the token embedding), not an
``nn.Sequential``; the conversion makes one layer per embedding, block, norm and head, and
the data (each token follows from the one before by a fixed rule, from a random start)
is learnable without any download.
"""
from __future__ import annotations

from typing import Iterator, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["TinyGPT", "make_tokens"]

VOCAB, LENGTH = 32, 16


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, with residuals."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """A GPT in a dozen lines: tied embedding and head, a loop over its blocks."""

    def __init__(self, vocab: int = VOCAB, width: int = 64, heads: int = 4,
                 layers: int = 4, length: int = LENGTH) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(length, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight
        for table in (self.tok, self.pos):  # GPT-2's initialisation: small logits at first
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_tokens(steps: int, batch: int, seed: int = 0) -> Iterator[Tuple[Tensor, Tensor]]:
    """``steps`` mini-batches of ``(inputs, next tokens)``: from a random start, each token
    is the previous plus one, modulo ``VOCAB``."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = [torch.randint(VOCAB, (batch,), generator=gen)]
        for _ in range(LENGTH):
            tokens.append((tokens[-1] + 1) % VOCAB)
        seq = torch.stack(tokens, 1)
        yield seq[:, :-1], seq[:, 1:]
