"""A language-modelling task with no download: a byte-level causal transformer (pre-norm, learned positions,
tied embeddings) on the running Python's top-level standard library ``*.py`` files, sorted by name (the last
10% for validation). Splits: ``iid`` (every worker samples all of it), ``files`` (worker ``r`` gets the
``r``-th contiguous run of files)."""

import math
import os
import sys
from pathlib import Path

import torch
from torch import nn

CONTEXT, VOCAB, VALIDATION_SHARE = 64, 256, 0.1
LM_SPLITS = ("iid", "files")


def corpus_files() -> list[Path]:
    return sorted(Path(os.__file__).parent.glob("*.py"))


def describe_corpus() -> str:
    files = corpus_files()
    size = sum(f.stat().st_size for f in files)
    return f"{len(files)} files of the Python {sys.version.split()[0]} standard library, {size / 1e6:.1f} MB"


def make_lm_data(world: int, rank: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This worker's training tokens and the validation tokens."""
    if split not in LM_SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(LM_SPLITS)}")
    files = corpus_files()
    cut = len(files) - max(1, int(len(files) * VALIDATION_SHARE))
    train, validation = files[:cut], files[cut:]
    if split == "files":
        per = math.ceil(len(train) / world)
        train = train[rank * per : (rank + 1) * per]
    data = (bytearray(b"".join(f.read_bytes() for f in part)) for part in (train, validation))
    return tuple(torch.frombuffer(part, dtype=torch.uint8).long() for part in data)


def windows(tokens: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets for windows of ``CONTEXT`` bytes starting at ``starts``."""
    chunk = tokens[starts[:, None] + torch.arange(CONTEXT + 1)]
    return chunk[:, :-1], chunk[:, 1:]


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        mask = torch.triu(torch.full((CONTEXT, CONTEXT), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, n = self.norm1(x), x.shape[1]
        x = x + self.attention(h, h, h, attn_mask=self.mask[:n, :n], need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """Byte-level causal transformer: embeddings, ``depth`` pre-norm blocks, tied output layer."""

    def __init__(self, width: int = 64, depth: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        nn.init.normal_(self.embed.weight, std=0.02)  # tied with the output layer: small logits at first
        self.position = nn.Parameter(torch.zeros(CONTEXT, width))
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.T


def make_lm_model(width: int = 64, depth: int = 2, seed: int = 0) -> TinyGPT:
    """The benchmark's model (120,576 parameters at the defaults; width 192, depth 3: 1.39M)."""
    torch.manual_seed(seed)
    return TinyGPT(width=width, depth=depth)


@torch.no_grad()
def validation_loss(model: nn.Module, tokens: torch.Tensor) -> float:
    """Mean next-byte cross-entropy (nats) over 256 fixed windows of the validation set."""
    g = torch.Generator().manual_seed(1)
    starts = torch.randint(0, len(tokens) - CONTEXT - 1, (256,), generator=g)
    x, y = windows(tokens, starts)
    return nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).item()
