"""Modelled time of one all-reduce of ``S`` bytes over peers with the links of a
:class:`~pccl.sim.network.NetworkModel`, per algorithm.

The per-hop cost of the implementation (:data:`pccl.algorithms.HOP_OVERHEAD_S`) and
the mesh's own cost per byte (:data:`pccl.algorithms.MESH_CPU_SECONDS_PER_BYTE`) are the values
calibrated on real pccl here (see :mod:`pccl.algorithms`); the link latencies and rates
come from the network model. :func:`pccl.sim.scale.calibration` checks these formulas
against the all-reduce times measured with emulated 5 ms links (bench/latency.py).

* **ring** over ``order``: ``2 (k - 1)`` hops. A pipelined ring pays every hop's latency
  on the chain that carries a chunk around, so the latency part is ``2 (k - 1)`` x the
  ring's *mean* hop (latency + overhead), and its slowest link paces the bytes:
  ``2 (k - 1) / k x S / min bw``.
* **mesh** (recursive doubling over the ranks of ``order``, as ``rust/ring/mesh.rs``):
  every step waits for its slowest pair: ``sum over steps of max (lat + c S / bw)``.
* **hierarchical** (regions): a mesh inside every region, a mesh between one leader per
  region, then the result down each region's tree (a mesh's hops again, no bytes
  reduced): small tensors cross the oceans ``log2 regions`` times instead of in most
  of the mesh's steps.
* **striped** (regions, large tensors): ``m`` region-sorted rings, each carrying
  ``S / m``, whose cross-region edges use different hosts; every host's up- and
  downlink is shared by the ``m`` rings, the per-flow TCP limit is not (each ring has
  its own streams).
* **via master**: every peer sends ``S`` up its own link to the master and gets the
  result back down it: the slowest peer's trip each way plus ``k S`` through the
  master's link each way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pccl import algorithms
from pccl.sim.network import NetworkModel

#: The master's link (bytes/s each way): a datacentre host.
MASTER_BANDWIDTH = 1.25e9


def ring_seconds(net: NetworkModel, order: Sequence[int], nbytes: float,
                 share: int = 1) -> float:
    k = len(order)
    if k < 2:
        return 0.0
    a = np.asarray(order)
    b = np.roll(a, -1)
    bw = net.bandwidth(a, b, share)
    lat = net.latency(a, b) + algorithms.HOP_OVERHEAD_S
    hops = 2 * (k - 1)
    return float(hops * lat.mean() + hops / k * nbytes / bw.min())


def _mesh_steps(k: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (sender rank, receiver rank) pairs of each mesh step, both directions of an
    exchange listed."""
    p = 1 << (k.bit_length() - 1)
    steps = []
    extras = np.arange(p, k)
    if len(extras):
        steps.append((extras, extras - p))
    r = np.arange(p)
    s = 1
    while s < p:
        steps.append((r, r ^ s))
        s <<= 1
    if len(extras):
        steps.append((extras - p, extras))
    return steps


def mesh_seconds(net: NetworkModel, order: Sequence[int], nbytes: float,
                 cpu_per_byte: float | None = None) -> float:
    k = len(order)
    if k < 2:
        return 0.0
    c = algorithms.MESH_CPU_SECONDS_PER_BYTE if cpu_per_byte is None else cpu_per_byte
    a = np.asarray(order)
    total = 0.0
    for snd, rcv in _mesh_steps(k):
        i, j = a[snd], a[rcv]
        step = net.latency(i, j) + algorithms.HOP_OVERHEAD_S + nbytes / net.bandwidth(i, j) \
            + c * nbytes
        total += float(step.max())
    return total


def by_region(net: NetworkModel, order: Sequence[int]) -> list[list[int]]:
    """``order`` split into its regions (each keeps ``order``'s sequence)."""
    groups: dict[int, list[int]] = {}
    for p in order:
        groups.setdefault(int(net.region[p]), []).append(int(p))
    return [groups[r] for r in sorted(groups)]


def hierarchical_seconds(net: NetworkModel, order: Sequence[int], nbytes: float) -> float:
    groups = by_region(net, order)
    inner = max(mesh_seconds(net, g, nbytes) for g in groups)
    leaders = mesh_seconds(net, [g[0] for g in groups], nbytes)
    down = max(mesh_seconds(net, g, nbytes, cpu_per_byte=0.0) for g in groups)
    return inner + leaders + down


def region_sorted(net: NetworkModel, order: Sequence[int]) -> list[int]:
    """``order`` regrouped region by region (three cross-region hops in all)."""
    return [p for g in by_region(net, order) for p in g]


def striped_seconds(net: NetworkModel, order: Sequence[int], nbytes: float,
                    rings: int) -> float:
    """``rings`` region-sorted rings, ring ``r`` rotating every region's members by
    ``r`` x (size / rings) so that its cross-region hops use other hosts."""
    groups = by_region(net, order)
    m = max(1, rings)
    worst = 0.0
    for r in range(m):
        ring = []
        for g in groups:
            shift = (r * len(g)) // m
            ring.extend(g[shift:] + g[:shift])
        worst = max(worst, ring_seconds(net, ring, nbytes / m, share=m))
    return worst


def via_master_seconds(net: NetworkModel, order: Sequence[int], nbytes: float) -> float:
    a = np.asarray(order)
    k = len(a)
    lat = net.master_latency(a)
    up = float((lat + nbytes / net.up[a]).max())
    down = float((lat + nbytes / net.down[a]).max())
    return up + down + 2 * k * nbytes / MASTER_BANDWIDTH


def all_algorithms(net: NetworkModel, order: Sequence[int], nbytes: float,
                   stripes: int = 4) -> dict[str, float]:
    """Modelled seconds of every algorithm for one all-reduce of ``nbytes``."""
    sorted_ring = region_sorted(net, order)
    return {
        "via_master": via_master_seconds(net, order, nbytes),
        "ring_join_order": ring_seconds(net, order, nbytes),
        "ring_region_sorted": ring_seconds(net, sorted_ring, nbytes),
        "mesh": mesh_seconds(net, order, nbytes),
        "mesh_region_sorted": mesh_seconds(net, sorted_ring, nbytes),
        "hierarchical": hierarchical_seconds(net, order, nbytes),
        f"striped_{stripes}": striped_seconds(net, order, nbytes, stripes),
    }
