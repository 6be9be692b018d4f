"""``/metrics`` (a Prometheus registry) and ``/healthz`` over HTTP with aiohttp: a peer's,
for ``Communicator(metrics_listen=...)``, and the base of the master's status server
(:class:`pccl.master.status_server.StatusServer` adds its routes). Imported only by a
process that serves them (aiohttp takes a while to import).

Whoever can reach the port is a stranger, so everything a client can make the server hold
has a budget and a deadline (the class attributes of :class:`MetricsServer`, read when a
connection arrives):

- connections: at most ``max_connections`` open at once and ``max_connections_per_ip``
  from one address; a connection over either budget is answered ``503`` and closed at
  once, before anything of it is read (the connections already open keep going);
- a request head (request line and headers) must arrive whole within ``head_timeout``
  seconds of its first byte (of the connection's start, for the first request), however
  slowly it trickles in;
- a connection idle between requests is closed after ``keepalive_timeout`` seconds; so is
  one whose response the client does not read;
- a head is at most aiohttp's line and header limits (8190 bytes a line, 128 headers).

A token guards every route but ``/healthz`` when the server has one; a listen address
other machines can reach needs one (:func:`pccl.peer.options.check_metrics_listen`,
``pccl.master.status.check_listen``). Programs (Prometheus, curl) send it as
``Authorization: Bearer TOKEN``. A browser cannot, so it opens ``/?token=TOKEN`` once:
the server answers ``303 See Other`` to the same URL without the token, setting a cookie
(HttpOnly, SameSite=Strict, for this port: :meth:`MetricsServer.cookie_name`) that
stands for the token from then on, so the token leaves the address bar, and with it the
browser's next requests, referrers and access logs. The cookie holds a digest of the
token, not the token. A token in the URL is never answered with anything but that
redirect (or 401 when it is wrong). Every comparison is in constant time.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from pccl.protocol.auth import join_host_port, split_host_port

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_BUSY_TEXT = b"too many connections; try again later\n"
#: What a connection over budget gets before it is closed (written in one piece: it fits
#: any socket buffer, so nothing of it is left to flush).
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
         b"Content-Length: %d\r\nConnection: close\r\nRetry-After: 5\r\n\r\n%s"
         % (len(_BUSY_TEXT), _BUSY_TEXT))
#: Seconds between two log lines about refused connections (a flood logs once a while).
_REFUSAL_LOG_EVERY = 60.0


class _Connection(asyncio.Protocol):
    """One accepted connection, in front of aiohttp's protocol: admitted within the
    server's budgets (or refused at once), and held to a deadline whenever no request of
    it is being handled: its head must be whole within ``head_timeout`` of its first
    byte, and an idle connection goes after ``keepalive_timeout``."""

    def __init__(self, server: MetricsServer) -> None:
        self.server = server
        self.inner: asyncio.Protocol | None = None  # aiohttp's, once admitted
        self.transport: asyncio.Transport | None = None
        self.ip = ""
        self.busy = 0  # requests of this connection inside the application now
        self.head_started = False  # bytes of a next head arrived while idle
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # --- asyncio's side -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.ip = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "?"
        if not self.server._admit(self):
            transport.write(_BUSY)
            transport.close()
            return
        runner = self.server._runner
        assert runner is not None and runner.server is not None
        self.inner = runner.server()
        self.inner.connection_made(transport)
        self._arm(self.server.head_timeout)

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        if not self.busy and not self.head_started:
            # A head begins: it has head_timeout to be whole (or less, the idle deadline).
            self.head_started = True
            loop = asyncio.get_running_loop()
            self._arm(min(self._deadline - loop.time(), self.server.head_timeout))
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.inner is not None:
            self.server._release(self)
            inner, self.inner = self.inner, None
            inner.connection_lost(exc)

    # --- the application's side (MetricsServer._track) ----------------------------------

    def request_started(self) -> None:
        self.busy += 1
        self.head_started = False
        self._disarm()

    def request_done(self) -> None:
        self.busy -= 1
        if not self.busy and self.inner is not None:
            # (also bounds the writing of the response: a client that does not read it
            # is cut at this deadline)
            self._arm(self.server.keepalive_timeout)

    # --- the deadline -------------------------------------------------------------------

    def _arm(self, seconds: float) -> None:
        self._disarm()
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + max(seconds, 0.0)
        self._timer = loop.call_at(self._deadline, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self.transport is not None and not self.busy:
            log.debug("%s: closing a connection from %s (%s)", self.server.what, self.ip,
                      "request head too slow" if self.head_started else "idle")
            self.transport.abort()  # not close(): nothing waits for a client's reading


class _Site(web.BaseSite):
    """aiohttp's TCP site with each connection behind a :class:`_Connection`."""

    def __init__(self, runner: web.BaseRunner, server: MetricsServer, host: str,
                 port: int) -> None:
        super().__init__(runner)
        self._metrics_server = server
        self._host = host
        self._port = port
        self.listening: asyncio.Server | None = None

    @property
    def name(self) -> str:
        return f"http://{join_host_port(self._host, self._port)}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self.listening = self._server = await loop.create_server(
            lambda: _Connection(self._metrics_server), self._host or None, self._port,
            backlog=128)


class _WithoutCreated:
    """The metrics of ``registry`` without prometheus_client's ``*_created`` samples
    (a gauge per counter and histogram holding its creation time: as many series again,
    which nothing reads and which read as counts)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


def _without_created(registry: CollectorRegistry) -> CollectorRegistry:
    exposed = CollectorRegistry(auto_describe=False)
    exposed.register(_WithoutCreated(registry))
    return exposed


class MetricsServer:
    """``registry`` at ``/metrics`` and ``ok`` at ``/healthz`` on ``listen``; owned by
    whoever starts it (a peer's communicator: ``connect()`` / ``close()``). Subclasses
    add routes and middlewares. ``token``: what every route but ``/healthz`` asks for
    (None: nothing)."""

    #: Names the server in a bind failure and in the log.
    what = "the peer's metrics server"
    #: The log line's path.
    home = "/metrics"
    #: Seconds a request head may take from its first byte (the first request's: from
    #: the connection's start).
    head_timeout = 10.0
    #: Seconds a connection may stay idle between requests.
    keepalive_timeout = 15.0
    #: Connections open at once, in all and from one IP address; a newcomer over either
    #: is answered 503 and closed.
    max_connections = 32
    max_connections_per_ip = 8

    def __init__(self, registry: CollectorRegistry, listen: str,
                 token: str | None = None) -> None:
        self.registry = registry
        self._exposed = _without_created(registry)
        self.listen = listen
        self.token = token
        self.address = ""  # "host:port" actually bound, once started
        self._runner: web.AppRunner | None = None
        self._conns: dict[asyncio.BaseTransport, _Connection] = {}
        self._per_ip: collections.Counter[str] = collections.Counter()
        self.refused = 0  # connections refused over budget so far
        self._refusal_logged = -_REFUSAL_LOG_EVERY

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)

    def middlewares(self) -> list[Any]:
        """The application's middlewares, outermost first (subclasses append theirs)."""
        return [self._track, self._auth]

    def bind_hint(self) -> str:
        """Added to the message of a bind failure (what to do instead)."""
        return ""

    @property
    def connections(self) -> int:
        """Connections admitted and open now."""
        return len(self._conns)

    async def start(self) -> None:
        app = web.Application(middlewares=self.middlewares())
        self.add_routes(app)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     shutdown_timeout=1.0,
                                     keepalive_timeout=self.keepalive_timeout)
        await self._runner.setup()
        host, port = split_host_port(self.listen)
        site = _Site(self._runner, self, host, port)
        try:
            await site.start()
        except OSError as e:
            await self.stop()
            raise OSError(e.errno, f"{self.what} cannot listen on {self.listen!r}: "
                                   f"{e.strerror}{self.bind_hint()}") from None
        assert site.listening is not None
        self.address = join_host_port(*site.listening.sockets[0].getsockname()[:2])
        log.info("%s on http://%s%s", self.what.removeprefix("the "), self.address, self.home)

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # --- the budgets ----------------------------------------------------------------------

    def _admit(self, conn: _Connection) -> bool:
        if len(self._conns) >= self.max_connections \
                or self._per_ip[conn.ip] >= self.max_connections_per_ip \
                or self._runner is None:
            self.refused += 1
            now = time.monotonic()
            if now - self._refusal_logged >= _REFUSAL_LOG_EVERY:
                self._refusal_logged = now
                log.warning("%s: refusing connections over its budget (%d open, %d from "
                            "%s; %d refused so far)", self.what, len(self._conns),
                            self._per_ip[conn.ip], conn.ip, self.refused)
            return False
        assert conn.transport is not None
        self._conns[conn.transport] = conn
        self._per_ip[conn.ip] += 1
        return True

    def _release(self, conn: _Connection) -> None:
        if conn.transport is not None and self._conns.pop(conn.transport, None) is not None:
            self._per_ip[conn.ip] -= 1
            if self._per_ip[conn.ip] <= 0:
                del self._per_ip[conn.ip]

    @web.middleware
    async def _track(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Tells the connection a request of it is inside (no head deadline meanwhile)."""
        conn = self._conns.get(request.transport) if request.transport is not None else None
        if conn is not None:
            conn.request_started()
        try:
            return await handler(request)
        finally:
            if conn is not None:
                conn.request_done()

    # --- the routes -----------------------------------------------------------------------

    @property
    def cookie_name(self) -> str:
        """The cookie a browser holds for this server: one per port (a browser sends a
        host's cookies to every port of it, and two servers on one host may have
        different tokens)."""
        return f"pccl-token-{split_host_port(self.address or self.listen)[1]}"

    def _cookie_value(self) -> str:
        """What the cookie holds: a digest of the token (a stolen cookie opens this
        server until its token changes, but does not tell the token)."""
        assert self.token
        return hmac.new(self.token.encode(), b"pccl status cookie", hashlib.sha256).hexdigest()

    def _unauthorized(self) -> web.HTTPUnauthorized:
        return web.HTTPUnauthorized(
            text=f"{self.what} needs its token: 'Authorization: Bearer TOKEN', or in a "
                 f"browser open /?token=TOKEN once\n",
            headers={"WWW-Authenticate": 'Bearer realm="pccl"', "Cache-Control": "no-store"})

    def _authorized(self, request: web.Request) -> bool:
        """Whether ``request`` carries the token (header) or the cookie that stands for
        it; every comparison in constant time."""
        assert self.token
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            return hmac.compare_digest(auth[len("Bearer "):].encode(), self.token.encode())
        cookie = request.cookies.get(self.cookie_name)
        return cookie is not None and hmac.compare_digest(cookie.encode(),
                                                          self._cookie_value().encode())

    def _exchange(self, request: web.Request, given: str) -> web.HTTPSeeOther:
        """A browser's ``?token=TOKEN``: the same URL without it, and the cookie."""
        assert self.token
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            raise self._unauthorized()
        url = request.rel_url
        redirect = web.HTTPSeeOther(
            str(url.with_query([(k, v) for k, v in url.query.items() if k != "token"])),
            headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"})
        # Secure only where this server can tell the browser reached it over https (a
        # plain-http server's cookie with Secure would never come back).
        redirect.set_cookie(self.cookie_name, self._cookie_value(), path="/", httponly=True,
                            samesite="Strict", secure=request.secure)
        return redirect

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "HEAD"])
        if self.token and request.path != "/healthz":
            if "token" in request.query:
                raise self._exchange(request, request.query["token"])
            if not self._authorized(request):
                raise self._unauthorized()
        response = await handler(request)
        response.headers.setdefault("Cache-Control", "no-store")
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        return response

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=generate_latest(self._exposed),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text="ok\n")
