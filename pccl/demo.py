"""``python -m pccl demo``: a local cluster narrated step by step.

A master runs in this process; every peer is a real process (``pccl.testing.peer_worker``)
driven over a pipe. The demo shows peers joining, an all-reduce with bit-identical
results, a late joiner, a peer killed with SIGKILL and the run going on, and a
graceful shutdown.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pccl.master.server import MasterNode
from pccl.testing.processes import PeerProcess

COUNT = 1 << 20  # float32 elements per peer: 4 MiB


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


async def _knock(master: MasterNode, new: list[PeerProcess]) -> None:
    """Starts the ``new`` peer processes; returns once they all wait to be admitted."""
    before = len(master.state.pending())
    for p in new:
        await p.start()
    await master.wait_for(lambda s: len(s.pending()) >= before + len(new), timeout=120)


async def _admit(master: MasterNode, live: list[PeerProcess], new: list[PeerProcess]) -> None:
    """The ``live`` peers vote the pending ``new`` ones in."""
    say(f"  {len(new)} peer(s) pending; the {len(live)} accepted peer(s) call update_topology()")
    await asyncio.gather(*(p.call("update_topology") for p in live))
    for p in new:
        await p.wait_accepted()


async def _reduce(peers: list[PeerProcess], round_no: int) -> list[dict[str, Any]]:
    seeds = {p.peer_id: 1000 * round_no + (p.peer_id or 0) for p in peers}
    await asyncio.gather(*(p.call("make_tensor", name="grad", dtype="float32", count=COUNT,
                                  seed=seeds[p.peer_id]) for p in peers))
    t0 = time.perf_counter()
    results = await asyncio.gather(*(p.call("all_reduce", name="grad", op="AVG", tag=round_no)
                                     for p in peers))
    dt = time.perf_counter() - t0
    say(f"  all-reduce AVG of {COUNT * 4 >> 20} MiB float32 over {len(peers)} peers: "
        f"{dt * 1e3:.0f} ms, {results[0]['tx_bytes'] / 1e6:.1f} MB sent per peer")
    digests = {r["digest"] for r in results}
    say(f"  result digests: {len(digests)} distinct -> "
        f"{'bit-identical on every peer' if len(digests) == 1 else 'MISMATCH'}")
    return results


async def run_demo(n_peers: int = 4) -> int:
    if n_peers < 2:
        raise SystemExit("the demo needs at least 2 peers")
    peers: list[PeerProcess] = []
    gone: list[PeerProcess] = []
    async with MasterNode(listen="127.0.0.1:0", heartbeat_interval=0.25,
                          heartbeat_timeout=2.0, status_listen="127.0.0.1:0") as master:
        try:
            say(f"master listening on {master.address}; live status page on "
                f"http://{master.status_address}/ (JSON: /api/status, Prometheus: /metrics)")
            first = PeerProcess(master.address, pool_size=2, extra_args=["--peer-timeout", "5"])
            peers.append(first)
            await first.start()
            await first.wait_accepted()
            say(f"peer {first.peer_id} joined an empty run and was accepted at once")

            joiners = [PeerProcess(master.address, pool_size=2,
                                   extra_args=["--peer-timeout", "5"])
                       for _ in range(n_peers - 1)]
            await _knock(master, joiners)
            await _admit(master, [first], joiners)
            peers += joiners
            attrs = await first.call("attributes")
            say(f"peers {[p.peer_id for p in peers]} accepted; world size "
                f"{attrs['GLOBAL_WORLD_SIZE']}, ring {(await first.call('info'))['ring']}")

            say("round 1")
            await _reduce(peers, 1)

            say("a late joiner knocks while the others keep reducing")
            late = PeerProcess(master.address, pool_size=2, extra_args=["--peer-timeout", "5"])
            await _knock(master, [late])
            count = await first.call("pending_peer_count")
            # are_peers_pending() is a collective: every accepted peer asks, all hear one
            # answer (so all take the same branch).
            pending = await asyncio.gather(*(p.call("are_peers_pending") for p in peers))
            say(f"  pending_peer_count() -> {count}; are_peers_pending() on every peer -> "
                f"{pending}; round 2 runs meanwhile, without it")
            await _reduce(peers, 2)
            await _admit(master, peers, [late])
            peers.append(late)
            say(f"  peer {late.peer_id} admitted; world size "
                f"{(await first.call('attributes'))['GLOBAL_WORLD_SIZE']}")

            victim = peers[1]
            say(f"SIGKILL peer {victim.peer_id} (no goodbye, sockets reset by the kernel)")
            victim.kill()
            peers.remove(victim)
            gone.append(victim)
            await master.wait_for(lambda s: victim.peer_id not in s.peers, timeout=60)
            say(f"  the master dropped peer {victim.peer_id} at once and rebuilds the ring "
                "from the survivors on its own")
            results = await _reduce(peers, 3)
            say(f"  the survivors' next all-reduce ran on the repaired ring (world size "
                f"{results[0]['world_size']}); nobody called update_topology()")

            say("everyone leaves gracefully")
            await asyncio.gather(*(p.call("close") for p in peers))
            await master.wait_for(lambda s: not s.peers, timeout=60)
            done = master.monitor.collectives
            say(f"all peers left; the master counted {done['ok']} collectives ok and "
                f"{done['failed']} failed, {len(master.monitor.timeline)} timeline events; "
                "stopping the master")
        finally:
            for p in peers + gone:
                await p.close()
    say("demo finished")
    return 0
