"""Playing a peer by hand against a master: for tests that send what a real peer never
would (garbage after registration, a peer that registers and falls silent)."""

from __future__ import annotations

import asyncio

from pccl.protocol.auth import split_host_port
from pccl.protocol.transport import FramedConnection


async def dial_master(address: str, secret: bytes | None = None, *, insecure: bool = False,
                      timeout: float = 10.0) -> FramedConnection:
    """A control connection to the master at ``address`` past the transport handshake
    (encrypted unless ``insecure``); the master's challenge is the next message."""
    host, port = split_host_port(address)
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, port)
        conn = FramedConnection(reader, writer)
        try:
            await conn.dial(secret, insecure=insecure)
        except BaseException:
            conn.abort()
            raise
    return conn


def write_raw(conn: FramedConnection, data: bytes) -> None:
    """Writes ``data`` as the connection's payload: sealed into records when encrypted,
    so the master's decoder (not its integrity check) is what sees it."""
    conn.writer.write(conn.session.seal(data) if conn.session is not None else data)


__all__ = ["dial_master", "write_raw"]
