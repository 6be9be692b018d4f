"""Quantized all-reduce: bit-identical on every peer for every algorithm x wire type x
input dtype, within a documented error bound of the exact result, ~4x fewer bytes on
the wire for float32, and defined NaN / Inf behaviour."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from reference import bf16_round, bf16_to_f32

import pccl

try:  # imported up front: a first import inside a test would stall the event loop
    import torch
except ImportError:  # torch is optional
    torch = None

A = pccl.QuantizationAlgorithm
W = pccl.DataType
WIRES = [W.UINT8, W.INT8, W.FLOAT8_E4M3, W.FLOAT8_E5M2]
ALGS = [A.MIN_MAX, A.ZERO_POINT_SCALE]
INPUTS = ["float16", "bfloat16", "float32", "float64"]


def make(dtype: str, values: np.ndarray):
    """A tensor of ``dtype`` holding ``values`` (bfloat16 via torch), and its float64 view."""
    if dtype == "bfloat16":
        bits = bf16_round(values.astype(np.float32))
        t = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)
        return t, bf16_to_f32(bits).astype(np.float64)
    arr = values.astype(dtype)
    return arr, arr.astype(np.float64)


def as_f64(t) -> np.ndarray:
    if type(t).__module__.startswith("torch"):
        return bf16_to_f32(t.view(torch.int16).numpy().view(np.uint16)).astype(np.float64)
    return t.astype(np.float64)


def raw(t) -> bytes:
    if type(t).__module__.startswith("torch"):
        return t.view(torch.int16).numpy().tobytes()
    return t.tobytes()


def bound(wire: W, world: int, xs: list[np.ndarray], dtype: str) -> float:
    """Documented bound on |result - exact sum| (see docs/semantics.md).

    Every partial sum is encoded once per hop (world - 1 reduce-scatter hops plus the
    owner's final encoding). Its range is at most R = sum of the inputs' ranges and its
    magnitude at most M = sum of max|x|. An 8-bit integer code is off by at most half a
    step of R/252; an fp8 code by its relative precision of M. Each hop also rounds to
    the input dtype once (relative eps).
    """
    R = sum(float(x.max() - x.min()) for x in xs)
    M = sum(float(np.abs(x).max()) for x in xs)
    per_hop = R / 252 * 0.51 if wire in (W.UINT8, W.INT8) else M * (
        2.0 ** -4 if wire == W.FLOAT8_E4M3 else 2.0 ** -3)
    eps = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23,
           "float64": 2.0 ** -52}[dtype]
    return world * (per_hop + 2 * eps * M) + 1e-30


@pytest.mark.parametrize("world", [2, 3, 4])
async def test_every_combination_is_bit_identical_and_bounded(pccl_cluster, world) -> None:
    cluster = await pccl_cluster(world)
    n = 3001
    for dtype in INPUTS:
        if dtype == "bfloat16" and torch is None:
            continue
        for alg in ALGS:
            for wire in WIRES:
                rng = np.random.default_rng(world * 1000 + int(alg) * 100 + int(wire))
                made = [make(dtype, rng.standard_normal(n) * (r + 1)) for r in range(world)]
                tensors = [t for t, _ in made]
                xs = [x for _, x in made]
                q = pccl.QuantizationOptions(alg, wire)
                await asyncio.gather(*(c.all_reduce(t, op=pccl.ReduceOp.SUM, quantization=q)
                                       for c, t in zip(cluster.comms, tensors)))
                assert all(raw(t) == raw(tensors[0]) for t in tensors), (dtype, alg, wire)
                err = np.max(np.abs(as_f64(tensors[0]) - np.sum(xs, axis=0)))
                assert err <= bound(wire, world, xs, dtype), (dtype, alg, wire, err)


async def test_avg_is_the_quantized_sum_divided(pccl_cluster) -> None:
    cluster = await pccl_cluster(3)
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(1000).astype(np.float32) for _ in range(3)]
    ts = [x.copy() for x in xs]
    q = pccl.QuantizationOptions(A.MIN_MAX, W.UINT8)
    await asyncio.gather(*(c.all_reduce(t, op=pccl.ReduceOp.AVG, quantization=q)
                           for c, t in zip(cluster.comms, ts)))
    assert all(t.tobytes() == ts[0].tobytes() for t in ts)
    exact = np.mean([x.astype(np.float64) for x in xs], axis=0)
    assert np.max(np.abs(ts[0] - exact)) <= bound(W.UINT8, 3, xs, "float32") / 3


async def test_tx_bytes_are_about_a_quarter_for_float32(pccl_cluster) -> None:
    cluster = await pccl_cluster(3)
    xs = [np.random.default_rng(i).standard_normal(1 << 20).astype(np.float32)
          for i in range(3)]
    plain = await asyncio.gather(*(c.all_reduce(x.copy()) for c, x in zip(cluster.comms, xs)))
    q = pccl.QuantizationOptions(A.ZERO_POINT_SCALE, W.FLOAT8_E4M3)
    quant = await asyncio.gather(*(c.all_reduce(x.copy(), quantization=q, tag=1)
                                   for c, x in zip(cluster.comms, xs)))
    for p, qi in zip(plain, quant):
        assert qi.tx_bytes <= 0.30 * p.tx_bytes
        assert qi.rx_bytes <= 0.30 * p.rx_bytes


@pytest.mark.parametrize("wire", WIRES)
async def test_edge_inputs(pccl_cluster, wire) -> None:
    cluster = await pccl_cluster(2)
    q = pccl.QuantizationOptions(A.MIN_MAX, wire)

    async def run(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        ta, tb = a.copy(), b.copy()
        await asyncio.gather(cluster.comms[0].all_reduce(ta, quantization=q),
                             cluster.comms[1].all_reduce(tb, quantization=q))
        assert ta.tobytes() == tb.tobytes()
        return ta

    # Constant chunks and zeros survive exactly.
    np.testing.assert_array_equal(await run(np.full(100, 1.5, np.float32),
                                            np.full(100, 2.25, np.float32)),
                                  np.full(100, 3.75, np.float32))
    np.testing.assert_array_equal(await run(np.zeros(100, np.float32),
                                            np.zeros(100, np.float32)),
                                  np.zeros(100, np.float32))
    # Huge ranges: no overflow to inf, no NaN.
    big = np.linspace(-3e37, 3e37, 100).astype(np.float32)
    out = await run(big, big)
    assert np.all(np.isfinite(out))
    # Subnormals: tiny values stay tiny and finite.
    tiny = np.full(100, 1e-40, np.float32)
    out = await run(tiny, tiny)
    assert np.all(np.isfinite(out)) and np.all(np.abs(out) < 1e-37)
    # NaN and Inf keep their class at their position; they do not become finite garbage.
    a = np.linspace(-1, 1, 100).astype(np.float32)
    b = a.copy()
    a[5], b[7], a[9], b[9] = np.nan, np.inf, -np.inf, -np.inf
    out = await run(a, b)
    assert np.isnan(out[5]) and out[7] == np.inf and out[9] == -np.inf
    mask = np.ones(100, bool)
    mask[[5, 7, 9]] = False
    assert np.all(np.isfinite(out[mask]))


async def test_invalid_quantization_is_invalid_argument(pccl_cluster) -> None:
    cluster = await pccl_cluster(1)
    (c,) = cluster.comms
    q = pccl.QuantizationOptions(A.MIN_MAX, W.UINT8)
    with pytest.raises(pccl.InvalidArgumentError):
        await c.all_reduce(np.ones(4, np.int32), quantization=q)
    with pytest.raises(pccl.InvalidArgumentError):
        await c.all_reduce(np.ones(4, np.float32), op=pccl.ReduceOp.MAX, quantization=q)
    with pytest.raises(pccl.InvalidArgumentError):
        await c.all_reduce(np.ones(4, np.float32),
                           quantization=pccl.QuantizationOptions(A.MIN_MAX, W.FLOAT32))


async def test_peers_disagreeing_on_quantization_get_invalid_usage(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    xs = [np.ones(10, np.float32) for _ in range(2)]
    qs = [pccl.QuantizationOptions(A.MIN_MAX, W.UINT8),
          pccl.QuantizationOptions(A.MIN_MAX, W.INT8)]
    res = await asyncio.gather(*(c.all_reduce(x, quantization=q)
                                 for c, x, q in zip(cluster.comms, xs, qs)),
                               return_exceptions=True)
    assert all(isinstance(r, pccl.InvalidUsageError) for r in res)
    assert all((x == 1).all() for x in xs)


@pytest.mark.parametrize("count", [0, 1, 2, 5])
async def test_odd_sizes_quantized(pccl_cluster, count) -> None:
    """Fewer elements than peers: empty pieces still carry a header and stay in step."""
    cluster = await pccl_cluster(3)
    q = pccl.QuantizationOptions(A.MIN_MAX, W.UINT8)
    xs = [np.full(count, r + 1.0, np.float32) for r in range(3)]
    await asyncio.gather(*(c.all_reduce(x, quantization=q) for c, x in zip(cluster.comms, xs)))
    for x in xs:
        np.testing.assert_array_equal(x, np.full(count, 6.0, np.float32))
