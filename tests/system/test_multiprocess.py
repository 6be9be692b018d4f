"""Membership with peers in real processes: join, SIGKILL, SIGSTOP, late join."""

from __future__ import annotations

import asyncio
import struct

import numpy as np
import pytest

import pccl
from pccl.testing import Cluster

pytestmark = pytest.mark.multiprocess


async def _spawn_and_admit(cluster: Cluster, spawn, n: int, voters=(), **kwargs) -> list:
    """Spawns ``n`` peer processes and admits them; ``voters`` are peer processes that
    are already accepted (they vote along with the in-process peers)."""
    before = len(cluster.master.state.pending())
    procs = [await spawn(cluster.master.address, **kwargs) for _ in range(n)]
    await cluster.master.wait_for(lambda s: len(s.pending()) == before + n, timeout=60)
    live = [c for c in cluster.comms if c.state.name == "ACCEPTED"]
    await asyncio.gather(*(c.update_topology() for c in live),
                         *(v.call("update_topology") for v in voters))
    for p in procs:
        await p.wait_accepted()
    return procs


async def test_processes_join_and_see_the_same_world(pccl_peer_process) -> None:
    async with Cluster(1) as cluster:
        procs = await _spawn_and_admit(cluster, pccl_peer_process, 3)
        (local,) = cluster.comms
        assert local.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) == 4
        for p in procs:
            a = await p.call("attributes")
            assert a["GLOBAL_WORLD_SIZE"] == 4
            info = await p.call("info")
            assert info["ring"] == local.ring
            assert info["lanes"] == [2, 2]


async def test_sigkilled_peer_is_dropped_and_the_rest_go_on(pccl_peer_process) -> None:
    async with Cluster(1) as cluster:
        victim, other = await _spawn_and_admit(cluster, pccl_peer_process, 2)
        (local,) = cluster.comms
        victim.kill()
        await cluster.master.wait_for(lambda s: victim.peer_id not in s.peers, timeout=30)
        await asyncio.gather(local.update_topology(), other.call("update_topology"))
        assert local.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) == 2
        assert (await other.call("attributes"))["GLOBAL_WORLD_SIZE"] == 2
        assert (await other.call("info"))["lanes"] == [2, 2]


async def test_stopped_peer_is_dropped_by_heartbeat(pccl_peer_process) -> None:
    async with Cluster(1, master_kwargs={"heartbeat_interval": 0.1,
                                         "heartbeat_timeout": 1.0}) as cluster:
        (stopped,) = await _spawn_and_admit(cluster, pccl_peer_process, 1)
        (local,) = cluster.comms
        stopped.stop()  # SIGSTOP: sockets stay open, nothing answers
        vote = asyncio.create_task(local.update_topology())
        await cluster.master.wait_for(lambda s: stopped.peer_id not in s.peers, timeout=30)
        await vote
        assert local.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) == 1


async def test_process_with_wrong_secret_is_refused(pccl_peer_process) -> None:
    good_secret = b"5f0c1a9e7d3b42c8a6e1f0b97c2d4e3a"
    evil_secret = b"c0ffee00d15ea5e5b16b00b5a11ce0de"  # as strong, but another run's
    async with Cluster(1, secret=good_secret) as cluster:
        bad = await pccl_peer_process(cluster.master.address, secret=evil_secret,
                                      extra_args=["--attempts", "1"])
        with pytest.raises(pccl.AuthenticationError):
            await bad.wait_accepted()
        good = await pccl_peer_process(cluster.master.address, secret=good_secret)
        await cluster.master.wait_for(lambda s: len(s.pending()) == 1, timeout=60)
        await cluster.comms[0].update_topology()
        await good.wait_accepted()


async def test_graceful_close_of_a_process(pccl_peer_process) -> None:
    async with Cluster(1) as cluster:
        (p,) = await _spawn_and_admit(cluster, pccl_peer_process, 1)
        await p.call("close")
        await cluster.master.wait_for(lambda s: len(s.peers) == 1, timeout=30)
        assert p.proc is not None
        async with asyncio.timeout(30):
            assert await p.proc.wait() == 0


@pytest.mark.parametrize("payload", [struct.pack(">I", 0xFFFFFFFF) + b"x" * 64,
                                     b"\x00" * 300], ids=["4GiB-prefix", "zeros"])
async def test_garbage_to_a_process_p2p_port_and_to_the_master(pccl_peer_process,
                                                                 payload) -> None:
    async with Cluster(1) as cluster:
        (p,) = await _spawn_and_admit(cluster, pccl_peer_process, 1)
        port = (await p.call("info"))["p2p_port"]
        for host, prt in [("127.0.0.1", port),
                          tuple(cluster.master.address.rsplit(":", 1))]:
            reader, writer = await asyncio.open_connection(host, int(prt))
            writer.write(payload)
            async with asyncio.timeout(10):
                try:
                    while await reader.read(65536):
                        pass
                except ConnectionResetError:
                    pass
            writer.close()
            try:
                await writer.wait_closed()
            except ConnectionResetError:
                pass
        # Both keep working: a new process joins, every ring is rebuilt, and a reduce runs.
        (q,) = await _spawn_and_admit(cluster, pccl_peer_process, 1, voters=[p])
        (local,) = cluster.comms
        x = np.ones(1000, dtype=np.float32)
        for proc in (p, q):
            await proc.call("make_tensor", name="t", dtype="float32", count=1000, seed=1)
        results = await asyncio.gather(local.all_reduce(x),
                                       *(proc.call("all_reduce", name="t") for proc in (p, q)))
        assert results[0].world_size == 3
        assert results[1]["digest"] == results[2]["digest"]


async def test_two_peer_groups_across_processes(pccl_peer_process) -> None:
    async with Cluster(1) as cluster:
        procs = [await pccl_peer_process(cluster.master.address, group=g) for g in (0, 1, 1)]
        await cluster.master.wait_for(lambda s: len(s.pending()) == 3, timeout=60)
        await cluster.comms[0].update_topology()
        for p in procs:
            await p.wait_accepted()
        sizes = [await p.call("attributes") for p in procs]
        assert [s["PEER_GROUP_WORLD_SIZE"] for s in sizes] == [2, 2, 2]
        assert all(s["GLOBAL_WORLD_SIZE"] == 4 and s["NUM_DISTINCT_PEER_GROUPS"] == 2
                   for s in sizes)
        g1 = [p for p in procs[1:]]
        for p in g1:
            await p.call("make_tensor", name="t", dtype="int64", count=10, seed=p.peer_id)
        r = await asyncio.gather(*(p.call("all_reduce", name="t") for p in g1))
        assert r[0]["digest"] == r[1]["digest"] and r[0]["world_size"] == 2
