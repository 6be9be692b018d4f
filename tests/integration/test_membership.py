"""In-process membership: join, late join, leave, groups, auth, garbage, liveness."""

from __future__ import annotations

import asyncio
import resource
import struct

import numpy as np
import pytest

import pccl
from pccl.protocol import PROTOCOL_VERSION, codec
from pccl.protocol import messages as m
from pccl.testing import Cluster
from pccl.testing.control import dial_master, write_raw

# Shared secrets are keys of at least 128 random bits (pccl.identity.check_secret).
SECRET = b"5f0c1a9e7d3b42c8a6e1f0b97c2d4e3a"
WRONG_SECRET = b"c0ffee00d15ea5e5b16b00b5a11ce0de"  # as strong, but another run's

A = pccl.Attribute


def attrs(c: pccl.Communicator) -> tuple[int, int, int, int]:
    return tuple(c.get_attribute(a) for a in (A.GLOBAL_WORLD_SIZE, A.PEER_GROUP_WORLD_SIZE,
                                               A.NUM_DISTINCT_PEER_GROUPS,
                                               A.LARGEST_PEER_GROUP_WORLD_SIZE))


async def test_single_peer_is_accepted_alone(pccl_cluster) -> None:
    cluster = await pccl_cluster(1)
    (c,) = cluster.comms
    assert attrs(c) == (1, 1, 1, 1)
    assert not await c.are_peers_pending()
    await c.update_topology()  # nothing to do, but valid
    assert c.ring_lanes() == (0, 0)  # a ring of one needs no link


async def test_join_builds_rings_with_pools(pccl_cluster) -> None:
    cluster = await pccl_cluster(4, pool_size=3)
    ring = cluster.comms[0].ring
    assert ring == sorted(c.peer_id for c in cluster.comms)
    for c in cluster.comms:
        assert attrs(c) == (4, 4, 1, 4)
        assert c.ring == ring
        assert c.ring_lanes() == (3, 3)  # streams from prev, to next
    assert cluster.master.state.pending() == []


async def test_late_joiner_waits_while_others_keep_working(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    a, b = cluster.comms
    late = cluster.new_comm()
    join = asyncio.create_task(late.connect())
    await cluster.master.wait_for(lambda s: len(s.pending()) == 1)
    # The run goes on: queries are answered, the world is unchanged, the joiner waits.
    # (are_peers_pending() is a collective: every accepted peer asks, all hear one answer;
    # pending_peer_count() is a plain query that waits for nobody.)
    for _ in range(3):
        assert await asyncio.gather(a.are_peers_pending(), b.are_peers_pending()) == [True] * 2
        assert await a.pending_peer_count() == 1
    assert attrs(a) == (2, 2, 1, 2)
    assert not join.done()
    await asyncio.gather(a.update_topology(), b.update_topology())
    await join
    for c in (a, b, late):
        assert attrs(c) == (3, 3, 1, 3)
        assert c.ring_lanes() == (2, 2)
    assert await asyncio.gather(*(c.are_peers_pending() for c in (a, b, late))) == [False] * 3
    assert await a.pending_peer_count() == 0


async def test_graceful_leave_shrinks_the_world_and_rings_reform(pccl_cluster) -> None:
    cluster = await pccl_cluster(3)
    a, b, c = cluster.comms
    old_epoch = a.epoch
    await c.close()
    await c.close()  # idempotent
    await cluster.master.wait_for(lambda s: len(s.accepted()) == 2)
    await asyncio.gather(a.update_topology(), b.update_topology())
    assert a.epoch == b.epoch > old_epoch
    for x in (a, b):
        assert attrs(x) == (2, 2, 1, 2)
        assert x.ring_lanes() == (2, 2)
    with pytest.raises(pccl.PCCLError):
        await c.update_topology()


async def test_two_peer_groups_have_separate_rings_and_sizes(pccl_cluster) -> None:
    cluster = await pccl_cluster(5, groups=[0, 0, 1, 1, 1])
    g0 = [c for c in cluster.comms if c.peer_group == 0]
    g1 = [c for c in cluster.comms if c.peer_group == 1]
    for c in g0:
        assert attrs(c) == (5, 2, 2, 3)
        assert c.ring == sorted(x.peer_id for x in g0)
    for c in g1:
        assert attrs(c) == (5, 3, 2, 3)
        assert c.ring == sorted(x.peer_id for x in g1)


async def test_update_topology_misuse_is_invalid_usage(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    a, _ = cluster.comms
    fresh = pccl.Communicator(master=cluster.master.address)
    with pytest.raises(pccl.InvalidUsageError):
        await fresh.update_topology()
    first = asyncio.create_task(a.update_topology())
    await asyncio.sleep(0)  # let it send its vote
    with pytest.raises(pccl.InvalidUsageError):
        await a.update_topology()
    await cluster.comms[1].update_topology()
    await first


async def test_a_peer_dying_during_the_vote_does_not_block_it(pccl_cluster) -> None:
    cluster = await pccl_cluster(3)
    a, b, c = cluster.comms
    votes = [asyncio.create_task(x.update_topology()) for x in (a, b)]
    await cluster.master.wait_for(lambda s: len(s.votes) == 2)
    await c.close()
    await asyncio.gather(*votes)
    assert attrs(a) == (2, 2, 1, 2)


async def test_connect_to_a_closed_port_fails_cleanly() -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    comm = pccl.Communicator(master=f"127.0.0.1:{port}")
    with pytest.raises(pccl.MasterConnectionError, match="2 attempts"):
        await comm.connect(n_attempts=2)
    await comm.close()


@pytest.mark.parametrize("peer_secret", [WRONG_SECRET, None], ids=["wrong", "missing"])
async def test_wrong_or_missing_secret(peer_secret, caplog) -> None:
    async with Cluster(1, secret=SECRET) as cluster:
        bad = pccl.Communicator(master=cluster.master.address, secret=peer_secret)
        with pytest.raises(pccl.AuthenticationError):
            await bad.connect(n_attempts=1)
        # The master kept serving: a peer with the right secret still joins.
        good = cluster.new_comm()
        await cluster.admit([good])
        assert attrs(good)[0] == 2


async def test_peer_with_secret_refuses_master_without_one() -> None:
    async with pccl.MasterNode(listen="127.0.0.1:0") as master:
        comm = pccl.Communicator(master=master.address, secret=SECRET)
        with pytest.raises(pccl.AuthenticationError):
            await comm.connect(n_attempts=1)


async def _raw(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = address.rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def _expect_closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Waits until the remote end closes (FIN or RST), then releases our socket."""
    async with asyncio.timeout(10):
        try:
            while await reader.read(65536):
                pass
        except ConnectionResetError:
            pass  # closed with unread data in its buffer: the kernel sends RST
    writer.close()
    try:
        await writer.wait_closed()
    except ConnectionResetError:
        pass


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("payload", [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    struct.pack(">I", 0xFFFFFFFF) + b"x" * 100,  # 4 GiB length prefix
    struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1",
    codec.frame(m.Ping(seq=1)),  # valid frame, wrong message for a handshake
], ids=["http", "4GiB-prefix", "bad-msgpack", "wrong-message"])
async def test_garbage_to_the_master_closes_only_that_connection(pccl_cluster, payload) -> None:
    cluster = await pccl_cluster(2)
    rss = _rss_mib()
    reader, writer = await _raw(cluster.master.address)
    writer.write(payload)
    await _expect_closed(reader, writer)
    assert _rss_mib() - rss < 64
    late = cluster.new_comm()
    await cluster.admit([late])
    assert attrs(late)[0] == 3


async def test_garbage_after_registration_drops_that_peer_only(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    conn = await dial_master(cluster.master.address)
    challenge = await conn.recv()
    assert isinstance(challenge, m.Challenge)
    conn.send_nowait(m.Hello(version=PROTOCOL_VERSION, peer_group=0, p2p_port=9,
                             p2p_host="127.0.0.1", nonce=b"n" * 16, mac=b""))
    await cluster.master.wait_for(lambda s: len(s.pending()) == 1)
    write_raw(conn, struct.pack(">I", 0xFFFFFFFF))
    await cluster.master.wait_for(lambda s: not s.pending())
    await _expect_closed(conn.reader, conn.writer)
    a, b = cluster.comms
    await asyncio.gather(a.update_topology(), b.update_topology())
    assert attrs(a)[0] == 2


@pytest.mark.parametrize("payload", [
    b"\x00" * 64,
    struct.pack(">I", 0xFFFFFFFF) + b"y" * 100,
    b"PCCLP2P\x01" + b"z" * 200,
], ids=["zeros", "4GiB-prefix", "bad-hello"])
async def test_garbage_to_a_p2p_port_is_refused_and_logged(pccl_cluster, payload, caplog) -> None:
    cluster = await pccl_cluster(2)
    a, b = cluster.comms
    rss = _rss_mib()
    reader, writer = await _raw(f"127.0.0.1:{b.p2p_port}")
    writer.write(payload)
    await _expect_closed(reader, writer)
    assert _rss_mib() - rss < 64
    # The peer still forms rings: admit a third peer, which rebuilds every pool.
    late = cluster.new_comm()
    await cluster.admit([late])
    assert b.ring_lanes() == (2, 2)
    assert any("p2p" in r.getMessage() and "refused" in r.getMessage()
               for r in caplog.records)


async def test_half_open_peer_is_dropped_by_heartbeat() -> None:
    async with Cluster(2, master_kwargs={"heartbeat_interval": 0.1,
                                         "heartbeat_timeout": 0.5}) as cluster:
        # A peer that registers and then never speaks again (as if its host froze).
        conn = await dial_master(cluster.master.address)
        await conn.recv()  # the challenge
        conn.send_nowait(m.Hello(version=PROTOCOL_VERSION, peer_group=0, p2p_port=9,
                                 p2p_host="127.0.0.1", nonce=b"n" * 16, mac=b""))
        await cluster.master.wait_for(lambda s: len(s.pending()) == 1)
        await cluster.master.wait_for(lambda s: not s.pending(), timeout=10)
        await _expect_closed(conn.reader, conn.writer)
        assert await cluster.comms[0].pending_peer_count() == 0
        assert await asyncio.gather(*(c.are_peers_pending() for c in cluster.comms)) == [False] * 2


async def test_peers_notice_a_dead_master() -> None:
    # (Without reconnect_timeout=0 a call waits for the master to come back: up to ten
    # minutes by default; that wait is tests/system/test_master_restart.py's.)
    cluster = Cluster(2, comm_kwargs={"reconnect_timeout": 0})
    async with cluster:
        a, _ = cluster.comms
        await cluster.master.stop()
        with pytest.raises(pccl.MasterConnectionError):
            async with asyncio.timeout(10):
                while True:  # bounded by the timeout: the reader notices EOF promptly
                    await a.are_peers_pending()


async def test_peer_that_never_reports_its_links_cannot_stall_a_round() -> None:
    """A registered peer answers heartbeats but never reports its p2p links: the round
    that would admit it ends at establish_timeout without it, and the others go on."""
    async with Cluster(2, master_kwargs={"establish_timeout": 1.0}) as cluster:
        conn = await dial_master(cluster.master.address)
        await conn.recv()  # the challenge
        conn.send_nowait(m.Hello(version=PROTOCOL_VERSION, peer_group=0, p2p_port=9,
                                 p2p_host="127.0.0.1", nonce=b"n" * 16, mac=b""))

        async def answer_pings_only() -> None:
            while True:
                msg = await conn.recv()
                if isinstance(msg, m.Ping):
                    conn.send_nowait(m.Pong(seq=msg.seq))

        pinger = asyncio.create_task(answer_pings_only())
        try:
            await cluster.master.wait_for(lambda s: len(s.pending()) == 1)
            a, b = cluster.comms
            async with asyncio.timeout(30):
                await asyncio.gather(a.update_topology(), b.update_topology())
            assert attrs(a)[0] == 2 and not cluster.master.state.pending()
            x, y = np.ones(8, np.float32), np.full(8, 2, np.float32)
            await asyncio.gather(a.all_reduce(x), b.all_reduce(y))
            assert np.array_equal(x, np.full(8, 3, np.float32))
        finally:
            pinger.cancel()
            await asyncio.gather(pinger, return_exceptions=True)
            await conn.close()


async def test_rank_and_world_size_shard_the_group_in_join_order(pccl_cluster) -> None:
    cluster = await pccl_cluster(3)
    comms = sorted(cluster.comms, key=lambda c: c.peer_id)
    assert [c.rank for c in comms] == [0, 1, 2]
    assert [c.world_size for c in comms] == [3, 3, 3]
    # An earlier peer leaves: the later ranks move down, still dense.
    await comms[0].close()
    await cluster.master.wait_for(lambda s: len(s.accepted()) == 2)
    await asyncio.gather(*(c.update_topology() for c in comms[1:]))
    assert [c.rank for c in comms[1:]] == [0, 1]
    assert [c.world_size for c in comms[1:]] == [2, 2]
    with pytest.raises(pccl.InvalidUsageError):
        cluster.new_comm().rank  # noqa: B018 - not accepted yet


async def test_last_synced_revision(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    arrays = [np.full(8, 3.0, np.float32) for _ in cluster.comms]
    states = [pccl.SharedState([pccl.TensorInfo.from_numpy(a, "w")], revision=4)
              for a in arrays]
    assert [c.last_synced_revision for c in cluster.comms] == [None, None]
    await asyncio.gather(*(c.sync_shared_state(s) for c, s in zip(cluster.comms, states)))
    assert [c.last_synced_revision for c in cluster.comms] == [4, 4]
