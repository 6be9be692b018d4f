"""A stranger without the shared secret against the parking lot of a peer's p2p port.

A ring link into a peer behind NAT is opened by that peer: it dials its neighbour and
sends ``PCCLREV | token | stream`` (``rust/net/node/``), and the neighbour keeps the
stream until its own side of the link asks for that token. Such streams arrive before
any authentication, so a stranger can send as many as it likes, with made-up tokens.
Here one does, hundreds of them, at every member's p2p port, and keeps them open; a
peer behind NAT (on loopback: one whose advertised p2p address does not answer the
master's dial-back) then still joins and the group reduces exactly. A stream that
repeats the token and stream number of one already waiting is refused; the first one
stays and its link opens."""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from collections.abc import Callable

import numpy as np

from pccl import _core
from pccl.testing import Cluster
from pccl.testing.processes import free_port

# Shared secrets are keys of at least 128 random bits (pccl.identity.check_secret).
SECRET = b"5f0c1a9e7d3b42c8a6e1f0b97c2d4e3a"
STRANGERS = 300  # per member (bounded; each a TCP connection kept open)
REVERSE_MAGIC = b"PCCLREV\x01"


def _reverse_frame(token: bytes, stream: int) -> bytes:
    body = REVERSE_MAGIC + token + struct.pack(">H", stream)
    return struct.pack(">I", len(body)) + body


async def _open_reverse(port: int, token: bytes, stream: int = 0
                        ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_reverse_frame(token, stream))
    await writer.drain()
    return reader, writer


async def _hung_up(reader: asyncio.StreamReader, timeout: float = 15.0) -> bool:
    """Whether the other end closes the connection (reading nothing) within ``timeout``
    seconds (a bound on a hang, not a measurement)."""
    try:
        async with asyncio.timeout(timeout):
            return await reader.read(1) == b""
    except ConnectionError:
        return True
    except TimeoutError:
        return False


async def _close(conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]) -> None:
    for _, writer in conns:
        writer.close()
    for _, writer in conns:
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def _eventually(cond: Callable[[], bool], what: str, tries: int = 1500) -> None:
    """Waits (bounded) for a state the test cannot be told about: polls ``cond``."""
    for _ in range(tries):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


async def test_a_flood_of_strangers_does_not_lock_a_peer_behind_nat_out() -> None:
    async with Cluster(2, secret=SECRET, comm_kwargs={"p2p_timeout": 5.0}) as cluster:
        strangers: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        try:
            for comm in cluster.comms:
                for _ in range(STRANGERS):
                    strangers.append(await _open_reverse(comm.p2p_port, os.urandom(16)))
            # Nothing listens at the joiner's advertised address: the master's dial-back
            # fails, and its ring neighbour must let it dial in reverse.
            joiner = cluster.new_comm(p2p_advertise_address=f"127.0.0.1:{free_port()}")
            members = cluster.comms[:2]
            async with asyncio.timeout(60):
                join = asyncio.create_task(joiner.connect(n_attempts=1))
                try:
                    await cluster.master.wait_for(lambda s: len(s.pending()) == 1)
                    await asyncio.gather(*(c.update_topology() for c in members))
                    await join
                finally:
                    join.cancel()
                    await asyncio.gather(join, return_exceptions=True)
            assert not cluster.master.state.peers[joiner.peer_id].reachable
            assert "reverse" in cluster.master.state.paths.values()
            xs = [np.full(4096, i + 1, np.float32) for i in range(3)]
            async with asyncio.timeout(30):
                await asyncio.gather(*(c.all_reduce(x) for c, x in zip(cluster.comms, xs)))
            for x in xs:
                np.testing.assert_array_equal(x, np.full(4096, 6, np.float32))
            # Most strangers were refused at once, and the few that waited are let go
            # once their short deadline passes: every one is hung up on.
            hung_up = await asyncio.gather(*(_hung_up(r) for r, _ in strangers))
            assert all(hung_up), hung_up.count(False)
        finally:
            await _close(strangers)


async def test_a_repeated_token_does_not_replace_the_stream_already_waiting() -> None:
    token = os.urandom(16)
    # Each node proves its own key and knows the other's (the master's roster).
    ids, idr = _core.Identity(), _core.Identity()
    sender = await _core.P2PNode.bind(1, secret=SECRET, identity=ids)
    receiver = await _core.P2PNode.bind(2, secret=SECRET, identity=idr)
    keys = {1: ids.public_key, 2: idr.public_key}
    sender.set_peer_keys(keys)
    receiver.set_peer_keys(keys)
    try:
        # The receiver (behind NAT) dials the sender back before the sender asked for
        # the link: its stream waits in the sender's parking lot.
        dial_back = asyncio.ensure_future(
            receiver.open_inbound("reverse", f"127.0.0.1:{sender.port}", token))
        await _eventually(lambda: sender.parked() == (0, 1), "the dial-back is parked")
        # Someone who learned the token (not the secret) sends the same token and stream.
        reader, writer = await _open_reverse(sender.port, token)
        try:
            assert await _hung_up(reader), "the repeat was kept"
        finally:
            await _close([(reader, writer)])
        assert sender.parked() == (0, 1)
        # The first stream is still there, and the link opens on it.
        async with asyncio.timeout(30):
            await sender.connect_pool("", 2, 1, 1, route="reverse", token=token)
            await dial_back
        assert sender.parked() == (0, 0)
    finally:
        await sender.close()
        await receiver.close()
