"""The straggler statistics (pccl.master.stragglers) on events with chosen clocks: exact
lags, held times, shares, rates and the outlier flag."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import pccl
from pccl.master.stragglers import OUTLIER_FLOOR_S, StragglerTracker, quantile
from pccl.testing import Cluster, LinkEmulator
from pccl.testing.data import deterministic_tensor

G = 0
PEERS = {1: G, 2: G, 3: G}


def run(t: StragglerTracker, tag: int, calls: dict[int, float], dones: dict[int, float],
        performed: float, end: float, ok: bool = True, ring: bool = True) -> None:
    """One collective: calls and dones in time order, the perform, the outcome."""
    events = [(at, "call", p) for p, at in calls.items()] + \
        [(at, "done", p) for p, at in dones.items()]
    for at, what, p in sorted(events):
        (t.called if what == "call" else t.done)(at, p, G, tag)
    t.performed(performed, G, tag)
    t.ended(end, G, tag, tuple(sorted(calls)), ok, ring)


def test_quantile_is_nearest_rank() -> None:
    xs = [0.4, 0.1, 0.3, 0.2]
    assert quantile(xs, 0.5) == 0.3
    assert quantile(xs, 0.95) == 0.4
    assert quantile([7.0], 0.95) == 7.0


def test_a_late_caller_holds_the_time_from_the_previous_call() -> None:
    t = StragglerTracker()
    # 1 calls at 10, 2 at 10.5, 3 at 12.5; the ring runs 12.5..13; everyone done at 13.
    run(t, 5, {1: 10.0, 2: 10.5, 3: 12.5}, {1: 13.0, 2: 13.0, 3: 13.0}, 12.5, 13.0)
    rows = {r.peer: r for r in t.table(PEERS)}
    assert rows[3].call_p95 == 2.5 and rows[2].call_p95 == 0.5 and rows[1].call_p95 == 0.0
    assert rows[3].held == 2.0  # from 2's call to its own
    assert rows[3].wait_share == 2.0 / 3.0  # of the wall time 10..13
    assert rows[1].held == rows[2].held == 0.0
    assert [r.peer for r in t.table(PEERS)] == [3, 2, 1]
    assert rows[1].done_p95 == 0.0


def test_the_last_to_finish_holds_from_the_previous_finish() -> None:
    t = StragglerTracker()
    # Everyone calls at once; 2 finishes at 1.36, 1 at 1.53, 3 at 1.70 (a slow link into 3).
    for k in range(4):
        base = 10.0 * k
        run(t, 1, {1: base + 1.0, 2: base + 1.0, 3: base + 1.0},
            {2: base + 1.36, 1: base + 1.53, 3: base + 1.70}, base + 1.0, base + 1.75)
    rows = t.table(PEERS)
    assert [r.peer for r in rows] == [3, 1, 2]
    slow = rows[0]
    assert slow.collectives == 4
    assert slow.held == pytest.approx(4 * 0.17)
    assert slow.wait_share == pytest.approx(0.17 / 0.75)
    assert slow.done_p95 == pytest.approx(0.34) and slow.call_p95 == 0.0
    assert slow.straggler
    assert not rows[1].straggler and not rows[2].straggler
    assert rows[1].done_p50 == pytest.approx(0.17) and rows[2].done_p50 == 0.0


def test_ties_hold_nothing_and_flag_nobody() -> None:
    t = StragglerTracker()
    run(t, 1, {1: 0.0, 2: 0.0, 3: 0.0}, {1: 1.0, 2: 1.0, 3: 1.0}, 0.0, 1.0)
    rows = t.table(PEERS)
    assert all(r.held == 0.0 and r.wait_share == 0.0 and not r.straggler for r in rows)
    assert [r.peer for r in rows] == [1, 2, 3]


def test_a_small_hold_on_fast_collectives_is_not_flagged() -> None:
    t = StragglerTracker()
    # Peer 3 is always 5 ms late on 10 ms collectives: half the time, but under the floor.
    for k in range(3):
        run(t, 1, {1: k, 2: k, 3: k + 0.005}, {}, k + 0.005, k + 0.01)
    rows = t.table(PEERS)
    assert rows[0].peer == 3 and rows[0].wait_share == pytest.approx(0.5)
    assert 0.005 < OUTLIER_FLOOR_S and not rows[0].straggler
    assert rows[0].done_p95 is None  # reduced by the master: no per-member end


def test_two_stragglers_against_a_quick_one_are_not_outliers_of_each_other() -> None:
    t = StragglerTracker()
    # 2 and 3 alternate being last by 1 s: each holds half the collectives.
    for k in range(4):
        late = 2 if k % 2 else 3
        calls = {1: 10.0 * k, 2: 10.0 * k, 3: 10.0 * k}
        calls[late] += 1.0
        run(t, 1, calls, {}, 10.0 * k + 1.0, 10.0 * k + 1.0)
    rows = {r.peer: r for r in t.table(PEERS)}
    assert rows[2].wait_share == rows[3].wait_share == 0.5
    assert not rows[2].straggler and not rows[3].straggler  # 0.5 < 3 x the other's 0.5


def test_failed_or_partly_seen_collectives_are_not_recorded() -> None:
    t = StragglerTracker()
    run(t, 1, {1: 0.0, 2: 1.0, 3: 2.0}, {}, 2.0, 3.0, ok=False)
    t.called(0.0, 1, G, 2)  # 2 and 3 called before this tracker saw them
    t.performed(1.0, G, 2)
    t.ended(2.0, G, 2, (1, 2, 3), True)
    assert t.table(PEERS) == []


def test_the_window_keeps_the_newest_collectives() -> None:
    t = StragglerTracker(window=2)
    run(t, 1, {1: 0.0, 2: 0.0, 3: 5.0}, {}, 5.0, 5.0)
    run(t, 1, {1: 10.0, 2: 10.0, 3: 10.0}, {}, 10.0, 11.0)
    run(t, 1, {1: 20.0, 2: 20.0, 3: 20.0}, {}, 20.0, 21.0)
    row = next(r for r in t.table(PEERS) if r.peer == 3)
    assert row.collectives == 2 and row.held == 0.0 and row.call_p95 == 0.0


def test_ring_rate_is_bytes_over_the_ring_time_between_heartbeats() -> None:
    t = StragglerTracker()
    t.heartbeat(0.0, 1, G, 1000)
    assert t.ring_rate(1) is None  # one sample
    run(t, 1, {1: 0.125, 2: 0.125, 3: 0.125}, {}, 0.25, 0.75)  # 0.5 s of ring
    run(t, 2, {1: 0.75, 2: 0.75, 3: 0.75}, {}, 0.75, 0.875, ring=False)  # mesh: not counted
    t.heartbeat(1.0, 1, G, 1000 + 2_000_000)
    assert t.ring_rate(1) == 4_000_000.0
    t.heartbeat(2.0, 1, G, 1000 + 2_000_000)  # idle: no new ring time, same rate
    assert t.ring_rate(1) == 4_000_000.0
    t.heartbeat(3.0, 1, G, 5)  # the counter went back: a fresh series
    assert t.ring_rate(1) is None
    t.forget(1)
    assert t.ring_rate(1) is None


def test_open_collectives_are_bounded() -> None:
    from pccl.master import stragglers

    t = StragglerTracker()
    for tag in range(stragglers.MAX_OPEN + 10):
        t.called(0.0, 1, G, tag)
    assert len(t._open) == stragglers.MAX_OPEN


# --- end to end: a master, three peers, one of them slow ------------------------------

STATUS = {"status_listen": "127.0.0.1:0"}
# 1 MiB all-reduces take the ring, not the mesh (whose bytes the counters leave out).
NO_MESH = {**STATUS, "mesh_max_bytes": 0}


async def api_status(master: object) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, \
            http.get(f"http://{master.status_address}/api/status") as r:  # type: ignore[attr-defined]
        assert r.status == 200
        doc: dict[str, Any] = await r.json()
        return doc


async def metrics_text(master: object) -> str:
    async with aiohttp.ClientSession() as http, \
            http.get(f"http://{master.status_address}/metrics") as r:  # type: ignore[attr-defined]
        return await r.text()


def lag_samples(text: str, peer: int) -> dict[tuple[str, str], float]:
    return {(s.labels["phase"], s.labels["quantile"]): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "pccl_peer_lag_seconds" and s.labels["peer"] == str(peer)}


@pytest.mark.timeout(60)
async def test_a_peer_behind_a_capped_link_is_named_first() -> None:
    """16 Mbit/s into one peer of three (the link emulator): each peer runs its own loop
    of 1 MiB all-reduces, as a training loop does; the ring waits for the capped peer to
    finish, and /api/status names it first, flagged, within four collectives."""
    async with LinkEmulator(bandwidth=2e6, chunk_size=64 * 1024) as emu, \
            Cluster(2, master_kwargs=NO_MESH) as cluster:
        slow = await cluster.admit_behind(emu)

        async def train(comm: pccl.Communicator, seed: int) -> None:
            x = deterministic_tensor("float32", 256 * 1024, seed=seed)
            for _ in range(4):
                await comm.all_reduce(x, tag=1)

        await asyncio.gather(*(train(c, i) for i, c in enumerate(cluster.comms)))
        doc = await api_status(cluster.master)
        assert doc["slowest"][0] == slow.peer_id, doc["slowest"]
        peers = {p["id"]: p for p in doc["peers"]}
        lag = peers[slow.peer_id]["lag"]
        assert lag["collectives"] == 4 and lag["straggler"] is True, lag
        assert lag["wait_share"] >= 0.1 and lag["done_p95_s"] > 0
        assert not any(peers[c.peer_id]["lag"]["straggler"] for c in cluster.comms
                       if c is not slow)
        text = await metrics_text(cluster.master)
        assert set(lag_samples(text, slow.peer_id)) == {
            ("call", "0.5"), ("call", "0.95"), ("done", "0.5"), ("done", "0.95")}
        # The ring rate needs the heartbeat after the last collective's bytes.
        deadline = asyncio.get_running_loop().time() + 10
        while lag["ring_bytes_per_s"] is None:
            assert asyncio.get_running_loop().time() < deadline, lag
            await asyncio.sleep(0.05)
            lag = {p["id"]: p for p in (await api_status(cluster.master))["peers"]}[
                slow.peer_id]["lag"]
        assert lag["ring_bytes_per_s"] > 0
        print(f"capped peer: {lag}")


@pytest.mark.timeout(60)
async def test_a_peer_that_calls_late_is_named_first() -> None:
    """One peer of three calls each all-reduce 0.2 s after the others (its step takes
    longer): the collectives wait for it, and it leads the table with its call lag."""
    async with Cluster(3, master_kwargs=STATUS) as cluster:
        late = cluster.comms[1]

        async def train(comm: pccl.Communicator) -> None:
            x = np.ones(1000, dtype=np.float32)
            for _ in range(4):
                if comm is late:
                    await asyncio.sleep(0.2)  # its slower step (the scenario, not a wait)
                await comm.all_reduce(x, tag=1)

        await asyncio.gather(*(train(c) for c in cluster.comms))
        doc = await api_status(cluster.master)
        assert doc["slowest"][0] == late.peer_id
        lag = {p["id"]: p for p in doc["peers"]}[late.peer_id]["lag"]
        assert lag["straggler"] is True and lag["call_p50_s"] > 0, lag
        assert lag["done_p50_s"] is None  # reduced by the master: no ring, no done lag
        text = await metrics_text(cluster.master)
        assert lag_samples(text, late.peer_id)[("call", "0.5")] == lag["call_p50_s"]


def test_the_outlier_rule_compares_with_the_median_of_the_others() -> None:
    t = StragglerTracker()
    peers = {p: G for p in range(1, 6)}
    # 5 peers; 5 is last by 4 s once, 4 by 1 s twice, 3 by 1 s once (10 s collectives).
    for k, (late, by) in enumerate([(5, 4.0), (4, 1.0), (4, 1.0), (3, 1.0)]):
        calls = dict.fromkeys(peers, 20.0 * k)
        calls[late] += by
        run(t, 1, calls, {}, 20.0 * k + by, 20.0 * k + 10.0)
    rows = {r.peer: r for r in t.table(peers)}
    assert [r.peer for r in t.table(peers)] == [5, 4, 3, 1, 2]
    assert rows[5].wait_share == 0.1 and rows[4].wait_share == 0.05
    # 5: others' median (of 0, 0, 0.025, 0.05) is 0.025: 0.1 >= 3 x 0.025, and >= 10 %.
    assert rows[5].straggler and not rows[4].straggler
