"""A model of the public internet between peers: regions on three continents, home
links with heavy-tailed latency and uplinks, and per-flow TCP throughput limited by
round-trip time and loss.

Every number here is an *input* (typical public figures, stated where they come from);
none is measured on this machine, which has no internet. What the simulation measures
on real pccl code (master CPU, the data plane's per-hop cost, the stream scaling) is in
:mod:`pccl.sim.collectives` and :mod:`pccl.sim.scale`, with its source.

One-way latency between peers ``i`` and ``j``::

    lat(i, j) = backbone[region(i)][region(j)] + home(i) + home(j)

``home`` is each peer's last-mile delay (log-normal: median 2 ms, a tail of tens of
ms). Bandwidth of the directed link ``i -> j`` with a pool of ``streams`` TCP streams::

    bw(i, j) = min(up(i), down(j), streams * mathis(rtt(i, j), loss))

``mathis`` is the Mathis et al. (1997) steady-state throughput of one Reno-like flow,
``1.22 * MSS / (rtt * sqrt(loss))``: on long paths the flow, not the access link, is
the limit, which is why pccl pools streams (measured here: K streams carry 0.86-0.98 x
K one stream's rate, docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

MSS = 1448  # bytes of TCP payload per segment (Ethernet MTU, timestamps on)


@dataclasses.dataclass(frozen=True)
class Region:
    name: str
    weight: float  # share of the peers
    intra_ms: float  # one-way backbone latency between two peers of this region


#: Three continents. Shares: roughly where public GPU capacity sits. Latencies: half of
#: typical public round trips (intra-continent 20-40 ms, US-EU 80 ms, US-Asia 150 ms,
#: EU-Asia 180 ms round trip; e.g. the published inter-region figures of cloud providers).
DEFAULT_REGIONS = (
    Region("na", 0.45, 12.0),
    Region("eu", 0.35, 10.0),
    Region("asia", 0.20, 18.0),
)
DEFAULT_CROSS_MS = {("na", "eu"): 40.0, ("na", "asia"): 75.0, ("eu", "asia"): 90.0}


@dataclasses.dataclass
class NetworkModel:
    """Peers drawn from a seeded distribution; arrays indexed by peer slot."""

    regions: Sequence[Region] = DEFAULT_REGIONS
    cross_ms: dict[tuple[str, str], float] = dataclasses.field(
        default_factory=lambda: dict(DEFAULT_CROSS_MS))
    #: Where the master runs (a datacentre: no home link of its own).
    master_region: str = "na"
    #: Last mile, one way: log-normal median and sigma (ms), capped.
    home_median_ms: float = 2.0
    home_sigma: float = 1.0
    home_cap_ms: float = 150.0
    #: Uplink: log-normal median (bits/s) and sigma; downlink = ``down_ratio`` x uplink.
    up_median_bps: float = 200e6
    up_sigma: float = 1.0
    up_min_bps: float = 5e6
    up_max_bps: float = 10e9
    down_ratio: float = 4.0
    #: Packet loss on every path (for the per-flow TCP limit) and streams per link.
    loss: float = 1e-4
    streams: int = 4
    #: Every one-way latency collapses to this when set (a flat network, e.g. the
    #: emulated 5 ms hops of bench/latency.py); regions and home links are ignored.
    flat_ms: float | None = None
    flat_master_ms: float | None = None

    def __post_init__(self) -> None:
        names = [r.name for r in self.regions]
        self._index = {n: i for i, n in enumerate(names)}
        n = len(names)
        self.backbone = np.zeros((n, n))
        for i, r in enumerate(self.regions):
            self.backbone[i, i] = r.intra_ms / 1e3
        for (a, b), ms in self.cross_ms.items():
            i, j = self._index[a], self._index[b]
            self.backbone[i, j] = self.backbone[j, i] = ms / 1e3
        self.region = np.zeros(0, dtype=np.int64)
        self.home = np.zeros(0)
        self.up = np.zeros(0)
        self.down = np.zeros(0)

    # --- peers ---

    @classmethod
    def sampled(cls, n: int, seed: int, **kw: Any) -> NetworkModel:
        """A model (fields ``kw``) with ``n`` peers drawn with ``seed``."""
        net = cls(**kw)
        net.sample(n, np.random.default_rng(seed))
        return net

    def sample(self, n: int, rng: np.random.Generator) -> None:
        """Draws ``n`` more peers (slots ``len(self) .. len(self) + n - 1``)."""
        w = np.array([r.weight for r in self.regions], dtype=float)
        region = rng.choice(len(self.regions), size=n, p=w / w.sum())
        home = np.minimum(rng.lognormal(math.log(self.home_median_ms), self.home_sigma, n),
                          self.home_cap_ms) / 1e3
        up = np.clip(rng.lognormal(math.log(self.up_median_bps), self.up_sigma, n),
                     self.up_min_bps, self.up_max_bps) / 8
        self.region = np.concatenate([self.region, region])
        self.home = np.concatenate([self.home, home])
        self.up = np.concatenate([self.up, up])
        self.down = np.concatenate([self.down, up * self.down_ratio])

    def __len__(self) -> int:
        return len(self.region)

    def region_name(self, i: int) -> str:
        return self.regions[int(self.region[i])].name

    # --- links ---

    def latency(self, i: int | np.ndarray, j: int | np.ndarray) -> np.ndarray:
        """One-way latency (s) from peer(s) ``i`` to peer(s) ``j`` (broadcasting)."""
        if self.flat_ms is not None:
            return np.full(np.broadcast(np.asarray(i), np.asarray(j)).shape,
                           self.flat_ms / 1e3)
        return np.asarray(self.backbone[self.region[i], self.region[j]] + self.home[i]
                          + self.home[j])

    def master_latency(self, i: int | np.ndarray) -> np.ndarray:
        """One-way latency (s) between peer(s) ``i`` and the master."""
        if self.flat_master_ms is not None:
            return np.full(np.shape(i), self.flat_master_ms / 1e3)
        m = self._index[self.master_region]
        return np.asarray(self.backbone[self.region[i], m] + self.home[i])

    def bandwidth(self, i: int | np.ndarray, j: int | np.ndarray,
                  share: int = 1) -> np.ndarray:
        """Rate (bytes/s) of the directed link ``i -> j`` with the pool's streams, when
        ``share`` such links (each with streams of its own) use the same hosts at once:
        the access links are split between them, the per-flow TCP limit is not."""
        rtt = 2 * self.latency(i, j)
        flow = 1.22 * MSS / (np.maximum(rtt, 1e-4) * math.sqrt(self.loss))
        return np.asarray(np.minimum(np.minimum(self.up[i], self.down[j]) / share,
                                     self.streams * flow))

    def matrix(self, peers: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(latency, bandwidth) between ``peers`` as dense matrices (k x k)."""
        p = np.asarray(peers)
        return self.latency(p[:, None], p[None, :]), self.bandwidth(p[:, None], p[None, :])
