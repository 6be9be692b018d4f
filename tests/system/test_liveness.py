"""Liveness under PCCL's own usage pattern (issue 16), end to end.

Each test drives real communicators (in-process, or a peer process for a SIGKILL) the way
PCCL programs do, and bounds every wait with ``asyncio.timeout``: a hang fails the test
instead of stalling the suite. The sans-IO side of the same rules is in
test_master_state.py ("liveness").
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import pccl
import pccl.blocking as pb
from pccl.testing import Cluster
from pccl.testing.data import deterministic_tensor, digest

BOUND = 60.0  # seconds any scenario below may take; past it the run hung


def _state(values: np.ndarray) -> pccl.SharedState:
    return pccl.SharedState([pccl.TensorInfo.from_numpy(values, "w")], revision=0)


async def test_pending_idiom_takes_one_branch_on_every_peer() -> None:
    """Issue 16, item 1. B asks whether peers are pending before C knocks, A after. With a
    per-peer answer B heard False and went on to reduce while A admitted C and synced:
    each waited for the other forever. Collective: both hear True and stay together."""
    async with Cluster(2) as cluster:
        a, b = cluster.comms
        async with asyncio.timeout(BOUND):
            b_asks = asyncio.create_task(b.are_peers_pending())
            await cluster.master.wait_for(lambda s: b.peer_id in s.pending_votes, timeout=BOUND)
            c = cluster.new_comm()
            c_joins = asyncio.create_task(c.connect())
            await cluster.master.wait_for(lambda s: len(s.pending()) == 1, timeout=BOUND)
            assert await a.pending_peer_count() == 1  # the hint: no waiting for anyone
            assert not b_asks.done()  # the collective question waits for every accepted peer
            answers = await asyncio.gather(a.are_peers_pending(), b_asks)
            assert answers == [True, True]

            # The idiom continues alike on every peer: admit, sync, reduce.
            await asyncio.gather(a.update_topology(), b.update_topology(), c_joins)
            values = [np.full(1024, 7.0, np.float32), np.full(1024, 7.0, np.float32),
                      np.zeros(1024, np.float32)]
            states = [_state(v) for v in values]
            states[0].revision = states[1].revision = 1
            await asyncio.gather(*(comm.sync_shared_state(s)
                                   for comm, s in zip((a, b, c), states)))
            assert [s.revision for s in states] == [1, 1, 1]
            assert all(np.array_equal(v, values[0]) for v in values)
            infos = await asyncio.gather(*(comm.all_reduce(v, op=pccl.ReduceOp.SUM)
                                           for comm, v in zip((a, b, c), values)))
            assert [i.world_size for i in infos] == [3, 3, 3]
            assert all(np.array_equal(v, np.full(1024, 21.0, np.float32)) for v in values)


@pytest.mark.multiprocess
async def test_sigkill_mid_step_survivors_relaunch_without_update_topology(
        pccl_peer_process) -> None:
    """Issue 16, item 2. MNIST-DDP's loop: four tagged async reduces, each waited, failed
    ones relaunched, no update_topology() in between. A peer SIGKILLed mid-step: every
    survivor sees the same outcome per tag, and the relaunched tags run on the ring the
    master rebuilt from the survivors, with exact results."""
    n = 1 << 20
    async with Cluster(2, comm_kwargs={"peer_timeout": 10.0}) as cluster:
        a, b = cluster.comms
        victim = await pccl_peer_process(cluster.master.address)
        async with asyncio.timeout(BOUND):
            await cluster.master.wait_for(lambda s: len(s.pending()) == 1, timeout=BOUND)
            await asyncio.gather(a.update_topology(), b.update_topology())
            await victim.wait_accepted()
            xs = {p: [deterministic_tensor("float32", n, seed=10 * i + k) for k in range(4)]
                  for i, p in enumerate("ab")}
            before = {p: [digest(x) for x in v] for p, v in xs.items()}
            for tag in range(4):
                await victim.call("make_tensor", name=f"g{tag}", dtype="float32", count=n,
                                  seed=99 + tag)
            handles = {p: [comm.all_reduce_async(x, tag=tag)
                           for tag, x in enumerate(xs[p])] for p, comm in (("a", a), ("b", b))}
            calls = [asyncio.create_task(victim.call("all_reduce", name=f"g{t}", tag=t))
                     for t in range(4)]
            await cluster.master.wait_for(
                lambda s: any(c.op_id >= 0 for c in s.collectives.values()), timeout=BOUND)
            victim.kill()
            await asyncio.gather(*calls, return_exceptions=True)
            outcomes = {p: await asyncio.gather(*hs, return_exceptions=True)
                        for p, hs in handles.items()}
            ok = {p: [not isinstance(r, BaseException) for r in rs]
                  for p, rs in outcomes.items()}
            assert ok["a"] == ok["b"], outcomes  # the same outcome per tag on every survivor
            assert not all(ok["a"])  # the kill did hit the step
            for p in "ab":
                for tag, r in enumerate(outcomes[p]):
                    if isinstance(r, BaseException):
                        assert isinstance(r, pccl.PeerConnectionError), r
                        assert digest(xs[p][tag]) == before[p][tag]  # nothing written
            # Relaunch what failed, as the loop does: no update_topology().
            failed = [t for t in range(4) if not ok["a"][t]]
            infos = await asyncio.gather(*(comm.all_reduce(xs[p][t], tag=t)
                                           for t in failed for p, comm in (("a", a), ("b", b))))
            assert {i.world_size for i in infos} == {2}
            for t in failed:
                want = (deterministic_tensor("float32", n, seed=t)
                        + deterministic_tensor("float32", n, seed=10 + t))
                assert xs["a"][t].tobytes() == xs["b"][t].tobytes() == want.tobytes()
            assert a.get_attribute(pccl.Attribute.PEER_GROUP_WORLD_SIZE) == 2


async def test_blocking_sync_survives_a_peer_that_votes_for_a_topology_update() -> None:
    """Issue 16, item 3. PCCL programs do not catch errors of sync_shared_state(): one
    that was called off because another peer was voting in update_topology() must join
    the vote and sync, not raise CollectiveAbortedError."""
    async with pccl.MasterNode(listen="127.0.0.1:0", heartbeat_interval=0.25,
                               heartbeat_timeout=3.0) as master:
        comms = [pb.Communicator(master.address, 0, 1) for _ in range(2)]
        try:
            await asyncio.to_thread(comms[0].connect)
            joining = asyncio.create_task(asyncio.to_thread(comms[1].connect))
            await master.wait_for(lambda s: len(s.pending()) == 1, timeout=BOUND)
            await asyncio.gather(asyncio.to_thread(comms[0].update_topology), joining)
            values = [np.arange(256, dtype=np.float32), np.zeros(256, np.float32)]
            states = [pb.SharedState([pb.TensorInfo.from_numpy(v, "w")]) for v in values]
            async with asyncio.timeout(BOUND):
                syncing = asyncio.create_task(asyncio.to_thread(
                    comms[1].sync_shared_state, states[1]))
                await master.wait_for(lambda s: bool(s.syncs), timeout=BOUND)
                await asyncio.to_thread(comms[0].update_topology)
                infos = await asyncio.gather(
                    asyncio.to_thread(comms[0].sync_shared_state, states[0]), syncing)
            assert infos[1].rx_bytes == values[0].nbytes
            assert np.array_equal(values[1], values[0])
        finally:
            await asyncio.gather(*(asyncio.to_thread(c.close) for c in comms))


async def test_joiners_never_roll_a_running_peer_back() -> None:
    """Issue 16, item 4. A trained alone to revision 5; B and C join with step-0 state and
    all sync with ENFORCE_POPULAR: A keeps its state and revision, B and C receive it."""
    async with Cluster(1) as cluster:
        (a,) = cluster.comms
        trained = np.zeros(4096, np.float32)
        state_a = _state(trained)
        async with asyncio.timeout(BOUND):
            for step in range(1, 6):
                trained += step
                state_a.revision += 1
                await a.sync_shared_state(state_a)
            b, c = cluster.new_comm(), cluster.new_comm()
            joins = [asyncio.create_task(x.connect()) for x in (b, c)]
            await cluster.master.wait_for(lambda s: len(s.pending()) == 2, timeout=BOUND)
            assert await a.are_peers_pending()
            await asyncio.gather(a.update_topology(), *joins)
            fresh = [np.zeros(4096, np.float32), np.zeros(4096, np.float32)]
            states = [_state(f) for f in fresh]
            state_a.revision += 1
            infos = await asyncio.gather(a.sync_shared_state(state_a),
                                         *(x.sync_shared_state(s)
                                           for x, s in zip((b, c), states)))
        assert np.array_equal(trained, np.full(4096, 15.0, np.float32))  # not rolled back
        assert infos[0].rx_bytes == 0
        assert [s.revision for s in (state_a, *states)] == [6, 6, 6]
        assert all(np.array_equal(f, trained) for f in fresh)


@pytest.mark.parametrize("address", ["127.0.0.1", "localhost:", "[::1]", "host:notaport"])
def test_a_master_address_without_a_port_is_refused(address: str) -> None:
    """Issue 16, item 5: it silently meant port 48148 (somebody else's run)."""
    with pytest.raises(pccl.InvalidArgumentError, match="48148"):
        pccl.Communicator(master=address)
    with pytest.raises(pccl.InvalidArgumentError):  # PCCL's bindings refuse it too
        pb.Communicator(address)


@pytest.mark.parametrize("call", ["all_reduce", "sync", "update_topology", "pending"])
async def test_a_peer_that_never_makes_the_call_does_not_hang_the_others(call: str) -> None:
    """The deadline: two peers make a collective call, the third (alive, answering
    heartbeats) never does. Both callers fail with OperationTimeoutError, nothing
    written; then everyone makes the call and it works."""
    async with Cluster(3) as cluster:
        comms = cluster.comms
        xs = [np.full(512, float(i + 1), np.float32) for i in range(3)]
        states = [_state(x) for x in xs]

        def make(i: int, timeout: float | None = 1.0) -> asyncio.Task:
            comm = comms[i]
            coro = {"all_reduce": lambda: comm.all_reduce(xs[i], timeout=timeout),
                    "sync": lambda: comm.sync_shared_state(states[i], timeout=timeout),
                    "update_topology": lambda: comm.update_topology(timeout=timeout),
                    "pending": lambda: comm.are_peers_pending(timeout=timeout)}[call]()
            return asyncio.ensure_future(coro)

        async with asyncio.timeout(BOUND):
            results = await asyncio.gather(make(0), make(1), return_exceptions=True)
            for r in results:
                assert isinstance(r, pccl.OperationTimeoutError), r
                assert isinstance(r, TimeoutError) and f"[{comms[2].peer_id}]" in str(r)
            assert [float(x[0]) for x in xs] == [1.0, 2.0, 3.0]  # nothing written
            assert [s.revision for s in states] == [0, 0, 0]
            await asyncio.gather(*(make(i, None) for i in range(3)))
        if call == "all_reduce":
            assert all(np.array_equal(x, np.full(512, 6.0, np.float32)) for x in xs)
        if call == "sync":
            assert len({x.tobytes() for x in xs}) == 1


async def test_repair_off_keeps_the_explicit_update_topology_semantics() -> None:
    """MasterNode(repair_rings=False): after a peer left, collectives fail at once until
    update_topology() (the behaviour before issue 16, for programs that want it)."""
    async with Cluster(3, master_kwargs={"repair_rings": False}) as cluster:
        a, b, c = cluster.comms
        await c.close()
        async with asyncio.timeout(BOUND):
            for r in await asyncio.gather(a.all_reduce(np.ones(8, np.float32)),
                                          b.all_reduce(np.ones(8, np.float32)),
                                          return_exceptions=True):
                assert isinstance(r, pccl.PeerConnectionError), r
            await asyncio.gather(a.update_topology(), b.update_topology())
            infos = await asyncio.gather(a.all_reduce(np.ones(8, np.float32)),
                                         b.all_reduce(np.ones(8, np.float32)))
        assert [i.world_size for i in infos] == [2, 2]


async def test_pending_peer_count_is_a_plain_query_in_both_apis() -> None:
    async with Cluster(1) as cluster:
        (a,) = cluster.comms
        joiner = pb.Communicator(cluster.master.address, 0, 1)
        try:
            async with asyncio.timeout(BOUND):
                joins = asyncio.create_task(asyncio.to_thread(joiner.connect))
                await cluster.master.wait_for(lambda s: len(s.pending()) == 1, timeout=BOUND)
                assert await a.pending_peer_count() == 1  # answered at once, no vote needed
                await asyncio.gather(a.update_topology(), joins)
                assert await a.pending_peer_count() == 0
                assert await asyncio.to_thread(joiner.pending_peer_count) == 0
        finally:
            await asyncio.to_thread(joiner.close)


async def test_a_cancelled_question_does_not_spoil_the_next() -> None:
    async with Cluster(2) as cluster:
        a, b = cluster.comms
        async with asyncio.timeout(BOUND):
            asking = asyncio.create_task(a.are_peers_pending())
            await cluster.master.wait_for(lambda s: a.peer_id in s.pending_votes, timeout=BOUND)
            asking.cancel()
            await asyncio.gather(asking, return_exceptions=True)
            assert await asyncio.gather(a.are_peers_pending(), b.are_peers_pending()) == [
                False, False]
