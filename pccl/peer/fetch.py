"""The shared-state fetch engine of a peer: brings the tensors a sync plan names from
their holders, verified against their content hashes as the bytes land.

The engine runs in Rust (``rust/net/fetch.rs``), behind one call,
:meth:`pccl._core.P2PNode.start_fetch`: large tensors travel in ranges spread over the
holders (a range whose holder fails goes on from the next one, after the hash leaves
already landed); small ones in pipelined batches over one stream per holder; a tensor
whose bytes do not match its hash is fetched whole from each holder in turn; at most
:data:`MAX_FETCHES_IN_FLIGHT` streams at once. Nothing here talks to the master or
decides anything about the sync: :class:`pccl.communicator.Communicator` hands it the
master's plan and reports the outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from pccl import _core
from pccl.protocol import messages as m
from pccl.shared_state import SyncProgress
from pccl.tensors import RawTensor, byte_buffer

log = logging.getLogger("pccl.communicator")

#: Fetches (streams) one sync keeps in flight at once.
MAX_FETCHES_IN_FLIGHT: int = _core.MAX_FETCHES_IN_FLIGHT
#: Tensors of at least twice this size are fetched in ranges over several streams at
#: once (passed to the engine on every sync, so tests may lower it).
RANGE_BYTES: int = _core.FETCH_RANGE_BYTES


class Fetcher:
    """Fetches one sync's plan through ``node`` (a :class:`pccl._core.P2PNode`). ``op`` is
    the running fetch (None before it starts): :class:`SyncReporter` reads its progress."""

    def __init__(self, node: Any, peer_id: int | None, pool: int, peer_timeout: float,
                 master: str = "") -> None:
        self.node, self.peer_id, self.pool, self.peer_timeout = node, peer_id, pool, peer_timeout
        self.master = master  # the relay's address
        self.op: Any = None

    async def fetch_planned(self, plan: m.SyncPlan, by_key: dict[str, RawTensor],
                             in_place: bool, fetched: dict[str, Any]) -> list[BaseException]:
        """Fetches what ``plan`` says into scratch buffers (or, ``in_place``, the tensors).
        What verifies goes into ``fetched``; returns the failures. Every transfer has
        ended by then, cancelled or not: nothing writes into the buffers afterwards."""
        keys = list(plan.fetch_keys)
        outs = [by_key[k].data if in_place else byte_buffer(by_key[k].nbytes) for k in keys]
        for sid, token in zip(plan.source_ids, plan.source_relays):
            # A holder behind NAT: its transfer streams go through the master's relay.
            await self.node.set_transfer_relay(sid, self.master if token else "", token)
        try:
            op = self.node.start_fetch(
                [(k, out, bytes(want), list(sources))
                 for k, out, want, sources in zip(keys, outs, plan.fetch_hashes,
                                                  plan.fetch_sources)],
                dict(zip(plan.source_ids, plan.source_addrs)),
                streams=self.pool, io_timeout=self.peer_timeout, range_bytes=RANGE_BYTES)
        except _core.PCCLError as e:  # e.g. tensors sharing memory: a failed fetch
            return [e]
        self.op = op
        run = op.run()
        try:
            # Shielded: a cancelled caller stops the transfers through abort() and waits
            # for them to end instead of leaving them writing into released buffers.
            results = await asyncio.shield(run)
        except asyncio.CancelledError:
            op.abort()
            with contextlib.suppress(Exception):
                await run
            raise
        for key, out, r in zip(keys, outs, results):
            if r is None:
                fetched[key] = out
        return [r for r in results if r is not None]


def prefault_all(buffers: list[Any]) -> None:
    """Best effort: an optimization must never fail a sync."""
    for b in buffers:
        try:
            _core.prefault(b)
        except Exception as e:  # noqa: BLE001 (nothing to recover; the commit faults pages in)
            log.debug("prefault skipped: %s", e)


class SyncReporter:
    """Reports a running sync's progress to a callback and, for long transfers, to the
    log; an owned task from the master's plan until the outcome (``async with``).
    ``fetcher`` runs the fetch (its ``op`` gives the bytes landed), ``fetched`` holds the
    tensors that verified."""

    LOG_EVERY = 10.0

    def __init__(self, node_of: Callable[[], Any], peer_id: int | None,
                 callback: Callable[[SyncProgress], object] | None, interval: float,
                 served_before: int, fetcher: Fetcher, fetched: dict[str, Any],
                 sizes: list[int]) -> None:
        self._node_of, self._peer_id, self._callback = node_of, peer_id, callback
        self._interval = max(float(interval), 0.01)
        self._served_before = served_before
        self._fetcher, self._fetched = fetcher, fetched
        self._rx_total, self._tensors = sum(sizes), len(sizes)
        self._started = time.perf_counter()
        self._task: asyncio.Task[None] | None = None

    def snapshot(self, final: bool = False) -> SyncProgress:
        node = self._node_of()
        tx = int(node.bytes_served() - self._served_before) if node is not None else 0
        op = self._fetcher.op
        return SyncProgress(
            rx_bytes=op.rx_bytes if op is not None else 0,
            rx_total=self._rx_total, tx_bytes=tx,
            tensors_done=max(len(self._fetched), op.tensors_done if op is not None else 0),
            tensors_total=self._tensors, seconds=time.perf_counter() - self._started,
            final=final)

    def _emit(self, final: bool = False) -> SyncProgress:
        p = self.snapshot(final)
        if self._callback is not None:
            try:
                self._callback(p)
            except Exception:
                log.exception("peer %s: the sync progress callback failed; not calling it "
                              "again", self._peer_id)
                self._callback = None
        return p

    async def _run(self) -> None:
        logged = 0.0
        while True:
            await asyncio.sleep(self._interval)
            p = self._emit()
            if p.rx_total and p.seconds - logged >= self.LOG_EVERY:
                logged = p.seconds
                log.info("peer %s: shared-state sync: %.1f of %.1f MiB fetched, %d/%d "
                         "tensors, %.1fs (%.2f GB/s)", self._peer_id,
                         p.rx_bytes / 2**20, p.rx_total / 2**20, p.tensors_done,
                         p.tensors_total, p.seconds, p.rx_bytes / max(p.seconds, 1e-9) / 1e9)

    async def __aenter__(self) -> SyncReporter:
        self._emit()
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._emit(final=True)
