"""The data and the model of the training examples: a byte-level language model trained
on the Python standard library's own source files (they ship with every Python, so
nothing is downloaded).

Data: the ``*.py`` files next to ``os.py``. A file belongs to the validation split when
the first byte of the SHA-256 of its name is below 26 (about one file in ten), so the
split depends only on the file names. The training files, ordered by that hash and
concatenated, form one byte stream that is cut into ``n`` equal contiguous shards: peer
``k`` trains on shard ``k`` only. Batches are random windows of the shard, drawn from a
generator seeded with ``(seed, shard, step)``, so a run is reproducible and a peer's
batches do not depend on what the other peers do.

Model: a small pre-norm decoder-only transformer over bytes (vocabulary 256), with
learned position embeddings; ``tiny_lm(size)`` builds one of the sizes in ``SIZES``.
``Size.pairs`` adds a byte-pair input embedding: one learned vector per (previous byte,
byte), 65,536 rows, added to the byte's own embedding. It multiplies the parameters (the
bytes a DiLoCo outer step moves) by about 30 while adding little compute per token (a
lookup and a sparse gradient): on a CPU, that is the ratio of bytes to FLOPs that large
models trained on GPUs have, so the link, not the compute, sets the pace.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256


def _key(path: Path) -> bytes:
    return hashlib.sha256(path.name.encode()).digest()


@dataclass
class Corpus:
    train: np.ndarray  # uint8, the training stream (all shards, in order)
    val: np.ndarray  # uint8, the validation stream
    train_files: int
    val_files: int

    def shard(self, k: int, n: int) -> np.ndarray:
        """Shard ``k`` of ``n``: a contiguous, equal slice of the training stream."""
        size = len(self.train) // n
        return self.train[k * size:(k + 1) * size]


def load_corpus(root: Path | None = None) -> Corpus:
    """The standard library's ``*.py`` files, split deterministically by name hash."""
    root = root or Path(os.__file__).parent
    files = sorted(root.glob("*.py"), key=_key)
    if not files:
        raise RuntimeError(f"no *.py files under {root}")
    train, val = [], []
    for f in files:
        (val if _key(f)[0] < 26 else train).append(f.read_bytes())
    return Corpus(np.frombuffer(b"".join(train), dtype=np.uint8).copy(),
                  np.frombuffer(b"".join(val), dtype=np.uint8).copy(), len(train), len(val))


def batch(stream: np.ndarray, ctx: int, size: int, seed: int, shard: int,
          step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` random windows of ``stream``: inputs and next-byte targets (int64)."""
    rng = np.random.default_rng([seed, shard, step])
    starts = rng.integers(0, len(stream) - ctx - 1, size=size)
    idx = starts[:, None] + np.arange(ctx + 1)[None, :]
    w = torch.from_numpy(stream[idx].astype(np.int64))
    return w[:, :-1], w[:, 1:]


def val_batches(val: np.ndarray, ctx: int, windows: int,
                per_batch: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed validation set: ``windows`` evenly spaced windows of the validation stream."""
    starts = np.linspace(0, len(val) - ctx - 1, windows).astype(np.int64)
    idx = starts[:, None] + np.arange(ctx + 1)[None, :]
    w = torch.from_numpy(val[idx].astype(np.int64))
    return [(w[i:i + per_batch, :-1], w[i:i + per_batch, 1:])
            for i in range(0, windows, per_batch)]


@dataclass(frozen=True)
class Size:
    dim: int
    layers: int
    heads: int
    ctx: int
    pairs: bool = False  # the byte-pair input embedding (VOCAB ** 2 x dim)


SIZES = {
    "tiny": Size(dim=32, layers=1, heads=2, ctx=32),  # for tests: a few ms per step
    "small": Size(dim=64, layers=2, heads=4, ctx=64),  # the measured runs
    # "small" plus the byte-pair table: 4.3 M parameters (17 MB in float32), for runs
    # where the link dominates (train.py --preset slowlink).
    "medium": Size(dim=64, layers=2, heads=4, ctx=64, pairs=True),
}


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.size = size
        self.tok = nn.Embedding(VOCAB, size.dim)
        self.pos = nn.Embedding(size.ctx, size.dim)
        self.pair = nn.Embedding(VOCAB * VOCAB, size.dim) if size.pairs else None
        self.blocks = nn.ModuleList(Block(size.dim, size.heads) for _ in range(size.layers))
        self.ln = nn.LayerNorm(size.dim)
        self.head = nn.Linear(size.dim, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        if self.pair is not None:  # the first byte pairs with byte 0
            h = h + self.pair(F.pad(x[:, :-1], (1, 0)) * VOCAB + x)
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.ln(h))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))


def tiny_lm(size: str, seed: int) -> TinyLM:
    """The model, initialised from ``seed`` (the same on every peer)."""
    torch.manual_seed(seed)
    model = TinyLM(SIZES[size])
    with torch.no_grad():  # small init keeps the first steps of every mode comparable
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
                if name.endswith(("proj.weight", "down.weight")):
                    p.mul_(1.0 / math.sqrt(2 * model.size.layers))
            elif name.endswith("bias"):
                p.zero_()
    return model


@torch.no_grad()
def evaluate(model: TinyLM, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean cross-entropy (nats per byte) over the validation batches."""
    total, n = 0.0, 0
    for x, y in batches:
        total += float(model.loss(x, y)) * x.numel()
        n += x.numel()
    return total / n
