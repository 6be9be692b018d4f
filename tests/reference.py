"""Reference results for the all-reduce, computed with numpy in the exact order each
algorithm uses, so float results can be compared bit for bit.

The ring (and the master, which replays it):

Chunk ``c`` of the buffer (elements ``count*c//world .. count*(c+1)//world``) is
accumulated along the ring starting at rank ``c``: ``((x_c op x_c+1) op x_c+2) ...``.
AVG is that SUM divided once by ``world``. float16/bfloat16 arithmetic happens in float32,
rounded to 16 bits after every operation; integers wrap.

The mesh (recursive doubling, ``mesh_reference``): with ``p`` the largest power of two
not above ``world``, rank ``r + p`` folds into rank ``r`` after it, then blocks of
doubling size combine lower block first.
"""

from __future__ import annotations

import numpy as np

import pccl

OPS = [pccl.ReduceOp.SUM, pccl.ReduceOp.AVG, pccl.ReduceOp.PROD, pccl.ReduceOp.MAX,
       pccl.ReduceOp.MIN]
INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOAT_DTYPES = ["float16", "bfloat16", "float32", "float64"]


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (round to nearest even), returned as uint16 bits."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = np.isnan(x)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, np.uint16(0x7FC0), rounded).astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _apply(op: pccl.ReduceOp, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        if op in (pccl.ReduceOp.SUM, pccl.ReduceOp.AVG):
            return a + b
        if op == pccl.ReduceOp.PROD:
            return a * b
        if op == pccl.ReduceOp.MAX:
            return np.maximum(a, b)
        return np.minimum(a, b)


@np.errstate(over="ignore", invalid="ignore")
def _combine(dtype: str, op: pccl.ReduceOp, acc: np.ndarray, x: np.ndarray) -> np.ndarray:
    if dtype == "bfloat16":
        return bf16_round(_apply(op, bf16_to_f32(acc), bf16_to_f32(x)))
    if dtype == "float16":
        return _apply(op, acc.astype(np.float32), x.astype(np.float32)).astype(np.float16)
    return _apply(op, acc, x).astype(acc.dtype)


@np.errstate(over="ignore", invalid="ignore")
def _divide(dtype: str, s: np.ndarray, world: int) -> np.ndarray:
    if dtype == "bfloat16":
        return bf16_round(bf16_to_f32(s) / np.float32(world))
    if dtype == "float16":
        return (s.astype(np.float32) / np.float32(world)).astype(np.float16)
    if dtype in FLOAT_DTYPES:
        return (s / s.dtype.type(world)).astype(s.dtype)
    # Integers: truncate toward zero, computed exactly with Python ints.
    out = [(abs(int(v)) // world) * (1 if int(v) >= 0 else -1) for v in s.tolist()]
    return np.array(out, dtype=s.dtype)


def ring_reference(inputs: list[np.ndarray], op: pccl.ReduceOp, dtype: str) -> np.ndarray:
    """What every peer must hold after the all-reduce (bfloat16 given as uint16 bits)."""
    world = len(inputs)
    count = inputs[0].size
    out = np.empty_like(inputs[0])
    for c in range(world):
        lo, hi = count * c // world, count * (c + 1) // world
        acc = inputs[c][lo:hi].copy()
        for j in range(1, world):
            acc = _combine(dtype, op, acc, inputs[(c + j) % world][lo:hi])
        if op == pccl.ReduceOp.AVG:
            acc = _divide(dtype, acc, world)
        out[lo:hi] = acc
    return out


def mesh_reference(inputs: list[np.ndarray], op: pccl.ReduceOp, dtype: str) -> np.ndarray:
    """What every peer must hold after a mesh all-reduce of ``inputs`` (in rank order)."""
    world = len(inputs)
    p = 1 << (world.bit_length() - 1)
    acc = [inputs[r].copy() if r + p >= world else _combine(dtype, op, inputs[r], inputs[r + p])
           for r in range(p)]
    while len(acc) > 1:
        acc = [_combine(dtype, op, acc[i], acc[i + 1]) for i in range(0, len(acc), 2)]
    out = acc[0]
    if op == pccl.ReduceOp.AVG:
        out = _divide(dtype, out, world)
    return out


def reference(algorithm: str, inputs: list[np.ndarray], op: pccl.ReduceOp,
              dtype: str) -> np.ndarray:
    """The reference for how the all-reduce ran (``ReduceInfo.algorithm``)."""
    if algorithm == "mesh":
        return mesh_reference(inputs, op, dtype)
    return ring_reference(inputs, op, dtype)


def random_input(dtype: str, count: int, seed: int, op: pccl.ReduceOp) -> np.ndarray:
    """Values that exercise the op without making PROD overflow floats to inf at once
    (integers are meant to wrap). bfloat16 comes back as uint16 bits."""
    rng = np.random.default_rng(seed)
    if dtype in INT_DTYPES:
        info = np.iinfo(dtype)
        lo, hi = (max(info.min, -5), min(info.max, 5)) if op == pccl.ReduceOp.PROD else (
            info.min, info.max)
        return rng.integers(lo, hi, size=count, endpoint=True, dtype=dtype)
    scale = 2.0 if op == pccl.ReduceOp.PROD else 100.0
    vals = (rng.standard_normal(count) * scale).astype(np.float32)
    if dtype == "bfloat16":
        return bf16_round(vals)
    return vals.astype(dtype)


def in_ring_order(comms: list, per_comm: list) -> list:
    """``per_comm[i]`` belongs to ``comms[i]``; returns them ordered by ring rank (peers
    that connected concurrently may have joined in any order), as ``ring_reference``
    wants its inputs."""
    ranks = [c.ring.index(c.peer_id) for c in comms]
    return [x for _, x in sorted(zip(ranks, per_comm), key=lambda t: t[0])]
