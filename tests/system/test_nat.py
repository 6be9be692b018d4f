"""Peers behind real kernel NAT: each home is a network namespace behind a router
namespace that masquerades with nftables and drops connections from outside (a home
router), on the same LAN as the master and the public peers (``VirtualLan.add_nat_host``).
No port is forwarded anywhere. The master finds out who cannot be dialed (its dial-back
check) and has the NAT'd end of a ring link dial instead (reverse); two NAT'd neighbours
punch a hole (simultaneous open), or, behind a NAT that maps every connection to a new
port, go through the master's relay (or refuse to, with allow_relay=False, and are told
why). Every result is bit-identical to the reference. Skipped unless root with iproute2
and nft."""

from __future__ import annotations

import asyncio

import pytest
from reference import reference

import pccl
from pccl.testing import PeerProcess
from pccl.testing.data import deterministic_tensor, digest
from pccl.testing.netns import Host, MasterProcess, VirtualLan, nat_unavailable

pytestmark = [pytest.mark.netns, pytest.mark.multiprocess, pytest.mark.alone,
              pytest.mark.skipif(nat_unavailable() is not None,
                                 reason=str(nat_unavailable()))]

COUNT = 50_000

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


class Run:
    def __init__(self, lan: VirtualLan, master: MasterProcess) -> None:
        self.lan = lan
        self.master = master
        self.peers: list[PeerProcess] = []

    @classmethod
    async def start(cls, lan: VirtualLan, status: bool = False) -> Run:
        master = await lan.start_master(await lan.add_host("master"), heartbeat_interval=0.2,
                                        heartbeat_timeout=3.0, status=status)
        return cls(lan, master)

    async def spawn(self, host: Host, *extra: str) -> PeerProcess:
        """Starts a peer; the accepted ones vote it in. Returns it once registered."""
        before = len(self.master.registered)
        proc = await self.lan.spawn_peer(
            host, self.master.address, reply_timeout=60.0, secret=SECRET,
            extra_args=["--peer-timeout", "5", "--attempts", "3", *extra])
        await self.master.wait_for(lambda m: len(m.registered) > before)
        if self.peers:
            await asyncio.gather(*(p.call("update_topology") for p in self.peers))
        return proc

    async def join(self, host: Host, *extra: str) -> PeerProcess:
        proc = await self.spawn(host, *extra)
        await proc.wait_accepted(timeout=60)
        self.peers.append(proc)
        return proc

    async def reduce_exactly(self, name: str) -> None:
        """SUM of each peer's tensor ``name`` (seeded by its id): bit-identical to the
        reference in the order of the algorithm that ran, on every peer."""
        for p in self.peers:
            await p.call("make_tensor", name=name, dtype="float32", count=COUNT,
                         seed=p.peer_id + len(name))
        ring = (await self.peers[0].call("info"))["ring"]
        inputs = [deterministic_tensor("float32", COUNT, seed=pid + len(name)) for pid in ring]
        results = await asyncio.gather(*(p.call("all_reduce", name=name) for p in self.peers))
        (algorithm,) = {r["algorithm"] for r in results}  # the ring or the mesh, for all
        want = digest(reference(algorithm, inputs, pccl.ReduceOp.SUM, "float32"))
        assert [r["digest"] for r in results] == [want] * len(self.peers)
        assert all(r["world_size"] == len(self.peers) for r in results)

    def log_has(self, text: str) -> bool:
        return any(text in line for line in self.master.log)


async def test_a_peer_behind_nat_joins_by_reverse_connections() -> None:
    async with VirtualLan() as lan:
        run = await Run.start(lan)
        for label in ("a", "b"):
            await run.join(await lan.add_host(label))
        nat = await run.join(await lan.add_nat_host("home"))
        # The master saw it come from its router's public address, could not dial it
        # back, and had it dial its ring neighbour instead.
        assert run.master.peer_host(nat.peer_id).startswith("10.47.0.")
        assert run.log_has("not reachable from here, behind NAT?")
        assert run.log_has("dialed in reverse")
        assert not run.log_has("relayed through")
        await run.reduce_exactly("x")
        await run.reduce_exactly("yy")


async def test_two_peers_behind_nat_punch_a_hole_even_when_refusing_the_relay() -> None:
    async with VirtualLan() as lan:
        run = await Run.start(lan)
        await run.join(await lan.add_nat_host("home1"))
        await run.join(await lan.add_nat_host("home2"), "--no-relay")
        assert run.log_has("is hole-punched")
        assert not run.log_has("relaying a stream")  # both links are direct TCP
        await run.reduce_exactly("x")
        await run.reduce_exactly("yy")


async def test_behind_a_symmetric_nat_the_link_falls_back_to_the_relay() -> None:
    async with VirtualLan() as lan:
        run = await Run.start(lan)
        await run.join(await lan.add_nat_host("home1"))
        await run.join(await lan.add_nat_host("home2", random_ports=True))
        assert run.log_has("is hole-punched")  # tried first...
        assert run.log_has("relaying a stream")  # ...and the relay took over
        await run.reduce_exactly("x")
        # The next round relays that pair at once (no second 5 s punch).
        assert not run.log_has("is relayed through this master")
        await run.join(await lan.add_host("public"))
        assert run.log_has("is relayed through this master")
        await run.reduce_exactly("yy")


async def test_two_peers_behind_one_nat_take_their_lan() -> None:
    # Before: the master punched (or relayed) a link between two peers of one home LAN.
    async with VirtualLan() as lan:
        run = await Run.start(lan, status=True)
        home = await lan.add_nat_host("home")
        a = await run.join(home)
        b = await run.join(await lan.add_nat_host("laptop", behind=home))
        # One public address (the router's) for both, neither dialable from outside.
        assert run.master.peer_host(a.peer_id) == run.master.peer_host(b.peer_id)
        assert run.log_has("not reachable from here, behind NAT?")
        await run.reduce_exactly("x")
        status = await run.master.api_status()
        (group,) = status["groups"]
        assert [link["path"] for link in group["links"]] == ["lan", "lan"]
        assert [(p["path_in"], p["path_out"]) for p in status["peers"]] == [("lan", "lan")] * 2
        assert run.log_has("dialed on their LAN")
        assert not run.log_has("is hole-punched") and not run.log_has("relaying a stream")


async def test_where_their_lan_fails_two_peers_behind_one_nat_go_on_without_it() -> None:
    # Their dials to each other's private address vanish (two networks behind one NAT):
    # nobody is dropped, the round runs again over the public address, and the link
    # ends up relayed (this NAT does not hairpin a punch), bit-identical as ever.
    async with VirtualLan() as lan:
        run = await Run.start(lan, status=True)
        home = await lan.add_nat_host("home")
        other = await lan.add_nat_host("other", behind=home)
        for h in (home, other):
            await lan.isolate_at_home(h)
        await run.join(home, "--p2p-timeout", "1")
        await run.join(other, "--p2p-timeout", "1")
        assert run.log_has("dialed on their LAN") and run.log_has("on a LAN failed")
        assert not run.master.gone
        await run.reduce_exactly("x")
        status = await run.master.api_status()
        assert [link["path"] for link in status["groups"][0]["links"]] == ["relay", "relay"]


async def test_allow_relay_false_fails_with_the_reason() -> None:
    async with VirtualLan() as lan:
        run = await Run.start(lan)
        await run.join(await lan.add_nat_host("home1"))
        refuser = await run.spawn(await lan.add_nat_host("home2", random_ports=True),
                                  "--no-relay")
        with pytest.raises(pccl.MasterConnectionError,
                           match="hole punching between them failed.*allow_relay=False"):
            await refuser.wait_accepted(timeout=60)
        # The first peer goes on alone.
        await run.reduce_exactly("x")


async def test_sigkill_of_a_nat_peer_mid_reduce_fails_cleanly_and_the_rest_go_on() -> None:
    async with VirtualLan() as lan:
        run = await Run.start(lan)
        await run.join(await lan.add_host("a"))
        await run.join(await lan.add_host("b"))
        victim = await run.join(await lan.add_nat_host("home"))
        await run.reduce_exactly("warm")
        for p in run.peers:
            await p.call("make_tensor", name="big", dtype="float32", count=4_000_000, seed=1)
        reduces = [asyncio.create_task(p.call("all_reduce", name="big")) for p in run.peers]
        await asyncio.sleep(0.05)  # let the ring start moving bytes (not a sync point)
        victim.kill()
        outcomes = await asyncio.gather(*reduces, return_exceptions=True)
        survivors = [p for p in run.peers if p is not victim]
        for p, o in zip(run.peers, outcomes):
            if p is not victim:
                assert isinstance(o, pccl.PCCLError) or o["world_size"] == 3, o
        run.peers = survivors
        await run.master.wait_for(lambda m: victim.peer_id in m.gone, timeout=30)
        await asyncio.gather(*(p.call("update_topology") for p in survivors))
        await run.reduce_exactly("after")


async def test_a_nat_joiner_fetches_shared_state_from_a_nat_holder_through_the_relay() -> None:
    async with VirtualLan() as lan:
        run = await Run.start(lan)
        holder = await run.join(await lan.add_nat_host("home1"))
        big, small = 3_000_000, 1000  # the big one travels in ranges over several streams
        for name, n in (("w", big), ("b", small)):
            await holder.call("make_tensor", name=name, dtype="float32", count=n, seed=7)
        info = await holder.call("sync", names=["w", "b"], revision=1)
        assert info["rx_bytes"] == 0
        want = await holder.call("content_hash", names=["w", "b"])
        joiner = await run.join(await lan.add_nat_host("home2", random_ports=True))
        for name, n in (("w", big), ("b", small)):
            await joiner.call("make_tensor", name=name, dtype="float32", count=n, seed=99)
        infos = await asyncio.gather(
            holder.call("sync", names=["w", "b"], revision=2),
            joiner.call("sync", names=["w", "b"], revision=0, strategy="RECEIVE_ONLY"))
        assert await joiner.call("content_hash", names=["w", "b"]) == want
        assert [i["revision"] for i in infos] == [2, 2]
        assert infos[1]["rx_bytes"] == 4 * (big + small)
        assert infos[0]["tx_bytes"] > 0
        await run.reduce_exactly("after")


async def test_doctor_behind_nat_says_so_and_is_still_ready(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    # This master runs without a secret (the doctor warns of it), explicitly so.
    monkeypatch.delenv("PCCL_SECRET")
    monkeypatch.setenv("PCCL_ALLOW_ANONYMOUS", "1")
    async with VirtualLan() as lan:
        run = await Run.start(lan)
        home = await lan.add_nat_host("home")
        proc = await asyncio.create_subprocess_exec(
            *home.exec_prefix, sys.executable, "-m", "pccl", "doctor", "--master",
            run.master.address, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        async with asyncio.timeout(60):
            out, err = await proc.communicate()
        text = out.decode()
        assert proc.returncode == 0, (text, err.decode())
        assert f"this machine is {home.address}:" in text and "behind NAT" in text
        assert "[warn] reachability: the master could not dial" in text
        # The other warning: this master runs without a secret.
        assert "nothing authenticated" in text and "verdict: ready, with 2 warning(s)" in text
        assert not run.master.registered  # the doctor registered nothing
