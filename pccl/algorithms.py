"""Which all-reduce algorithm a group's collectives use, from a cost model.

Two algorithms run between peers (a third, for tiny tensors, is the master reducing
them: ``Communicator(via_master_max_bytes=)``):

* the **ring** (reduce-scatter + all-gather): ``2 (k - 1)`` hops, each carrying
  ``S / k`` bytes: ``T_ring(S) = 2 (k - 1) a + 2 (k - 1) / k * S / bw``;
* the **mesh** (recursive doubling over direct links to ``log2 k`` partners, plus one
  hop in and one out for the peers above the largest power of two ``p <= k``):
  ``R = log2 p (+ 2)`` hops, each carrying all ``S`` bytes, and each byte costing the
  link's time plus :data:`MESH_CPU_SECONDS_PER_BYTE` (``m``: a mesh step sends,
  receives and reduces the whole tensor one after the other on one stream, where the
  ring pipelines pieces over several and hides that work under its transfers):
  ``T_mesh(S) = R a + R S (1 / bw + m)``.

``a`` is the cost of one hop: the link's one-way latency plus this implementation's
own cost of moving a piece (:data:`HOP_OVERHEAD_S`). The mesh wins below the size where
the two meet,

    S* = a (2 (k - 1) - R) / (R (1 / bw + m) - 2 (k - 1) / (k bw)),

which grows with the latency, with k and, while the link's time dominates ``m``, with
the bandwidth (about 3.4 a bw at k = 32, 0.33 a bw at k = 2 on a 1 GB/s link; on a slow
link the mesh's extra work matters less: 2.1 a bw at k = 6 and 40 MB/s, against 0.42
a bw at 1 GB/s), and never passes :data:`MESH_CAP_BYTES`.

The master computes ``S*`` once per group and ring epoch (:func:`mesh_max_bytes`), from
the latencies measured while the peers opened that epoch's links, and sends the one
number to every member: every peer then picks the same algorithm for the same tensor.

Where ``optimize_topology()`` measured the latency of each pair (its probes time their
dials), the hops are not all alike: peers in several regions have short hops inside a
region and long ones between them. The model then takes the latency part of each
algorithm from the pairs it uses (:func:`ring_path_latency`, :func:`mesh_path_latency`)
instead of ``hops x a``: the ring's ``2 (k - 1) / k`` times the sum over its edges, the
mesh's slowest pair of each of its steps. The best ring visits each region once; the
mesh then ranks the peers in an order of its own (:func:`mesh_order`, sent by the master
with the ring), since recursive doubling wants regions split along a rank bit, not laid
out in runs.
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

#: What a byte costs a mesh hop besides the link's time, seconds: the unpipelined send,
#: receive and reduce of the whole tensor. Calibrated with bench/allreduce.py
#: (processes on loopback, encrypted, 256 KiB and 1 MiB, mesh forced against ring
#: forced): 3.2 ms per extra MiB for one mesh hop at k = 2 against 0.8 ms for the
#: ring's two half-size hops; with loopback taken at :data:`DEFAULT_BANDWIDTH` (1 ns a
#: byte), 3 ns a byte on top. It was a factor on the link's time (4x) before, which on
#: a 40 MB/s link counted 100 ns a byte and hop; 6 peers on such emulated links
#: measured 14.1 ms for a 64 KiB mesh all-reduce and 16.1 ms for 256 KiB (docs/scale.md).
MESH_CPU_SECONDS_PER_BYTE = 3e-9


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


#: The largest group :func:`mesh_order` builds orders to the mesh's shape for (it reads
#: every pair's latency and matches groups pairwise level by level: 0.09 s at 256
#: peers, 0.23 s at 255, whose 127 extras are the most; pure Python, on one core of
#: this project's 2-core VM); larger groups only get the ring's best start.
MESH_ORDER_MAX_WORLD = 256


def mesh_order(world: int, latency: Callable[[int, int], float],
               max_world: int = MESH_ORDER_MAX_WORLD) -> list[int]:
    """The mesh's rank order over a ring of ``world`` peers: ``order[r]`` is the ring
    position that takes mesh rank ``r``; ``latency(i, j)`` is between ring positions.

    Candidates, the cheapest by :func:`mesh_path_latency` winning (the earlier on ties):

    1. the ring from its best start (:func:`mesh_start`; position 0 first, so a group
       whose pairs are all alike keeps the ring's own order);
    2. up to ``max_world`` peers, orders built to the mesh's shape:

       - the extras (the ``world - p`` peers above the largest power of two ``p``,
         each folding into rank ``r - p``) are chosen three ways: from the closest
         disjoint pairs; the same, one region at a time first; and per region, so
         that the peers each region keeps fill whole blocks of the cube (two
         regions of 6 in a mesh of 12 keep 4 each, not 3 and 5);
       - the other ``p`` peers are matched pairwise, closest pairs first, then the
         pairs matched the same way, and so on: after ``log2 p`` levels, close peers
         share the low levels (the first steps) and regions meet at the top;
       - which level becomes which rank bit (every rotation of the levels, both
         ways), and which block of ranks hosts the extras (flipping rank bits), are
         then chosen, since the hosts must be ranks ``0 .. world - p - 1``: with two
         regions of three, one host in each, which puts the crossing on rank bit 0.

    A ring visiting regions in turn is the worst order for recursive doubling when
    ``world`` is not a power of two: 6 peers in 2 regions of 3 cross between them at 3
    of the mesh's 4 steps from any start of the ring, and at 1 of 4 in this order.
    """
    if world < 3:
        return list(range(world))

    def cost(order: Sequence[int]) -> float:
        return mesh_path_latency(world, lambda a, b: latency(order[a], order[b]))

    s = mesh_start(world, latency)
    best = [(s + r) % world for r in range(world)]
    if world > max_world:
        return best
    best_cost = cost(best)
    for order in _clustered_orders(world, latency):
        c = cost(order)
        if c < best_cost - 1e-12:
            best, best_cost = order, c
    return best


def _clustered_orders(world: int, latency: Callable[[int, int], float]) -> list[list[int]]:
    """The candidate orders of :func:`mesh_order`'s second kind."""
    d = [[0.0 if i == j else max(latency(i, j), latency(j, i)) for j in range(world)]
         for i in range(world)]
    p = 1 << (world.bit_length() - 1)
    e = world - p
    pairs = sorted((d[i][j], i, j) for i in range(world) for j in range(i + 1, world)) \
        if e else []
    choices = [_pick_extras(pairs, d, e, spread) for spread in (False, True)] if e else [[]]
    by_region = _extras_by_region(pairs, d, e) if e else None
    if by_region is not None:
        choices.append(by_region)
    orders: list[list[int]] = []
    seen: set[frozenset[int]] = set()
    for extras in choices:
        # Where the regions are plain, the three ways often agree: each set is shaped once
        # (the orders depend on the set, not on the order it was picked in).
        if frozenset(extras) not in seen:
            seen.add(frozenset(extras))
            orders += _shaped_orders(extras, world, d)
    return orders


def _extras_by_region(pairs: list[tuple[float, int, int]], d: list[list[float]],
                      e: int) -> list[int] | None:
    """Extras taken so that what stays of each region splits into few whole blocks of
    the mesh's cube. Regions: peers linked through pairs at most twice the median
    distance to a nearest neighbour. Taking ``x`` extras from a region of ``n`` leaves
    ``n - x`` peers, which fill ``popcount(n - x)`` aligned blocks of ranks; the split
    of the ``e`` extras (at most half of each region, so that each folds into a peer of
    its own region) with the fewest blocks wins. Inside a region the extras come from
    its closest disjoint pairs. None when the regions cannot give ``e`` extras."""
    world = len(d)
    nearest = sorted(min(d[i][j] for j in range(world) if j != i) for i in range(world))
    limit = 2 * nearest[world // 2]
    parent = list(range(world))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for lat, i, j in pairs:
        if lat > limit:
            break
        parent[root(i)] = root(j)
    regions: dict[int, list[int]] = {}
    for i in range(world):
        regions.setdefault(root(i), []).append(i)
    sizes = [len(r) for r in regions.values()]
    # best[x]: (blocks, extras per region) over the regions so far, x extras in all.
    best: list[tuple[int, list[int]] | None] = [(0, [])] + [None] * e
    for n in sizes:
        nxt: list[tuple[int, list[int]] | None] = [None] * (e + 1)
        for x, got in enumerate(best):
            if got is None:
                continue
            for take in range(min(n // 2, e - x) + 1):
                cand = (got[0] + bin(n - take).count("1"), got[1] + [take])
                old = nxt[x + take]
                if old is None or cand[0] < old[0]:
                    nxt[x + take] = cand
        best = nxt
    split = best[e]
    if split is None:
        return None
    want = dict(zip(regions, split[1], strict=True))
    region = [root(i) for i in range(world)]
    extras: list[int] = []
    used: set[int] = set()
    for _, i, j in pairs:  # one pass: each region's closest disjoint pairs
        if len(extras) == e:
            break
        r = region[i]
        if want[r] and region[j] == r and i not in used and j not in used:
            used.update((i, j))
            extras.append(j)
            want[r] -= 1
    return extras


def _pick_extras(pairs: list[tuple[float, int, int]], d: list[list[float]], e: int,
                 spread: bool) -> list[int]:
    """One of each of the ``e`` closest disjoint pairs (``pairs``: (latency, i, j),
    sorted). ``spread``: a pair is first passed over when its extra lies within twice
    the pair's latency of an extra already taken, so that each region gives one
    before any gives two (two regions of 5 make cores of 4 and 4, not 3 and 5); the
    pairs passed over fill what is left."""
    extras: list[int] = []
    used: set[int] = set()
    for lat, i, j in pairs:
        if len(extras) == e:
            return extras
        if i in used or j in used:
            continue
        if spread and any(d[j][x] <= 2 * lat for x in extras):
            continue
        used.update((i, j))
        extras.append(j)
    for _, i, j in pairs:
        if len(extras) == e:
            break
        if i not in used and j not in used:
            used.update((i, j))
            extras.append(j)
    return extras


def _shaped_orders(extras: list[int], world: int, d: list[list[float]]) -> list[list[int]]:
    """Orders with these extras: the other peers matched level by level, each way of
    reading the levels as rank bits."""
    p = world - len(extras)
    e = len(extras)
    taken = set(extras)
    groups = [[i] for i in range(world) if i not in taken]
    # Level by level, greedy matching of the groups, closest first; a pair of groups
    # costs its slowest rank pair (element by element, as recursive doubling pairs them).
    while len(groups) > 1:
        n = len(groups)
        pairs = sorted((max(d[a][b] for a, b in zip(groups[x], groups[y], strict=True)), x, y)
                       for x in range(n) for y in range(x + 1, n))
        merged: list[list[int]] = []
        done: set[int] = set()
        for _, x, y in pairs:
            if x not in done and y not in done:
                done.update((x, y))
                merged.append(groups[x] + groups[y])
                if len(done) == n:
                    break
        groups = merged
    logical = groups[0]
    m = p.bit_length() - 1
    orders = []
    for flip in (False, True):
        for t in range(m):
            # Physical rank bit b reads logical bit (b + t) % m, or (t - b) % m.
            src = [((t - b) if flip else (b + t)) % m for b in range(m)]
            core = [logical[sum(((r >> b) & 1) << src[b] for b in range(m))]
                    for r in range(p)]
            if not e:
                orders.append(core)
                continue
            # The hosts' block of ranks (0..2^h, h = bits of e - 1) may be any of the
            # p / 2^h blocks of the same shape: flipping rank bits h and up changes no
            # pair of the recursive doubling, only who hosts. The block whose hosts
            # are closest to the extras wins.
            h = (e - 1).bit_length()
            _, block, hosted = _best_block(core, e, h, extras, d)
            orders.append([core[r ^ block] for r in range(p)] + hosted)
    return orders


def _best_block(core: list[int], e: int, h: int, extras: list[int],
                d: list[list[float]]) -> tuple[float, int, list[int]]:
    """Among the blocks ``c`` of ``2^h`` ranks of ``core``, the one whose first ``e``
    members host ``extras`` with the shortest slowest pair: (that latency, c, the
    extras in host order); the first such block on ties."""
    best: tuple[float, int, list[int]] | None = None
    # Flipping low bits too reorders the hosts inside a block ([C C A A] -> [A A C C]
    # for hosts that must be two A and one C); tried where it is cheap.
    step = 1 if len(core) * e * e <= 1 << 16 else 1 << h
    for c in range(0, len(core), step):
        slowest, hosted = _hosted([core[r ^ c] for r in range(e)], extras, d)
        if best is None or slowest < best[0] - 1e-12:
            best = (slowest, c, hosted)
    assert best is not None
    return best


def _hosted(hosts: list[int], extras: list[int],
            d: list[list[float]]) -> tuple[float, list[int]]:
    """``extras`` in the order of the ``hosts`` they fold into (rank ``p + i`` pairs
    with rank ``i``), closest pairs first, and the slowest such pair's latency."""
    out = [-1] * len(hosts)
    free = set(extras)
    slowest = 0.0
    for lat, i, x in sorted((d[h][x], i, x) for i, h in enumerate(hosts) for x in extras):
        if out[i] < 0 and x in free:
            out[i] = x
            free.discard(x)
            slowest = max(slowest, lat)
    return slowest, out


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
    return hops * (one_way + HOP_OVERHEAD_S) \
        + hops * nbytes * (1 / bandwidth + MESH_CPU_SECONDS_PER_BYTE)


def mesh_max_bytes(world: int, one_way: float, bandwidth: float = DEFAULT_BANDWIDTH,
                   cap: int = MESH_CAP_BYTES, *,
                   latency: Callable[[int, int], float] | None = None,
                   mesh_latency: Callable[[int, int], float] | None = None) -> int:
    """The largest all-reduce (bytes) for which the mesh is modelled faster than the
    ring, at most ``cap``; 0 for a group of one. ``latency(i, j)``: the one-way latency
    from ring rank ``i`` to ``j`` where pairs differ (else every hop is ``one_way``);
    ``mesh_latency(i, j)`` the same between mesh ranks, where the mesh has its own order
    (default: ``latency``)."""
    if world < 2:
        return 0
    hops_ring, hops_mesh = 2 * (world - 1), mesh_rounds(world)
    per_byte = hops_mesh * (1 / bandwidth + MESH_CPU_SECONDS_PER_BYTE) \
        - hops_ring / world / bandwidth
    if latency is None:
        saved = (hops_ring - hops_mesh) * (one_way + HOP_OVERHEAD_S)
    else:
        saved = (ring_path_latency(world, latency)
                 - mesh_path_latency(world, mesh_latency or latency)
                 + (hops_ring - hops_mesh) * HOP_OVERHEAD_S)
    if saved <= 0:
        return 0
    if per_byte <= 0:
        return cap
    return int(min(cap, saved / per_byte))
