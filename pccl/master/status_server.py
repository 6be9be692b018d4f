"""The HTTP side of the master's status (see :mod:`pccl.master.status`): aiohttp routes
for the page, ``/api/status``, ``/api/events``, ``/metrics`` and ``/healthz``. Imported by
the master only when it serves them."""

from __future__ import annotations

import asyncio
import hmac
import importlib.resources
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from pccl.master.status import KEEPALIVE, MAX_EVENT_STREAMS, MAX_EVENTS_PER_SECOND, RunMonitor
from pccl.peer.metrics_server import MetricsServer

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _page() -> bytes:
    return importlib.resources.files("pccl.master").joinpath("status.html").read_bytes()


class StatusServer(MetricsServer):
    """Serves a :class:`RunMonitor` on ``listen`` ("host:port"): the page, the JSON API
    and its event stream, besides the ``/metrics`` and ``/healthz`` of every metrics
    server; owned by the master."""

    what = "the master's status server"
    home = "/"

    def __init__(self, monitor: RunMonitor, listen: str, token: str | None) -> None:
        super().__init__(monitor.registry, listen)
        self.monitor = monitor
        self.token = token
        self._streams: set[asyncio.Task[Any]] = set()
        self._closing = asyncio.Event()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/", self._index)
        app.router.add_get("/api/status", self._status)
        app.router.add_get("/api/events", self._events)
        super().add_routes(app)

    def middlewares(self) -> list[Any]:
        return [self._auth]

    def bind_hint(self) -> str:
        return " (give another --status HOST:PORT, port 0 for a free one, or --status off)"

    async def stop(self) -> None:
        self._closing.set()
        for task in list(self._streams):
            task.cancel()
        await super().stop()

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
