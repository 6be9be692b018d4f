"""pccl.sim (issue 22): the network model, the modelled collectives against pccl's own
cost model and mesh schedule, the master's cached roster against its peers, and small
whole runs of the scale simulation (no violations; the same seed replays the same run)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pccl import _core, algorithms
from pccl.master import state as ms
from pccl.sim import Churn, NetworkModel, ScaleSim, collectives, run
from pccl.testing.sim import Sim


def test_network_model_is_seeded_and_its_links_are_consistent() -> None:
    a, b = NetworkModel(), NetworkModel()
    a.sample(500, np.random.default_rng(7))
    b.sample(500, np.random.default_rng(7))
    assert np.array_equal(a.region, b.region) and np.array_equal(a.up, b.up)
    lat, bw = a.matrix(range(500))
    assert np.allclose(lat, lat.T)  # one-way latency is the same both ways here
    assert lat.min() > 0 and lat.max() < 0.5
    assert np.all(bw <= np.minimum(a.up[:, None], a.down[None, :]) + 1e-6)
    # Cross-continent links are slower per flow than links inside a region.
    na, asia = np.flatnonzero(a.region == 0), np.flatnonzero(a.region == 2)
    assert lat[np.ix_(na, asia)].mean() > lat[np.ix_(na, na)].mean()
    assert set(np.unique(a.region)) == {0, 1, 2}
    flat = NetworkModel(flat_ms=5.0, flat_master_ms=25.0)
    flat.sample(3, np.random.default_rng(0))
    assert float(flat.latency(0, 2)) == pytest.approx(0.005)
    assert float(flat.master_latency(1)) == pytest.approx(0.025)


def _uniform(k: int, one_way_ms: float, rate: float) -> NetworkModel:
    net = NetworkModel(flat_ms=one_way_ms, flat_master_ms=0.0, loss=1e-18)
    net.sample(k, np.random.default_rng(0))
    net.up[:] = net.down[:] = rate
    return net


@pytest.mark.parametrize("k", [2, 3, 5, 8, 13, 32])
def test_uniform_links_give_pccls_own_cost_model(k: int) -> None:
    net = _uniform(k, 5.0, 1e9)
    order = list(range(k))
    for nbytes in (4096, 1 << 20, 64 << 20):
        assert collectives.ring_seconds(net, order, nbytes) == pytest.approx(
            algorithms.ring_seconds(k, nbytes, 0.005, 1e9))
        assert collectives.mesh_seconds(net, order, nbytes) == pytest.approx(
            algorithms.mesh_seconds(k, nbytes, 0.005, 1e9))


@pytest.mark.parametrize("k", range(2, 41))
def test_modelled_mesh_steps_are_the_rust_schedule(k: int) -> None:
    pairs = set()
    for snd, rcv in collectives._mesh_steps(k):
        pairs |= {(int(a), int(b)) for a, b in zip(snd, rcv)}
    want = {(r, int(q)) for r in range(k) for q in _core.mesh_partners(r, k)}
    # Every exchange of the Rust schedule, and nothing else (the extras' pairs are one
    # way each step: in at the first, out at the last).
    assert {frozenset(p) for p in pairs} == {frozenset(p) for p in want}
    assert len(collectives._mesh_steps(k)) == _core.mesh_rounds(k)


def test_slowest_link_paces_the_ring_and_a_mesh_step_waits_for_its_slowest_pair() -> None:
    net = _uniform(8, 1.0, 1e9)
    order = list(range(8))
    fast = collectives.ring_seconds(net, order, 64 << 20)
    net.up[3] = 1e7  # one peer with a 10 MB/s uplink
    slow = collectives.ring_seconds(net, order, 64 << 20)
    assert slow == pytest.approx(fast - 14 / 8 * (64 << 20) / 1e9 + 14 / 8 * (64 << 20) / 1e7)
    assert collectives.mesh_seconds(net, order, 4096) > collectives.mesh_seconds(
        _uniform(8, 1.0, 1e9), order, 4096)


def test_regions_help_small_tensors_and_striping_helps_large_ones() -> None:
    net = NetworkModel()
    net.sample(300, np.random.default_rng(3))
    order = list(range(300))
    t = collectives.all_algorithms(net, order, 4096)
    assert t["ring_region_sorted"] < t["ring_join_order"]  # 3 ocean crossings, not ~200
    assert min(t["mesh"], t["hierarchical"], t["via_master"]) < t["ring_region_sorted"]
    big = collectives.all_algorithms(net, order, 64 << 20)
    assert big["ring_region_sorted"] <= big["ring_join_order"]
    assert math.isfinite(big["striped_4"]) and big["striped_4"] > 0


def test_the_cached_roster_always_matches_the_peers() -> None:
    """The master's cached accepted/pending/per-group lists against a recount after
    every event of seeded runs with joins, kills and dropped connections."""
    checked = 0
    for seed in range(12):
        sim = Sim(seed, peers=4, joiners=3, steps=4, kills=2, drops=1, breaks=1)
        handle = sim.master.handle

        def checked_handle(ev: ms.Event, st: ms.MasterState = sim.master,
                           handle=handle) -> list[ms.Command]:
            nonlocal checked
            out = handle(ev)
            acc = [p for p, r in st.peers.items() if r.status is ms.PeerStatus.ACCEPTED]
            pend = [p for p, r in st.peers.items() if r.status is ms.PeerStatus.REGISTERED]
            assert st.accepted() == acc and st.pending() == pend
            for g in {r.peer_group for r in st.peers.values()}:
                want = [p for p in acc if st.peers[p].peer_group == g]
                assert st._members(g) == want and st._member_set(g) == frozenset(want)
            checked += 1
            return out

        sim.master.handle = checked_handle  # type: ignore[method-assign]
        assert sim.run().violations == []
    assert checked > 1000


def test_a_small_run_with_churn_keeps_every_invariant() -> None:
    fig = run(40, seed=5, duration=60.0, churn=Churn(kills=0.2, hangs=0.05, leaves=0.1,
                                                     joins=0.3, start=5.0, stop=50.0),
              reduce_bytes=64 << 10, sync_bytes=1 << 20)
    assert fig["violations"] == []
    assert fig["steps_done"] >= 40
    assert fig["kills"] + fig["hangs"] + fig["leaves"] >= 3 and fig["joins"] >= 3
    assert fig["admission"]["n"] >= 40
    assert fig["master_events"] > 1000 and fig["master_cpu_per_event_us"] > 0
    assert 0 <= fig["lost_fraction"] < 1
    assert set(fig["calls"]) >= {"reduce1", "reduce2", "sync"}


def test_peer_groups_run_their_own_collectives_and_syncs_under_churn() -> None:
    """Four groups of about 10: every group steps on its own (its collectives' worlds
    are its members, its syncs agree inside it), and every invariant holds, the parity
    of each group's syncs included."""
    sim = ScaleSim(40, seed=7, duration=60.0, measure_cpu=False, group_size=10,
                   churn=Churn(kills=0.2, hangs=0.05, leaves=0.1, joins=0.3, start=5.0,
                               stop=50.0),
                   reduce_bytes=64 << 10, sync_bytes=1 << 20)
    rep = sim.run()
    assert rep.violations == []
    master = sim.master.state
    groups = {master.peers[p].peer_group for p in master.accepted()}
    assert groups == {0, 1, 2, 3}
    # Each group has its own ring, of about 10.
    assert sim.steps_done >= 40
    assert set(master.rings) == groups and all(5 <= len(r) <= 16 for r in master.rings.values())
    # Syncs committed per group: every instance's committers are of one group.
    assert sim.by_sync and all(len({sim.group_of(p) for p in states}) == 1
                               for states in sim.by_sync.values())


def test_without_measured_cpu_the_same_seed_replays_the_same_run() -> None:
    def once() -> tuple[int, float, int, int]:
        sim = ScaleSim(25, seed=11, steps=2, measure_cpu=False,
                       churn=Churn(kills=0.2, joins=0.2, start=3.0, stop=30.0))
        rep = sim.run()
        return rep.events, sim.now, sim.steps_done, sim.kills

    assert once() == once()


def test_the_command_line_writes_every_section(tmp_path) -> None:
    """``python -m pccl.sim`` end to end at toy sizes: every section lands in the JSON,
    the calibration rows come from the measured bench results in the repository."""
    import json

    from pccl.sim.__main__ import main

    out = tmp_path / "scale.json"
    rc = main(["--peers", "24", "--minutes", "0.5", "--algorithm-peers", "8", "40",
               "--solver-peers", "8", "--solver-budget", "0.05", "--out", str(out)])
    assert rc == 0
    fig = json.loads(out.read_text())
    assert [r["peers"] for r in fig["runs"]] == [24] and fig["runs"][0]["violations"] == []
    assert fig["runs"][0]["steps_done"] > 0
    assert {(r["peers"], r["size"]) for r in fig["algorithms"]} == {
        (k, s) for k in (8, 40) for s in ("4 KiB", "1 MiB", "64 MiB")}
    assert fig["solver"][0]["peers"] == 8 and fig["solver"][0]["solver_s"] > 0
    cal = fig["calibration"]
    assert [r["peers"] for r in cal["data_plane"]] == [4, 8, 16, 32]
    for r in cal["end_to_end"]:
        # The simulated via-master all-reduce is one master round trip, as measured.
        assert 0.05 < r["model_s"]["via_master"] < 0.08
