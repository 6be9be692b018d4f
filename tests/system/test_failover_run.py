"""Several masters for real: peers given ``master=[active, standby]`` re-form their group on
the standby when the active master process is SIGKILLed, with state bit-identical; and a
partition that leaves a minority with a live master never lets both masters run
collectives for the group."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import numpy as np
import pytest

import pccl
from pccl.communicator import PeerState
from pccl.testing import free_port
from pccl.testing.link_emulator import LinkEmulator
from pccl.testing.processes import master_process

FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0, "recovery_grace": 2.0}


async def _master_process(port: int, *extra: str) -> asyncio.subprocess.Process:
    return await master_process(port, "--heartbeat-interval", "0.2", "--heartbeat-timeout",
                                "2", "--recovery-grace", "2", *extra)


async def _retry(p, cmd: str, **kwargs):
    """A call that went out before the peer noticed the loss fails with
    MasterConnectionError; the documented answer is to run it again."""
    for _ in range(3):
        try:
            return await p.call(cmd, timeout=60, **kwargs)
        except pccl.MasterConnectionError:
            continue
    return await p.call(cmd, timeout=60, **kwargs)


@pytest.mark.multiprocess
async def test_sigkilled_master_fails_over_to_the_standby(pccl_peer_process) -> None:
    ports = [free_port(), free_port()]
    masters = [await _master_process(ports[0], "--quorum"),
               await _master_process(ports[1], "--standby")]
    both = f"127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}"
    try:
        peers = [await pccl_peer_process(both)]
        await peers[0].wait_accepted()
        for _ in range(2):
            newcomer = await pccl_peer_process(both)
            async with asyncio.timeout(60):
                while not await peers[0].call("pending_peer_count"):  # noqa: ASYNC110
                    await asyncio.sleep(0.05)  # a bounded poll of a plain query
            await asyncio.gather(*(p.call("update_topology") for p in peers))
            await newcomer.wait_accepted()
            peers.append(newcomer)
        for i, p in enumerate(peers):
            await p.call("make_tensor", name="x", dtype="float32", count=100_000, seed=i)
            await p.call("make_tensor", name="w", dtype="float32", count=50_000, seed=i)
        res = await asyncio.gather(*(p.call("all_reduce", name="x", tag=1) for p in peers))
        assert len({r["digest"] for r in res}) == 1 and res[0]["world_size"] == 3
        synced = await asyncio.gather(*(p.call("sync", names=["w"], revision=1) for p in peers))
        assert len({s["digests"]["w"] for s in synced}) == 1
        before = await asyncio.gather(*(p.call("info") for p in peers))

        masters[0].kill()  # the active master: SIGKILL, never restarted
        await masters[0].wait()

        res2 = await asyncio.gather(*(_retry(p, "all_reduce", name="x", tag=2) for p in peers))
        assert len({r["digest"] for r in res2}) == 1
        assert [r["world_size"] for r in res2] == [3, 3, 3]
        # The group is the same: same ids, and shared state goes on from revision 1.
        synced2 = await asyncio.gather(*(_retry(p, "sync", names=["w"], revision=2)
                                         for p in peers))
        assert {s["revision"] for s in synced2} == {2}
        assert len({s["digests"]["w"] for s in synced2}) == 1
        after = await asyncio.gather(*(p.call("info") for p in peers))
        assert [i["peer_id"] for i in after] == [i["peer_id"] for i in before]
        assert all(i["epoch"] > j["epoch"] for i, j in zip(after, before))
    finally:
        for proc in masters:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def _admit_one_by_one(master: pccl.MasterNode, comms: list[pccl.Communicator]) -> None:
    """The first peer starts the run on ``master``; each next one is admitted by an
    update_topology() of those already in."""
    await comms[0].connect()
    for c in comms[1:]:
        joining = asyncio.create_task(c.connect())
        await master.wait_for(lambda s: len(s.pending()) == 1, timeout=30)
        await asyncio.gather(*(x.update_topology() for x in comms if x.state
                               is PeerState.ACCEPTED))
        await joining


async def _step(c: pccl.Communicator, x: np.ndarray, tag: int) -> None:
    """One all-reduce across a failover: a call that meets the loss fails with a typed
    error and is run again (bounded)."""
    for _ in range(20):
        try:
            await c.all_reduce(x, tag=tag)
            return
        except (pccl.MasterConnectionError, pccl.PeerConnectionError):
            continue
    raise AssertionError("the step never went through")


async def test_a_partitioned_minority_stops_and_the_majority_goes_on() -> None:
    """Five peers reach the active master each through its own link; the links of
    three are cut (their connections reset, new ones refused). Those three re-form the
    group on the standby; the two left with the active master can run no collective
    there (their ring lost its majority: they are sent to the standby and join the
    group there). At no time do both masters complete a collective."""
    active = pccl.MasterNode("127.0.0.1:0", quorum=True, **FAST)
    standby = pccl.MasterNode("127.0.0.1:0", standby=True, **FAST)
    await active.start()
    await standby.start()
    links = [LinkEmulator(active.address) for _ in range(5)]
    comms: list[pccl.Communicator] = []
    try:
        for link in links:
            await link.start()
        for link in links:
            comms.append(pccl.Communicator([link.address, standby.address],
                                           p2p_listen_host="127.0.0.1", timeout=5.0,
                                           reconnect_timeout=60.0))
        await _admit_one_by_one(active, comms)
        xs = [np.full(1000, i + 1, dtype=np.float32) for i in range(5)]
        await asyncio.gather(*(c.all_reduce(x, tag=1) for c, x in zip(comms, xs)))
        assert all(np.array_equal(x, np.full(1000, 15, dtype=np.float32)) for x in xs)
        ran = dict(active.state.collective_paths), active.state.next_op_id

        for link in links[2:]:  # peers 3, 4, 5 cannot reach the active master any more
            link.refuse_new()
            await link.reset_all()

        ys = [np.full(1000, i + 1, dtype=np.float32) for i in range(5)]
        await asyncio.wait_for(asyncio.gather(*(_step(c, y, 2) for c, y in zip(comms, ys))),
                               120)
        assert all(np.array_equal(y, np.full(1000, 15, dtype=np.float32)) for y in ys)
        # Everyone ended up on the standby; the active master ran nothing after the cut.
        assert sorted(standby.state.accepted()) == sorted(c.peer_id for c in comms)
        assert active.state.accepted() == []
        assert (dict(active.state.collective_paths), active.state.next_op_id) == ran
        assert active.state.lineage[0][1] == frozenset(range(1, 6))  # never moved on
    finally:
        await asyncio.gather(*(c.close() for c in comms))
        for link in links:
            await link.stop()
        await standby.stop()
        await active.stop()


async def test_a_vanished_master_host_costs_its_silence_not_the_connect_timeout() -> None:
    """The active master's host vanishes (every link to it silently stalls: no reset,
    new connections hang). The peers notice its silence after its heartbeat timeout
    and ask both masters at once; the standby answers, and after a short grace (not the
    60 s connect timeout the peers were given) they re-form the group there. The bound
    below is a hang guard that the old one-after-the-other scan could not meet: it
    waited the whole timeout for the dead master first."""
    active = pccl.MasterNode("127.0.0.1:0", quorum=True, **FAST)
    standby = pccl.MasterNode("127.0.0.1:0", standby=True, **FAST)
    await active.start()
    await standby.start()
    link = LinkEmulator(active.address)
    comms: list[pccl.Communicator] = []
    try:
        await link.start()
        comms = [pccl.Communicator([link.address, standby.address],
                                   p2p_listen_host="127.0.0.1", timeout=60.0,
                                   reconnect_timeout=120.0) for _ in range(3)]
        await _admit_one_by_one(active, comms)
        ids = sorted(c.peer_id for c in comms)
        link.blackhole()

        xs = [np.full(100, i + 1, dtype=np.float32) for i in range(3)]
        await asyncio.wait_for(asyncio.gather(*(_step(c, x, 7) for c, x in zip(comms, xs))),
                               40)
        assert all(np.array_equal(x, np.full(100, 6, dtype=np.float32)) for x in xs)
        assert sorted(standby.state.accepted()) == ids
        assert sorted(c.peer_id for c in comms) == ids  # same ids on the standby
    finally:
        await asyncio.gather(*(c.close() for c in comms))
        link.blackhole(False)
        await link.stop()
        await standby.stop()
        await active.stop()


async def test_a_new_run_starts_on_the_master_that_is_not_a_standby() -> None:
    """Before any group exists, peers listing the standby first still start the run on
    the other master (challenges say which is a standby), and later peers find it."""
    standby = pccl.MasterNode("127.0.0.1:0", standby=True, **FAST)
    primary = pccl.MasterNode("127.0.0.1:0", quorum=True, **FAST)
    await standby.start()
    await primary.start()
    comms = [pccl.Communicator([standby.address, primary.address],
                               p2p_listen_host="127.0.0.1") for _ in range(2)]
    try:
        await comms[0].connect()
        joining = asyncio.create_task(comms[1].connect())
        await primary.wait_for(lambda s: len(s.pending()) == 1, timeout=30)
        await comms[0].update_topology()
        await joining
        assert sorted(primary.state.accepted()) == sorted(c.peer_id for c in comms)
        assert standby.state.peers == {} and standby.state.held_groups() == []
        x = [np.full(8, i + 1, dtype=np.float32) for i in range(2)]
        await asyncio.gather(*(c.all_reduce(a) for c, a in zip(comms, x)))
        assert all(np.array_equal(a, np.full(8, 3, dtype=np.float32)) for a in x)
    finally:
        await asyncio.gather(*(c.close() for c in comms))
        await primary.stop()
        await standby.stop()


async def test_a_peer_the_standby_sends_away_tries_again_until_the_run_starts(caplog) -> None:
    """The first peer comes up before the master that starts the run: the standby
    sends it away, and connect() tries again (back-off, n_attempts) until it can."""
    caplog.set_level(logging.INFO, logger="pccl.master.status")
    port = free_port()
    standby = pccl.MasterNode("127.0.0.1:0", standby=True, **FAST)
    await standby.start()
    comm = pccl.Communicator([f"127.0.0.1:{port}", standby.address],
                             p2p_listen_host="127.0.0.1")
    primary = pccl.MasterNode(f"127.0.0.1:{port}", quorum=True, **FAST)
    try:
        connecting = asyncio.create_task(comm.connect(n_attempts=20))
        async with asyncio.timeout(30):
            while "a standby" not in caplog.text:  # noqa: ASYNC110 - bounded poll of a log
                await asyncio.sleep(0.01)
        await primary.start()
        await asyncio.wait_for(connecting, 60)
        assert primary.state.accepted() == [comm.peer_id]
        assert standby.state.peers == {}
    finally:
        await comm.close()
        await primary.stop()
        await standby.stop()
