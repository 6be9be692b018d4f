"""Which all-reduce algorithm a group's collectives use, from a cost model.

Two algorithms run between peers (a third, for tiny tensors, is the master reducing
them: ``Communicator(via_master_max_bytes=)``):

* the **ring** (reduce-scatter + all-gather): ``2 (k - 1)`` hops, each carrying
  ``S / k`` bytes: ``T_ring(S) = 2 (k - 1) a + 2 (k - 1) / k * S / bw``;
* the **mesh** (recursive doubling over direct links to ``log2 k`` partners, plus one
  hop in and one out for the peers above the largest power of two ``p <= k``):
  ``R = log2 p (+ 2)`` hops, each carrying all ``S`` bytes, and each byte costing
  :data:`MESH_BYTE_COST` times what it costs the ring (a mesh step sends, receives and
  reduces the whole tensor one after the other on one stream, where the ring pipelines
  pieces over several): ``T_mesh(S) = R a + R S c / bw``.

``a`` is the cost of one hop: the link's one-way latency plus this implementation's
own cost of moving a piece (:data:`HOP_OVERHEAD_S`). The mesh wins below the size where
the two meet,

    S* = a * bw * (2 (k - 1) - R) / (R c - 2 (k - 1) / k),

which grows with the bandwidth-delay product and with k (about 3.4 a bw at k = 32, 0.33
a bw at k = 2), and never passes :data:`MESH_CAP_BYTES`.

The master computes ``S*`` once per group and ring epoch (:func:`mesh_max_bytes`), from
the latencies measured while the peers opened that epoch's links, and sends the one
number to every member: every peer then picks the same algorithm for the same tensor.

Where ``optimize_topology()`` measured the latency of each pair (its probes time their
dials), the hops are not all alike: peers in several regions have short hops inside a
region and long ones between them. The model then takes the latency part of each
algorithm from the pairs it uses (:func:`ring_path_latency`, :func:`mesh_path_latency`)
instead of ``hops x a``: the ring's ``2 (k - 1) / k`` times the sum over its edges, the
mesh's slowest pair of each of its steps. Ranks are ring positions on both, so a ring
that visits each region once also keeps the mesh's first steps inside a region.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

from pccl import _core

#: What one hop costs this implementation besides the link's latency: a piece's send,
#: receive and reduce through the Rust data plane (encrypted), seconds. Calibrated
#: with ``bench/latency.py --algorithms --master-ms 0 --link-ms 0``: fitting ring and
#: mesh times of a 4 KiB all-reduce to (fixed cost + hops x this) gave 25 us at k = 4
#: and 120 us at k = 8 (every peer in one process on 2 cores).
HOP_OVERHEAD_S = 100e-6

#: Round trips a pool's dial takes (TCP connect, the Noise handshake, the p2p hello):
#: the dial times the peers report are divided by twice this to estimate one-way
#: latency. Calibrated against emulated links: adding 5 ms each way to every p2p link
#: added 36.6 ms (k = 4) and 35.7 ms (k = 8) to the median dial, 3.6 round trips.
DIAL_ROUND_TRIPS = 3.5

#: Bandwidth assumed when no probe measured the group's links (bytes/s).
DEFAULT_BANDWIDTH = 1e9

#: Largest all-reduce the cost model sends to the mesh, in bytes.
MESH_CAP_BYTES = 1 << 20

#: How much more a byte costs on the mesh than on the ring. Calibrated with
#: bench/allreduce.py (processes, encrypted, 256 KiB and 1 MiB, mesh forced against
#: ring forced): 3.2 ms per extra MiB for one mesh hop at k = 2 against 0.8 ms for the
#: ring's two half-size hops.
MESH_BYTE_COST = 4.0


def mesh_rounds(world: int) -> int:
    """Hops of the mesh all-reduce of ``world`` peers."""
    return int(_core.mesh_rounds(world))


def mesh_partners(rank: int, world: int) -> list[int]:
    """The ranks ``rank`` exchanges pieces with in a mesh all-reduce of ``world`` peers
    (a link each way with each)."""
    return [int(r) for r in _core.mesh_partners(rank, world)]


def mesh_steps(world: int) -> list[list[tuple[int, int]]]:
    """The mesh's hops in order, each the directed ``(sender, receiver)`` rank pairs that
    move pieces in it (the schedule of ``rust/ring/mesh.rs``): the extras' step in, the
    recursive-doubling exchanges, the extras' step out."""
    if world < 2:
        return []
    p = 1 << (world.bit_length() - 1)
    extras = list(range(p, world))
    steps = [[(r, r - p) for r in extras]] if extras else []
    j = 1
    while j < p:
        steps.append([(r, r ^ j) for r in range(p)])
        j <<= 1
    if extras:
        steps.append([(r - p, r) for r in extras])
    return steps


def ring_path_latency(world: int, latency: Callable[[int, int], float]) -> float:
    """Latency part of a ring all-reduce whose hop from rank ``i`` to ``i + 1`` takes
    ``latency(i, i + 1)`` seconds: its ``2 (k - 1)`` steps go round the ring about
    twice, ``2 (k - 1) / k`` times the sum over the edges (``2 (k - 1) a`` when every
    hop takes ``a``)."""
    if world < 2:
        return 0.0
    total = sum(latency(i, (i + 1) % world) for i in range(world))
    return 2 * (world - 1) / world * total


def mesh_path_latency(world: int, latency: Callable[[int, int], float]) -> float:
    """Latency part of a mesh all-reduce (:func:`mesh_steps`): each step waits for its
    slowest pair (``R a`` when every hop takes ``a``)."""
    return sum(max(latency(a, b) for a, b in step) for step in mesh_steps(world))


def mesh_rotation(world: int, latency: Callable[[int, int], float],
                  candidates: Sequence[int] | None = None) -> int:
    """Where the mesh's ranks should start on a ring of ``world`` peers: the offset
    ``s`` (rank ``r`` = ring position ``(s + r) % world``) whose mesh has the least
    latency (:func:`mesh_path_latency`), among ``candidates`` (default: every offset);
    the first such offset on ties. ``latency(i, j)`` is between ring positions. The
    ring itself is the same cycle whatever the offset; the mesh is not: recursive
    doubling pairs ranks ``r ^ 2^j``, so a region of 4 ring neighbours starting at
    rank 2 meets the others at two of its steps, and at one starting at rank 0."""
    def shifted(s: int) -> Callable[[int, int], float]:
        return lambda i, j: latency((s + i) % world, (s + j) % world)

    offsets = range(world) if candidates is None else candidates
    best, best_cost = 0, math.inf
    for s in offsets:
        cost = mesh_path_latency(world, shifted(s))
        if cost < best_cost - 1e-12:
            best, best_cost = s, cost
    return best


def mesh_start(world: int, latency: Callable[[int, int], float], tries: int = 8) -> int:
    """:func:`mesh_rotation` over a few likely offsets: 0, and the positions right
    after the ring's ``tries - 1`` longest hops (where regions meet), which costs
    ``tries`` mesh evaluations instead of ``world``."""
    hops = [latency((i - 1) % world, i) for i in range(world)]
    longest = sorted(range(world), key=lambda i: (-hops[i], i))[:max(tries - 1, 0)]
    return mesh_rotation(world, latency, [0] + [i for i in longest if i != 0])


def one_way_latency(dial_seconds: Sequence[float]) -> float:
    """One-way link latency (s) estimated from the durations of pool dials: the median
    dial over twice :data:`DIAL_ROUND_TRIPS`; 0 when nothing was measured."""
    dials = [d for d in dial_seconds if d >= 0]
    if not dials:
        return 0.0
    return statistics.median(dials) / (2 * DIAL_ROUND_TRIPS)


def ring_seconds(world: int, nbytes: int, one_way: float, bandwidth: float) -> float:
    """Modelled time of a ring all-reduce (see the module docs)."""
    if world < 2:
        return 0.0
    hops = 2 * (world - 1)
    return hops * (one_way + HOP_OVERHEAD_S) + hops / world * nbytes / bandwidth


def mesh_seconds(world: int, nbytes: int, one_way: float, bandwidth: float) -> float:
    """Modelled time of a mesh all-reduce (see the module docs)."""
    hops = mesh_rounds(world)
    return hops * (one_way + HOP_OVERHEAD_S) + hops * nbytes * MESH_BYTE_COST / bandwidth


def mesh_max_bytes(world: int, one_way: float, bandwidth: float = DEFAULT_BANDWIDTH,
                   cap: int = MESH_CAP_BYTES, *,
                   latency: Callable[[int, int], float] | None = None) -> int:
    """The largest all-reduce (bytes) for which the mesh is modelled faster than the
    ring, at most ``cap``; 0 for a group of one. ``latency(i, j)``: the one-way latency
    from ring rank ``i`` to ``j`` where pairs differ (else every hop is ``one_way``)."""
    if world < 2:
        return 0
    hops_ring, hops_mesh = 2 * (world - 1), mesh_rounds(world)
    per_byte = (hops_mesh * MESH_BYTE_COST - hops_ring / world) / bandwidth
    if latency is None:
        saved = (hops_ring - hops_mesh) * (one_way + HOP_OVERHEAD_S)
    else:
        saved = (ring_path_latency(world, latency) - mesh_path_latency(world, latency)
                 + (hops_ring - hops_mesh) * HOP_OVERHEAD_S)
    if saved <= 0:
        return 0
    if per_byte <= 0:
        return cap
    return int(min(cap, saved / per_byte))
