"""A userspace TCP link emulator for fault injection and WAN benchmarks.

The CI kernels have no ``netem``, so latency, bandwidth caps, window limits and
link faults are produced by this proxy instead. It listens on a local port and
forwards every accepted connection to a target listener, shaping the bytes in
both directions::

    async with LinkEmulator(f"127.0.0.1:{port}", latency=0.05, bandwidth=10e6) as link:
        reader, writer = await asyncio.open_connection(*link.address.split(":"))
        ...
        link.blackhole()          # the link goes silent, sockets stay open
        await link.reset_all()    # both peers see a TCP reset

Model, per connection and per direction (see ``LinkEmulator`` for details)::

    source socket --read--> [token bucket] --> [delivery queue, +latency] --write--> sink socket
                    ^ paused while: window full, bucket in debt, sink backed up, blackholed
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import socket
import struct
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any

__all__ = ["LinkEmulator"]

logger = logging.getLogger(__name__)

# Even with ``window=None`` a direction never holds more than this many undelivered bytes,
# so a fast sender behind a long latency cannot balloon the proxy's memory. At 50 ms of
# latency this still allows ~1.3 GB/s, far above what loopback benchmarks need.
_MAX_BUFFERED = 64 * 1024 * 1024

# The token bucket may bank this much link time (and at least one chunk). Without some
# slack, every late wake-up of the throttle timer under CPU load is bandwidth lost for
# good; 10 ms absorbs scheduler jitter while keeping bursts short.
_BURST_SECONDS = 0.01

# Marks a half-close travelling through a delivery queue behind the data sent before it.
_EOF = object()
# Returned by a pump step when the connection is being torn down.
_STOP = object()


def _split_hostport(address: str) -> tuple[str, int]:
    """Split ``"host:port"`` (or ``"[v6]:port"``) into its parts.

    >>> _split_hostport("[::1]:80")
    ('::1', 80)
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected 'host:port', got {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _abort_with_rst(transport: asyncio.Transport) -> None:
    """Close ``transport`` so that the peer receives a TCP RST rather than a FIN.

    A plain ``abort()`` only resets when unread data is pending; a zero linger
    timeout makes the reset unconditional, which is what a crashed host looks like.
    """
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # already dead: abort() below still releases it
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class _TokenBucket:
    """Token bucket that may go into debt.

    A read of ``n`` bytes is always accepted (the bytes are already in hand); the
    debt it leaves is the time the emulated link spends serialising them, during
    which the source is not read again. This turns the bucket into a virtual link
    that is busy until ``stamp + debt / rate``. The capacity is ``min_burst`` bytes or
    ``_BURST_SECONDS`` of traffic at the current rate, whichever is larger.

    >>> b = _TokenBucket(min_burst=100)
    >>> b.take(300, rate=100.0, now=0.0)   # 200 bytes over the burst -> 2 s busy
    2.0
    """

    __slots__ = ("min_burst", "stamp", "tokens")

    def __init__(self, min_burst: int) -> None:
        self.min_burst = float(min_burst)
        self.tokens = self.min_burst
        self.stamp: float | None = None

    def _refill(self, rate: float, now: float) -> None:
        if self.stamp is not None:
            cap = max(self.min_burst, rate * _BURST_SECONDS)
            self.tokens = min(cap, self.tokens + (now - self.stamp) * rate)
        self.stamp = now

    def take(self, n: int, rate: float, now: float) -> float:
        """Consume ``n`` tokens; return seconds until the bucket is out of debt."""
        self._refill(rate, now)
        self.tokens -= n
        return max(0.0, -self.tokens / rate)

    def debt_time(self, rate: float, now: float) -> float:
        """Seconds until the bucket is out of debt at ``rate`` (0 if it is not)."""
        self._refill(rate, now)
        return max(0.0, -self.tokens / rate)

    def reset(self) -> None:
        self.tokens = self.min_burst
        self.stamp = None


class _Side(asyncio.BufferedProtocol):
    """One socket owned by the emulator: the accepted one or the one dialled to the target."""

    def __init__(self, emu: LinkEmulator, *, accepted: bool) -> None:
        self._emu = emu
        self.accepted = accepted
        self.transport: asyncio.Transport | None = None
        self.conn: _Connection | None = None
        self.outgoing: _Direction | None = None  # direction this socket feeds
        self.incoming: _Direction | None = None  # direction that writes into this socket
        self.made = False
        self.lost = False
        self.eof = False  # the peer half-closed; nothing more will be read
        self.write_paused = False
        self.reading = False
        self.lost_future: asyncio.Future[None] = emu._loop.create_future()
        # One receive buffer reused for every read: the payload is copied out into an
        # immutable ``bytes`` because the transport may keep a reference to what we write.
        self._view = memoryview(bytearray(emu.chunk_size))

    # -- asyncio protocol callbacks --------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.made = True
        # Nothing may be read before both ends exist and the directions are wired up;
        # until then the peer's bytes wait in its kernel buffers, like on a slow link.
        transport.pause_reading()
        # The default 64 KiB high-water mark would pause the source after every large
        # chunk; a few chunks of slack keep the pipe full at loopback speeds.
        high = max(4 * self._emu.chunk_size, 256 * 1024)
        transport.set_write_buffer_limits(high=high)
        self._emu._sides.add(self)
        if self.accepted:
            self._emu._on_accepted(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._emu._sides.discard(self)
        if not self.lost_future.done():
            self.lost_future.set_result(None)
        if self.conn is not None:
            self.conn.side_lost(self, exc)

    def get_buffer(self, sizehint: int) -> memoryview:
        direction = self.outgoing
        if direction is not None:
            room = direction.room()
            # Never read past the window, so a small window really limits what is in flight.
            if 0 < room < len(self._view):
                return self._view[:room]
        return self._view

    def buffer_updated(self, nbytes: int) -> None:
        data = bytes(self._view[:nbytes])
        if self.outgoing is not None:
            self.outgoing.push(data)

    def eof_received(self) -> bool:
        self.eof = True
        self.reading = False
        if self.outgoing is None:
            return False
        self.outgoing.push_eof()
        # Keep the socket open: the other direction may still have data for this peer.
        return True

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.incoming is not None:
            self.incoming.update_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.incoming is not None:
            self.incoming.wake.set()
            self.incoming.update_reading()

    # -- helpers -----------------------------------------------------------------------

    def writable(self) -> bool:
        return (self.transport is not None and not self.write_paused
                and not self.transport.is_closing())

    def set_reading(self, want: bool) -> None:
        # After EOF the transport must not be resumed: it would read EOF a second time.
        if want == self.reading or self.eof or self.lost or self.transport is None:
            return
        self.reading = want
        if want:
            self.transport.resume_reading()
        else:
            self.transport.pause_reading()

    def abort(self, *, rst: bool) -> None:
        if self.transport is None or self.lost:
            return
        if rst:
            _abort_with_rst(self.transport)
        else:
            self.transport.abort()


class _Direction:
    """Bytes flowing from one socket (``src``) to the other (``dst``) of a connection."""

    def __init__(self, conn: _Connection, src: _Side, dst: _Side, name: str) -> None:
        self.conn = conn
        self.emu = conn.emu
        self.src = src
        self.dst = dst
        self.name = name
        # (delivery time, payload) in read order; delivery times never decrease.
        self.queue: collections.deque[tuple[float, object]] = collections.deque()
        self.inflight = 0  # payload bytes read from src and not yet written to dst
        self.last_at = 0.0
        self.bucket = _TokenBucket(self.emu.chunk_size)
        self.throttle: asyncio.TimerHandle | None = None
        self.reset_at: float | None = None
        self.eof_sent = False
        self.wake = asyncio.Event()
        # Set by LinkEmulator.classify from the first bytes of the client->server
        # direction: a cap for this connection only (e.g. per sending peer).
        self.rate_override: float | None = None
        self.classified = name != "client->server"
        self.head = b""
        # Bytes read from src so far (what ``LinkEmulator.tamper`` is told).
        self.offset = 0
        # Every byte read from src, when the emulator records (see ``recorded()``).
        self.recording: bytearray | None = None
        if self.emu._record:
            self.recording = bytearray()
            self.emu._recordings.append((f"{conn.id} {name}", self.recording))
        src.outgoing = self
        dst.incoming = self

    def room(self) -> int:
        window = self.emu.window
        cap = _MAX_BUFFERED if window is None else min(window, _MAX_BUFFERED)
        return cap - self.inflight

    def update_reading(self) -> None:
        """Read from the source only while every reason to hold back is absent."""
        emu = self.emu
        want = (not self.conn.closing
                and not emu._blackholed
                and self.throttle is None
                and self.dst.writable()
                and self.room() > 0)
        self.src.set_reading(want)

    def _schedule(self, now: float, extra: float = 0.0) -> float:
        latency = self.conn.latency_override
        at = now + extra + (self.emu.latency if latency is None else latency)
        # A latency decrease must not let later bytes overtake earlier ones.
        at = max(at, self.last_at)
        self.last_at = at
        return at

    def rate(self) -> float | None:
        return self.rate_override if self.rate_override is not None else self.emu.bandwidth

    def push(self, data: bytes) -> None:
        emu = self.emu
        if emu.tamper is not None:
            offset, self.offset = self.offset, self.offset + len(data)
            data = emu.tamper(self.conn.id, self.name, offset, bytes(data))
            if not data:
                return
        n = len(data)
        now = emu._loop.time()
        if self.recording is not None:
            self.recording += data
        if not self.classified:
            # The first bytes may arrive in several reads (a length prefix written on
            # its own, say): keep asking until the classifier decides or 64 bytes came.
            self.head += bytes(data[:64 - len(self.head)])
            if emu.classify is None and emu.classify_latency is None:
                self.classified = True
            else:
                if emu.classify is not None:
                    self.rate_override = emu.classify(self.head)
                if emu.classify_latency is not None:
                    self.conn.latency_override = emu.classify_latency(self.head)
                self.classified = (len(self.head) >= 64 or (
                    (emu.classify is None or self.rate_override is not None)
                    and (emu.classify_latency is None
                         or self.conn.latency_override is not None)))
        busy = 0.0
        rate = self.rate()
        if rate is not None:
            busy = self.bucket.take(n, rate, now)
            if self.throttle is not None:  # a read raced with pause_reading(); re-arm below
                self.throttle.cancel()
                self.throttle = None
            if busy > 0.0:
                # The virtual link is serialising these bytes; read nothing until it is free.
                self.throttle = emu._loop.call_at(now + busy, self._unthrottle)
        at = self._schedule(now, busy)
        if (not self.queue and at <= now and not emu._blackholed and self.dst.writable()
                and self.reset_at is None):
            # Nothing queued ahead and nothing to wait for (no latency, within the burst):
            # write straight through, which is what keeps unshaped links fast.
            self.dst.transport.write(data)  # type: ignore[union-attr]
            emu._bytes_forwarded += n
        else:
            if not self.queue:
                self.wake.set()
            self.queue.append((at, data))
            self.inflight += n
        self.update_reading()

    def push_eof(self) -> None:
        if not self.queue:
            self.wake.set()
        self.queue.append((self._schedule(self.emu._loop.time()), _EOF))

    def schedule_reset(self) -> None:
        """Our source died abruptly: let the reset reach the sink after the data sent before it."""
        if self.reset_at is None:
            self.reset_at = self._schedule(self.emu._loop.time())
            self.wake.set()

    def drop(self) -> None:
        """The sink is gone; discard whatever was still travelling toward it."""
        self.queue.clear()
        self.inflight = 0

    def _unthrottle(self) -> None:
        self.throttle = None
        self.update_reading()

    def retune(self) -> None:
        """Re-evaluate throttling and reading after a live parameter change."""
        if self.throttle is not None:
            self.throttle.cancel()
            self.throttle = None
        bandwidth = self.rate()
        if bandwidth is None:
            self.bucket.reset()
        elif not self.conn.closing:
            now = self.emu._loop.time()
            busy = self.bucket.debt_time(bandwidth, now)
            if busy > 0.0:
                self.throttle = self.emu._loop.call_at(now + busy, self._unthrottle)
        self.update_reading()
        self.wake.set()

    def cancel_timers(self) -> None:
        if self.throttle is not None:
            self.throttle.cancel()
            self.throttle = None

    def _step(self, now: float) -> object:
        """Deliver everything that is due; return the next wake-up time, None or _STOP."""
        conn = self.conn
        if conn.closing:
            return _STOP
        if self.emu._blackholed:
            return None  # blackhole(False) wakes us
        queue = self.queue
        dst = self.dst
        delivered = False
        while queue and dst.writable():
            at, item = queue[0]
            if at > now:
                break
            queue.popleft()
            if item is _EOF:
                self.eof_sent = True
                if dst.transport.can_write_eof():  # type: ignore[union-attr]
                    # The sink may have been reset meanwhile (ENOTCONN): the teardown
                    # that follows is the same as for any other dead sink.
                    with contextlib.suppress(OSError):
                        dst.transport.write_eof()  # type: ignore[union-attr]
                conn.maybe_close_gracefully()
                if conn.closing:
                    return _STOP
            else:
                assert isinstance(item, bytes)
                self.inflight -= len(item)
                self.emu._bytes_forwarded += len(item)
                delivered = True
                dst.transport.write(item)  # type: ignore[union-attr]
        if delivered:
            self.update_reading()  # window credit came back
        deadline: float | None = None
        if self.reset_at is not None:
            if now >= self.reset_at:
                logger.debug("%s: %s peer reset; resetting the other peer", conn, self.name)
                conn.abort(rst=True)
                return _STOP
            deadline = self.reset_at
        if queue and dst.writable():
            head = queue[0][0]
            deadline = head if deadline is None else min(deadline, head)
        # Otherwise resume_writing() / push() / a live change sets ``wake``.
        return deadline

    async def pump(self) -> None:
        """Deliver queued bytes to the sink at their due time, in order."""
        loop = self.emu._loop
        try:
            while True:
                self.wake.clear()
                deadline = self._step(loop.time())
                if deadline is _STOP:
                    return
                if deadline is None:
                    await self.wake.wait()
                    continue
                assert isinstance(deadline, float)
                try:
                    async with asyncio.timeout_at(deadline):
                        await self.wake.wait()
                except TimeoutError:
                    pass
        except Exception:
            # A bug, not a network error: make it loud, then tear the connection down.
            logger.exception("%s: %s pump failed", self.conn, self.name)
            self.conn.abort(rst=True)


class _Connection:
    """One proxied connection: the accepted socket, the dialled socket and two directions."""

    _ids = 0

    def __init__(self, emu: LinkEmulator, client: _Side) -> None:
        _Connection._ids += 1
        self.id = _Connection._ids
        self.emu = emu
        self.client = client
        self.server: _Side | None = None
        self.up: _Direction | None = None  # client -> server
        self.down: _Direction | None = None  # server -> client
        self.closing = False
        self.finished = False
        # From ``LinkEmulator.classify_latency``: this connection's one-way latency, both
        # directions, once its first bytes told who dialled (None: the emulator's).
        self.latency_override: float | None = None
        self.done: asyncio.Future[None] = emu._loop.create_future()
        self.pumps: list[asyncio.Task[None]] = []
        client.conn = self
        self.dial_task = emu._spawn(self._dial(), f"link-emulator-dial-{self.id}")
        self.dial_task.add_done_callback(lambda _t: self._maybe_finished())

    def __repr__(self) -> str:
        return f"<link connection #{self.id}>"

    async def _dial(self) -> None:
        emu = self.emu
        # Across a dead link the SYN would not arrive either, so the target only sees the
        # connection once the blackhole is lifted.
        await emu._link_up.wait()
        try:
            host, port = _split_hostport(emu._resolve_target())
        except Exception as exc:
            # A test set-up mistake rather than a network fault, so say it louder.
            logger.warning("%r: no usable target (%r); resetting the client", self, exc)
            self.abort(rst=True)
            return
        server = _Side(emu, accepted=False)
        server.conn = self
        self.server = server
        try:
            await emu._loop.create_connection(lambda: server, host, port)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # refused, unreachable, unresolvable...
            logger.debug("%r: cannot reach target: %r", self, exc)
            self.abort(rst=True)
            return
        if self.closing or self.client.lost:
            self.abort(rst=True)
            return
        logger.debug("%r: connected %s -> %s", self, emu.address, f"{host}:{port}")
        self.up = _Direction(self, self.client, server, "client->server")
        self.down = _Direction(self, server, self.client, "server->client")
        for direction in (self.up, self.down):
            name = f"link-emulator-{self.id}-{direction.name}"
            self.pumps.append(emu._spawn(direction.pump(), name))
        self.up.update_reading()
        self.down.update_reading()

    def directions(self) -> tuple[_Direction, ...]:
        return tuple(d for d in (self.up, self.down) if d is not None)

    def poke(self) -> None:
        """Apply a live change of the emulator's settings."""
        for direction in self.directions():
            direction.retune()

    def side_lost(self, side: _Side, exc: Exception | None) -> None:
        if not self.closing:
            if side.outgoing is None or side.incoming is None:
                # Lost before the link was wired up: nothing to relay, just clean up.
                self.abort(rst=True)
            else:
                which = "client" if side.accepted else "server"
                logger.debug("%r: %s side lost (%r)", self, which, exc)
                side.incoming.drop()
                side.outgoing.schedule_reset()
                side.incoming.update_reading()
        self._maybe_finished()

    def maybe_close_gracefully(self) -> None:
        """Both peers have half-closed and each FIN was relayed: close both sockets."""
        up, down = self.up, self.down
        if up is not None and down is not None and up.eof_sent and down.eof_sent:
            self._begin_close()
            for side in (self.client, self.server):
                if side is not None and side.transport is not None and not side.lost:
                    side.transport.close()  # flushes what is still buffered first
            self._maybe_finished()

    def abort(self, *, rst: bool) -> None:
        self._begin_close()
        for side in (self.client, self.server):
            if side is not None:
                side.abort(rst=rst)
        if not self.dial_task.done() and self.dial_task is not asyncio.current_task():
            self.dial_task.cancel()
        self._maybe_finished()

    def _begin_close(self) -> None:
        if self.closing:
            return
        self.closing = True
        for direction in self.directions():
            direction.cancel_timers()
            direction.wake.set()  # pumps notice ``closing`` and return

    def _maybe_finished(self) -> None:
        if self.finished or not self.client.lost or not self.dial_task.done():
            return
        server = self.server
        if server is not None and server.made and not server.lost:
            return
        self.finished = True
        self.closing = True
        for direction in self.directions():
            direction.cancel_timers()
        for pump in self.pumps:
            if not pump.done() and pump is not asyncio.current_task():
                pump.cancel()
        self.emu._connection_finished(self)
        if not self.done.done():
            self.done.set_result(None)


class LinkEmulator:
    """Async TCP proxy: listens on `listen`, forwards each accepted connection to `target`.

    Every connection gets two independent directions, each modelled as a link that
    first serialises bytes at ``bandwidth`` and then propagates them for ``latency``
    seconds::

        async with LinkEmulator(lambda: f"127.0.0.1:{port}", latency=0.05) as link:
            host, port_s = link.address.split(":")
            reader, writer = await asyncio.open_connection(host, int(port_s))

    Parameters:
        target: ``"host:port"`` or a zero-argument callable returning one. Resolved
            for each new connection, so it may be set (or changed) after construction;
            existing connections stay where they are.
        listen: local ``"host:port"`` to bind; port 0 picks a free one (see ``address``).
        latency: one-way delay in seconds, in each direction. A chunk read at ``t`` is
            written out at ``t + latency`` while later chunks keep being read, so latency
            does not cost throughput (up to ``window``).
        bandwidth: bytes/s per connection per direction, or None for unlimited. A token
            bucket (burst: one ``chunk_size`` or 10 ms of traffic, whichever is larger)
            that, once in debt, stops reading the source until the emulated link has
            "sent" the bytes already read.
        window: most bytes read but not yet delivered, per connection per direction, or
            None. Once reached the source is not read, so throughput <= window / latency,
            like a window-limited TCP flow on a long fat pipe.
        chunk_size: largest single read; use ~256 KiB for throughput benchmarks.
        classify: given a connection's first client bytes (up to 64), the bandwidth cap
            of its client->server direction, or None to wait for more bytes; with
            ``p2p_dialer_id`` that shapes each dialling peer differently.
        classify_latency: the same for the connection's one-way latency in both
            directions (bytes read before it decides pay the emulator's ``latency``):
            per-pair latency, peers in regions.
        record: keep every byte that crosses the link, per connection and direction
            (``recorded()``); for tests only (memory grows with the traffic).
        tamper: a man in the middle that may change, inject, replay or drop bytes (see
            ``pccl.testing.mitm.Tamper``).

    ``latency``, ``bandwidth`` and ``window`` may be reassigned at any time and affect
    existing connections (a new latency applies to bytes read from then on). Connection
    set-up is not delayed: the dialler's connect() completes at once, and its first bytes
    pay the latency. If the target cannot be reached the dialler gets a reset. Faults:
    ``blackhole()``, ``reset_all()``, ``refuse_new()``. Connection errors are logged at
    debug level and never raised to the caller.
    """

    def __init__(
        self,
        target: str | Callable[[], str] | None = None,
        *,
        listen: str = "127.0.0.1:0",
        latency: float = 0.0,
        bandwidth: float | None = None,
        window: int | None = None,
        chunk_size: int = 64 * 1024,
        classify: Callable[[bytes], float | None] | None = None,
        classify_latency: Callable[[bytes], float | None] | None = None,
        record: bool = False,
        tamper: Callable[[int, str, int, bytes], bytes] | None = None,
    ) -> None:
        if chunk_size < 1:
            raise ValueError("chunk_size must be positive")
        self.target = target
        # Given the first bytes a client sends, the bandwidth cap of that connection's
        # client->server direction (None: the emulator-wide ``bandwidth``). With
        # ``p2p_dialer_id`` this shapes each sending peer differently.
        self.classify = classify
        # The same for the connection's one-way latency, both directions, from the bytes
        # read once it decides (None: the emulator-wide ``latency``): per-pair latency,
        # e.g. peers in regions.
        self.classify_latency = classify_latency
        # A man in the middle: called with (connection id, "client->server" or
        # "server->client", offset in that direction, bytes read) for every read, it
        # returns what to forward instead (changed, longer, shorter, or b"" to drop).
        # Recording sees what it returns. ``pccl.testing.mitm.Tamper`` builds attacks.
        self.tamper = tamper
        self.listen = listen
        self.chunk_size = int(chunk_size)
        self._loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set by start()
        self._server: asyncio.Server | None = None
        self._address: str | None = None
        self._blackholed = False
        self._refusing = False
        self._stopping = False
        self._stopped: asyncio.Future[None] | None = None
        self._link_up = asyncio.Event()
        self._link_up.set()
        self._conns: set[_Connection] = set()
        self._sides: set[_Side] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._count_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._bytes_forwarded = 0
        self._accepted = 0
        # With ``record``: (connection id and direction, every byte read in it), for
        # tests that check what travels on the wire (e.g. that it is encrypted).
        self._record = bool(record)
        self._recordings: list[tuple[str, bytearray]] = []
        self._latency = 0.0
        self._bandwidth: float | None = None
        self._window: int | None = None
        # Through the setters, so constructor arguments get the same validation.
        self.latency = latency
        self.bandwidth = bandwidth
        self.window = window

    # -- live settings -------------------------------------------------------------------

    @property
    def latency(self) -> float:
        """One-way delay in seconds added in each direction."""
        return self._latency

    @latency.setter
    def latency(self, value: float) -> None:
        value = float(value)
        if not (value >= 0.0 and math.isfinite(value)):
            raise ValueError(f"latency must be a finite number >= 0, got {value!r}")
        self._latency = value
        # Already queued bytes keep their delivery time; nothing else to re-evaluate.

    @property
    def bandwidth(self) -> float | None:
        """Bytes/s per connection per direction, or None for unlimited."""
        return self._bandwidth

    @bandwidth.setter
    def bandwidth(self, value: float | None) -> None:
        if value is not None:
            value = float(value)
            if not (value > 0.0 and math.isfinite(value)):
                raise ValueError(f"bandwidth must be a finite number > 0 or None, got {value!r}")
        self._bandwidth = value
        self._poke_all()

    @property
    def window(self) -> int | None:
        """Most undelivered bytes per connection per direction, or None for unlimited."""
        return self._window

    @window.setter
    def window(self, value: int | None) -> None:
        if value is not None:
            value = int(value)
            if value < 1:
                raise ValueError(f"window must be >= 1 or None, got {value!r}")
        self._window = value
        self._poke_all()

    def _poke_all(self) -> None:
        for conn in list(self._conns):
            conn.poke()

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Bind and start accepting; returns once the listening socket is ready."""
        if self._server is not None:
            raise RuntimeError("LinkEmulator already started")
        if self._stopping:
            raise RuntimeError("LinkEmulator was stopped; create a new one")
        self._loop = asyncio.get_running_loop()
        host, port = _split_hostport(self.listen)
        self._server = await self._loop.create_server(
            lambda: _Side(self, accepted=True), host, port)
        sockname = self._server.sockets[0].getsockname()
        bound_host = sockname[0] if ":" not in sockname[0] else f"[{sockname[0]}]"
        self._address = f"{bound_host}:{sockname[1]}"
        logger.debug("link emulator listening on %s", self._address)

    @property
    def address(self) -> str:
        """The ``"host:port"`` actually bound (valid after ``start()``)."""
        if self._address is None:
            raise RuntimeError("LinkEmulator not started")
        return self._address

    async def stop(self) -> None:
        """Close the listener and every connection, and cancel every task; idempotent."""
        if self._stopped is not None:
            await asyncio.shield(self._stopped)
            return
        self._stopping = True
        self._stopped = asyncio.get_running_loop().create_future()
        try:
            if self._server is not None:
                # Stop accepting first, and let connections accepted already get their
                # transports: CPython 3.11 drops (and leaks) the socket of an accept whose
                # transport is made after Server.close(). They are refused below.
                for sock in self._server.sockets:
                    self._loop.remove_reader(sock.fileno())
                for _ in range(2):
                    await asyncio.sleep(0)  # (one loop pass makes the pending transports)
                self._server.close()
            for conn in list(self._conns):
                conn.abort(rst=False)
            for side in list(self._sides):  # refused or half-dialled sockets
                side.abort(rst=False)
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # abort() closes the socket on the next loop iteration; wait until it has.
            await asyncio.gather(*(side.lost_future for side in list(self._sides)))
            await asyncio.gather(*(conn.done for conn in list(self._conns)))
            if self._server is not None:
                await self._server.wait_closed()
        finally:
            self._stopped.set_result(None)
        logger.debug("link emulator %s stopped", self._address)

    async def __aenter__(self) -> LinkEmulator:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- faults --------------------------------------------------------------------------

    def blackhole(self, enabled: bool = True) -> None:
        """Silently stall the link (both directions) or heal it.

        Sockets stay open and nothing is read, so senders fill their buffers and block,
        as on a dead route. Bytes already inside the emulator are delivered after the
        link heals. New connections are accepted but only dialled through once healed::

            link.blackhole()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader.read(1), 0.2)
            link.blackhole(False)
        """
        self._blackholed = bool(enabled)
        if self._blackholed:
            self._link_up.clear()
        else:
            self._link_up.set()
        self._poke_all()

    async def reset_all(self) -> None:
        """Abort every current connection with a TCP RST to both peers.

        Returns once all their sockets are closed::

            await link.reset_all()   # the client's next read raises ConnectionResetError
        """
        conns = list(self._conns)
        for conn in conns:
            conn.abort(rst=True)
        await asyncio.gather(*(conn.done for conn in conns))

    def refuse_new(self, enabled: bool = True) -> None:
        """While enabled, reset each newly accepted connection at once (existing ones live on).

        The dialler's connect() succeeds (the kernel completes the handshake) but its
        first read or write fails::

            link.refuse_new()
            reader, writer = await asyncio.open_connection(host, port)
            assert await reader.read(1) == b""   # or ConnectionResetError
        """
        self._refusing = bool(enabled)

    # -- observation ---------------------------------------------------------------------

    @property
    def connection_count(self) -> int:
        """Number of proxied connections currently open (accepted and not yet fully closed)."""
        return len(self._conns)

    @property
    def connections_accepted(self) -> int:
        """Number of connections accepted so far (open or closed)."""
        return self._accepted

    def recorded(self) -> dict[str, bytes]:
        """With ``record=True``: every byte read so far, by ``"<connection id>
        client->server"`` / ``"... server->client"``, all connections (closed ones too)."""
        if not self._record:
            raise RuntimeError("LinkEmulator(record=True) is needed for recorded()")
        return {name: bytes(data) for name, data in self._recordings}

    @property
    def bytes_forwarded(self) -> int:
        """Payload bytes delivered so far, both directions, all connections."""
        return self._bytes_forwarded

    async def wait_for_connections(self, count: int) -> None:
        """Wait until ``connection_count == count`` (e.g. until a peer has reconnected).

        ::

            await asyncio.wait_for(link.wait_for_connections(0), 5)
        """
        if len(self._conns) == count:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (count, future)
        self._count_waiters.append(entry)
        try:
            await future
        finally:
            if entry in self._count_waiters:
                self._count_waiters.remove(entry)

    # -- internals -----------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = self._loop.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _resolve_target(self) -> str:
        target = self.target
        if callable(target):
            target = target()
        if not isinstance(target, str):
            raise ValueError(f"no usable target: {target!r}")
        return target

    def _on_accepted(self, side: _Side) -> None:
        if self._stopping or self._refusing:
            logger.debug("link emulator %s: refusing a new connection", self._address)
            side.abort(rst=True)
            return
        self._conns.add(_Connection(self, side))
        self._accepted += 1
        self._notify_count()

    def _connection_finished(self, conn: _Connection) -> None:
        self._conns.discard(conn)
        self._notify_count()

    def _notify_count(self) -> None:
        count = len(self._conns)
        for wanted, future in self._count_waiters:
            if wanted == count and not future.done():
                future.set_result(None)


def p2p_dialer_id(first_bytes: bytes) -> int | None:
    """The sending peer's id in the first frame a pccl p2p dialer sends (its hello:
    4-byte length, magic, version, then ``from`` as a big-endian u64), or None.

    Only clear-text streams (``insecure=True`` on every peer) show it: on the default
    encrypted transport the hello travels inside the encrypted stream. A clear-text
    dialer's transport hello (the frame ``PCCLCLR\\x01``) comes first and is skipped."""
    clear_hello = b"\x00\x00\x00\x08PCCLCLR\x01"
    if first_bytes.startswith(clear_hello):
        first_bytes = first_bytes[len(clear_hello):]
    if len(first_bytes) < 22 or first_bytes[4:12] != b"PCCLP2P\x01":
        return None
    return int.from_bytes(first_bytes[14:22], "big")
