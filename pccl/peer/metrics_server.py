"""A peer's ``/metrics`` and ``/healthz`` over HTTP (aiohttp), for
``Communicator(metrics_listen=...)``; imported only then (aiohttp takes a while to
import)."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from pccl.peer.metrics import PeerMetrics
from pccl.protocol.auth import split_host_port

log = logging.getLogger(__name__)


class MetricsServer:
    """``/metrics`` (and ``/healthz``) of one peer on ``listen``; owned by its
    communicator (started by ``connect()``, stopped by ``close()``)."""

    def __init__(self, metrics: PeerMetrics, listen: str) -> None:
        self.metrics = metrics
        self.listen = listen
        self.address = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     shutdown_timeout=1.0)
        await self._runner.setup()
        host, port = split_host_port(self.listen)
        site = web.TCPSite(self._runner, host, port)
        try:
            await site.start()
        except OSError as e:
            await self.stop()
            raise OSError(e.errno, f"the peer's metrics server cannot listen on "
                                   f"{self.listen!r}: {e.strerror}") from None
        server: Any = site._server
        sock = server.sockets[0].getsockname()
        self.address = f"[{sock[0]}]:{sock[1]}" if ":" in sock[0] else f"{sock[0]}:{sock[1]}"
        log.info("peer metrics on http://%s/metrics", self.address)

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text="ok\n")
