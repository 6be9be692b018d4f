"""The HTTP side of the master's status (see :mod:`pccl.master.status`): aiohttp routes
for the page, ``/api/status``, ``/api/events``, ``/metrics`` and ``/healthz``. Imported by
the master only when it serves them."""

from __future__ import annotations

import asyncio
import hmac
import importlib.resources
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from pccl.master.status import KEEPALIVE, MAX_EVENT_STREAMS, MAX_EVENTS_PER_SECOND, RunMonitor
from pccl.protocol.auth import split_host_port

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _page() -> bytes:
    return importlib.resources.files("pccl.master").joinpath("status.html").read_bytes()


class StatusServer:
    """Serves a :class:`RunMonitor` on ``listen`` ("host:port"); owned by the master."""

    def __init__(self, monitor: RunMonitor, listen: str, token: str | None) -> None:
        self.monitor = monitor
        self.listen = listen
        self.token = token
        self._runner: web.AppRunner | None = None
        self._streams: set[asyncio.Task[Any]] = set()
        self._closing = asyncio.Event()
        self.address = ""

    async def start(self) -> None:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/", self._index)
        app.router.add_get("/api/status", self._status)
        app.router.add_get("/api/events", self._events)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     shutdown_timeout=1.0)
        await self._runner.setup()
        host, port = split_host_port(self.listen)
        site = web.TCPSite(self._runner, host, port, backlog=128)
        try:
            await site.start()
        except OSError as e:
            await self._runner.cleanup()
            self._runner = None
            raise OSError(e.errno, f"the master's status server cannot listen on "
                                   f"{self.listen!r}: {e.strerror} (give another "
                                   f"--status HOST:PORT, port 0 for a free one, or --status "
                                   f"off)") from None
        sock = site._server.sockets[0].getsockname()  # type: ignore[union-attr]
        shown = sock[0]
        self.address = f"[{shown}]:{sock[1]}" if ":" in shown else f"{shown}:{sock[1]}"
        log.info("status page on http://%s/", self.address)

    async def stop(self) -> None:
        self._closing.set()
        for task in list(self._streams):
            task.cancel()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "HEAD"])
        if self.token and request.path != "/healthz":
            given = request.query.get("token", "")
            auth = request.headers.get("Authorization", "")
            if auth.startswith("Bearer "):
                given = auth[len("Bearer "):]
            if not hmac.compare_digest(given.encode(), self.token.encode()):
                raise web.HTTPUnauthorized(
                    text="this status server needs its token: 'Authorization: Bearer TOKEN' "
                         "or ?token=TOKEN\n",
                    headers={"WWW-Authenticate": 'Bearer realm="pccl"'})
        response = await handler(request)
        response.headers.setdefault("Cache-Control", "no-store")
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        return response

    async def _index(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=_page(), content_type="text/html", charset="utf-8",
                            headers={"Content-Security-Policy": "default-src 'self'; "
                                     "style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
                                     "frame-ancestors 'none'"})

    async def _status(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self.monitor.snapshot())

    async def _healthz(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text="ok\n")

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        body = generate_latest(self.monitor.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _events(self, request: web.Request) -> web.StreamResponse:
        """The status document again whenever something changed (at most
        MAX_EVENTS_PER_SECOND a second, at least every KEEPALIVE seconds)."""
        if len(self._streams) >= MAX_EVENT_STREAMS:
            raise web.HTTPServiceUnavailable(text="too many open event streams\n")
        task = asyncio.current_task()
        assert task is not None
        self._streams.add(task)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-store"})
        changed = self.monitor.changed
        try:
            await response.prepare(request)
            while not self._closing.is_set():
                changed.clear()
                data = json.dumps(self.monitor.snapshot(), separators=(",", ":"))
                await response.write(f"event: status\ndata: {data}\n\n".encode())
                # A deadline on the wait (keepalive), then a floor between snapshots.
                try:
                    async with asyncio.timeout(KEEPALIVE):
                        await changed.wait()
                except TimeoutError:
                    pass
                await asyncio.sleep(1.0 / MAX_EVENTS_PER_SECOND)  # rate limit, not sync
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._streams.discard(task)
        return response
