"""Master restart: peers outlive their master, register with a fresh one on the same
address, and the run goes on with state bit-identical across peers."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import Iterator

import numpy as np
import pytest

import pccl
from pccl import _core
from pccl.communicator import PeerState
from pccl.testing import Cluster, free_port
from pccl.testing.crash import crash_master
from pccl.testing.data import deterministic_tensor
from pccl.testing.processes import master_process

S = pccl.SharedStateSyncStrategy
FAST_MASTER = {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0, "recovery_grace": 5.0}


def make_state(seed: int, revision: int) -> tuple[pccl.SharedState, np.ndarray]:
    w = deterministic_tensor("float32", 50_000, seed)
    return pccl.SharedState([pccl.TensorInfo.from_numpy(w, "w")], revision=revision), w


def digest(a: np.ndarray) -> bytes:
    return _core.content_hash(a.reshape(-1).view(np.uint8))


async def restart(cluster: Cluster, **kwargs) -> None:
    """Crashes the cluster's master (every connection dies without a word) and starts
    a fresh one, with no state, on the same address."""
    address = cluster.master.address
    await crash_master(cluster.master)
    cluster.master = pccl.MasterNode(listen=address, **{**FAST_MASTER, **kwargs})
    await cluster.master.start()


async def test_peers_reform_the_group_with_a_restarted_master(pccl_cluster) -> None:
    cluster = await pccl_cluster(3, master_kwargs=FAST_MASTER)
    comms = cluster.comms
    ids = [c.peer_id for c in comms]
    pairs = [make_state(7, 0) for _ in comms]
    pairs[1][1][3] = 123.0  # diverged: corrected by the first sync
    for s, _ in pairs:
        s.revision = 1
    await asyncio.gather(*(c.sync_shared_state(s) for c, (s, _) in zip(comms, pairs)))
    assert len({digest(w) for _, w in pairs}) == 1

    # Two peers start a reduce the third never joins: in flight when the master dies.
    x = [np.full(1000, i + 1, dtype=np.float32) for i in range(3)]
    before = [a.copy() for a in x]
    inflight = [comms[i].all_reduce_async(x[i], tag=5) for i in (0, 1)]
    await cluster.master.wait_for(lambda s: any(c.inits for c in s.collectives.values()))
    address = cluster.master.address
    await cluster.master.stop()
    for res in await asyncio.gather(*inflight, return_exceptions=True):
        assert isinstance(res, pccl.MasterConnectionError), res
    assert all(np.array_equal(a, b) for a, b in zip(x, before))  # nothing written

    # Calls made while there is no master wait for one instead of failing: a plain query
    # and the collective are_peers_pending() that every peer makes.
    count = asyncio.create_task(comms[2].pending_peer_count())
    waiting = [asyncio.create_task(c.are_peers_pending()) for c in comms]
    cluster.master = pccl.MasterNode(listen=address, **FAST_MASTER)
    await cluster.master.start()
    async with asyncio.timeout(30):
        assert await count == 0
        assert await asyncio.gather(*waiting) == [False] * 3
    await cluster.master.wait_for(lambda s: len(s.accepted()) == 3, timeout=30)
    # The run goes on: topology, reduce, shared state (revision continues at 2).
    await asyncio.gather(*(c.update_topology() for c in comms))
    assert [c.peer_id for c in comms] == ids  # ids kept: ring order and tie-breaks too
    assert all(c.reconnects == 1 for c in comms)
    infos = await asyncio.gather(*(c.all_reduce(a, tag=5) for c, a in zip(comms, x)))
    assert all(i.world_size == 3 for i in infos)
    assert all(np.array_equal(a, np.full(1000, 6, dtype=np.float32)) for a in x)
    for s, w in pairs:
        w *= 2
        s.revision += 1
    await asyncio.gather(*(c.sync_shared_state(s) for c, (s, _) in zip(comms, pairs)))
    assert [s.revision for s, _ in pairs] == [2, 2, 2]
    assert len({digest(w) for _, w in pairs}) == 1


async def test_restarted_master_learns_the_revision_from_the_peers(pccl_cluster) -> None:
    cluster = await pccl_cluster(2, master_kwargs=FAST_MASTER)
    pairs = [make_state(3, 1) for _ in range(2)]
    await asyncio.gather(*(c.sync_shared_state(s) for c, (s, _) in zip(cluster.comms, pairs)))
    await restart(cluster)
    await cluster.master.wait_for(lambda s: len(s.accepted()) == 2, timeout=30)
    assert cluster.master.state.last_revision == {c.peer_id: 1 for c in cluster.comms}
    # Skipping a revision is still refused after the restart.
    for s, _ in pairs:
        s.revision = 5
    res = await asyncio.gather(*(c.sync_shared_state(s)
                                 for c, (s, _) in zip(cluster.comms, pairs)),
                               return_exceptions=True)
    assert all(isinstance(r, pccl.RevisionIncrementViolationError) for r in res), res


async def test_restarted_master_waits_for_the_old_group_then_admits_who_came(
        pccl_cluster) -> None:
    cluster = await pccl_cluster(3, master_kwargs=FAST_MASTER)
    a, b, gone = cluster.comms
    # The third peer goes down with the master and never comes back.
    gone.options = dataclasses.replace(gone.options, reconnect_timeout=0)
    await restart(cluster, recovery_grace=0.5)
    await cluster.master.wait_for(lambda s: len(s.accepted()) == 2, timeout=30)
    assert sorted(cluster.master.state.accepted()) == sorted([a.peer_id, b.peer_id])
    with pytest.raises(pccl.MasterConnectionError):
        await gone.are_peers_pending()
    x, y = np.ones(100, np.float64), np.full(100, 2.0)
    infos = await asyncio.gather(a.all_reduce(x), b.all_reduce(y))
    assert [i.world_size for i in infos] == [2, 2]
    assert np.array_equal(x, np.full(100, 3.0)) and np.array_equal(x, y)


async def test_the_recovered_group_admits_a_fresh_joiner(pccl_cluster) -> None:
    cluster = await pccl_cluster(2, master_kwargs=FAST_MASTER)
    await restart(cluster)
    # Calls wait until the peer is back in the group (bounded by reconnect_timeout).
    assert await asyncio.gather(*(c.are_peers_pending() for c in cluster.comms)) == [False] * 2
    late = cluster.new_comm()
    await cluster.admit([late])
    assert late.state is PeerState.ACCEPTED and late.peer_id not in (1, 2)
    xs = [np.full(10, i, dtype=np.int32) for i in range(3)]
    await asyncio.gather(*(c.all_reduce(v) for c, v in zip(cluster.comms, xs)))
    assert all(np.array_equal(v, np.full(10, 3, dtype=np.int32)) for v in xs)


@contextlib.contextmanager
def held_port(address: str) -> Iterator[None]:
    """Keeps the port of ``address`` bound, not listening: dials there are refused, and
    no other test's server (the suite runs in parallel) takes the port meanwhile and
    answers a peer that is still dialing the stopped master."""
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, int(port)))
        yield


async def test_peers_give_up_after_reconnect_timeout(pccl_cluster) -> None:
    cluster = await pccl_cluster(2, master_kwargs=FAST_MASTER,
                                 comm_kwargs={"reconnect_timeout": 0.5})
    a, _ = cluster.comms
    address = cluster.master.address
    await cluster.master.stop()
    with held_port(address):
        async with asyncio.timeout(10):
            while True:  # bounded by the timeout; a call may fail before the peer notices
                with pytest.raises(pccl.MasterConnectionError) as err:
                    await a.are_peers_pending()
                if "again within 0.5s" in str(err.value):
                    break
        with pytest.raises(pccl.MasterConnectionError):
            a.all_reduce_async(np.ones(4, np.float32))


async def test_close_while_reconnecting_is_clean(pccl_cluster) -> None:
    cluster = await pccl_cluster(2, master_kwargs=FAST_MASTER)
    a, _ = cluster.comms
    await cluster.master.stop()
    waiting = asyncio.create_task(a.are_peers_pending())
    async with asyncio.timeout(10):
        while a.state is not PeerState.RECONNECTING:  # noqa: ASYNC110 - bounded poll
            await asyncio.sleep(0.01)
    await a.close()
    with pytest.raises(pccl.MasterConnectionError, match="closed"):
        await waiting


async def _admit_one(accepted: list, newcomer) -> None:
    """Votes ``newcomer`` (a peer process) in with every accepted peer process."""
    async with asyncio.timeout(60):
        # A bounded poll of the plain query (are_peers_pending() is a collective).
        while not await accepted[0].call("pending_peer_count"):  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    await asyncio.gather(*(p.call("update_topology") for p in accepted))
    await newcomer.wait_accepted()


@pytest.mark.multiprocess
async def test_sigkilled_master_process_is_replaced(pccl_peer_process) -> None:
    """A real master process SIGKILLed and started again; the peers are processes."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    masters = [await master_process(port)]
    try:
        peers = [await pccl_peer_process(address)]
        await peers[0].wait_accepted()
        for _ in range(2):
            newcomer = await pccl_peer_process(address)
            await _admit_one(peers, newcomer)
            peers.append(newcomer)
        for i, p in enumerate(peers):
            await p.call("make_tensor", name="x", dtype="float32", count=200_000, seed=i)
        res = await asyncio.gather(*(p.call("all_reduce", name="x", tag=1) for p in peers))
        assert len({r["digest"] for r in res}) == 1
        masters[0].kill()
        await masters[0].wait()
        masters.append(await master_process(port))
        # A call waits for the new master, then the reduce runs on all three; one that
        # went out before the peer noticed the loss fails with MasterConnectionError and
        # is retried, as documented.
        async def reduce(p):
            try:
                return await p.call("all_reduce", name="x", tag=2, timeout=60)
            except pccl.MasterConnectionError:
                return await p.call("all_reduce", name="x", tag=2, timeout=60)

        res2 = await asyncio.gather(*(reduce(p) for p in peers))
        assert len({r["digest"] for r in res2}) == 1
        assert [r["world_size"] for r in res2] == [3, 3, 3]
        info = await asyncio.gather(*(p.call("info") for p in peers))
        assert [i["peer_id"] for i in info] == [p.peer_id for p in peers]
    finally:
        for proc in masters:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def test_a_stopped_master_is_reported_in_words(
        pccl_cluster, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="pccl.communicator")
    cluster = await pccl_cluster(1, master_kwargs=FAST_MASTER)
    (comm,) = cluster.comms
    await restart(cluster)
    async with asyncio.timeout(30):  # (waits until the peer registered again)
        assert await comm.are_peers_pending() is False
    assert comm.reconnects == 1
    assert "lost the connection to the master (the other end closed the connection)" \
        in caplog.text
    assert "bytes read on a total" not in caplog.text
