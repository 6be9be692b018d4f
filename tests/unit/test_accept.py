"""``pccl.protocol.transport.accept``: the master's and the admin socket's accept, safe to
cancel. CPython 3.11's ``loop.sock_accept`` accepts in the loop's reader callback; when
the awaiting task is cancelled in the same turn of the loop, just before that callback
runs, the accepted socket is dropped unclosed (a leak the suite's fixture caught once in
a master stopped mid-accept). Here the connection stays in the backlog instead."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

from pccl.protocol.transport import accept


def _listener(family: int = socket.AF_INET, path: str = "") -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind(path or ("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    return sock


async def test_a_cancel_in_the_turn_the_connection_arrives_leaves_it_for_the_next_accept(
) -> None:
    loop = asyncio.get_running_loop()
    with _listener() as listener, socket.socket() as client:
        task = asyncio.create_task(accept(listener))
        await asyncio.sleep(0)  # it waits for the listener to be readable
        client.connect(listener.getsockname())  # (loopback: done in the kernel)
        # The cancel runs first in the next turn, the listener's reader callback later
        # in the same turn: the order in which sock_accept lost the connection.
        loop.call_soon(task.cancel)
        with pytest.raises(asyncio.CancelledError):
            await task
        # The connection was not taken: the next accept gets it, and it is this client's.
        async with asyncio.timeout(10):
            conn = await accept(listener)
        with conn:
            assert conn.getpeername() == client.getsockname()
            assert not conn.getblocking()


async def test_connections_are_accepted_in_order_and_errors_reach_the_caller(
        tmp_path: object) -> None:
    with _listener(socket.AF_UNIX, f"{tmp_path}/admin.sock") as listener:
        clients = [socket.socket(socket.AF_UNIX) for _ in range(3)]
        try:
            for c in clients:
                c.connect(listener.getsockname())
            async with asyncio.timeout(10):
                got = [await accept(listener) for _ in clients]
            for conn, c in zip(got, clients, strict=True):
                with conn:
                    c.sendall(b"x")
                    assert conn.recv(1) == b"x"
        finally:
            for c in clients:
                c.close()
    # A closed listener: the error of accept() itself, not a wait forever.
    with pytest.raises(OSError):
        async with asyncio.timeout(10):
            await accept(listener)


async def test_a_waiting_accept_is_woken_by_a_later_connection() -> None:
    with _listener() as listener, socket.socket() as client:
        task = asyncio.create_task(accept(listener))
        await asyncio.sleep(0)
        assert not task.done()
        client.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            client.connect(listener.getsockname())
        async with asyncio.timeout(10):
            conn = await task
        conn.close()
