"""Tests for pccl.testing.link_emulator.

Timing checks only assert lower bounds that the emulation guarantees (a byte cannot
arrive before its latency has elapsed); the one upper bound, in the pipelining test,
has a margin of more than 20x. ``wait_for`` timeouts are hang guards, not sync.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio

from pccl.testing.link_emulator import LinkEmulator

GUARD = 10.0  # seconds; only to turn a hang into a failure


class EchoServer:
    """Echoes everything back, optionally after a greeting; relays half-close."""

    def __init__(self, greeting: bytes = b"") -> None:
        self.greeting = greeting
        self.accepted = 0
        self.handlers: set[asyncio.Task[None]] = set()
        self.server: asyncio.Server | None = None

    @property
    def address(self) -> str:
        assert self.server is not None
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            if self.greeting:
                writer.write(self.greeting)
            while data := await reader.read(256 * 1024):
                writer.write(data)
                await writer.drain()
            writer.write_eof()
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()
            self.handlers.discard(task)

    async def wait_handlers(self) -> None:
        if self.handlers:
            await asyncio.wait_for(asyncio.gather(*self.handlers, return_exceptions=True), GUARD)

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for task in list(self.handlers):
            task.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)
        await self.server.wait_closed()


@pytest.fixture(autouse=True)
def no_error_logs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Network faults must stay at debug level; an error record means a bug in the emulator."""
    caplog.set_level(logging.WARNING)
    yield
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad]


@pytest_asyncio.fixture
async def echo() -> AsyncIterator[EchoServer]:
    server = EchoServer()
    await server.start()
    yield server
    await server.stop()


async def connect(link: LinkEmulator) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = link.address.rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError, OSError):
        await writer.wait_closed()


async def round_trip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     payload: bytes = b"ping") -> float:
    """Send ``payload`` through the echo and return the elapsed loop time."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    writer.write(payload)
    got = await asyncio.wait_for(reader.readexactly(len(payload)), GUARD)
    assert got == payload
    return loop.time() - start


async def read_is_dead(reader: asyncio.StreamReader) -> bool:
    """True when the connection ended (EOF or reset) rather than producing data."""
    try:
        data = await asyncio.wait_for(reader.read(1024), GUARD)
    except ConnectionResetError:
        return True
    return data == b""


async def echo_transfer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        payload: bytes) -> bytes:
    """Stream ``payload`` out (in uneven pieces), half-close, and read until EOF."""

    async def send() -> None:
        view = memoryview(payload)
        sizes = [1, 1000, 65536, 300_000, 7]
        i = 0
        while view:
            n = sizes[i % len(sizes)]
            writer.write(view[:n])
            view = view[n:]
            i += 1
            await writer.drain()
        writer.write_eof()

    sender = asyncio.create_task(send())
    received = bytearray()
    while chunk := await asyncio.wait_for(reader.read(1 << 20), GUARD):
        received += chunk
    await sender
    return bytes(received)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "settings, size",
    [
        ({}, 6_000_000),
        ({"chunk_size": 256 * 1024}, 6_000_000),
        ({"latency": 0.005, "bandwidth": 50e6, "window": 100_000, "chunk_size": 7000}, 2_000_000),
    ],
    ids=["plain", "large-chunks", "shaped"],
)
async def test_echo_round_trip_is_byte_exact(
    echo: EchoServer, settings: dict[str, Any], size: int
) -> None:
    payload = os.urandom(size)
    async with LinkEmulator(echo.address, **settings) as link:
        reader, writer = await connect(link)
        received = await echo_transfer(reader, writer, payload)
        # The echo server relayed our FIN back, so both half-closes crossed the link.
        assert received == payload
        assert link.bytes_forwarded == 2 * size
        await close(writer)
        await asyncio.wait_for(link.wait_for_connections(0), GUARD)


@pytest.mark.asyncio
async def test_latency_is_a_lower_bound_and_live(echo: EchoServer) -> None:
    async with LinkEmulator(echo.address, latency=0.05) as link:
        reader, writer = await connect(link)
        assert await round_trip(reader, writer) >= 0.1 - 1e-3
        link.latency = 0.1  # applies to the already open connection
        assert await round_trip(reader, writer) >= 0.2 - 1e-3
        await close(writer)


@pytest.mark.asyncio
async def test_latency_does_not_serialise_chunks(echo: EchoServer) -> None:
    # 4 MB in 16 KiB reads is 256 chunks: one latency per chunk would need > 25 s each way.
    payload = os.urandom(4_000_000)
    async with LinkEmulator(echo.address, latency=0.1, chunk_size=16 * 1024) as link:
        reader, writer = await connect(link)
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await echo_transfer(reader, writer, payload) == payload
        elapsed = loop.time() - start
        assert elapsed >= 0.2 - 1e-3
        assert elapsed < 10.0
        await close(writer)


@pytest.mark.asyncio
async def test_bandwidth_cap_is_a_lower_bound(echo: EchoServer) -> None:
    async with LinkEmulator(echo.address, bandwidth=10e6) as link:
        reader, writer = await connect(link)
        # 1 MB at 10 MB/s is 0.1 s, less the burst the bucket allows (10 ms, i.e. 100 kB).
        assert await round_trip(reader, writer, os.urandom(1_000_000)) >= 0.08
        link.bandwidth = 5e6  # live change on the open connection
        assert await round_trip(reader, writer, os.urandom(500_000)) >= 0.08
        link.bandwidth = None
        await round_trip(reader, writer, os.urandom(1_000_000))
        await close(writer)


@pytest.mark.asyncio
async def test_window_limits_throughput_over_latency(echo: EchoServer) -> None:
    # At most 64 KiB may be in flight and each byte spends 20 ms in flight, so 1 MB
    # needs at least 15 windows' worth of latency: >= 0.3 s.
    async with LinkEmulator(echo.address, latency=0.02, window=64 * 1024) as link:
        reader, writer = await connect(link)
        assert await round_trip(reader, writer, os.urandom(1_000_000)) >= 0.25
        await close(writer)


@pytest.mark.asyncio
async def test_blackhole_stalls_then_heals(echo: EchoServer) -> None:
    async with LinkEmulator(echo.address) as link:
        reader, writer = await connect(link)
        await round_trip(reader, writer)
        assert echo.accepted == 1

        link.blackhole()
        writer.write(b"lost?")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.readexactly(5), 0.2)
        # A stalled link, not a closed one.
        assert not reader.at_eof()
        assert link.connection_count == 1

        # New connections are accepted but go nowhere while the link is dead.
        reader2, writer2 = await connect(link)
        writer2.write(b"hello")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader2.readexactly(5), 0.2)
        assert echo.accepted == 1

        # Nothing is read off a blackholed link, so a big sender stays blocked in drain()
        # (the kernel buffers are far smaller than this and do not grow without reads).
        bulk = os.urandom(48 * 1024 * 1024)
        writer.write(bulk)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(writer.drain(), 0.5)

        link.blackhole(False)
        assert await asyncio.wait_for(reader.readexactly(5), GUARD) == b"lost?"
        assert await asyncio.wait_for(reader.readexactly(len(bulk)), GUARD) == bulk
        assert await asyncio.wait_for(reader2.readexactly(5), GUARD) == b"hello"
        assert echo.accepted == 2
        await round_trip(reader, writer)
        await close(writer)
        await close(writer2)


@pytest.mark.asyncio
async def test_reset_all_resets_both_peers(echo: EchoServer) -> None:
    async with LinkEmulator(echo.address, latency=0.01) as link:
        reader, writer = await connect(link)
        await round_trip(reader, writer)
        assert link.connection_count == 1

        await link.reset_all()
        assert link.connection_count == 0
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(1024), GUARD)
        await echo.wait_handlers()  # the server-side socket died too
        await close(writer)

        # The emulator itself keeps working.
        reader, writer = await connect(link)
        await round_trip(reader, writer)
        await close(writer)


@pytest.mark.asyncio
async def test_peer_reset_propagates(echo: EchoServer) -> None:
    async with LinkEmulator(echo.address, latency=0.01) as link:
        reader, writer = await connect(link)
        await round_trip(reader, writer)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # the client host "crashes"
        await echo.wait_handlers()  # the server saw the reset arrive and closed
        await asyncio.wait_for(link.wait_for_connections(0), GUARD)


@pytest.mark.asyncio
async def test_server_close_reaches_client(echo: EchoServer) -> None:
    async with LinkEmulator(echo.address, latency=0.01) as link:
        reader, writer = await connect(link)
        await round_trip(reader, writer)
        await echo.stop()  # cancels the handler, which closes its socket (FIN)
        assert await read_is_dead(reader)
        await close(writer)
        await asyncio.wait_for(link.wait_for_connections(0), GUARD)


@pytest.mark.asyncio
async def test_refuse_new(echo: EchoServer) -> None:
    async with LinkEmulator(echo.address) as link:
        old_reader, old_writer = await connect(link)
        await round_trip(old_reader, old_writer)

        link.refuse_new()
        reader, writer = await connect(link)
        assert await read_is_dead(reader)
        await close(writer)
        assert echo.accepted == 1
        assert link.connection_count == 1
        await round_trip(old_reader, old_writer)  # existing connections are unaffected

        link.refuse_new(False)
        reader, writer = await connect(link)
        await round_trip(reader, writer)
        assert echo.accepted == 2
        await close(writer)
        await close(old_writer)


@pytest.mark.asyncio
async def test_target_callable_resolved_per_connection() -> None:
    first, second = EchoServer(b"A"), EchoServer(b"B")
    link = LinkEmulator()  # created before any server port is known
    await link.start()
    try:
        await first.start()
        await second.start()
        current = first.address
        link.target = lambda: current

        reader_a, writer_a = await connect(link)
        assert await asyncio.wait_for(reader_a.readexactly(1), GUARD) == b"A"
        current = second.address
        reader_b, writer_b = await connect(link)
        assert await asyncio.wait_for(reader_b.readexactly(1), GUARD) == b"B"
        await round_trip(reader_a, writer_a)  # the first connection stays on the old target
        assert (first.accepted, second.accepted) == (1, 1)
        await close(writer_a)
        await close(writer_b)
    finally:
        await link.stop()
        await first.stop()
        await second.stop()


@pytest.mark.asyncio
async def test_unreachable_target_resets_client() -> None:
    with socket.socket() as probe:  # a port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    async with LinkEmulator(dead) as link:
        reader, writer = await connect(link)
        assert await read_is_dead(reader)
        await close(writer)
        await asyncio.wait_for(link.wait_for_connections(0), GUARD)


def open_fd_count() -> int | None:
    """Open file descriptors of this process, where the OS exposes them (Linux)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


@pytest.mark.asyncio
async def test_stop_leaves_no_tasks_or_sockets(echo: EchoServer) -> None:
    fds_before = open_fd_count()
    tasks_before = asyncio.all_tasks()

    link = LinkEmulator(echo.address, latency=0.05, bandwidth=20e6)
    await link.start()
    reader, writer = await connect(link)
    await round_trip(reader, writer)
    writer.write(os.urandom(2_000_000))  # leaves bytes queued inside the emulator
    link.blackhole()
    reader2, writer2 = await connect(link)  # accepted, dial deferred by the blackhole
    await asyncio.wait_for(link.wait_for_connections(2), GUARD)

    await link.stop()
    # Checked straight away: stop() itself must have waited for everything it spawned.
    assert asyncio.all_tasks() - tasks_before - echo.handlers == set()
    await link.stop()  # idempotent
    assert link.connection_count == 0

    assert await read_is_dead(reader)
    assert await read_is_dead(reader2)
    await close(writer)
    await close(writer2)
    await echo.wait_handlers()
    assert asyncio.all_tasks() == tasks_before
    if fds_before is not None:
        assert open_fd_count() == fds_before


@pytest.mark.asyncio
async def test_stop_without_start_and_invalid_settings() -> None:
    link = LinkEmulator("127.0.0.1:1")
    with pytest.raises(RuntimeError):
        _ = link.address
    await link.stop()
    with pytest.raises(ValueError):
        LinkEmulator(latency=-1)
    with pytest.raises(ValueError):
        LinkEmulator(bandwidth=0)
    with pytest.raises(ValueError):
        LinkEmulator(window=0)


@pytest.mark.asyncio
async def test_classify_sees_first_bytes_split_over_several_writes(echo: EchoServer) -> None:
    """A pccl dialer writes a frame's length prefix and body separately; the classifier
    must still see the dialer id, however the bytes were split on the way."""
    import struct

    from pccl.testing.link_emulator import p2p_dialer_id

    seen: list[int | None] = []

    def classify(head: bytes) -> float | None:
        seen.append(p2p_dialer_id(head))
        return 1e9 if seen[-1] is not None else None

    async with LinkEmulator(echo.address, classify=classify) as link:
        reader, writer = await connect(link)
        body = b"PCCLP2P\x01" + struct.pack(">HQ", 1, 42) + b"z" * 40
        writer.write(struct.pack(">I", len(body)))
        await writer.drain()
        await asyncio.wait_for(reader.readexactly(4), 10)  # echoed: the prefix got through
        writer.write(body)
        await writer.drain()
        await asyncio.wait_for(reader.readexactly(len(body)), 10)
        assert seen[-1] == 42
        await close(writer)
