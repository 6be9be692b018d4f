"""Tiny all-reduces reduced by the master: every member sends its tensor with its init,
the master reduces them in the ring's order and answers everyone with the result (one
round trip, no ring). Real peers over real sockets."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
from reference import in_ring_order, ring_reference

import pccl
from pccl.testing import Cluster
from pccl.testing.data import deterministic_tensor


def via_master(cluster: Cluster) -> int:
    return cluster.master.state.collective_paths["via_master"]


@pytest.mark.parametrize("op", [pccl.ReduceOp.SUM, pccl.ReduceOp.AVG, pccl.ReduceOp.MAX])
async def test_tiny_collectives_are_reduced_by_the_master_in_the_rings_order(op) -> None:
    async with Cluster(5) as cluster:
        comms = cluster.comms
        for step, count in enumerate([1, 7, 1001, 16_384]):  # 16 384 x f32 = 64 KiB
            xs = [deterministic_tensor("float32", count, seed=10 * step + i) * 10.0 ** i
                  for i in range(5)]
            expected = ring_reference(in_ring_order(comms, [x.copy() for x in xs]), op, "float32")
            infos = await asyncio.gather(*(c.all_reduce(x, op=op, tag=step)
                                           for c, x in zip(comms, xs)))
            # No ring: the bytes went to the master and back.
            assert [(i.world_size, i.tx_bytes, i.rx_bytes) for i in infos] == [
                (5, 4 * count, 4 * count)] * 5
            assert all(x.tobytes() == expected.tobytes() for x in xs)
        assert via_master(cluster) == 4


async def test_out_of_place_leaves_the_input_alone() -> None:
    async with Cluster(3) as cluster:
        xs = [np.full(100, i + 1, dtype=np.int32) for i in range(3)]
        ys = [np.zeros(100, dtype=np.int32) for _ in range(3)]
        await asyncio.gather(*(c.all_reduce(x, y) for c, x, y in zip(cluster.comms, xs, ys)))
        assert all((y == 6).all() for y in ys)
        assert all((x == i + 1).all() for i, x in enumerate(xs))


async def test_a_member_that_does_not_send_its_tensor_makes_everyone_take_the_ring() -> None:
    """Peers configured differently agree anyway: the master runs the ring."""
    async with Cluster(3) as cluster:
        comms = cluster.comms
        comms[1].options = dataclasses.replace(comms[1].options, via_master_max_bytes=0)
        xs = [deterministic_tensor("float64", 999, seed=i) for i in range(3)]
        expected = ring_reference(in_ring_order(comms, [x.copy() for x in xs]),
                                  pccl.ReduceOp.SUM, "float64")
        infos = await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs)))
        assert all(i.tx_bytes > 0 for i in infos)  # the ring ran
        assert all(x.tobytes() == expected.tobytes() for x in xs)
        assert via_master(cluster) == 0


async def test_quantized_tiny_collectives_take_the_ring() -> None:
    async with Cluster(2) as cluster:
        q = pccl.QuantizationOptions(pccl.QuantizationAlgorithm.MIN_MAX, pccl.DataType.UINT8)
        xs = [deterministic_tensor("float32", 500, seed=i) for i in range(2)]
        await asyncio.gather(*(c.all_reduce(x, quantization=q)
                               for c, x in zip(cluster.comms, xs)))
        assert xs[0].tobytes() == xs[1].tobytes()
        assert via_master(cluster) == 0


# (A peer leaving before it calls: tests/system/test_early_start.py, one test for every path.)


async def test_cancel_before_the_others_call_withdraws_and_loses_nothing() -> None:
    async with Cluster(2) as cluster:
        a, b = cluster.comms
        xa, xb = np.full(64, 1, dtype=np.int64), np.full(64, 2, dtype=np.int64)
        ha = a.all_reduce_async(xa, tag=4)
        await cluster.master.wait_for(lambda s: any(c.inits for c in s.collectives.values()))
        ha.cancel()
        async with asyncio.timeout(5):  # the master's word comes at once, no timeout
            with pytest.raises(asyncio.CancelledError):
                await ha
        assert (xa == 1).all()
        await asyncio.gather(a.all_reduce(xa, tag=4), b.all_reduce(xb, tag=4))
        assert (xa == 3).all() and (xb == 3).all()


@pytest.mark.parametrize("world", [1, 2])
async def test_a_world_of_one_or_two(world) -> None:
    async with Cluster(world) as cluster:
        xs = [np.arange(33, dtype=np.float16) * (i + 1) for i in range(world)]
        infos = await asyncio.gather(*(c.all_reduce(x, op=pccl.ReduceOp.AVG)
                                       for c, x in zip(cluster.comms, xs)))
        assert [i.world_size for i in infos] == [world] * world
        want = np.arange(33, dtype=np.float16) * (1.0 if world == 1 else np.float16(1.5))
        assert all(x.tobytes() == want.astype(np.float16).tobytes() for x in xs)
