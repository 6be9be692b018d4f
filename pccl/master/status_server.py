"""The HTTP side of the master's status (see :mod:`pccl.master.status`): aiohttp routes
for the page, ``/api/status``, ``/api/events``, ``/metrics`` and ``/healthz``. Imported by
the master only when it serves them."""

from __future__ import annotations

import asyncio
import importlib.resources
from typing import Any

from aiohttp import web

from pccl.master.status import (
    KEEPALIVE,
    MAX_EVENT_STREAMS,
    MAX_EVENTS_PER_SECOND,
    RunMonitor,
    to_json,
)
from pccl.observe.server import MetricsServer


def _page() -> bytes:
    return importlib.resources.files("pccl.master").joinpath("status.html").read_bytes()


class StatusServer(MetricsServer):
    """Serves a :class:`RunMonitor` on ``listen`` ("host:port"): the page, the JSON API
    and its event stream, besides the ``/metrics`` and ``/healthz`` of every metrics
    server; owned by the master."""

    what = "the master's status server"
    home = "/"
    # A browser keeps a few connections and an event stream open; Prometheus one.
    max_connections = 128
    max_connections_per_ip = 16
    #: Seconds one /api/events stream lasts (then it ends; EventSource reconnects).
    stream_seconds = 600.0
    #: Seconds one event may take to be written (a client that does not read is cut).
    write_timeout = 10.0

    def __init__(self, monitor: RunMonitor, listen: str, token: str | None) -> None:
        super().__init__(monitor.registry, listen, token)
        self.monitor = monitor
        self._streams: set[asyncio.Task[Any]] = set()
        self._closing = asyncio.Event()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/", self._index)
        app.router.add_get("/api/status", self._status)
        app.router.add_get("/api/events", self._events)
        super().add_routes(app)

    def bind_hint(self) -> str:
        return " (give another --status HOST:PORT, port 0 for a free one, or --status off)"

    async def stop(self) -> None:
        self._closing.set()
        for task in list(self._streams):
            task.cancel()
        await super().stop()

    async def _index(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=_page(), content_type="text/html", charset="utf-8",
                            headers={"Content-Security-Policy": "default-src 'self'; "
                                     "style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
                                     "frame-ancestors 'none'"})

    async def _status(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text=to_json(self.monitor.snapshot()),
                            content_type="application/json")

    async def _events(self, request: web.Request) -> web.StreamResponse:
        """The status document again whenever something changed (at most
        MAX_EVENTS_PER_SECOND a second, at least every KEEPALIVE seconds), for at most
        ``stream_seconds`` (the browser's EventSource connects again); a write the client
        does not take within ``write_timeout`` ends the stream and its connection."""
        if len(self._streams) >= MAX_EVENT_STREAMS:
            raise web.HTTPServiceUnavailable(text="too many open event streams\n")
        task = asyncio.current_task()
        assert task is not None
        self._streams.add(task)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-store"})
        changed = self.monitor.changed
        loop = asyncio.get_running_loop()
        end = loop.time() + self.stream_seconds
        try:
            await response.prepare(request)
            while not self._closing.is_set() and loop.time() < end:
                changed.clear()
                data = to_json(self.monitor.snapshot())
                try:
                    async with asyncio.timeout(self.write_timeout):
                        await response.write(f"event: status\ndata: {data}\n\n".encode())
                except TimeoutError:
                    if request.transport is not None:
                        request.transport.abort()  # a client that does not read
                    break
                # A deadline on the wait (keepalive), then a floor between snapshots.
                try:
                    async with asyncio.timeout(min(KEEPALIVE, max(end - loop.time(), 0.0))):
                        await changed.wait()
                except TimeoutError:
                    pass
                await asyncio.sleep(1.0 / MAX_EVENTS_PER_SECOND)  # rate limit, not sync
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._streams.discard(task)
        return response
