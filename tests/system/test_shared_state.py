"""Shared-state sync: joiners catch up bit for bit, divergence is corrected, the
tie-break is deterministic, misuse gets typed errors, failures lose nothing."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

import pccl
from pccl import _core
from pccl.protocol import messages as m
from pccl.testing import Cluster, HeldMessage, LinkEmulator, free_port
from pccl.testing.data import deterministic_tensor, digest

try:
    import torch
except ImportError:  # optional
    torch = None

S = pccl.SharedStateSyncStrategy


def make_state(seed: int, revision: int = 0, n: int = 1000) -> tuple[pccl.SharedState, dict]:
    tensors = {"weights": deterministic_tensor("float32", n, seed),
               "step": np.array([seed], dtype=np.int64),
               "moments": deterministic_tensor("float16", 3 * n, seed + 1)}
    return pccl.SharedState([pccl.TensorInfo.from_numpy(t, k) for k, t in tensors.items()],
                            revision=revision), tensors


def hashes(tensors: dict) -> dict:
    return {k: _core.content_hash(t.reshape(-1).view(np.uint8)) for k, t in tensors.items()}


async def sync_all(comms, states, strategies=None):
    strategies = strategies or [S.ENFORCE_POPULAR] * len(comms)
    return await asyncio.gather(*(c.sync_shared_state(s, strategy=st)
                                  for c, s, st in zip(comms, states, strategies)),
                                return_exceptions=True)


async def test_identical_state_moves_nothing(pccl_cluster) -> None:
    cluster = await pccl_cluster(3)
    pairs = [make_state(1) for _ in range(3)]
    infos = await sync_all(cluster.comms, [p[0] for p in pairs])
    assert all(i == pccl.SyncInfo(tx_bytes=0, rx_bytes=0) for i in infos)


async def test_corrupted_tensor_is_corrected_by_enforce_popular(pccl_cluster) -> None:
    cluster = await pccl_cluster(4)
    pairs = [make_state(1) for _ in range(4)]
    bad = pairs[2][1]["weights"]
    bad[17] = np.float32(-1e9)
    infos = await sync_all(cluster.comms, [p[0] for p in pairs])
    want = hashes(pairs[0][1])
    assert all(hashes(t) == want for _, t in pairs)
    assert infos[2].rx_bytes == 4000 and sum(i.tx_bytes for i in infos) == 4000
    assert all(s.revision == 0 for s, _ in pairs)


async def test_late_joiner_receive_only_adopts_revision_and_content(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    pairs = [make_state(5, revision=0) for _ in range(2)]
    await sync_all(cluster.comms, [p[0] for p in pairs])
    for s, _ in pairs:
        s.revision += 1
    await sync_all(cluster.comms, [p[0] for p in pairs])
    joiner = cluster.new_comm()
    await cluster.admit([joiner])
    fresh_state, fresh = make_state(99, revision=0)  # different content, revision 0
    for s, _ in pairs:
        s.revision += 1
    infos = await sync_all([*cluster.comms[:2], joiner], [pairs[0][0], pairs[1][0], fresh_state],
                           [S.ENFORCE_POPULAR, S.ENFORCE_POPULAR, S.RECEIVE_ONLY])
    assert fresh_state.revision == 2 == pairs[0][0].revision
    assert hashes(fresh) == hashes(pairs[0][1])
    total = sum(t.nbytes for t in fresh.values())
    assert infos[2].rx_bytes == total
    # The load is spread: both up-to-date peers served part of it.
    assert infos[0].tx_bytes + infos[1].tx_bytes == total


async def test_two_way_tie_is_broken_by_the_earliest_joined_peer(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    a, b = sorted(cluster.comms, key=lambda c: c.peer_id)
    (sa, ta), (sb, tb) = make_state(1), make_state(2)
    want = hashes(ta)
    # The same outcome whatever order the peers call in.
    for first in (a, b):
        other = b if first is a else a
        s_first, s_other = (sa, sb) if first is a else (sb, sa)
        await sync_all([first, other], [s_first, s_other])
        assert hashes(ta) == hashes(tb) == want
        sa.revision += 1
        sb.revision += 1


async def test_revision_must_advance_by_exactly_one(pccl_cluster) -> None:
    cluster = await pccl_cluster(3)
    pairs = [make_state(1) for _ in range(3)]
    await sync_all(cluster.comms, [p[0] for p in pairs])
    pairs[0][0].revision += 1
    pairs[1][0].revision += 1
    pairs[2][0].revision += 2  # skips one
    pairs[1][1]["weights"][0] = 5.0  # diverged meanwhile
    before = hashes(pairs[2][1])
    res = await sync_all(cluster.comms, [p[0] for p in pairs])
    assert isinstance(res[2], pccl.RevisionIncrementViolationError)
    assert hashes(pairs[2][1]) == before
    # The others still synced among themselves (tie: the earliest joiner's content).
    assert not isinstance(res[0], Exception) and not isinstance(res[1], Exception)


async def test_mismatched_keys_name_the_key(pccl_cluster) -> None:
    cluster = await pccl_cluster(3)
    pairs = [make_state(1) for _ in range(3)]
    odd = pccl.SharedState([pccl.TensorInfo.from_numpy(t, k) for k, t in pairs[2][1].items()
                            if k != "step"] + [pccl.TensorInfo.from_numpy(np.zeros(3), "stepp")])
    res = await sync_all(cluster.comms, [pairs[0][0], pairs[1][0], odd])
    assert isinstance(res[2], pccl.InvalidUsageError)
    assert "'step'" in str(res[2]) or "stepp" in str(res[2])
    # A different dtype under the same key is refused the same way.
    cluster2 = cluster.comms[:2]
    s0, _ = make_state(1, revision=1)
    s1 = pccl.SharedState([pccl.TensorInfo.from_numpy(np.zeros(1000, np.float64), "weights"),
                           pccl.TensorInfo.from_numpy(np.zeros(1, np.int64), "step"),
                           pccl.TensorInfo.from_numpy(np.zeros(3000, np.float16), "moments")],
                          revision=1)
    s2, _ = make_state(1, revision=1)
    res = await sync_all(cluster.comms, [s0, s1, s2])
    assert isinstance(res[1], pccl.InvalidUsageError) and "weights" in str(res[1])
    assert len(cluster2) == 2


async def test_send_only_never_changes_local_tensors(pccl_cluster) -> None:
    cluster = await pccl_cluster(3)
    pairs = [make_state(1) for _ in range(3)]
    pairs[0][1]["weights"][3] = 3.0  # the SEND_ONLY peer is the odd one out
    before = hashes(pairs[0][1])
    res = await sync_all(cluster.comms, [p[0] for p in pairs],
                         [S.SEND_ONLY, S.ENFORCE_POPULAR, S.ENFORCE_POPULAR])
    assert not any(isinstance(r, Exception) for r in res)
    assert hashes(pairs[0][1]) == before
    assert hashes(pairs[1][1]) == hashes(pairs[2][1]) != before


async def test_allow_content_inequality_is_skipped(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    rngs = [np.arange(4, dtype=np.uint32) + i for i in range(2)]
    ws = [np.ones(10, np.float32) for _ in range(2)]
    states = [pccl.SharedState([pccl.TensorInfo.from_numpy(w, "w"),
                                pccl.TensorInfo.from_numpy(r, "rng",
                                                           allow_content_inequality=True)])
              for w, r in zip(ws, rngs)]
    infos = await sync_all(cluster.comms, states)
    assert all(i.rx_bytes == 0 for i in infos)
    assert not np.array_equal(rngs[0], rngs[1])


async def test_nobody_offering_state_is_no_shared_state(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    pairs = [make_state(1) for _ in range(2)]
    res = await sync_all(cluster.comms, [p[0] for p in pairs], [S.RECEIVE_ONLY] * 2)
    assert all(isinstance(r, pccl.NoSharedStateAvailableError) for r in res)


@pytest.mark.skipif(torch is None, reason="torch is not installed")
async def test_torch_tensors(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    ts = [torch.full((4, 5), float(i), dtype=torch.bfloat16) for i in range(2)]
    states = [pccl.SharedState([pccl.TensorInfo.from_torch(t, "t")]) for t in ts]
    await sync_all(cluster.comms, states)
    assert torch.equal(ts[0], ts[1])


async def holder_processes(cluster: Cluster, start_process, emu: LinkEmulator, port: int,
                           count: int) -> list:
    """``count`` accepted holder processes; the first one is reached through ``emu``
    (listening on ``port``), the others directly. The cluster's one peer admits them."""
    procs = [await start_process(cluster.master.address, extra_args=[
        "--p2p-advertise-address", emu.address, "--p2p-port", str(port)])]
    await cluster.master.wait_for(lambda s: len(s.pending()) == 1, timeout=60)
    for _ in range(count - 1):
        procs.append(await start_process(cluster.master.address))
    await cluster.master.wait_for(lambda s: len(s.pending()) == count, timeout=60)
    await cluster.comms[0].update_topology()
    for p in procs:
        await p.wait_accepted()
    return procs


async def forwarded(emu: LinkEmulator, nbytes: int) -> None:
    """Returns once ``emu`` forwarded ``nbytes`` (bounded)."""
    async with asyncio.timeout(30):
        while emu.bytes_forwarded < nbytes:  # noqa: ASYNC110 (no event to wait on)
            await asyncio.sleep(0.01)


@pytest.mark.alone  # 64 MiB+ transfers against the heartbeat timeout
@pytest.mark.parametrize(("fault", "sources"), [("kill", 1), ("kill", 2), ("stop", 2)])
async def test_source_lost_mid_transfer(pccl_peer_process, fault: str, sources: int) -> None:
    """An up-to-date source (a process) is SIGKILLed (or SIGSTOPped: frozen with its
    sockets open) while a large tensor flows to the stale peer through a slow link. With
    a second source holding the same content the stale peer fetches the rest from it,
    keeping what already landed (after ``peer_timeout`` of silence for a frozen source),
    and the sync succeeds for everyone left; with none, the stale peer gets
    PeerConnectionError and its tensor is untouched."""
    n = 16 << 20  # 64 MiB of float32
    port = free_port()
    async with LinkEmulator(f"127.0.0.1:{port}", bandwidth=20e6, chunk_size=256 * 1024) as emu:
        async with Cluster(1, comm_kwargs={"peer_timeout": 3.0}) as cluster:
            (stale,) = cluster.comms
            procs = await holder_processes(cluster, pccl_peer_process, emu, port, sources)
            src = procs[0]
            for p in procs:
                await p.call("make_tensor", name="w", dtype="float32", count=n, seed=7)
            mine = deterministic_tensor("float32", n, seed=8)
            before = digest(mine)
            state = pccl.SharedState([pccl.TensorInfo.from_numpy(mine, "w")])
            # The sources agree; src is the earlier joiner, so it is the stale peer's
            # first source, behind the slow emulator.
            strategy = S.ENFORCE_POPULAR if sources == 2 else S.RECEIVE_ONLY
            reports: list[pccl.SyncProgress] = []
            calls = [asyncio.create_task(p.call("sync", names=["w"], revision=0))
                     for p in procs]
            mine_sync = asyncio.create_task(stale.sync_shared_state(
                state, strategy, progress=reports.append, progress_interval=0.05))
            await cluster.master.wait_for(lambda s: any(x.planned for x in s.syncs.values()))
            await forwarded(emu, 4 << 20)
            if fault == "stop":
                src.stop()
                calls[0].cancel()  # a frozen process never answers
            else:
                src.kill()
                with pytest.raises(ConnectionError):
                    await calls[0]
            if sources == 1:
                with pytest.raises(pccl.PeerConnectionError, match="could not fetch"):
                    await mine_sync
                assert digest(mine) == before and state.revision == 0
                assert reports[-1].final and reports[-1].tensors_done == 0
                return
            info = await mine_sync
            theirs = await calls[1]
            assert digest(mine) == theirs["digests"]["w"] != before
            assert info.rx_bytes == 4 * n
            # The second holder served its own half and the rest of the first half: the
            # whole leaves that had landed from the lost holder were kept, not fetched again.
            assert 2 * n < theirs["tx_bytes"] <= 4 * n - (2 << 20)
            # Progress: bytes of the first attempt came in before the end, then all.
            assert reports[0].rx_total == 4 * n and reports[0].tensors_total == 1
            assert any(0 < r.rx_bytes < 4 * n and not r.final for r in reports)
            assert reports[-1] == dataclasses.replace(
                reports[-1], rx_bytes=4 * n, tensors_done=1, final=True)
            assert sum(r.final for r in reports) == 1


async def test_in_place_receive_only_lands_straight_in_the_tensors(pccl_cluster) -> None:
    cluster = await pccl_cluster(3)
    pairs = [make_state(4, revision=2) for _ in range(2)]
    fresh, tensors = make_state(99)
    infos = await asyncio.gather(
        *(c.sync_shared_state(s) for c, (s, _) in zip(cluster.comms, pairs)),
        cluster.comms[2].sync_shared_state(fresh, S.RECEIVE_ONLY, in_place=True))
    assert hashes(tensors) == hashes(pairs[0][1]) and fresh.revision == 2
    assert infos[2].rx_bytes == sum(t.nbytes for t in tensors.values())


async def test_progress_reports_and_a_failing_callback(pccl_cluster, caplog) -> None:
    cluster = await pccl_cluster(3)
    pairs = [make_state(4, revision=2) for _ in range(2)]
    fresh, tensors = make_state(99)
    total = sum(t.nbytes for t in tensors.values())
    seen: list[list[pccl.SyncProgress]] = [[], [], []]
    calls = 0

    def broken(p: pccl.SyncProgress) -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("callback bug")

    infos = await asyncio.gather(
        *(c.sync_shared_state(s, progress=seen[i].append)
          for i, (c, (s, _)) in enumerate(zip(cluster.comms, pairs))),
        cluster.comms[2].sync_shared_state(fresh, S.RECEIVE_ONLY, progress=seen[2].append))
    assert hashes(tensors) == hashes(pairs[0][1])
    first, last = seen[2][0], seen[2][-1]
    assert (first.rx_bytes, first.rx_total, first.tensors_done, first.tensors_total,
            first.final) == (0, total, 0, 3, False)
    assert (last.rx_bytes, last.tensors_done, last.final) == (total, 3, True)
    # Sources fetch nothing; what they served adds up to what the joiner fetched.
    assert all(r.rx_total == 0 and r.tensors_total == 0 for r in seen[0] + seen[1])
    assert seen[0][-1].tx_bytes + seen[1][-1].tx_bytes == total == infos[2].rx_bytes
    assert [i.tx_bytes for i in infos[:2]] == [seen[0][-1].tx_bytes, seen[1][-1].tx_bytes]

    # A callback that raises is logged once and dropped; the sync goes on.
    for s, _ in pairs:
        s.revision += 1
    fresh.revision += 1
    infos = await asyncio.gather(
        *(c.sync_shared_state(s) for c, (s, _) in zip(cluster.comms, pairs)),
        cluster.comms[2].sync_shared_state(fresh, progress=broken))
    assert calls == 1 and fresh.revision == 3
    assert "progress callback failed" in caplog.text


@pytest.mark.alone  # 96 MiB in one process against the heartbeat timeout
async def test_large_tensor_is_fetched_in_ranges_from_every_holder(pccl_cluster) -> None:
    cluster = await pccl_cluster(4)
    n = 3 * (32 << 20) // 4 + 5  # int32 elements: three ranges, the last one shorter
    good = np.arange(n, dtype=np.int32)
    states = [pccl.SharedState([pccl.TensorInfo.from_numpy(good.copy(), "w")])
              for _ in range(3)]
    mine = np.zeros(n, dtype=np.int32)
    infos = await asyncio.gather(
        *(c.sync_shared_state(s) for c, s in zip(cluster.comms, states)),
        cluster.comms[3].sync_shared_state(pccl.SharedState([pccl.TensorInfo.from_numpy(
            mine, "w")]), S.RECEIVE_ONLY))
    assert np.array_equal(mine, good)
    assert all(i.tx_bytes > 0 for i in infos[:3])
    assert sum(i.tx_bytes for i in infos[:3]) == infos[3].rx_bytes == good.nbytes


@pytest.mark.alone  # as above
async def test_a_range_from_a_lying_holder_falls_back_to_whole_fetches(pccl_cluster,
                                                                      monkeypatch) -> None:
    """A holder whose bytes do not match the hash it announced (here: its hash is faked)
    spoils the ranged fetch; whole-tensor fetches from the holders in turn get the
    popular content, and the liar's bytes are never accepted."""
    cluster = await pccl_cluster(4)
    n = 3 * (32 << 20) // 4
    good = np.arange(n, dtype=np.int32)
    tensors = [good.copy() for _ in range(3)]
    tensors[1][:: n // 8] = -1  # the liar's bytes differ in whatever range it serves
    real_hash = pccl.communicator._core.content_hash

    def lying_hash(buf, *a, **kw):  # type: ignore[no-untyped-def]
        if np.shares_memory(buf, tensors[1]):
            return real_hash(good)
        return real_hash(buf, *a, **kw)

    monkeypatch.setattr(pccl.communicator._core, "content_hash", lying_hash)
    states = [pccl.SharedState([pccl.TensorInfo.from_numpy(t, "w")]) for t in tensors]
    mine = np.zeros(n, dtype=np.int32)
    infos = await asyncio.gather(
        *(c.sync_shared_state(s) for c, s in zip(cluster.comms, states)),
        cluster.comms[3].sync_shared_state(pccl.SharedState([pccl.TensorInfo.from_numpy(
            mine, "w")]), S.RECEIVE_ONLY))
    assert np.array_equal(mine, good) and infos[3].rx_bytes == good.nbytes
    assert sum(i.tx_bytes for i in infos[:3]) > good.nbytes  # ranges, then whole tensors


async def test_fetch_into_checks_its_range(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    a, b = cluster.comms
    served = np.arange(3 << 20, dtype=np.uint8)
    a._node.serve("w", served)
    try:
        out = np.zeros(1 << 20, dtype=np.uint8)
        src = cluster.master.state.peers[a.peer_id].p2p_addr
        digests = await b._node.fetch_into(src, a.peer_id, "w", out, offset=1 << 20,
                                           total=3 << 20)
        assert np.array_equal(out, served[1 << 20:2 << 20]) and len(digests) == 16
        with pytest.raises(pccl.InvalidArgumentError, match="hash leaves"):
            await b._node.fetch_into(src, a.peer_id, "w", out, offset=5, total=3 << 20)
        with pytest.raises(pccl.InvalidUsageError, match="shorter"):
            await b._node.fetch_into(src, a.peer_id, "w", out, offset=3 << 20, total=4 << 20)
        with pytest.raises(pccl.InvalidUsageError, match="with 3145728 bytes"):
            await b._node.fetch_into(src, a.peer_id, "w", out, offset=0, total=2 << 20)
        whole = np.zeros(3 << 20, dtype=np.uint8)
        digests = await b._node.fetch_into(src, a.peer_id, "w", whole)
        assert _core.hash_root(digests, whole.nbytes) == _core.content_hash(served)
    finally:
        a._node.unserve_all()


async def test_fetch_op_reports_each_tensor_and_checks_its_buffers(pccl_cluster) -> None:
    """The fetch engine's Python edge: one result per tensor (None or the exception),
    progress while and after it runs, and buffers that may not share memory."""
    cluster = await pccl_cluster(2)
    a, b = cluster.comms
    served = np.arange(3 << 20, dtype=np.uint8)
    a._node.serve("w", served)
    try:
        src = cluster.master.state.peers[a.peer_id].p2p_addr
        out, other = np.zeros_like(served), np.zeros(5, np.uint8)
        op = b._node.start_fetch(
            [("w", out, _core.content_hash(served), [a.peer_id]),
             ("nope", other, _core.content_hash(other), [a.peer_id])],
            {a.peer_id: src}, streams=2, io_timeout=5.0)
        assert (op.rx_bytes, op.tensors_done) == (0, 0)
        results = await op.run()
        assert results[0] is None and np.array_equal(out, served)
        assert isinstance(results[1], pccl.PeerConnectionError)
        assert "does not serve" in str(results[1]) and "nope" in str(results[1])
        assert (op.rx_bytes, op.tensors_done) == (served.nbytes, 1)
        with pytest.raises(pccl.InvalidUsageError, match="twice"):
            op.run()
        with pytest.raises(pccl.InvalidArgumentError, match="overlap"):
            b._node.start_fetch([("x", out[:10], b"", [1]), ("y", out[5:20], b"", [1])], {})
    finally:
        a._node.unserve_all()


async def test_many_small_tensors_reuse_a_few_transfer_streams() -> None:
    """64 tensors from one holder: each fetch used to dial (and authenticate) a stream of
    its own; now a stream that finished a fetch cleanly serves the next ones, and the
    kept streams are closed when the sync ends."""
    port = free_port()
    async with LinkEmulator(f"127.0.0.1:{port}", latency=0.002) as emu:
        async with Cluster(0) as cluster:
            src = cluster.new_comm(p2p_listen_port=port, p2p_advertise_address=emu.address)
            await cluster.admit([src])
            joiner = cluster.new_comm()
            await cluster.admit([joiner])
            theirs = {f"t{i}": deterministic_tensor("float32", 1000 + i, i) for i in range(64)}
            mine = {k: np.zeros_like(t) for k, t in theirs.items()}
            open_before, accepted_before = emu.connection_count, emu.connections_accepted
            await asyncio.gather(
                src.sync_shared_state(pccl.SharedState(
                    [pccl.TensorInfo.from_numpy(t, k) for k, t in theirs.items()])),
                joiner.sync_shared_state(pccl.SharedState(
                    [pccl.TensorInfo.from_numpy(t, k) for k, t in mine.items()]),
                    S.RECEIVE_ONLY))
            assert all(np.array_equal(mine[k], theirs[k]) for k in theirs)
            # At most one stream per fetch in flight, not one per tensor.
            from pccl.peer.fetch import MAX_FETCHES_IN_FLIGHT
            assert emu.connections_accepted - accepted_before <= MAX_FETCHES_IN_FLIGHT < 64
            async with asyncio.timeout(10):
                await emu.wait_for_connections(open_before)


@pytest.mark.parametrize("who", ["fetcher", "holder"])
async def test_cancelled_sync_is_called_off_for_the_whole_group(who: str) -> None:
    """A caller cancels its sync while a tensor flows through a slow link: the fetcher
    mid-transfer, or the holder after it reported success (it had nothing to fetch).
    Nobody commits: the other peer gets CollectiveAbortedError, every tensor and
    revision is as before, and the next sync works."""
    n = 2 << 20  # 8 MiB of float32
    port = free_port()
    async with LinkEmulator(f"127.0.0.1:{port}", bandwidth=20e6, chunk_size=256 * 1024) as emu:
        async with Cluster(0) as cluster:
            holder = cluster.new_comm(p2p_listen_port=port, p2p_advertise_address=emu.address)
            await cluster.admit([holder])
            fetcher = cluster.new_comm()
            await cluster.admit([fetcher])
            theirs = deterministic_tensor("float32", n, 1)
            mine = deterministic_tensor("float32", n, 2)
            before = digest(mine)
            states = [pccl.SharedState([pccl.TensorInfo.from_numpy(t, "w")], revision=3)
                      for t in (theirs, mine)]
            calls = [asyncio.create_task(holder.sync_shared_state(states[0])),
                     asyncio.create_task(fetcher.sync_shared_state(states[1], S.RECEIVE_ONLY))]
            if who == "holder":
                await cluster.master.wait_for(
                    lambda s: 0 in s.syncs and holder.peer_id in s.syncs[0].reported, timeout=10)
            await forwarded(emu, 1 << 20)
            victim, other = calls if who == "holder" else calls[::-1]
            victim.cancel()
            with pytest.raises(asyncio.CancelledError):
                await victim
            with pytest.raises(pccl.CollectiveAbortedError, match="cancelled its sync"):
                await other
            assert digest(mine) == before and states[1].revision == 3
            assert not cluster.master.state.syncs
            infos = await asyncio.gather(
                holder.sync_shared_state(states[0]),
                fetcher.sync_shared_state(states[1], S.RECEIVE_ONLY))
            assert np.array_equal(mine, theirs) and infos[1].rx_bytes == 4 * n
            assert states[0].revision == states[1].revision == 3


async def test_cancel_after_the_group_decided_still_commits(pccl_cluster) -> None:
    """The outcome (success) is on its way when the caller cancels: the peer commits it
    anyway (parity with the group, which committed), then raises CancelledError."""
    cluster = await pccl_cluster(3)
    pairs = [make_state(1, revision=4) for _ in range(3)]
    stale_state, stale = pairs[2]
    stale["weights"][5] = np.float32(123.0)
    held = HeldMessage(cluster.comms[2], m.SyncOutcome)
    calls = [asyncio.create_task(c.sync_shared_state(s)) for c, (s, _) in zip(cluster.comms, pairs)]
    await asyncio.gather(*calls[:2])
    async with asyncio.timeout(10):
        await held.arrived.wait()
    assert held.message.ok and hashes(stale) != hashes(pairs[0][1])  # type: ignore[union-attr]
    calls[2].cancel()  # the task sees it before the outcome that follows
    held.release()
    with pytest.raises(asyncio.CancelledError):
        await calls[2]
    assert hashes(stale) == hashes(pairs[0][1]) and stale_state.revision == 4
    # The master counts the sync as done here too: the next revision follows it.
    for s, _ in pairs:
        s.revision += 1
    infos = await sync_all(cluster.comms, [p[0] for p in pairs])
    assert all(i == pccl.SyncInfo(tx_bytes=0, rx_bytes=0) for i in infos)


@pytest.mark.parametrize("pool", [1, 4])
async def test_one_large_tensor_from_one_holder_uses_pool_size_streams(monkeypatch,
                                                                       pool: int) -> None:
    """A single large tensor with a single holder is fetched in ranges over
    ``p2p_connection_pool_size`` streams (a per-connection cap, as on many internet
    paths, then does not cap the sync), and arrives bit for bit."""
    from pccl.peer import fetch

    monkeypatch.setattr(fetch, "RANGE_BYTES", 4 << 20)  # 16 MiB: 4 ranges
    port = free_port()
    async with LinkEmulator(f"127.0.0.1:{port}", bandwidth=100e6) as emu:
        async with Cluster(0, pool_size=pool) as cluster:
            src = cluster.new_comm(p2p_listen_port=port, p2p_advertise_address=emu.address)
            await cluster.admit([src])
            joiner = cluster.new_comm()
            await cluster.admit([joiner])
            theirs = deterministic_tensor("float32", 4 << 20, 3)
            mine = np.zeros_like(theirs)
            accepted_before = emu.connections_accepted
            infos = await asyncio.gather(
                src.sync_shared_state(pccl.SharedState([pccl.TensorInfo.from_numpy(theirs,
                                                                                   "w")])),
                joiner.sync_shared_state(pccl.SharedState([pccl.TensorInfo.from_numpy(mine,
                                                                                      "w")]),
                                         S.RECEIVE_ONLY))
            assert np.array_equal(mine, theirs) and infos[1].rx_bytes == theirs.nbytes
            assert emu.connections_accepted - accepted_before == pool


async def test_small_tensors_come_pipelined_and_a_liars_are_fetched_again(pccl_cluster,
                                                                          monkeypatch) -> None:
    """Small tensors come in batches, one stream per batch with the requests pipelined.
    A holder whose bytes do not match the hash it announced for some of them (faked
    here) spoils only those: each is fetched again from the other holder, and the
    liar's bytes are never accepted."""
    cluster = await pccl_cluster(3)
    good = {f"t{i}": deterministic_tensor("float32", 1000 + i, i) for i in range(40)}
    honest = {k: v.copy() for k, v in good.items()}
    liar = {k: v.copy() for k, v in good.items()}
    lies = list(liar)[::3]
    for k in lies:
        liar[k][0] = -1.0
    real_hash = pccl.communicator._core.content_hash

    def lying_hash(buf, *a, **kw):  # type: ignore[no-untyped-def]
        for k, t in liar.items():
            if np.shares_memory(buf, t):
                return real_hash(good[k])
        return real_hash(buf, *a, **kw)

    monkeypatch.setattr(pccl.communicator._core, "content_hash", lying_hash)
    mine = {k: np.zeros_like(v) for k, v in good.items()}

    def state(ts: dict) -> pccl.SharedState:
        return pccl.SharedState([pccl.TensorInfo.from_numpy(t, k) for k, t in ts.items()])

    infos = await asyncio.gather(
        cluster.comms[0].sync_shared_state(state(honest)),
        cluster.comms[1].sync_shared_state(state(liar)),
        cluster.comms[2].sync_shared_state(state(mine), S.RECEIVE_ONLY))
    assert all(np.array_equal(mine[k], good[k]) for k in good)
    total = sum(t.nbytes for t in good.values())
    assert infos[2].rx_bytes == total
    # Both holders served their share; the lies were served twice (once by the liar).
    assert infos[0].tx_bytes > 0 and infos[1].tx_bytes > 0
    assert infos[0].tx_bytes + infos[1].tx_bytes > total


@pytest.mark.parametrize("fault", ["reset", "silent"])
async def test_holder_link_lost_mid_batch_of_small_tensors(fault: str) -> None:
    """Batches of small tensors flow from a holder behind a slow link when the link is
    reset (RST both ways) or goes silent (sockets open, nothing delivered: after
    ``peer_timeout``): the stale peer keeps what verified, fetches the rest again from
    the other holder, and the sync succeeds, bit for bit. (The link, not the holder
    process, fails here: a SIGKILLed process's kernel may still deliver all it had
    written, which would leave nothing to fetch again.)"""
    names = [f"s{i}" for i in range(48)]
    count = 256 * 1024  # 1 MiB of float32 each, 48 MiB in all
    port = free_port()
    async with LinkEmulator(f"127.0.0.1:{port}", bandwidth=20e6, chunk_size=256 * 1024) as emu:
        async with Cluster(0, comm_kwargs={"peer_timeout": 3.0}) as cluster:
            src = cluster.new_comm(p2p_listen_port=port, p2p_advertise_address=emu.address)
            await cluster.admit([src])
            other, stale = cluster.new_comm(), cluster.new_comm()
            await cluster.admit([other, stale])
            good = {n: deterministic_tensor("float32", count, i) for i, n in enumerate(names)}
            mine = {n: np.zeros(count, dtype=np.float32) for n in names}

            def state(ts: dict) -> pccl.SharedState:
                return pccl.SharedState([pccl.TensorInfo.from_numpy(t, k)
                                         for k, t in ts.items()])

            calls = [asyncio.create_task(c.sync_shared_state(state(
                {k: v.copy() for k, v in good.items()}))) for c in (src, other)]
            calls.append(asyncio.create_task(stale.sync_shared_state(state(mine),
                                                                     S.RECEIVE_ONLY)))
            await forwarded(emu, 4 << 20)
            if fault == "reset":
                await emu.reset_all()
            else:
                emu.blackhole()
            infos = await asyncio.gather(*calls)
            assert all(np.array_equal(mine[n], good[n]) for n in names)
            total = len(names) * count * 4
            assert infos[2].rx_bytes == total
            # The other holder served its half and what the lost link had not delivered.
            assert total // 2 < infos[1].tx_bytes < total
