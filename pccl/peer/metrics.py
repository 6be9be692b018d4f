"""One peer's own counters: what its heartbeat answers tell the master (so the master's
status page shows each peer's traffic and sync progress) and, when
``Communicator(metrics_listen="host:port")`` asks for it, a Prometheus ``/metrics``
endpoint of the peer itself (behind ``metrics_token`` off loopback; served by
:mod:`pccl.observe.server`): bytes per ring link, collectives by outcome, time spent in
collectives, syncs, and the retries of the recovery policy (:mod:`pccl.recovery`).

Everything is updated on the event loop by the communicator; nothing here takes a lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pccl.observe.collector import ScrapeTimeCollector

_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class PeerMetrics:
    """Counters of one :class:`pccl.Communicator` (``comm.metrics``)."""

    def __init__(self) -> None:
        self.tx_bytes = 0  # p2p bytes sent: ring links and shared-state transfers served
        self.rx_bytes = 0  # p2p bytes received: ring links and shared-state fetches
        # Ring-link bytes by the peer at the other end: sent to the next peer, received
        # from the previous one (each all-reduce's ReduceInfo, attributed to its ring).
        self.link_tx: dict[int, int] = {}
        self.link_rx: dict[int, int] = {}
        # The running sync's progress, read at each heartbeat (None: no sync running).
        self.sync_progress: Callable[[], tuple[int, int]] | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        self.collectives = Counter("pccl_peer_collectives", "This peer's collectives, by "
                                   "outcome", ["outcome"], registry=self.registry)
        self.collective_seconds = Histogram(
            "pccl_peer_collective_seconds", "Time this peer spent in each collective "
            "(call to result)", buckets=_SECONDS_BUCKETS, registry=self.registry)
        self.syncs = Counter("pccl_peer_syncs", "This peer's shared-state syncs, by "
                             "outcome", ["outcome"], registry=self.registry)
        self.sync_seconds = Histogram("pccl_peer_sync_seconds", "Time this peer spent in "
                                      "each shared-state sync", buckets=_SECONDS_BUCKETS,
                                      registry=self.registry)
        self.retries = Counter("pccl_peer_retries", "Recoveries the retry policy "
                               "(pccl.recovery) took, by action", ["action"],
                               registry=self.registry)
        self.registry.register(ScrapeTimeCollector(_Traffic(self).collect))
        for outcome in ("ok", "failed"):
            self.collectives.labels(outcome)
            self.syncs.labels(outcome)
        for action in ("retry", "update_topology"):
            self.retries.labels(action)

    def heartbeat(self) -> tuple[int, int, int, int]:
        """(tx bytes, rx bytes, the running sync's fetched bytes, its total bytes)."""
        return (self.tx_bytes, self.rx_bytes, *self.sync_fetched())

    def sync_fetched(self) -> tuple[int, int]:
        """The running sync's (fetched, total) bytes; (0, 0) when none runs. Never
        raises: a heartbeat answer must not fail over a statistic (a sync whose node
        just closed, say)."""
        if self.sync_progress is None:
            return 0, 0
        try:
            return self.sync_progress()
        except Exception:
            return 0, 0

    def ring_traffic(self, ring: list[int], me: int | None, tx: int, rx: int) -> None:
        self.tx_bytes += tx
        self.rx_bytes += rx
        if me in ring and len(ring) > 1:
            i = ring.index(me)
            nxt, prv = ring[(i + 1) % len(ring)], ring[i - 1]
            self.link_tx[nxt] = self.link_tx.get(nxt, 0) + tx
            self.link_rx[prv] = self.link_rx.get(prv, 0) + rx


class _Traffic:
    """The byte counters, at scrape time."""

    def __init__(self, metrics: PeerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        mt = self.metrics
        tx = CounterMetricFamily("pccl_peer_p2p_tx_bytes", "p2p bytes this peer sent")
        tx.add_metric([], mt.tx_bytes)
        rx = CounterMetricFamily("pccl_peer_p2p_rx_bytes", "p2p bytes this peer received")
        rx.add_metric([], mt.rx_bytes)
        link_tx = CounterMetricFamily("pccl_peer_link_tx_bytes", "Ring-link bytes sent, by "
                                      "receiving peer", labels=["to"])
        for peer, n in sorted(mt.link_tx.items()):
            link_tx.add_metric([str(peer)], n)
        link_rx = CounterMetricFamily("pccl_peer_link_rx_bytes", "Ring-link bytes received, "
                                      "by sending peer", labels=["from"])
        for peer, n in sorted(mt.link_rx.items()):
            link_rx.add_metric([str(peer)], n)
        fetched, total = mt.sync_fetched()
        progress = GaugeMetricFamily("pccl_peer_sync_rx_bytes", "The running sync's fetched "
                                     "and total bytes", labels=["of"])
        progress.add_metric(["fetched"], fetched)
        progress.add_metric(["total"], total)
        yield from (tx, rx, link_tx, link_rx, progress)
