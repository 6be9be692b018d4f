"""pccl across real test hosts: the master and every peer in a network namespace of its
own, with its own address, joined by veth pairs to a private bridge, links shaped with
tc and cut at the kernel level (``pccl.testing.netns``). Skipped unless root with
iproute2."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
from reference import reference

import pccl
from pccl.testing import PeerProcess
from pccl.testing.data import deterministic_tensor, digest
from pccl.testing.netns import Host, MasterProcess, VirtualLan, wait_until

pytestmark = [pytest.mark.netns, pytest.mark.multiprocess, pytest.mark.alone]

PEER_TIMEOUT = 1.5  # ring I/O inactivity before a collective fails
HEARTBEAT_INTERVAL = 0.2
HEARTBEAT_TIMEOUT = 2.0
SLACK = 2.0  # scheduling headroom on a loaded 2-core machine

# The run's shared secret (a key of at least 128 random bits). The hosts are on a LAN
# (10.x addresses, not loopback): a master there with nothing to authenticate who joins
# is refused unless told --allow-anonymous, so the runs here use a secret, which also
# runs the secure handshake across the namespaces. The master process (``python -m pccl
# master``, started by pccl.testing.netns) reads it from PCCL_SECRET in the environment it
# inherits; each peer gets it with --secret-hex.
SECRET = b"5f0c1a9e7d3b42c8a6e1f0b97c2d4e3a"


@pytest.fixture(autouse=True)
def _run_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PCCL_SECRET", SECRET.decode())


class Net:
    """A master host plus peer hosts on one LAN; ``hosts`` maps peer id -> its host."""

    def __init__(self, lan: VirtualLan, master: MasterProcess) -> None:
        self.lan = lan
        self.master = master
        self.peers: list[PeerProcess] = []
        self.hosts: dict[int, Host] = {}

    @classmethod
    async def start(cls, lan: VirtualLan, n_peers: int) -> Net:
        master = await lan.start_master(await lan.add_host("master"),
                                        heartbeat_interval=HEARTBEAT_INTERVAL,
                                        heartbeat_timeout=HEARTBEAT_TIMEOUT)
        net = cls(lan, master)
        for _ in range(n_peers):
            await net.join(await lan.add_host(f"peer{len(net.peers)}"))
        return net

    async def join(self, host: Host) -> PeerProcess:
        """Starts a peer on ``host``; the accepted peers vote it in (if there are any)."""
        before = len(self.master.registered)
        proc = await self.lan.spawn_peer(
            host, self.master.address, reply_timeout=30.0, secret=SECRET,
            extra_args=["--peer-timeout", str(PEER_TIMEOUT), "--attempts", "3"])
        if self.peers:
            await self.master.wait_for(lambda m: len(m.registered) > before)
            await asyncio.gather(*(p.call("update_topology") for p in self.peers))
        peer_id = await proc.wait_accepted(timeout=30)
        self.peers.append(proc)
        self.hosts[peer_id] = host
        return proc

    async def make(self, name: str, dtype: str, count: int) -> dict[int, str]:
        """Each peer's tensor ``name`` seeded by its peer id; returns id -> digest."""
        return {p.peer_id: await p.call("make_tensor", name=name, dtype=dtype, count=count,
                                        seed=p.peer_id) for p in self.peers}


def expected(ring: list[int], dtype: str, count: int, results: list) -> str:
    """Digest of the SUM every peer must hold, computed in the order of the algorithm
    the peers report (the ring's or the mesh's; one for all)."""
    inputs = [deterministic_tensor(dtype, count, seed=pid) for pid in ring]
    (algorithm,) = {r["algorithm"] for r in results}
    return digest(reference(algorithm, inputs, pccl.ReduceOp.SUM, dtype))


async def reduce_all(peers: list[PeerProcess], name: str) -> list:
    return await asyncio.gather(*(p.call("all_reduce", name=name) for p in peers))


async def test_membership_across_hosts(pccl_netns: VirtualLan) -> None:
    """Join, leave and a late joiner, each peer on its own host and address."""
    net = await Net.start(pccl_netns, 3)
    # The master saw every peer arrive from that peer's own address on the LAN.
    for p in net.peers:
        assert net.master.peer_host(p.peer_id) == net.hosts[p.peer_id].address
    assert len({net.master.peer_host(p.peer_id) for p in net.peers}) == 3
    rings = set()
    for p in net.peers:
        assert (await p.call("attributes"))["GLOBAL_WORLD_SIZE"] == 3
        info = await p.call("info")
        rings.add(tuple(info["ring"]))
        assert info["lanes"] == [2, 2]
    assert rings == {tuple(sorted(p.peer_id for p in net.peers))}

    leaver, *stay = net.peers
    await leaver.call("close")
    await net.master.wait_for(lambda m: leaver.peer_id in m.gone, timeout=10)
    async with asyncio.timeout(10):
        assert await leaver.proc.wait() == 0
    net.peers = stay
    await asyncio.gather(*(p.call("update_topology") for p in stay))
    for p in stay:
        assert (await p.call("attributes"))["GLOBAL_WORLD_SIZE"] == 2

    late = await net.join(await pccl_netns.add_host("late"))
    assert net.master.peer_host(late.peer_id) == net.hosts[late.peer_id].address
    for p in net.peers:
        assert (await p.call("attributes"))["GLOBAL_WORLD_SIZE"] == 3
    # The late joiner is on the ring: a reduce over the new ring is exact.
    await net.make("t", "int64", 10_000)
    ring = (await late.call("info"))["ring"]
    assert sorted(ring) == sorted(p.peer_id for p in net.peers)
    results = await reduce_all(net.peers, "t")
    want = expected(ring, "int64", 10_000, results)
    assert [r["digest"] for r in results] == [want] * 3
    assert all(r["world_size"] == 3 for r in results)


@pytest.mark.parametrize("qdisc", [None, "tbf", "htb"])
async def test_all_reduce_exact_across_hosts(pccl_netns: VirtualLan, qdisc: str | None) -> None:
    """4 hosts, float32 and int64 SUM bit-identical to the ring-order reference; with a
    shaped host the run takes at least as long as its uplink needs for what it sent."""
    net = await Net.start(pccl_netns, 4)
    rate = 60e6
    slow = net.peers[1]
    if qdisc is not None:
        await pccl_netns.shape(net.hosts[slow.peer_id], rate, qdisc=qdisc)
    ring = (await slow.call("info"))["ring"]
    count = 1 << 20
    await net.make("f", "float32", count)
    await net.make("i", "int64", count // 4)
    t0 = time.monotonic()
    results = await reduce_all(net.peers, "f")
    took = time.monotonic() - t0
    assert [r["digest"] for r in results] == [expected(ring, "float32", count, results)] * 4
    results_i = await reduce_all(net.peers, "i")
    assert [r["digest"] for r in results_i] == [expected(ring, "int64", count // 4, results_i)] * 4
    if qdisc is not None:
        sent = results[net.peers.index(slow)]["tx_bytes"]
        assert sent >= 2 * 3 / 4 * count * 4  # 2(n-1)/n of the buffer
        # The bytes really went through the shaper, and it held them to the rate.
        stats = await pccl_netns.qdisc_stats(net.hosts[slow.peer_id])
        assert stats["kind"] == qdisc
        assert stats["bytes"] >= sent + results_i[net.peers.index(slow)]["tx_bytes"]
        assert took >= 0.8 * sent * 8 / rate, (took, sent)


async def test_sigkill_mid_all_reduce_across_hosts(pccl_netns: VirtualLan) -> None:
    """A host's peer is SIGKILLed while the ring runs: the others get
    PeerConnectionError with their buffers untouched, and the retry after
    update_topology() is exact over the survivors."""
    net = await Net.start(pccl_netns, 4)
    victim = net.peers[2]
    vhost = net.hosts[victim.peer_id]
    count = 2 << 20
    # Mid-ring: the victim has put 1 MiB of the reduce on the wire (of ~12 MiB).
    before, calls = await _reduce_under_way(pccl_netns, net, vhost, "tbf", count,
                                            "the victim to send its first MiB")
    victim.kill()
    survivors = [p for p in net.peers if p is not victim]
    for p, c in zip(net.peers, calls):
        if p is victim:
            with pytest.raises(ConnectionError):
                await c
        else:
            with pytest.raises(pccl.PeerConnectionError):
                await c
            assert await p.call("digest", name="t") == before[p.peer_id]
    await net.master.wait_for(lambda m: victim.peer_id in m.gone, timeout=10)

    await asyncio.gather(*(p.call("update_topology") for p in survivors))
    ring = (await survivors[0].call("info"))["ring"]
    assert sorted(ring) == sorted(p.peer_id for p in survivors)
    results = await reduce_all(survivors, "t")
    assert [r["digest"] for r in results] == [expected(ring, "float32", count, results)] * 3
    assert all(r["world_size"] == 3 for r in results)


async def _reduce_under_way(lan: VirtualLan, net: Net, host: Host, qdisc: str, count: int,
                            what: str) -> tuple[dict[int, str], list[asyncio.Task[Any]]]:
    """Shapes ``host`` to 30 Mbit/s (keeps the ring busy for seconds), starts an
    all-reduce of ``count`` float32 on every peer and returns once ``host`` has put
    1 MiB of it on the wire: each peer's digest before the reduce, and the calls."""
    await lan.shape(host, 30e6, qdisc=qdisc)
    before = await net.make("t", "float32", count)
    sent0, _ = await lan.link_bytes(host)
    calls = [asyncio.create_task(p.call("all_reduce", name="t")) for p in net.peers]
    await wait_until(lambda: _sent_since(lan, host, sent0, 1 << 20), 20, what)
    assert not any(c.done() for c in calls)
    return before, calls


async def _sent_since(lan: VirtualLan, host: Host, base: int, n: int) -> bool:
    sent, _ = await lan.link_bytes(host)
    return sent - base >= n


async def test_receive_only_joiner_becomes_bit_identical(pccl_netns: VirtualLan) -> None:
    """Two hosts hold a synced state; a late joiner on a third host, behind a shaped
    downlink and holding other content, syncs RECEIVE_ONLY and ends with the same
    content hashes and revision, fetched from both holders."""
    net = await Net.start(pccl_netns, 2)
    names = ["weights", "step", "moments"]
    specs = {"weights": ("float32", 1 << 20), "step": ("int64", 1), "moments": ("float16", 1 << 19)}

    async def fill(p: PeerProcess, seed: int) -> None:
        for k, (dtype, n) in specs.items():
            await p.call("make_tensor", name=k, dtype=dtype, count=n, seed=seed + len(k))

    for p in net.peers:
        await fill(p, 5)
    for rev in (0, 1):
        infos = await asyncio.gather(*(p.call("sync", names=names, revision=rev)
                                       for p in net.peers))
        assert all(i["rx_bytes"] == 0 and i["revision"] == rev for i in infos)
    want = await net.peers[0].call("content_hash", names=names)
    assert await net.peers[1].call("content_hash", names=names) == want

    jhost = await pccl_netns.add_host("joiner")
    await pccl_netns.shape(jhost, 80e6, qdisc="htb", direction="ingress")
    joiner = await net.join(jhost)
    await fill(joiner, 99)
    assert await joiner.call("content_hash", names=names) != want
    infos = await asyncio.gather(
        *(p.call("sync", names=names, revision=2) for p in net.peers[:2]),
        joiner.call("sync", names=names, revision=0, strategy="RECEIVE_ONLY"))
    assert await joiner.call("content_hash", names=names) == want
    assert [i["revision"] for i in infos] == [2, 2, 2]
    assert infos[2]["digests"] == infos[0]["digests"] == infos[1]["digests"]
    total = sum(np.dtype(d).itemsize * n for d, n in specs.values())
    assert infos[2]["rx_bytes"] == total
    assert infos[0]["tx_bytes"] > 0 and infos[1]["tx_bytes"] > 0
    assert infos[0]["tx_bytes"] + infos[1]["tx_bytes"] == total
    # What reached the joiner went through its shaped port.
    stats = await pccl_netns.qdisc_stats(jhost, direction="ingress")
    assert stats["kind"] == "htb" and stats["bytes"] >= total


async def _outcomes(peers: list[PeerProcess], calls: list[asyncio.Task],
                    since: float) -> tuple[list[BaseException | None], dict[int, float]]:
    """Each call's error (None if it succeeded) and when it ended, relative to ``since``."""
    ended: dict[int, float] = {}

    async def one(p: PeerProcess, c: asyncio.Task) -> BaseException | None:
        try:
            await c
        except BaseException as e:
            return e
        finally:
            ended[p.peer_id] = time.monotonic() - since
        return None

    return list(await asyncio.gather(*(one(p, c) for p, c in zip(peers, calls)))), ended


async def test_link_cut_mid_ring(pccl_netns: VirtualLan) -> None:
    """A host is unplugged at the kernel level while the ring runs (no resets, the
    packets vanish): every peer's collective fails with a typed error, buffers
    untouched, no sooner than a timeout and no later than the larger of peer_timeout
    and the master's heartbeat timeout (the master waits for the silent peer's report
    until it drops it); the master drops the cut peer and the rest recover."""
    net = await Net.start(pccl_netns, 4)
    victim = net.peers[1]
    vhost = net.hosts[victim.peer_id]
    count = 2 << 20
    before, calls = await _reduce_under_way(pccl_netns, net, vhost, "htb", count,
                                            "the victim to send its first MiB")
    await pccl_netns.set_link(vhost, up=False)
    errors, ended = await _outcomes(net.peers, calls, since=time.monotonic())
    survivors = [p for p in net.peers if p is not victim]
    for p, err in zip(net.peers, errors):
        # Every peer, the cut one included (its pipes still work), gets a typed error.
        assert isinstance(err, pccl.PeerConnectionError | pccl.MasterConnectionError), err
        if p is not victim:
            assert isinstance(err, pccl.PeerConnectionError), err
            # Not a reset (that would be immediate): a timeout noticed the silence.
            assert 0.5 * PEER_TIMEOUT <= ended[p.peer_id], ended
            assert ended[p.peer_id] <= max(PEER_TIMEOUT, HEARTBEAT_TIMEOUT) + SLACK, ended
        assert await p.call("digest", name="t") == before[p.peer_id]
    await net.master.wait_for(lambda m: victim.peer_id in m.gone, timeout=HEARTBEAT_TIMEOUT + 5)
    assert "heartbeat" in net.master.gone[victim.peer_id] or "closed" in net.master.gone[
        victim.peer_id]

    await asyncio.gather(*(p.call("update_topology") for p in survivors))
    ring = (await survivors[0].call("info"))["ring"]
    assert sorted(ring) == sorted(p.peer_id for p in survivors)
    results = await reduce_all(survivors, "t")
    assert [r["digest"] for r in results] == [expected(ring, "float32", count, results)] * 3


async def test_partition_between_two_hosts_mid_ring(pccl_netns: VirtualLan) -> None:
    """Only the link between two ring neighbours is cut (both still reach the master):
    every peer's collective fails with PeerConnectionError within peer_timeout, buffers
    untouched, nobody is dropped; once the link heals the same four peers reduce
    exactly."""
    net = await Net.start(pccl_netns, 4)
    ring = (await net.peers[0].call("info"))["ring"]
    a, b = net.hosts[ring[0]], net.hosts[ring[1]]
    count = 1 << 20  # a sends ~6 MiB at 30 Mbit/s: the ring runs ~1.6 s
    before, calls = await _reduce_under_way(pccl_netns, net, a, "tbf", count,
                                            "the first MiB on the partitioned link")
    await pccl_netns.partition(a, b)
    errors, ended = await _outcomes(net.peers, calls, since=time.monotonic())
    for p, err in zip(net.peers, errors):
        assert isinstance(err, pccl.PeerConnectionError), err
        assert 0.5 * PEER_TIMEOUT <= ended[p.peer_id] <= PEER_TIMEOUT + SLACK, ended
        assert await p.call("digest", name="t") == before[p.peer_id]
    assert net.master.gone == {}

    await pccl_netns.heal(a, b)
    await asyncio.gather(*(p.call("update_topology") for p in net.peers))
    ring = (await net.peers[0].call("info"))["ring"]
    assert len(ring) == 4
    results = await reduce_all(net.peers, "t")
    assert [r["digest"] for r in results] == [expected(ring, "float32", count, results)] * 4
