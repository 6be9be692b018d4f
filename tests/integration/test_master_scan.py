"""A peer's connections to its masters, as the failover churn soak found them lacking:

- a peer with several masters dials them all at once and keeps one connection: every
  other connection it made is closed, including those it never looked at (a peer
  leaving while it re-registered kept a socket to a master open after close());
- a peer that leaves makes sure the master reads its Leave (the master lost it when it
  wrote to the closing peer first, and counted the leave as a loss)."""

from __future__ import annotations

import asyncio

import pytest

import pccl
from pccl.protocol import messages as m
from pccl.protocol.transport import FramedConnection
from pccl.testing import free_port

A, B, C = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"


class FakeConn:
    """What the scan does with a connection: keep it, or close it."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.closing = False

    def start_close(self) -> None:
        self.closing = True

    async def close(self) -> None:
        self.closing = True


def challenge(groups: list[int], standby: bool = False) -> m.Challenge:
    return m.Challenge(version=m.PROTOCOL_VERSION, nonce=bytes(16), auth=False,
                       groups=groups, standby=standby)


def scanning(masters: list[str]) -> pccl.Communicator:
    return pccl.Communicator(masters, peer_group=0, insecure=True)


async def test_connections_answered_with_the_chosen_one_are_closed(monkeypatch) -> None:
    """Three masters answer at once and all hold the group: the first in the list is
    kept; the two answers the scan never looked at are closed too."""
    comm = scanning([A, B, C])
    made: dict[str, FakeConn] = {}

    async def reach(addr: str, timeout: float):  # type: ignore[no-untyped-def]
        made[addr] = FakeConn(addr)
        return made[addr], challenge([0])

    monkeypatch.setattr(comm, "_reach", reach)
    conn, got = await comm._dial_master(5.0)
    assert conn is made[A] and got.groups == [0]
    assert comm._master_addr == A
    assert not made[A].closing
    assert made[B].closing and made[C].closing


async def test_a_scan_cancelled_as_a_dial_ends_closes_that_connection(monkeypatch) -> None:
    """The scan is cancelled (close() during a re-registration) in the very step in
    which one master's dial completes: that connection was never looked at, and is
    closed; the dial still under way is cancelled."""
    comm = scanning([A, B])
    made: dict[str, FakeConn] = {}
    scan: asyncio.Task[object] | None = None
    hanging = asyncio.Event()
    cancelled: list[str] = []

    async def reach(addr: str, timeout: float):  # type: ignore[no-untyped-def]
        if addr == B:
            try:
                await hanging.wait()  # a master that never answers
            except asyncio.CancelledError:
                cancelled.append(addr)
                raise
        await asyncio.sleep(0)  # the scan is waiting on both dials by now
        made[addr] = FakeConn(addr)
        assert scan is not None
        scan.cancel()  # lands before the scan sees this dial's result
        return made[addr], challenge([], standby=True)

    monkeypatch.setattr(comm, "_reach", reach)
    scan = asyncio.create_task(comm._dial_master(5.0))
    with pytest.raises(asyncio.CancelledError):
        await scan
    assert made[A].closing
    assert cancelled == [B] and B not in made


async def test_a_last_message_survives_writes_to_a_closing_peer() -> None:
    """A peer sends Leave and closes while the master, slow to read it, still writes to
    the peer: with ``linger`` the master reads the Leave; the peer's close ends once the
    master closed its end. (With a plain close the master's second write breaks the
    pipe and asyncio drops the unread Leave: the churn soak saw graceful leaves counted
    as losses, which stopped a group under quorums.)"""
    accepted: asyncio.Future[FramedConnection] = asyncio.get_running_loop().create_future()

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        accepted.set_result(FramedConnection(r, w))

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        peer = FramedConnection(*await asyncio.open_connection("127.0.0.1", port))
        master = await accepted
        peer.send_nowait(m.Leave())
        closing = asyncio.create_task(peer.linger(10.0))
        # The master writes before it reads; each write reaches the peer's socket.
        for seq in range(3):
            master.send_nowait(m.Ping(seq=seq))
            await master.writer.drain()
            await asyncio.sleep(0.05)
        assert not closing.done()  # still waiting for the master's end
        assert isinstance(await master.recv(), m.Leave)
        await master.close()
        async with asyncio.timeout(10.0):
            await closing
    finally:
        server.close()
        await server.wait_closed()


async def test_a_closed_peer_leaves_gracefully_at_the_master() -> None:
    """Communicator.close() lingers until the master closed its end: the master drops
    the peer as having left (not lost), and close() returns."""
    async with pccl.MasterNode(f"127.0.0.1:{free_port()}", insecure=True) as master:
        comm = pccl.Communicator(master.address, insecure=True,
                                 p2p_listen_host="127.0.0.1")
        await comm.connect()
        peer_id = comm.peer_id
        await master.wait_for(lambda s: peer_id in s.accepted(), timeout=30.0)
        await comm.close()
        await master.wait_for(lambda s: peer_id not in s.peers, timeout=30.0)
        drops = [e["text"] for e in master.monitor.timeline
                 if e["kind"] == "dropped" and peer_id in e["peers"]]
        assert len(drops) == 1 and "left gracefully" in drops[0], drops
