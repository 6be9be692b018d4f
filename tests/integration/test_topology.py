"""optimize_topology(): links measured through per-pair shaped emulators, the ring
avoids the slow links, reduces still work; a peer lost during it fails it cleanly."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest

import pccl
from pccl.master.state import MasterState
from pccl.testing import Cluster

pytest.importorskip("pccl.topology")

FAST, SLOW = 80e6, 4e6


async def shaped_cluster(stack, n: int, slow: set[tuple[int, int]], *, fast: float = FAST,
                         latency: Callable[[int, int], float] | None = None,
                         chunk_size: int = 256 * 1024, **kwargs):
    """n peers; the link from join-index i to j is SLOW if (i, j) in ``slow``, else
    ``fast``; ``latency(i, j)``: its one-way latency, when given; ``kwargs`` go to
    each Communicator."""
    cluster = await stack.enter_async_context(
        Cluster(0, pool_size=2, master_kwargs={"insecure": True}))
    comms = await cluster.admit_shaped(
        stack, n, lambda i, j: SLOW if (i, j) in slow else fast, latency,
        chunk_size=chunk_size, **kwargs)
    return cluster, comms


def edges(ring: list[int]) -> set[tuple[int, int]]:
    return {(ring[k], ring[(k + 1) % len(ring)]) for k in range(len(ring))}


@pytest.mark.alone  # measures links: other tests' load skews the rates
async def test_optimized_ring_avoids_the_slow_links() -> None:
    from contextlib import AsyncExitStack

    async with AsyncExitStack() as stack:
        # Join order 0->1->2->3->0 uses both slow links.
        slow = {(0, 1), (2, 3)}
        cluster, comms = await shaped_cluster(stack, 4, slow)
        ids = [c.peer_id for c in comms]
        assert comms[0].ring == ids
        await asyncio.gather(*(c.optimize_topology() for c in comms))
        ring = comms[0].ring
        assert sorted(ring) == sorted(ids)
        assert all(c.ring == ring for c in comms)
        slow_ids = {(ids[a], ids[b]) for a, b in slow}
        assert not (edges(ring) & slow_ids), (ring, slow_ids)
        # The measured matrix is in the master, and the rings work.
        assert cluster.master.state.bandwidth[(ids[0], ids[1])][0] < \
            cluster.master.state.bandwidth[(ids[0], ids[2])][0]
        xs = [np.full(1000, i + 1, np.float32) for i in range(4)]
        await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs)))
        assert all((x == 10).all() for x in xs)
        # A second optimization reuses fresh measurements: no probes, same ring.
        await asyncio.gather(*(c.optimize_topology() for c in comms))
        assert comms[0].ring == ring


@pytest.mark.alone  # measures latencies: other tests' load skews them
async def test_optimized_ring_visits_each_region_once() -> None:
    """Peers in two regions, 15 ms apart one way, every link capped alike: the probes'
    dials measure each pair's latency, and the ring crosses between the regions twice
    (join order crosses at every hop)."""
    from contextlib import AsyncExitStack

    n, far = 6, 0.015

    def region(i: int) -> int:
        return i % 2

    async with AsyncExitStack() as stack:
        cluster, comms = await shaped_cluster(
            stack, n, set(), fast=8e6, chunk_size=64 * 1024,
            latency=lambda i, j: far if region(i) != region(j) else 0.0,
            via_master_max_bytes=0)
        ids = [c.peer_id for c in comms]
        of = {p: region(k) for k, p in enumerate(ids)}
        assert all(of[a] != of[b] for a, b in edges(comms[0].ring))
        await asyncio.gather(*(c.optimize_topology() for c in comms))
        ring = comms[0].ring
        assert all(c.ring == ring for c in comms)
        state = cluster.master.state
        # Every pair was measured, and every pair across is slower than any inside.
        inside = [v for (a, b), (v, _) in state.latency.items() if of[a] == of[b]]
        across = [v for (a, b), (v, _) in state.latency.items() if of[a] != of[b]]
        assert len(inside) + len(across) == n * (n - 1)
        assert min(across) > max(inside), (sorted(inside), sorted(across))
        assert sum(of[a] != of[b] for a, b in edges(ring)) == 2, (ring, of)
        # The mesh ranks the peers in an order of its own, the regions split along a
        # rank bit: one of its 4 steps crosses between them, where the ring's order
        # crosses at 3 from any start.
        from pccl import algorithms

        def crossings(order: list[int]) -> int:
            return sum(any(of[order[a]] != of[order[b]] for a, b in step)
                       for step in algorithms.mesh_steps(n))
        order = state.mesh_orders[state.peers[ids[0]].peer_group]
        assert sorted(order) == sorted(ring)
        assert crossings(order) == 1, (order, of)
        assert min(crossings(ring[s:] + ring[:s]) for s in range(n)) == 3
        # The mesh runs in that order (its ranks are not the ops' ring ranks), exact
        # and bit-identical on every peer.
        rng = np.random.default_rng(5)
        xs = [rng.standard_normal(1001).astype(np.float32) for _ in range(n)]
        want = np.sum(np.stack(xs).astype(np.float64), axis=0)
        infos = await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs)))
        assert {i.algorithm for i in infos} == {"mesh"}, state.mesh_limits
        assert all(x.tobytes() == xs[0].tobytes() for x in xs)
        np.testing.assert_allclose(xs[0], want, rtol=1e-5, atol=1e-5)


async def test_peer_lost_during_optimization_fails_it_everywhere() -> None:
    async with Cluster(4) as cluster:
        comms = cluster.comms
        calls = [asyncio.create_task(c.optimize_topology()) for c in comms[:3]]
        await cluster.master.wait_for(lambda s: len(s.opt_votes) == 3)
        await comms[3].close()
        for call in calls:
            with pytest.raises(pccl.TopologyOptimizationFailedError):
                await call
        live = comms[:3]
        await asyncio.gather(*(c.update_topology() for c in live))
        xs = [np.ones(10, np.float32) for _ in live]
        await asyncio.gather(*(c.all_reduce(x) for c, x in zip(live, xs)))
        assert all((x == 3).all() for x in xs)


async def test_small_groups_need_no_probes(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    await asyncio.gather(*(c.optimize_topology() for c in cluster.comms))
    assert not cluster.master.state.bandwidth


def _three_accepted() -> MasterState:
    """A master state with peers 1, 2, 3 accepted in one group (ring epoch 2): 1 alone,
    then 2 and 3 through a vote."""
    from pccl.master import state as st
    from pccl.protocol import messages as m

    s = st.MasterState(mesh_max_bytes=0)
    for p in (1, 2, 3):
        s.handle(st.PeerRegistered(p, 0, f"h:{p}"))
    s.handle(st.Received(1, m.P2PReport(epoch=1, failed=[])))
    s.handle(st.Received(1, m.UpdateTopology()))
    for p in (1, 2, 3):
        s.handle(st.Received(p, m.P2PReport(epoch=2, failed=[])))
    return s


def test_a_better_ring_found_later_is_adopted_at_the_next_update() -> None:
    from pccl.master import state as st
    from pccl.protocol import messages as m

    s = _three_accepted()
    assert s.rings[0] == [1, 2, 3] and not s.rings_stale
    s.opt_round = 1
    s.handle(st.BetterRing(1, 0, [1, 3, 2]))
    assert s.ring_order[0] == [1, 3, 2] and s.rings_stale
    s.handle(st.BetterRing(0, 0, [2, 1, 3]))  # stale round: ignored
    assert s.ring_order[0] == [1, 3, 2]
    out = []
    for p in (1, 2, 3):
        out += s.handle(st.Received(p, m.UpdateTopology()))
    # The order shows in each member's neighbours (1 -> 3 -> 2 -> 1).
    nexts = {c.peer_id: c.msg.next_id for c in out if isinstance(c.msg, m.EstablishP2P)}
    assert nexts == {1: 3, 3: 2, 2: 1}


async def test_reduce_against_an_optimizing_peer_is_called_off(pccl_cluster) -> None:
    cluster = await pccl_cluster(3)
    a, b, c = cluster.comms
    votes = [asyncio.create_task(x.optimize_topology()) for x in (a, b)]
    await cluster.master.wait_for(lambda s: len(s.opt_votes) == 2)
    x = np.ones(4, np.float32)
    with pytest.raises(pccl.CollectiveAbortedError):
        await c.all_reduce(x)
    await c.optimize_topology()
    await asyncio.gather(*votes)


def test_the_solver_is_told_the_path_types_of_peers_behind_nat() -> None:
    """Peers 3 and 4 cannot be dialed: nobody probes them (a probe would fail), links
    into them count as a typical direct link when their sender can be dialed (they dial
    it: reverse) and as much less between two of them (punched or relayed); the ring
    found puts them apart."""
    from pccl import topology
    from pccl.master import state as st
    from pccl.protocol import messages as m

    s = st.MasterState(mesh_max_bytes=0, token_key=bytes(32))
    for p in (1, 2, 3, 4):
        s.handle(st.PeerRegistered(p, 0, f"h:{p}", reachable=p < 3))
    s.handle(st.Received(1, m.P2PReport(epoch=1, failed=[])))
    s.handle(st.Received(1, m.UpdateTopology()))
    for p in (1, 2, 3, 4):
        s.handle(st.Received(p, m.P2PReport(epoch=2, failed=[])))
    assert s.rings[0] == [1, 2, 3, 4]  # join order: the NAT'd pair is adjacent
    out = []
    for p in (1, 2, 3, 4):
        out += s.handle(st.Received(p, m.OptimizeTopology()))
    probes = {c.peer_id: c.msg.target_ids for c in out
              if isinstance(c, st.Send) and isinstance(c.msg, m.ProbeRequest)}
    assert probes == {1: [2], 2: [1], 3: [1, 2], 4: [1, 2]}
    for p, targets in probes.items():
        out = s.handle(st.Received(p, m.ProbeReport(target_ids=targets,
                                                    rates=[100e6] * len(targets))))
    solve = next(c for c in out if isinstance(c, st.Solve))
    idx = {p: k for k, p in enumerate(solve.members)}
    bw = solve.bw
    assert bw[idx[1]][idx[3]] == bw[idx[2]][idx[4]] == 100e6  # reverse: as direct
    assert bw[idx[3]][idx[4]] == bw[idx[4]][idx[3]] == 100e6 * s.nat_pair_factor
    import numpy as np
    ring = [solve.members[k] for k in topology.solve_exact(np.array(bw))]
    pairs = {(ring[k], ring[(k + 1) % 4]) for k in range(4)}
    assert (3, 4) not in pairs and (4, 3) not in pairs, ring


def test_the_solver_is_told_the_latencies_the_probes_dials_measured() -> None:
    """Each probe reports its quickest dial per target; the master keeps one-way
    latencies per pair and hands the solver the matrix, a pair no probe reaches (into a
    peer behind NAT) at the group's median. Reports without dials give no matrix."""
    from pccl import algorithms
    from pccl.master import state as st
    from pccl.protocol import messages as m

    def optimize(dials: bool) -> st.Solve:
        s = st.MasterState(mesh_max_bytes=0, token_key=bytes(32))
        for p in (1, 2, 3, 4):
            s.handle(st.PeerRegistered(p, 0, f"h:{p}", reachable=p != 4))
        s.handle(st.Received(1, m.P2PReport(epoch=1, failed=[])))
        s.handle(st.Received(1, m.UpdateTopology()))
        for p in (1, 2, 3, 4):
            s.handle(st.Received(p, m.P2PReport(epoch=2, failed=[])))
        out = []
        for p in (1, 2, 3, 4):
            out += s.handle(st.Received(p, m.OptimizeTopology()))
        probes = {c.peer_id: c.msg.target_ids for c in out
                  if isinstance(c, st.Send) and isinstance(c.msg, m.ProbeRequest)}
        assert probes == {1: [2, 3], 2: [1, 3], 3: [1, 2], 4: [1, 2, 3]}
        for p, targets in probes.items():
            out = s.handle(st.Received(p, m.ProbeReport(
                target_ids=targets, rates=[100e6] * len(targets),
                dial_seconds=[0.007 * (p + t) for t in targets] if dials else [])))
        return next(c for c in out if isinstance(c, st.Solve))

    assert optimize(dials=False).latency is None
    solve = optimize(dials=True)
    assert solve.latency is not None
    idx = {p: k for k, p in enumerate(solve.members)}
    lat = solve.latency
    for a in (1, 2, 3, 4):
        for b in (1, 2, 3):
            if a != b:
                assert lat[idx[a]][idx[b]] == algorithms.one_way_latency([0.007 * (a + b)])
    measured = sorted(lat[i][j] for i in range(4) for j in range(4)
                      if i != j and solve.members[j] != 4)
    assert [lat[idx[a]][idx[4]] for a in (1, 2, 3)] == [measured[len(measured) // 2]] * 3


def test_measurements_of_departed_peers_are_forgotten_at_the_next_optimization() -> None:
    from pccl.master import state as st
    from pccl.protocol import messages as m

    s = st.MasterState(mesh_max_bytes=0, token_key=bytes(32))
    for p in (1, 2, 3, 4):
        s.handle(st.PeerRegistered(p, 0, f"h:{p}"))
    s.handle(st.Received(1, m.P2PReport(epoch=1, failed=[])))
    s.handle(st.Received(1, m.UpdateTopology()))
    for p in (1, 2, 3, 4):
        s.handle(st.Received(p, m.P2PReport(epoch=2, failed=[])))

    def optimize(peers: tuple[int, ...]) -> None:
        out = []
        for p in peers:
            out += s.handle(st.Received(p, m.OptimizeTopology()))
        for c in out:
            if isinstance(c, st.Send) and isinstance(c.msg, m.ProbeRequest):
                s.handle(st.Received(c.peer_id, m.ProbeReport(
                    target_ids=c.msg.target_ids, rates=[1e8] * len(c.msg.target_ids),
                    dial_seconds=[0.01] * len(c.msg.target_ids))))

    optimize((1, 2, 3, 4))
    assert len(s.bandwidth) == len(s.latency) == 12
    s.handle(st.Received(4, m.Leave()))
    if s.round is not None:  # the repair round without peer 4
        for p in (1, 2, 3):
            s.handle(st.Received(p, m.P2PReport(epoch=s.round.epoch, failed=[])))
    assert 4 not in s.peers and s.round is None
    assert (4, 1) in s.bandwidth and (1, 4) in s.latency  # kept until the next one
    optimize((1, 2, 3))
    assert all(4 not in pair for pair in [*s.bandwidth, *s.latency])
    assert len(s.bandwidth) == len(s.latency) == 6


def test_a_better_ring_found_during_a_round_waits_for_the_next_update() -> None:
    # The round installs the ring whose links it made; a better order that came in
    # meanwhile stays pending (rings_stale) for the next update_topology().
    from pccl.master import state as st
    from pccl.protocol import messages as m

    s = _three_accepted()
    s.handle(st.PeerRegistered(4, 0, "h:4"))  # a joiner: the next vote runs a round
    for p in (1, 2, 3):
        s.handle(st.Received(p, m.UpdateTopology()))
    assert s.round is not None and s.round.epoch == 3
    s.opt_round = 1
    s.handle(st.BetterRing(1, 0, [1, 3, 2]))  # while the round of epoch 3 runs
    for p in (1, 2, 3, 4):
        s.handle(st.Received(p, m.P2PReport(epoch=3, failed=[])))
    assert s.rings[0] == [1, 2, 3, 4] and s.rings_stale
    out = []
    for p in (1, 2, 3, 4):
        out += s.handle(st.Received(p, m.UpdateTopology()))
    nexts = {c.peer_id: c.msg.next_id for c in out if isinstance(c.msg, m.EstablishP2P)}
    assert nexts == {1: 3, 3: 2, 2: 4, 4: 1}
