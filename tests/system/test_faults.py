"""Failures mid-collective: stalled and reset links (through the link emulator), peers
SIGKILLed in the middle of a 64 MiB reduce, and results across real processes."""

from __future__ import annotations

import asyncio
import time

import pytest
from reference import in_ring_order, ring_reference

import pccl
from pccl.peer import state as ps
from pccl.protocol import messages as m
from pccl.testing import Cluster, LinkEmulator
from pccl.testing.crash import crash
from pccl.testing.data import deterministic_tensor, digest

MiB = 1 << 20


@pytest.mark.parametrize("out_of_place", [False, True], ids=["in_place", "out_of_place"])
@pytest.mark.parametrize("fault", ["blackhole", "reset"])
async def test_stalled_or_reset_link_fails_everyone_in_bounded_time(fault, out_of_place) -> None:
    """Out of place, the results land in ``out`` as the ring computes them: after a
    failure ``out`` is unspecified, but the input is untouched, so the retry loses
    nothing."""
    async with LinkEmulator(bandwidth=20e6, chunk_size=256 * 1024) as emu:
        async with Cluster(2, comm_kwargs={"peer_timeout": 1.0}) as cluster:
            slow = await cluster.admit_behind(emu, peer_timeout=1.0)
            comms = cluster.comms
            xs = [deterministic_tensor("float32", 4 * MiB, seed=i) for i in range(3)]
            before = [x.copy() for x in xs]
            ys = [x.copy() * 0 for x in xs] if out_of_place else [None] * 3
            handles = [c.all_reduce_async(x, y) for c, x, y in zip(comms, xs, ys)]
            await cluster.master.wait_for(
                lambda s: any(c.op_id >= 0 for c in s.collectives.values()))
            t0 = time.monotonic()
            if fault == "blackhole":
                emu.blackhole()
            else:
                await emu.reset_all()
            results = await asyncio.gather(*handles, return_exceptions=True)
            elapsed = time.monotonic() - t0
            assert all(isinstance(r, pccl.PeerConnectionError) for r in results), results
            # Bounded: the 1 s link timeout plus a control-plane round trip (generous).
            assert elapsed < 30
            for x, b in zip(xs, before):
                assert x.tobytes() == b.tobytes()  # nothing written on failure
            # Heal the link, rebuild the rings, retry: it works.
            emu.blackhole(False)
            emu.bandwidth = None
            await asyncio.gather(*(c.update_topology() for c in comms))
            await asyncio.gather(*(c.all_reduce(x, y) for c, x, y in zip(comms, xs, ys)))
            expected = ring_reference(in_ring_order(comms, before), pccl.ReduceOp.SUM, "float32")
            if out_of_place:
                assert all(x.tobytes() == b.tobytes() for x, b in zip(xs, before))
                xs = ys
            assert all(x.tobytes() == expected.tobytes() for x in xs)
            assert slow.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) == 3


async def test_cancel_mid_ring_aborts_every_peer_and_loses_nothing() -> None:
    async with LinkEmulator(bandwidth=10e6, chunk_size=256 * 1024) as emu:
        async with Cluster(1) as cluster:
            await cluster.admit_behind(emu)
            a, b = cluster.comms
            xa = deterministic_tensor("float32", 2 * MiB, seed=1)
            xb = deterministic_tensor("float32", 2 * MiB, seed=2)
            ca, cb = xa.copy(), xb.copy()
            ha, hb = a.all_reduce_async(xa, tag=9), b.all_reduce_async(xb, tag=9)
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
            await asyncio.gather(a.all_reduce(xa, tag=9), b.all_reduce(xb, tag=9))
            assert xa.tobytes() == xb.tobytes()


@pytest.mark.parametrize("quantized", [False, True], ids=["plain", "quantized"])
async def test_ring_done_here_but_failed_for_the_group_puts_the_tensor_back(
        quantized) -> None:
    """In place, the ring writes results into the caller's tensor as it goes (no copy
    after the outcome). Here every ring finishes, but one peer is lost before it reports
    its part done: the group's outcome is a failure, and every peer's tensor comes back
    with its exact original bytes; the retry on the repaired ring reduces those."""
    q = (pccl.QuantizationOptions(pccl.QuantizationAlgorithm.MIN_MAX,
                                  pccl.DataType.UINT8) if quantized else None)
    async with Cluster(3, comm_kwargs={"via_master_max_bytes": 0}) as cluster:
        a, b, c = cluster.comms
        n = 300_003
        xs = [deterministic_tensor("float32", n, seed=20 + i) for i in range(3)]
        before = [x.copy() for x in xs]
        ring_done = asyncio.Event()
        do = c._do

        def swallow_ring_done(cmd: ps.Command) -> None:
            if isinstance(cmd, ps.Send) and isinstance(cmd.msg, m.CollectiveDone):
                assert cmd.msg.ok, cmd
                ring_done.set()  # c's ring finished; the master never hears it
                return
            do(cmd)

        c._do = swallow_ring_done  # type: ignore[method-assign]
        handles = [comm.all_reduce_async(x, quantization=q)
                   for comm, x in zip(cluster.comms, xs)]
        async with asyncio.timeout(60):
            await ring_done.wait()
        await cluster.master.wait_for(
            lambda s: any(len(col.reported) == 2 for col in s.collectives.values()),
            timeout=60)
        # a's and b's rings are done: their results are in their tensors already.
        assert xs[0].tobytes() != before[0].tobytes()
        assert xs[1].tobytes() != before[1].tobytes()
        await crash(c)
        results = await asyncio.gather(*handles, return_exceptions=True)
        assert all(isinstance(r, pccl.PeerConnectionError) for r in results[:2]), results
        assert isinstance(results[2], pccl.MasterConnectionError), results[2]
        for x, orig in zip(xs, before):
            assert x.tobytes() == orig.tobytes()  # put back, byte for byte

        infos = await asyncio.gather(a.all_reduce(xs[0]), b.all_reduce(xs[1]))
        assert [i.world_size for i in infos] == [2, 2]
        expected = ring_reference(in_ring_order([a, b], before[:2]), pccl.ReduceOp.SUM,
                                  "float32")
        assert xs[0].tobytes() == xs[1].tobytes() == expected.tobytes()


@pytest.mark.multiprocess
async def test_sigkill_mid_reduce_of_64_mib(pccl_peer_process) -> None:
    """A (in-process) -> V (process) -> B (in-process, behind a slow link) -> A.
    V is SIGKILLed while the reduce runs: A and B fail with PeerConnectionError, their
    buffers are untouched, and the retry (no update_topology(): the master rebuilds the
    ring from the survivors) gives A+B."""
    n = 64 * MiB // 4
    async with LinkEmulator(bandwidth=40e6, chunk_size=256 * 1024) as emu:
        # A roomy heartbeat: on a loaded machine V (busy making 64 MiB) must not be dropped
        # before the reduce starts (the repaired ring would then run it without V).
        async with Cluster(1, master_kwargs={"heartbeat_timeout": 30.0}) as cluster:
            a, victim, b = await cluster.ring_with_process(pccl_peer_process, emu)
            assert a.ring == [a.peer_id, victim.peer_id, b.peer_id]

            xa = deterministic_tensor("float32", n, seed=11)
            xb = deterministic_tensor("float32", n, seed=12)
            da, db = digest(xa), digest(xb)
            await victim.call("make_tensor", name="x", dtype="float32", count=n, seed=13)
            ha, hb = a.all_reduce_async(xa), b.all_reduce_async(xb)
            hv = asyncio.create_task(victim.call("all_reduce", name="x"))
            await cluster.master.wait_for(
                lambda s: any(c.op_id >= 0 and len(c.participants) == 3
                              for c in s.collectives.values()), timeout=60)
            victim.kill()
            for h in (ha, hb):
                with pytest.raises(pccl.PeerConnectionError):
                    await h
            with pytest.raises(ConnectionError):
                await hv
            assert digest(xa) == da and digest(xb) == db  # nothing lost

            emu.bandwidth = None
            infos = await asyncio.gather(a.all_reduce(xa), b.all_reduce(xb))
            assert [i.world_size for i in infos] == [2, 2]
            assert a.ring == b.ring == [a.peer_id, b.peer_id]
            assert a.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) == 2
            expected = ring_reference(
                [deterministic_tensor("float32", n, seed=11),
                 deterministic_tensor("float32", n, seed=12)], pccl.ReduceOp.SUM, "float32")
            assert xa.tobytes() == expected.tobytes() and xb.tobytes() == expected.tobytes()


@pytest.mark.multiprocess
async def test_results_are_bit_identical_across_processes(pccl_peer_process) -> None:
    async with Cluster(1) as cluster:
        (local,) = cluster.comms
        procs = [await pccl_peer_process(cluster.master.address) for _ in range(2)]
        await cluster.master.wait_for(lambda s: len(s.pending()) == 2, timeout=60)
        await local.update_topology()
        for p in procs:
            await p.wait_accepted()
        ids = [local.peer_id] + [p.peer_id for p in procs]
        rank = {pid: local.ring.index(pid) for pid in ids}
        count = 1001
        for dtype in ["float16", "float32", "float64", "int8", "int32", "int64", "uint16",
                      "uint64"]:
            for op in ["SUM", "AVG", "PROD", "MAX", "MIN"]:
                seeds = {pid: hash((dtype, op, pid)) % 10_000 for pid in ids}
                x = deterministic_tensor(dtype, count, seeds[local.peer_id])
                for p in procs:
                    await p.call("make_tensor", name="t", dtype=dtype, count=count,
                                 seed=seeds[p.peer_id])
                results = await asyncio.gather(
                    local.all_reduce(x, op=pccl.ReduceOp[op]),
                    *(p.call("all_reduce", name="t", op=op) for p in procs))
                inputs = sorted(ids, key=lambda pid: rank[pid])
                expected = ring_reference(
                    [deterministic_tensor(dtype, count, seeds[pid]) for pid in inputs],
                    pccl.ReduceOp[op], dtype)
                assert digest(x) == digest(expected), (dtype, op)
                assert all(r["digest"] == digest(expected) for r in results[1:]), (dtype, op)
