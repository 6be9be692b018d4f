"""``/metrics`` (a Prometheus registry) and ``/healthz`` over HTTP with aiohttp: a peer's,
for ``Communicator(metrics_listen=...)``, and the base of the master's status server
(:class:`pccl.master.status_server.StatusServer` adds its routes). Imported only by a
process that serves them (aiohttp takes a while to import)."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from pccl.protocol.auth import join_host_port, split_host_port

log = logging.getLogger(__name__)


class MetricsServer:
    """``registry`` at ``/metrics`` and ``ok`` at ``/healthz`` on ``listen``; owned by
    whoever starts it (a peer's communicator: ``connect()`` / ``close()``). Subclasses
    add routes and middlewares."""

    #: Names the server in a bind failure and in the log.
    what = "the peer's metrics server"
    #: The log line's path.
    home = "/metrics"

    def __init__(self, registry: CollectorRegistry, listen: str) -> None:
        self.registry = registry
        self.listen = listen
        self.address = ""  # "host:port" actually bound, once started
        self._runner: web.AppRunner | None = None

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)

    def middlewares(self) -> list[Any]:
        return []

    def bind_hint(self) -> str:
        """Added to the message of a bind failure (what to do instead)."""
        return ""

    async def start(self) -> None:
        app = web.Application(middlewares=self.middlewares())
        self.add_routes(app)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     shutdown_timeout=1.0)
        await self._runner.setup()
        host, port = split_host_port(self.listen)
        site = web.TCPSite(self._runner, host, port)
        try:
            await site.start()
        except OSError as e:
            await self.stop()
            raise OSError(e.errno, f"{self.what} cannot listen on {self.listen!r}: "
                                   f"{e.strerror}{self.bind_hint()}") from None
        server: Any = site._server
        self.address = join_host_port(*server.sockets[0].getsockname()[:2])
        log.info("%s on http://%s%s", self.what.removeprefix("the "), self.address, self.home)

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text="ok\n")
