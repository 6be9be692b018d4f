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


def test_the_cost_model_prefers_the_mesh_for_small_tensors_and_large_k() -> None:
    """Hand-checked values of pccl.algorithms (no network)."""
    assert algorithms.mesh_rounds(32) == 5 and algorithms.mesh_rounds(5) == 4
    assert algorithms.mesh_partners(5, 6) == [1]
    assert algorithms.mesh_partners(1, 6) == [5, 0, 3]
    # The limit grows with the hop latency and with k, and never passes the cap.
    limits = [algorithms.mesh_max_bytes(k, 0.005, 1e8) for k in (3, 4, 8, 32)]
    assert 0 < limits[0] < limits[1] and limits[2] <= limits[3] == algorithms.MESH_CAP_BYTES
    assert algorithms.mesh_max_bytes(8, 0.0, 1e9) < algorithms.mesh_max_bytes(8, 1e-3, 1e9)
    # k = 2: one hop instead of two, each byte dearer by m: S* = a / m, whatever bw.
    a = algorithms.HOP_OVERHEAD_S
    for bw in (1e9, 4e7):
        assert algorithms.mesh_max_bytes(2, 0.0, bw) == int(
            a / algorithms.MESH_CPU_SECONDS_PER_BYTE)
    # Larger k: the mesh's extra work weighs less on a slow link, so its limit is larger
    # there in link time (k = 6: R = 4 hops of S against the ring's 10 of S / 6).
    fast, slow = (algorithms.mesh_max_bytes(6, 0.005, bw, cap=1 << 40) for bw in (1e9, 4e7))
    r, m = 4, algorithms.MESH_CPU_SECONDS_PER_BYTE
    saved = (10 - r) * (0.005 + a)
    assert fast == int(saved / (r * (1e-9 + m) - 10 / 6 * 1e-9))
    assert slow == int(saved / (r * (1 / 4e7 + m) - 10 / 6 / 4e7))
    assert slow / 4e7 > 5 * fast / 1e9
    assert algorithms.mesh_max_bytes(1, 0.005, 1e9) == 0
    for k in (3, 4, 8, 32):
        s = algorithms.mesh_max_bytes(k, 0.001, 1e9, cap=1 << 40)
        # At the limit both models agree (within a byte's rounding).
        ring = algorithms.ring_seconds(k, s, 0.001, 1e9)
        mesh = algorithms.mesh_seconds(k, s, 0.001, 1e9)
        assert abs(ring - mesh) < 1e-6 * ring
    assert algorithms.one_way_latency([]) == 0.0
    assert algorithms.one_way_latency([0.006, 0.06, 0.012]) == pytest.approx(
        0.012 / (2 * algorithms.DIAL_ROUND_TRIPS))


def test_the_mesh_schedule_in_python_is_the_rust_one() -> None:
    for k in range(1, 41):
        steps = algorithms.mesh_steps(k)
        assert len(steps) == algorithms.mesh_rounds(k)
        for r in range(k):
            talks = {b for step in steps for a, b in step if a == r}
            talks |= {a for step in steps for a, b in step if b == r}
            assert talks == set(algorithms.mesh_partners(r, k)), (k, r)
        # Every step: each rank sends at most once and receives at most once.
        for step in steps:
            assert len({a for a, _ in step}) == len(step) == len({b for _, b in step})


def test_per_pair_latencies_in_the_cost_model() -> None:
    """Equal pairs give the hops x latency model; regions make the ring dearer when its
    ranks scatter them and the mesh's late steps the only slow ones when they don't."""
    for k in (2, 3, 5, 8, 13):
        same = algorithms.mesh_max_bytes(k, 0.004, 1e8, cap=1 << 40)
        per_pair = algorithms.mesh_max_bytes(k, 0.0, 1e8, cap=1 << 40,
                                             latency=lambda i, j: 0.004)
        assert abs(per_pair - same) <= 1, k
        assert algorithms.ring_path_latency(k, lambda i, j: 0.004) == pytest.approx(
            2 * (k - 1) * 0.004)
        assert algorithms.mesh_path_latency(k, lambda i, j: 0.004) == pytest.approx(
            algorithms.mesh_rounds(k) * 0.004)

    def regions(of):  # 40 ms between regions, 1 ms inside
        return lambda i, j: 0.001 if of(i) == of(j) else 0.040

    k = 16
    sorted_ranks, scattered = regions(lambda r: r // 8), regions(lambda r: r % 2)
    # A ring in region order crosses twice; scattered, at every hop.
    assert algorithms.ring_path_latency(k, sorted_ranks) == pytest.approx(
        2 * 15 / 16 * (14 * 0.001 + 2 * 0.040))
    assert algorithms.ring_path_latency(k, scattered) == pytest.approx(2 * 15 * 0.040)
    # The mesh's first three steps stay inside a region of 8 contiguous ranks.
    assert algorithms.mesh_path_latency(k, sorted_ranks) == pytest.approx(3 * 0.001 + 0.040)
    assert algorithms.mesh_path_latency(k, scattered) == pytest.approx(0.040 + 3 * 0.001)


def test_the_mesh_starts_at_a_region_edge() -> None:
    # A ring of 8 whose regions are positions 2..5 and 6..1: starting the ranks at
    # position 2 (or 6) keeps two of the mesh's three steps inside the regions.
    def region(pos: int) -> int:
        return int(2 <= pos % 8 <= 5)

    def lat(i: int, j: int) -> float:
        return 0.001 if region(i) == region(j) else 0.040

    assert algorithms.mesh_path_latency(8, lat) == pytest.approx(0.001 + 2 * 0.040)
    s = algorithms.mesh_rotation(8, lat)
    assert s in (2, 6)
    assert algorithms.mesh_path_latency(
        8, lambda i, j: lat((s + i) % 8, (s + j) % 8)) == pytest.approx(2 * 0.001 + 0.040)
    # Only the candidates are tried; ties keep the first.
    assert algorithms.mesh_rotation(8, lat, [0, 1]) == 0
    assert algorithms.mesh_rotation(8, lambda i, j: 0.01) == 0


def _regions(of):
    return lambda i, j: 0.001 if of(i) == of(j) else 0.010


@pytest.mark.parametrize(("k", "of", "best"), [
    (6, lambda i: i // 3, 0.013),  # 2 regions of 3: from any ring start, 31 ms
    (7, lambda i: i // 4, 0.013),
    (10, lambda i: i // 5, 0.014),  # cores of 4 and 4, crossing on one rank bit
    (12, lambda i: i // 4, 0.023),  # 3 regions: two crossing steps at least
    (20, lambda i: i // 5, 0.024),
    (40, lambda i: i // 10, 0.025),
    (8, lambda i: i // 4, 0.012),  # a power of two: the ring's order is as good
])
def test_the_mesh_orders_regions_along_rank_bits(k, of, best) -> None:
    lat = _regions(of)
    order = algorithms.mesh_order(k, lat)
    assert sorted(order) == list(range(k))
    got = algorithms.mesh_path_latency(k, lambda a, b: lat(order[a], order[b]))
    assert got == pytest.approx(best)
    # Never worse than the ring's best start, which is what a larger group gets.
    s = algorithms.mesh_start(k, lat)
    assert got <= algorithms.mesh_path_latency(
        k, lambda a, b: lat((s + a) % k, (s + b) % k)) + 1e-12
    assert algorithms.mesh_order(k, lat, max_world=k - 1) == [(s + r) % k for r in range(k)]


def test_the_mesh_order_is_the_rings_when_pairs_are_alike() -> None:
    for k in (3, 5, 6, 9, 16):
        assert algorithms.mesh_order(k, lambda i, j: 0.005) == list(range(k))


def test_the_mesh_order_copes_with_noisy_regions() -> None:
    # Latencies within 20% of their region's: the regions still split along rank bits
    # (brute force over all 6! orders agrees to within the noise).
    import itertools
    import random

    rnd = random.Random(3)
    k = 6
    noise = {(i, j): 1 + 0.2 * rnd.random() for i in range(k) for j in range(k)}

    def lat(i: int, j: int) -> float:
        return _regions(lambda r: r // 3)(i, j) * noise[(i, j)]

    def cost(order) -> float:
        return algorithms.mesh_path_latency(k, lambda a, b: lat(order[a], order[b]))
    brute = min(cost(p) for p in itertools.permutations(range(k)))
    got = cost(algorithms.mesh_order(k, lat))
    assert brute <= got <= brute + 0.002 * 4  # one crossing, like the best


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

