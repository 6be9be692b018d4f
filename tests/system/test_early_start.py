"""Early start (one master round trip): on an unchanged ring an all-reduce runs its ring
as soon as it is called, while the master checks agreement and decides the outcome.
Real peers over real sockets: exact results, skew past the stall timeout, disagreeing
peers, a peer lost before calling, cancellation, SIGSTOP and SIGKILL on the new path."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from reference import in_ring_order, reference

import pccl
from pccl.testing import Cluster, LinkEmulator
from pccl.testing.data import deterministic_tensor

MiB = 1 << 20
# Tiny all-reduces go through the master (tests/integration/test_via_master.py): off here, so that
# every size below takes the ring.
RING = {"via_master_max_bytes": 0}


def stats(cluster: Cluster) -> dict[str, int]:
    paths = cluster.master.state.collective_paths
    return {"confirmed": paths["early"], "voided": paths["voided"]}


async def test_small_collectives_take_the_early_path_with_exact_results() -> None:
    async with Cluster(3, comm_kwargs=RING) as cluster:
        comms = cluster.comms
        for step in range(6):
            xs = [deterministic_tensor("float32", 1000 + step, seed=10 * step + i)
                  for i in range(3)]
            inputs = in_ring_order(comms, [x.copy() for x in xs])
            infos = await asyncio.gather(*(c.all_reduce(x, tag=step % 2)
                                           for c, x in zip(comms, xs)))
            assert [i.world_size for i in infos] == [3, 3, 3]
            (algorithm,) = {i.algorithm for i in infos}  # the ring or the mesh, one for all
            expected = reference(algorithm, inputs, pccl.ReduceOp.SUM, "float32")
            assert all(x.tobytes() == expected.tobytes() for x in xs)
        assert stats(cluster) == {"confirmed": 6, "voided": 0}


async def test_above_the_threshold_the_master_performs_first() -> None:
    async with Cluster(2, comm_kwargs={**RING, "early_start_max_bytes": 1024}) as cluster:
        a, b = cluster.comms
        xs = [np.full(257, i + 1, dtype=np.float32) for i in range(2)]  # 1028 bytes
        await asyncio.gather(a.all_reduce(xs[0]), b.all_reduce(xs[1]))
        small = [np.full(256, i + 1, dtype=np.float32) for i in range(2)]  # 1024 bytes
        await asyncio.gather(a.all_reduce(small[0]), b.all_reduce(small[1]))
        assert float(xs[0][0]) == float(small[1][0]) == 3.0
        assert stats(cluster) == {"confirmed": 1, "voided": 0}


async def test_a_peer_calling_long_after_the_others_is_no_stall() -> None:
    """The others' pieces wait at the late peer (held) and their ring ops are not armed
    until the master heard every call: a skew of three stall timeouts loses nothing."""
    timeout = 0.5
    async with Cluster(3, comm_kwargs={**RING, "peer_timeout": timeout}) as cluster:
        comms = cluster.comms
        xs = [deterministic_tensor("float64", 100_003, seed=i) for i in range(3)]
        quantized = [deterministic_tensor("float32", 70_001, seed=7 + i) for i in range(3)]
        q = pccl.QuantizationOptions(pccl.QuantizationAlgorithm.MIN_MAX, pccl.DataType.UINT8)
        inputs = in_ring_order(comms, [x.copy() for x in xs])
        early = [c.all_reduce_async(x, tag=1) for c, x in zip(comms[:2], xs[:2])]
        early_q = [c.all_reduce_async(x, tag=2, quantization=q)
                   for c, x in zip(comms[:2], quantized[:2])]
        await cluster.master.wait_for(
            lambda s: sum(len(c.inits) for c in s.collectives.values()) == 4)
        # The skew under test (not a synchronisation): the late peer calls only after
        # three stall timeouts of silence on the others' ring links.
        await asyncio.sleep(3 * timeout)
        assert not any(h.done() for h in early + early_q)
        late = comms[2].all_reduce_async(xs[2], tag=1)
        late_q = comms[2].all_reduce_async(quantized[2], tag=2, quantization=q)
        infos = await asyncio.gather(*early, late, *early_q, late_q)
        assert all(i.world_size == 3 for i in infos)
        (algorithm,) = {i.algorithm for i in infos[:3]}
        expected = reference(algorithm, inputs, pccl.ReduceOp.SUM, "float64")
        assert all(x.tobytes() == expected.tobytes() for x in xs)
        # Quantized: every peer decodes the very same bytes.
        assert quantized[0].tobytes() == quantized[1].tobytes() == quantized[2].tobytes()
        assert stats(cluster) == {"confirmed": 2, "voided": 0}


async def test_collectives_awaited_in_other_orders_do_not_hold_each_other_up() -> None:
    """Peer A runs tags 1 and 2 together; peer B awaits tag 2 before it even calls tag 1.
    A's early pieces of tag 1 must not block tag 2 on the shared ring links."""
    async with Cluster(2, comm_kwargs=RING) as cluster:
        a, b = cluster.comms
        x1 = [np.full(50_000, v, dtype=np.int64) for v in (1, 10)]
        x2 = [np.full(30_000, v, dtype=np.int32) for v in (2, 20)]
        h1, h2 = a.all_reduce_async(x1[0], tag=1), a.all_reduce_async(x2[0], tag=2)

        async def b_in_its_order() -> None:
            await b.all_reduce(x2[1], tag=2)
            await b.all_reduce(x1[1], tag=1)

        async with asyncio.timeout(60):
            await asyncio.gather(h1, h2, b_in_its_order())
        assert all((x == 11).all() for x in x1) and all((x == 22).all() for x in x2)


@pytest.mark.parametrize("field", ["count", "dtype", "op"])
async def test_disagreeing_peers_fail_with_invalid_usage_and_lose_nothing(field) -> None:
    async with Cluster(3, comm_kwargs=RING) as cluster:
        comms = cluster.comms
        xs = [np.arange(4096, dtype=np.float32) + i for i in range(3)]
        odd = {"count": np.arange(4097, dtype=np.float32),
               "dtype": np.arange(4096, dtype=np.int32),
               "op": np.arange(4096, dtype=np.float32) + 2}[field]
        args = [(xs[0], pccl.ReduceOp.SUM), (xs[1], pccl.ReduceOp.SUM),
                (odd, pccl.ReduceOp.MAX if field == "op" else pccl.ReduceOp.SUM)]
        before = [x.copy() for x, _ in args]
        results = await asyncio.gather(*(c.all_reduce(x, op=op) for c, (x, op)
                                         in zip(comms, args)), return_exceptions=True)
        assert all(isinstance(r, pccl.InvalidUsageError) for r in results), results
        assert all(x.tobytes() == b.tobytes() for (x, _), b in zip(args, before))
        # The master names what differs, and the next agreeing call works (the ring was
        # rebuilt: the void op's pieces may still have been on its links).
        assert "disagree" in str(results[0])
        xs[2] = np.arange(4096, dtype=np.float32) + 2
        infos = await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs)))
        assert [i.world_size for i in infos] == [3, 3, 3]
        assert all((x == 3 * np.arange(4096, dtype=np.float32) + 3).all() for x in xs)


@pytest.mark.parametrize(("path", "comm_kwargs", "count", "counted"), [
    # an early start on the ring, voided by the leave, then run on the rebuilt ring
    ("early", RING, 1000, "voided"),
    # a tiny one the master reduces itself, without the leaver
    ("via_master", {}, 10, "via_master"),
    # a plain ring collective (early starts off)
    ("ring", {**RING, "early_start_max_bytes": 0}, 1000, None),
])
async def test_a_peer_leaving_before_it_calls_leaves_the_others_to_finish(
        path: str, comm_kwargs: dict[str, int], count: int, counted: str | None) -> None:
    """Whichever way the collective runs, the others finish it without the leaver."""
    async with Cluster(3, comm_kwargs=comm_kwargs) as cluster:
        a, b, gone = cluster.comms
        xa, xb = np.full(count, 1.0), np.full(count, 2.0)
        ha, hb = a.all_reduce_async(xa), b.all_reduce_async(xb)
        await cluster.master.wait_for(
            lambda s: sum(len(c.inits) for c in s.collectives.values()) == 2)
        await gone.close()
        infos = await asyncio.gather(ha, hb)
        assert [i.world_size for i in infos] == [2, 2]
        assert (xa == 3.0).all() and (xb == 3.0).all()
        if counted is not None:
            assert cluster.master.state.collective_paths[counted] == 1
        # (Between the two left, the cost model may take the mesh for the rebuilt ring.)
        assert (infos[0].algorithm == "master") == (path == "via_master")


async def test_cancelling_an_unconfirmed_early_start_calls_it_off_and_loses_nothing() -> None:
    async with Cluster(2, comm_kwargs=RING) as cluster:
        a, b = cluster.comms
        xa, xb = np.full(5000, 1, dtype=np.int64), np.full(5000, 2, dtype=np.int64)
        ha = a.all_reduce_async(xa, tag=3)
        await cluster.master.wait_for(
            lambda s: any(c.inits for c in s.collectives.values()))
        ha.cancel()
        with pytest.raises(asyncio.CancelledError):
            await ha
        assert (xa == 1).all()
        # The retry on both works (after the master rebuilt the ring).
        await asyncio.gather(a.all_reduce(xa, tag=3), b.all_reduce(xb, tag=3))
        assert (xa == 3).all() and (xb == 3).all()


@pytest.mark.multiprocess
async def test_sigstop_after_every_peer_called_fails_everyone_by_the_stall_timer(
        pccl_peer_process) -> None:
    """Once the master confirmed the early start, a frozen neighbour is a stall again:
    its neighbours fail by the stall timer, and the outcome (PeerConnectionError, inputs
    intact) comes once the master dropped the frozen peer by its heartbeat."""
    n = 3 * MiB // 4  # float32: under the early-start threshold
    async with LinkEmulator(bandwidth=2e6, chunk_size=64 * 1024) as emu:
        async with Cluster(1, master_kwargs={"heartbeat_timeout": 5.0},
                           comm_kwargs={**RING, "peer_timeout": 1.0}) as cluster:
            a, victim, b = await cluster.ring_with_process(pccl_peer_process, emu)
            xa = deterministic_tensor("float32", n, seed=1)
            xb = deterministic_tensor("float32", n, seed=2)
            ca, cb = xa.copy(), xb.copy()
            await victim.call("make_tensor", name="x", dtype="float32", count=n, seed=3)
            ha, hb = a.all_reduce_async(xa), b.all_reduce_async(xb)
            hv = asyncio.create_task(victim.call("all_reduce", name="x"))
            await cluster.master.wait_for(
                lambda s: any(c.op_id >= 0 for c in s.collectives.values()), timeout=60)
            assert stats(cluster)["confirmed"] == 1
            victim.stop()
            t0 = time.monotonic()
            for h in (ha, hb):
                with pytest.raises(pccl.PeerConnectionError) as e:
                    await h
                # The first failure (the outcome's message) is the armed stall timer's,
                # not the heartbeat's drop of the frozen peer.
                assert "stalled or dead" in str(e.value) or "accepted no data" in str(e.value)
            assert time.monotonic() - t0 < 30  # the stall timer and heartbeat, not a hang
            assert xa.tobytes() == ca.tobytes() and xb.tobytes() == cb.tobytes()
            victim.kill()
            with pytest.raises(ConnectionError):
                await hv
            emu.bandwidth = None
            infos = await asyncio.gather(a.all_reduce(xa), b.all_reduce(xb))
            assert [i.world_size for i in infos] == [2, 2]
            assert xa.tobytes() == xb.tobytes()


@pytest.mark.multiprocess
async def test_sigkill_of_a_peer_that_never_called(pccl_peer_process) -> None:
    """A and B started early; the third peer (a process) is SIGKILLed before its call:
    the early start is void and A and B finish on the rebuilt ring, world 2."""
    async with Cluster(2, comm_kwargs=RING) as cluster:
        a, b = cluster.comms
        victim = await pccl_peer_process(cluster.master.address)
        await cluster.master.wait_for(lambda s: len(s.pending()) == 1, timeout=60)
        await asyncio.gather(a.update_topology(), b.update_topology())
        await victim.wait_accepted()
        xa, xb = np.full(100_000, 1.5, dtype=np.float32), np.full(100_000, 2.0, np.float32)
        ha, hb = a.all_reduce_async(xa), b.all_reduce_async(xb)
        await cluster.master.wait_for(
            lambda s: sum(len(c.inits) for c in s.collectives.values()) == 2)
        victim.kill()
        infos = await asyncio.gather(ha, hb)
        assert [i.world_size for i in infos] == [2, 2]
        assert (xa == 3.5).all() and (xb == 3.5).all()
        assert stats(cluster)["voided"] == 1
