"""pccl.algorithms, no network: the mesh's cost model against the ring's, its schedule (the
same as Rust's), per-pair latencies, and the rank order that keeps regions together.
(The mesh all-reduce end to end: tests/system/test_mesh.py.)"""

from __future__ import annotations

import pytest

from pccl import algorithms


def test_the_cost_model_prefers_the_mesh_for_small_tensors_and_large_k() -> None:
    """Hand-checked values of pccl.algorithms (no network)."""
    assert algorithms.mesh_rounds(32) == 5 and algorithms.mesh_rounds(5) == 4
    assert algorithms.mesh_partners(5, 6) == [1]
    assert algorithms.mesh_partners(1, 6) == [5, 0, 3]
    # The limit grows with the hop latency and with k, and never passes the cap.
    limits = [algorithms.mesh_max_bytes(k, 0.005, 1e8) for k in (3, 4, 8, 32)]
    assert 0 < limits[0] < limits[1] and limits[2] <= limits[3] == algorithms.MESH_CAP_BYTES
    assert algorithms.mesh_max_bytes(8, 0.0, 1e9) < algorithms.mesh_max_bytes(8, 1e-3, 1e9)
    # k = 2: one hop instead of two, each byte dearer by m: S* = a / m, whatever bw.
    a = algorithms.HOP_OVERHEAD_S
    for bw in (1e9, 4e7):
        assert algorithms.mesh_max_bytes(2, 0.0, bw) == int(
            a / algorithms.MESH_CPU_SECONDS_PER_BYTE)
    # Larger k: the mesh's extra work weighs less on a slow link, so its limit is larger
    # there in link time (k = 6: R = 4 hops of S against the ring's 10 of S / 6).
    fast, slow = (algorithms.mesh_max_bytes(6, 0.005, bw, cap=1 << 40) for bw in (1e9, 4e7))
    r, m = 4, algorithms.MESH_CPU_SECONDS_PER_BYTE
    saved = (10 - r) * (0.005 + a)
    assert fast == int(saved / (r * (1e-9 + m) - 10 / 6 * 1e-9))
    assert slow == int(saved / (r * (1 / 4e7 + m) - 10 / 6 / 4e7))
    assert slow / 4e7 > 5 * fast / 1e9
    assert algorithms.mesh_max_bytes(1, 0.005, 1e9) == 0
    for k in (3, 4, 8, 32):
        s = algorithms.mesh_max_bytes(k, 0.001, 1e9, cap=1 << 40)
        # At the limit both models agree (within a byte's rounding).
        ring = algorithms.ring_seconds(k, s, 0.001, 1e9)
        mesh = algorithms.mesh_seconds(k, s, 0.001, 1e9)
        assert abs(ring - mesh) < 1e-6 * ring
    assert algorithms.one_way_latency([]) == 0.0
    assert algorithms.one_way_latency([0.006, 0.06, 0.012]) == pytest.approx(
        0.012 / (2 * algorithms.DIAL_ROUND_TRIPS))


def test_the_mesh_schedule_in_python_is_the_rust_one() -> None:
    for k in range(1, 41):
        steps = algorithms.mesh_steps(k)
        assert len(steps) == algorithms.mesh_rounds(k)
        for r in range(k):
            talks = {b for step in steps for a, b in step if a == r}
            talks |= {a for step in steps for a, b in step if b == r}
            assert talks == set(algorithms.mesh_partners(r, k)), (k, r)
        # Every step: each rank sends at most once and receives at most once.
        for step in steps:
            assert len({a for a, _ in step}) == len(step) == len({b for _, b in step})


def test_per_pair_latencies_in_the_cost_model() -> None:
    """Equal pairs give the hops x latency model; regions make the ring dearer when its
    ranks scatter them and the mesh's late steps the only slow ones when they don't."""
    for k in (2, 3, 5, 8, 13):
        same = algorithms.mesh_max_bytes(k, 0.004, 1e8, cap=1 << 40)
        per_pair = algorithms.mesh_max_bytes(k, 0.0, 1e8, cap=1 << 40,
                                             latency=lambda i, j: 0.004)
        assert abs(per_pair - same) <= 1, k
        assert algorithms.ring_path_latency(k, lambda i, j: 0.004) == pytest.approx(
            2 * (k - 1) * 0.004)
        assert algorithms.mesh_path_latency(k, lambda i, j: 0.004) == pytest.approx(
            algorithms.mesh_rounds(k) * 0.004)

    def regions(of):  # 40 ms between regions, 1 ms inside
        return lambda i, j: 0.001 if of(i) == of(j) else 0.040

    k = 16
    sorted_ranks, scattered = regions(lambda r: r // 8), regions(lambda r: r % 2)
    # A ring in region order crosses twice; scattered, at every hop.
    assert algorithms.ring_path_latency(k, sorted_ranks) == pytest.approx(
        2 * 15 / 16 * (14 * 0.001 + 2 * 0.040))
    assert algorithms.ring_path_latency(k, scattered) == pytest.approx(2 * 15 * 0.040)
    # The mesh's first three steps stay inside a region of 8 contiguous ranks.
    assert algorithms.mesh_path_latency(k, sorted_ranks) == pytest.approx(3 * 0.001 + 0.040)
    assert algorithms.mesh_path_latency(k, scattered) == pytest.approx(0.040 + 3 * 0.001)


def test_the_mesh_starts_at_a_region_edge() -> None:
    # A ring of 8 whose regions are positions 2..5 and 6..1: starting the ranks at
    # position 2 (or 6) keeps two of the mesh's three steps inside the regions.
    def region(pos: int) -> int:
        return int(2 <= pos % 8 <= 5)

    def lat(i: int, j: int) -> float:
        return 0.001 if region(i) == region(j) else 0.040

    assert algorithms.mesh_path_latency(8, lat) == pytest.approx(0.001 + 2 * 0.040)
    s = algorithms.mesh_rotation(8, lat)
    assert s in (2, 6)
    assert algorithms.mesh_path_latency(
        8, lambda i, j: lat((s + i) % 8, (s + j) % 8)) == pytest.approx(2 * 0.001 + 0.040)
    # Only the candidates are tried; ties keep the first.
    assert algorithms.mesh_rotation(8, lat, [0, 1]) == 0
    assert algorithms.mesh_rotation(8, lambda i, j: 0.01) == 0


def _regions(of):
    return lambda i, j: 0.001 if of(i) == of(j) else 0.010


@pytest.mark.parametrize(("k", "of", "best"), [
    (6, lambda i: i // 3, 0.013),  # 2 regions of 3: from any ring start, 31 ms
    (7, lambda i: i // 4, 0.013),
    (10, lambda i: i // 5, 0.014),  # cores of 4 and 4, crossing on one rank bit
    (12, lambda i: i // 4, 0.023),  # 3 regions: two crossing steps at least
    (20, lambda i: i // 5, 0.024),
    (40, lambda i: i // 10, 0.025),
    (8, lambda i: i // 4, 0.012),  # a power of two: the ring's order is as good
])
def test_the_mesh_orders_regions_along_rank_bits(k, of, best) -> None:
    lat = _regions(of)
    order = algorithms.mesh_order(k, lat)
    assert sorted(order) == list(range(k))
    got = algorithms.mesh_path_latency(k, lambda a, b: lat(order[a], order[b]))
    assert got == pytest.approx(best)
    # Never worse than the ring's best start, which is what a larger group gets.
    s = algorithms.mesh_start(k, lat)
    assert got <= algorithms.mesh_path_latency(
        k, lambda a, b: lat((s + a) % k, (s + b) % k)) + 1e-12
    assert algorithms.mesh_order(k, lat, max_world=k - 1) == [(s + r) % k for r in range(k)]


def test_the_mesh_order_is_the_rings_when_pairs_are_alike() -> None:
    for k in (3, 5, 6, 9, 16):
        assert algorithms.mesh_order(k, lambda i, j: 0.005) == list(range(k))


def test_the_mesh_order_copes_with_noisy_regions() -> None:
    # Latencies within 20% of their region's: the regions still split along rank bits
    # (brute force over all 6! orders agrees to within the noise).
    import itertools
    import random

    rnd = random.Random(3)
    k = 6
    noise = {(i, j): 1 + 0.2 * rnd.random() for i in range(k) for j in range(k)}

    def lat(i: int, j: int) -> float:
        return _regions(lambda r: r // 3)(i, j) * noise[(i, j)]

    def cost(order) -> float:
        return algorithms.mesh_path_latency(k, lambda a, b: lat(order[a], order[b]))
    brute = min(cost(p) for p in itertools.permutations(range(k)))
    got = cost(algorithms.mesh_order(k, lat))
    assert brute <= got <= brute + 0.002 * 4  # one crossing, like the best
