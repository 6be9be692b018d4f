"""Day two (issue 38): a master that stops on purpose says so, and a run is upgraded one
node at a time while it trains (adjacent protocol versions work together)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pccl
import pccl.master.server as server
from pccl.protocol import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, compatible
from pccl.testing import Cluster, free_port
from pccl.testing.processes import PeerProcess, stop_process

FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0, "recovery_grace": 5.0}
SHIM = [sys.executable, str(Path(__file__).resolve().parents[1] / "future_release.py"), "1"]


def test_the_window_takes_neighbours_and_refuses_the_rest() -> None:
    now = (PROTOCOL_VERSION, MIN_PROTOCOL_VERSION)
    nxt = (PROTOCOL_VERSION + 1, PROTOCOL_VERSION)  # the next release, a window of one
    after = (PROTOCOL_VERSION + 2, PROTOCOL_VERSION + 1)
    assert compatible(now, now) and compatible(now, nxt) and compatible(nxt, now)
    assert not compatible(now, after) and not compatible(after, now)
    assert not compatible(now, (MIN_PROTOCOL_VERSION - 1, MIN_PROTOCOL_VERSION - 1))


async def test_a_master_too_new_for_a_peer_names_both_versions(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "PROTOCOL_VERSION", PROTOCOL_VERSION + 2)
    monkeypatch.setattr(server, "MIN_PROTOCOL_VERSION", PROTOCOL_VERSION + 1)
    async with pccl.MasterNode(listen="127.0.0.1:0") as master:
        comm = pccl.Communicator(master=master.address, reconnect_timeout=0)
        with pytest.raises(pccl.ProtocolError) as err:
            await comm.connect()
        await comm.close()
    assert (f"the master speaks protocol {PROTOCOL_VERSION + 2} (it works with peers of "
            f"protocol {PROTOCOL_VERSION + 1} to {PROTOCOL_VERSION + 2}), this peer only "
            f"{PROTOCOL_VERSION}: upgrade pccl on this peer") in str(err.value)


async def test_a_peer_too_old_for_the_master_is_told_to_upgrade(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The master's side: a peer below its window (one that did not check, or believed
    # it could talk down) is refused, and told what to do.
    async with pccl.MasterNode(listen="127.0.0.1:0") as master:
        monkeypatch.setattr(pccl.peer.driver, "PROTOCOL_VERSION", MIN_PROTOCOL_VERSION - 1)
        monkeypatch.setattr(pccl.peer.driver, "compatible", lambda *_: True)  # unchecked
        comm = pccl.Communicator(master=master.address, reconnect_timeout=0)
        with pytest.raises(pccl.ProtocolError, match=(
                f"protocol version {MIN_PROTOCOL_VERSION - 1} is too old for this master .*"
                "upgrade pccl on this peer")):
            await comm.connect()
        await comm.close()


async def test_a_stopped_master_says_so_and_the_peers_wait_for_it(
        caplog: pytest.LogCaptureFixture) -> None:
    # Before: a graceful stop looked like a crash to the peers ("lost the connection").
    caplog.set_level(logging.WARNING, logger="pccl")
    async with Cluster(2, master_kwargs=FAST) as cluster:
        address = cluster.master.address
        await cluster.master.stop(reason="an upgrade to 0.2")
        async with asyncio.timeout(10):
            while not all(c.state.name == "RECONNECTING" for c in cluster.comms):  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        said = [r.getMessage() for r in caplog.records]
        assert sum("the master stopped on purpose (an upgrade to 0.2) and is expected back"
                   in t for t in said) >= 2, said
        cluster.master = pccl.MasterNode(listen=address, **FAST)
        await cluster.master.start()
        x = [np.full(8, i + 1.0, dtype=np.float32) for i in range(2)]
        await asyncio.gather(*(c.all_reduce(a) for c, a in zip(cluster.comms, x)))
        assert [a.tolist() for a in x] == [[3.0] * 8] * 2


async def test_a_master_that_ends_the_run_ends_the_peers_waits_at_once() -> None:
    # Before: peers kept registering for their whole reconnect_timeout (now 10 minutes).
    async with Cluster(2, master_kwargs=FAST, comm_kwargs={"reconnect_timeout": 600}) as c:
        await c.master.stop(end_run=True, reason="training finished")
        for comm in c.comms:
            async with asyncio.timeout(10):  # not 600: the wait ends with the message
                with pytest.raises(pccl.MasterConnectionError,
                                   match=r"the master ended the run \(training finished\)"):
                    await comm.all_reduce(np.ones(4, dtype=np.float32))


def _status(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=10) as r:
        doc: dict[str, Any] = json.load(r)
    return doc


async def _master(port: int, status: int, future: bool) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *(SHIM if future else []), sys.executable, "-m", "pccl", "master", "--listen",
        f"127.0.0.1:{port}", "--status", f"127.0.0.1:{status}", "--heartbeat-interval", "0.2",
        "--heartbeat-timeout", "2", stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL)


async def _until(pred: Any, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not await asyncio.to_thread(pred):  # noqa: ASYNC110 - a bounded poll
            await asyncio.sleep(0.1)


async def _retried(calls: Any) -> list[Any]:
    """``calls()`` (one call per peer, gathered), made again while it fails because
    the master just came back (the one recovery shape a training loop has)."""
    for attempt in range(20):
        try:
            return list(await calls())
        except (pccl.MasterConnectionError, pccl.PeerConnectionError,
                pccl.CollectiveAbortedError):
            assert attempt < 19
    raise AssertionError("unreachable")


async def test_a_rolling_upgrade_keeps_the_run_training_bit_identical() -> None:
    """Master first, then each peer in turn, to a release one protocol version ahead
    (tests/future_release.py): the group trains at every step, bit-identical."""
    port, status = free_port(), free_port()
    master = await _master(port, status, future=False)
    address = f"127.0.0.1:{port}"
    peers: list[PeerProcess] = []
    revision = 0

    async def train() -> None:
        """One step on every peer: sync the weights (a successor receives them), then
        reduce them; every peer ends with the same bytes."""
        nonlocal revision
        revision += 1
        synced = await _retried(lambda: asyncio.gather(*(
            p.call("sync", names=["w"], revision=revision) for p in peers)))
        done = await _retried(lambda: asyncio.gather(*(
            p.call("all_reduce", name="w", tag=revision) for p in peers)))
        assert len({s["digests"]["w"] for s in synced}) == 1, synced
        assert len({d["digest"] for d in done}) == 1, done
        assert {d["world_size"] for d in done} == {len(peers)}

    async def join(future: bool, seed: int) -> PeerProcess:
        """A new peer, admitted by a vote of the others (none: admitted alone)."""
        new = PeerProcess(address, command_prefix=SHIM if future else ())
        await new.start()
        if peers:
            await _until(lambda: any(p["state"] == "pending"
                                     for p in _status(status)["peers"]))
            await asyncio.gather(*(p.call("update_topology") for p in peers))
        await new.wait_accepted()
        await new.call("make_tensor", name="w", dtype="float32", count=10_000, seed=seed)
        return new

    try:
        await _until(lambda: _status_or_none(status) is not None)
        for i in range(3):
            peers.append(await join(False, seed=i))
        await train()

        # The master first: stopped (it tells the peers) and started as the next release;
        # the peers register with it again and it re-forms the group from them.
        await stop_process(master)
        master = await _master(port, status, future=True)
        await train()
        doc = _status(status)
        assert doc["master"]["protocol"] == PROTOCOL_VERSION + 1
        assert sorted(p["protocol"] for p in doc["peers"]) == [PROTOCOL_VERSION] * 3

        # Then each peer: it leaves, and its successor (the next release) joins and
        # receives the weights by the next sync.
        for i in range(3):
            old = peers.pop(0)
            await old.call("close")
            await old.close()
            peers.append(await join(True, seed=100 + i))
            await train()
        assert sorted(p["protocol"] for p in _status(status)["peers"]) == (
            [PROTOCOL_VERSION + 1] * 3)
    finally:
        for p in peers:
            await p.close()
        await stop_process(master)


def _status_or_none(port: int) -> dict[str, Any] | None:
    try:
        return _status(port)
    except OSError:
        return None
