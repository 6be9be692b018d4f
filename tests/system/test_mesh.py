"""The mesh all-reduce (recursive doubling between the peers, log2(k) hops) end to end:
exact results in its own fixed order for worlds that are not powers of two, the choice
between mesh and ring (one limit per group and epoch, from the master), and the fault
handling of the ring on the mesh: a stalled link, cancellation, SIGKILL and SIGSTOP
mid-collective, each losing nothing and followed by an exact retry."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from reference import in_ring_order, mesh_reference, random_input, ring_reference

import pccl
from pccl import algorithms
from pccl.testing import Cluster, LinkEmulator
from pccl.testing.data import deterministic_tensor, digest

MiB = 1 << 20
MESH = {"mesh_max_bytes": 64 * MiB}  # the master sends everything up to 64 MiB there
NO_VIA = {"via_master_max_bytes": 0}


@pytest.mark.parametrize("world", [6, 7, 8])
async def test_mesh_is_exact_and_alike_beyond_a_power_of_two(world) -> None:
    cases = [("float32", pccl.ReduceOp.SUM, 1001), ("float64", pccl.ReduceOp.AVG, 33),
             ("float16", pccl.ReduceOp.PROD, 5), ("int32", pccl.ReduceOp.MAX, 77),
             ("uint8", pccl.ReduceOp.SUM, 1)]
    async with Cluster(world, master_kwargs=MESH, comm_kwargs=NO_VIA) as cluster:
        comms = cluster.comms
        for step, (dtype, op, count) in enumerate(cases):
            inputs = [random_input(dtype, count, seed=100 * step + r, op=op)
                      for r in range(world)]
            expected = mesh_reference(in_ring_order(comms, inputs), op, dtype).tobytes()
            if step % 2:  # out of place: the input stays as it was
                xs = [x.copy() for x in inputs]
                ys = [np.zeros_like(x) for x in inputs]
                infos = await asyncio.gather(*(c.all_reduce(x, y, op=op)
                                               for c, x, y in zip(comms, xs, ys)))
                assert all(x.tobytes() == i.tobytes() for x, i in zip(xs, inputs))
                got = ys
            else:
                got = [x.copy() for x in inputs]
                infos = await asyncio.gather(*(c.all_reduce(x, op=op)
                                               for c, x in zip(comms, got)))
            assert {i.algorithm for i in infos} == {"mesh"}, (dtype, op)
            assert all(g.tobytes() == expected for g in got), (dtype, op, world)


async def test_a_collective_above_the_limit_or_quantized_takes_the_ring() -> None:
    async with Cluster(3, master_kwargs={"mesh_max_bytes": 4096},
                       comm_kwargs=NO_VIA) as cluster:
        comms = cluster.comms
        for count, algorithm in ((1024, "mesh"), (1025, "ring")):
            inputs = [deterministic_tensor("float32", count, seed=r) for r in range(3)]
            xs = [x.copy() for x in inputs]
            infos = await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs)))
            assert {i.algorithm for i in infos} == {algorithm}
            ref = mesh_reference if algorithm == "mesh" else ring_reference
            want = ref(in_ring_order(comms, inputs), pccl.ReduceOp.SUM, "float32").tobytes()
            assert all(x.tobytes() == want for x in xs)
        q = pccl.QuantizationOptions(pccl.QuantizationAlgorithm.MIN_MAX, pccl.DataType.UINT8)
        xs = [deterministic_tensor("float32", 100, seed=r) for r in range(3)]
        infos = await asyncio.gather(*(c.all_reduce(x, quantization=q)
                                       for c, x in zip(comms, xs)))
        assert {i.algorithm for i in infos} == {"ring"}
        assert xs[0].tobytes() == xs[1].tobytes() == xs[2].tobytes()


async def test_without_the_mesh_every_collective_takes_the_ring() -> None:
    async with Cluster(4, master_kwargs={"mesh_max_bytes": 0}, comm_kwargs=NO_VIA) as cluster:
        xs = [np.full(10, r + 1, dtype=np.int64) for r in range(4)]
        infos = await asyncio.gather(*(c.all_reduce(x) for c, x in zip(cluster.comms, xs)))
        assert {i.algorithm for i in infos} == {"ring"}
        assert all((x == 10).all() for x in xs)
        assert cluster.master.state.mesh_limits == {0: 0}


async def test_the_cost_model_gives_each_group_one_limit_from_its_measured_dials() -> None:
    """Default master: the limit comes from the cost model per group (k, the dials the
    members measured, the default bandwidth), and every member picks the same algorithm
    for the same tensor."""
    async with Cluster(7, groups=[0, 0, 0, 1, 1, 1, 1], comm_kwargs=NO_VIA) as cluster:
        state = cluster.master.state
        for g, k in ((0, 3), (1, 4)):
            one_way, bandwidth = state.mesh_inputs[g]
            assert one_way > 0 and bandwidth == algorithms.DEFAULT_BANDWIDTH
            assert state.mesh_limits[g] == algorithms.mesh_max_bytes(k, one_way, bandwidth)
        for count in (1000, 100_000, 300_000):
            xs = [np.full(count, 1.0, dtype=np.float32) for _ in range(7)]
            infos = await asyncio.gather(*(c.all_reduce(x) for c, x in zip(cluster.comms, xs)))
            for g, members in ((0, range(3)), (1, range(3, 7))):
                want = "mesh" if 4 * count <= state.mesh_limits[g] else "ring"
                assert {infos[i].algorithm for i in members} == {want}, (g, count)
                assert all((xs[i] == len(members)).all() for i in members)


@pytest.mark.parametrize("fault", ["blackhole", "reset"])
async def test_a_stalled_or_reset_mesh_link_fails_everyone_in_bounded_time(fault) -> None:
    async with LinkEmulator(bandwidth=5e6, chunk_size=64 * 1024) as emu:
        async with Cluster(2, master_kwargs=MESH,
                           comm_kwargs={**NO_VIA, "peer_timeout": 1.0}) as cluster:
            await cluster.admit_behind(emu, peer_timeout=1.0, **NO_VIA)
            comms = cluster.comms
            xs = [deterministic_tensor("float32", MiB, seed=i) for i in range(3)]
            before = [x.copy() for x in xs]
            handles = [c.all_reduce_async(x) for c, x in zip(comms, xs)]
            await cluster.master.wait_for(
                lambda s: any(c.op_id >= 0 for c in s.collectives.values()))
            t0 = time.monotonic()
            if fault == "blackhole":
                emu.blackhole()
            else:
                await emu.reset_all()
            results = await asyncio.gather(*handles, return_exceptions=True)
            assert all(isinstance(r, pccl.PeerConnectionError) for r in results), results
            assert time.monotonic() - t0 < 30
            assert all(x.tobytes() == b.tobytes() for x, b in zip(xs, before))
            emu.blackhole(False)
            emu.bandwidth = None
            await asyncio.gather(*(c.update_topology() for c in comms))
            infos = await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs)))
            assert {i.algorithm for i in infos} == {"mesh"}
            want = mesh_reference(in_ring_order(comms, before), pccl.ReduceOp.SUM, "float32")
            assert all(x.tobytes() == want.tobytes() for x in xs)


async def test_cancel_mid_mesh_aborts_every_peer_and_loses_nothing() -> None:
    async with LinkEmulator(bandwidth=5e6, chunk_size=64 * 1024) as emu:
        async with Cluster(1, master_kwargs=MESH, comm_kwargs=NO_VIA) as cluster:
            await cluster.admit_behind(emu, **NO_VIA)
            a, b = cluster.comms
            xa = deterministic_tensor("float32", MiB, seed=1)
            xb = deterministic_tensor("float32", MiB, seed=2)
            ca, cb = xa.copy(), xb.copy()
            ha, hb = a.all_reduce_async(xa, tag=4), b.all_reduce_async(xb, tag=4)
            await cluster.master.wait_for(
                lambda s: any(c.op_id >= 0 for c in s.collectives.values()))
            ha.cancel()
            with pytest.raises(asyncio.CancelledError):
                await ha
            with pytest.raises(pccl.PCCLError):
                await hb
            assert xa.tobytes() == ca.tobytes() and xb.tobytes() == cb.tobytes()
            emu.bandwidth = None
            await asyncio.gather(a.update_topology(), b.update_topology())
            infos = await asyncio.gather(a.all_reduce(xa, tag=4), b.all_reduce(xb, tag=4))
            assert {i.algorithm for i in infos} == {"mesh"}
            want = mesh_reference(in_ring_order([a, b], [ca, cb]), pccl.ReduceOp.SUM,
                                  "float32")
            assert xa.tobytes() == xb.tobytes() == want.tobytes()


@pytest.mark.multiprocess
@pytest.mark.parametrize("signal", ["SIGKILL", "SIGSTOP"])
async def test_a_peer_killed_or_frozen_mid_mesh_fails_the_others_and_loses_nothing(
        pccl_peer_process, signal) -> None:
    """A -> V (a process) -> B (behind a slow link): V is SIGKILLed or SIGSTOPped while
    the mesh all-reduce runs. A and B fail with PeerConnectionError (a frozen V by the
    stall timer or the heartbeat), their tensors untouched; the retry runs on the mesh
    the master rebuilt from the two of them and gives the exact result."""
    n = 2 * MiB // 4
    async with LinkEmulator(bandwidth=2e6, chunk_size=64 * 1024) as emu:
        master_kwargs = {**MESH, "heartbeat_timeout": 5.0 if signal == "SIGSTOP" else 30.0}
        async with Cluster(1, master_kwargs=master_kwargs,
                           comm_kwargs={**NO_VIA, "peer_timeout": 1.0}) as cluster:
            a, victim, b = await cluster.ring_with_process(pccl_peer_process, emu)
            xa = deterministic_tensor("float32", n, seed=11)
            xb = deterministic_tensor("float32", n, seed=12)
            da, db = digest(xa), digest(xb)
            await victim.call("make_tensor", name="x", dtype="float32", count=n, seed=13)
            ha, hb = a.all_reduce_async(xa), b.all_reduce_async(xb)
            hv = asyncio.create_task(victim.call("all_reduce", name="x"))
            await cluster.master.wait_for(
                lambda s: any(c.op_id >= 0 and len(c.participants) == 3
                              for c in s.collectives.values()), timeout=60)
            t0 = time.monotonic()
            if signal == "SIGKILL":
                victim.kill()
            else:
                victim.stop()
            for h in (ha, hb):
                with pytest.raises(pccl.PeerConnectionError):
                    await h
            assert time.monotonic() - t0 < 30
            assert digest(xa) == da and digest(xb) == db  # nothing lost
            victim.kill()
            with pytest.raises(ConnectionError):
                await hv
            emu.bandwidth = None
            infos = await asyncio.gather(a.all_reduce(xa), b.all_reduce(xb))
            assert [(i.world_size, i.algorithm) for i in infos] == [(2, "mesh")] * 2
            inputs = [deterministic_tensor("float32", n, seed=s) for s in (11, 12)]
            want = mesh_reference(in_ring_order([a, b], inputs), pccl.ReduceOp.SUM, "float32")
            assert xa.tobytes() == xb.tobytes() == want.tobytes()

