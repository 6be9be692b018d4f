"""A master under a mixed flood (issue 36): strangers and an insider attack it while
honest peers reduce, and the master's memory and file descriptors are sampled.

The master runs in its own process (``pccl-master``, no secret: anyone may complete the
handshake and register, the hardest case), with the limits it ships with. At the same
time, from other loopback source addresses (127.0.0.2 ... : the per-address budgets
apply to each):

- strangers that connect and say nothing (slowloris on the control port), that send
  garbage first frames or huge length prefixes, that finish the handshake and send a
  pre-hello frame of nested arrays, or relay hellos with made-up tokens;
- ``pccl doctor`` clients that ask for 8 MiB echoes and never read them;
- an insider that registers (claiming an honest peer's id), then sends lying p2p
  reports, a 4 MiB frame of nested arrays, a 2 MiB error text, and registers again.

Honest peers (in this process) run all-reduces with integer-valued data throughout
and check every result exactly. Prints one JSON object (and writes it with ``--out``):
steps, wrong results, the master's peak RSS and fd count, and what the attackers did.

    python bench/adversary_flood.py --seconds 60 --out bench/results/adversary_flood.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

import pccl
from pccl.master.server import RELAY_MAGIC
from pccl.protocol import PROTOCOL_VERSION
from pccl.protocol import messages as m
from pccl.protocol.transport import ConnectionClosed, FramedConnection
from pccl.testing import free_port
from pccl.testing.processes import master_process, stop_process


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Flood:
    def __init__(self, args: argparse.Namespace, port: int) -> None:
        self.args = args
        self.host = "127.0.0.1"
        self.port = port
        self.deadline = time.monotonic() + args.seconds
        self.counts: dict[str, int] = {}
        self.rng = random.Random(args.seed)

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def live(self) -> bool:
        return time.monotonic() < self.deadline

    def source(self, i: int) -> str:
        """The loopback address attacker task ``i`` connects from (``--per-source``
        tasks share each one)."""
        j = i // self.args.per_source
        return f"127.0.{1 + j // 250}.{2 + j % 250}"

    async def _open(self, i: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(self.host, self.port,
                                             local_addr=(self.source(i), 0))

    @contextlib.asynccontextmanager
    async def _challenged(self, i: int) -> AsyncIterator[FramedConnection]:
        """A control connection from attacker ``i``'s address, past the handshake and
        the master's challenge (no secret: anyone gets that far); aborted on exit."""
        conn = FramedConnection(*await self._open(i))
        try:
            await conn.dial(None)
            await conn.recv()
            yield conn
        finally:
            conn.abort()

    @staticmethod
    async def _bomb_until_dropped(conn: FramedConnection, body: bytes) -> None:
        """Sends ``body`` as one frame, then reads until the master hangs up."""
        assert conn.session is not None
        conn.writer.write(conn.session.seal(len(body).to_bytes(4, "big") + body))
        while True:
            await conn.recv()

    async def _attempt(self, what: str, coro: Any) -> None:
        try:
            async with asyncio.timeout(30):
                await coro
            self.count(what)
        except (OSError, ConnectionError, ConnectionClosed, pccl.PCCLError, TimeoutError,
                asyncio.IncompleteReadError):
            self.count(what + "_cut")

    # --- strangers ------------------------------------------------------------------

    async def silent(self, i: int) -> None:
        """Connects and says nothing until the master hangs up; again."""
        while self.live():
            async def once() -> None:
                r, w = await self._open(i)
                try:
                    while await r.read(1 << 16):
                        pass
                finally:
                    w.close()
            await self._attempt("silent", once())

    async def garbage(self, i: int) -> None:
        while self.live():
            async def once() -> None:
                r, w = await self._open(i)
                try:
                    kind = self.rng.randrange(3)
                    if kind == 0:
                        w.write(os.urandom(self.rng.randrange(1, 4096)))
                    elif kind == 1:
                        w.write((0xFFFFFFF0).to_bytes(4, "big") + os.urandom(64))
                    else:
                        body = RELAY_MAGIC + os.urandom(18)
                        w.write(len(body).to_bytes(4, "big") + body)
                    await w.drain()
                    while await r.read(1 << 16):
                        pass
                finally:
                    w.close()
            await self._attempt("garbage", once())

    async def bomb_before_hello(self, i: int) -> None:
        while self.live():
            async def once() -> None:
                async with self._challenged(i) as conn:
                    await self._bomb_until_dropped(
                        conn, msgpack.packb({"t": "hello", "x": [[]] * (60 << 10)}))
            await self._attempt("prehello_bomb", once())

    async def doctor(self, i: int) -> None:
        while self.live():
            async def once() -> None:
                async with self._challenged(i) as conn:
                    await conn.send(m.DoctorHello(version=PROTOCOL_VERSION, p2p_port=0,
                                                  nonce=secrets.token_bytes(16), mac=b""))
                    if isinstance(await conn.recv(), m.DoctorReport):
                        await conn.send(m.DoctorEcho(payload=b"", reply_bytes=64 << 20))
                        await asyncio.sleep(30)  # never reads: the attack itself
            await self._attempt("doctor", once())

    # --- the insider ----------------------------------------------------------------

    async def insider(self, i: int, honest_ids: list[int]) -> None:
        while self.live():
            async def once() -> None:
                async with self._challenged(i) as conn:
                    await conn.send(m.Hello(
                        version=PROTOCOL_VERSION, peer_group=0, p2p_port=9,
                        p2p_host=self.source(i), nonce=secrets.token_bytes(16), mac=b"",
                        resume_peer_id=self.rng.choice(honest_ids or [1]), resume_epoch=1,
                        resume_peers=honest_ids))
                    welcome = await conn.recv()
                    if not isinstance(welcome, m.Welcome):
                        return
                    self.count("insider_registered")
                    for e in range(64):
                        conn.send_nowait(m.P2PReport(epoch=e, failed=honest_ids))
                    conn.send_nowait(m.CollectiveDone(tag=0, op_id=0, ok=False,
                                                      kind=pccl.ErrorKind.NONE,
                                                      message="x" * (2 << 20)))
                    await self._bomb_until_dropped(
                        conn, msgpack.packb({"t": "coll_done", "x": [[]] * (4 << 20)}))
            await self._attempt("insider_round", once())


async def honest(comms: list[pccl.Communicator], flood: Flood, out: dict[str, Any]) -> None:
    step = 0
    n = 1 << 16
    while flood.live():
        step += 1
        xs = [np.full(n, float(step * (k + 1)), dtype=np.float32) for k in range(len(comms))]
        try:
            infos = await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs,
                                                                          strict=True)))
        except pccl.PCCLError as e:
            out["errors"].append(f"step {step}: {type(e).__name__}: {str(e)[:200]}")
            break
        want = float(step * sum(range(1, len(comms) + 1)))
        ok = all(i.world_size == len(comms) for i in infos) and all(
            bool((x == want).all()) for x in xs)
        out["steps"] += 1
        out["wrong"] += not ok


async def main(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    master = await master_process(port, "--heartbeat-interval", "0.5",
                                  "--heartbeat-timeout", "5",
                                  "--max-connections", str(args.max_connections))
    samples: list[tuple[float, int]] = []
    result: dict[str, Any] = {"steps": 0, "wrong": 0, "errors": []}
    try:
        for _ in range(200):  # bounded wait for the master to listen
            with contextlib.suppress(OSError):
                _, w = await asyncio.open_connection("127.0.0.1", port)
                w.close()
                break
            await asyncio.sleep(0.05)
        comms = [pccl.Communicator(master=f"127.0.0.1:{port}", p2p_connection_pool_size=2)
                 for _ in range(args.peers)]
        await comms[0].connect()  # alone: admitted at once
        joins = [asyncio.create_task(c.connect()) for c in comms[1:]]
        async with asyncio.timeout(60):
            while comms[0].world_size < args.peers:
                if await comms[0].are_peers_pending():
                    await comms[0].update_topology()
                else:
                    await asyncio.sleep(0.1)  # joiners still registering: ask again
            await asyncio.gather(*joins)
        base_rss, base_fds = _rss_mb(master.pid), _fds(master.pid)
        honest_ids = [int(c.peer_id) for c in comms if c.peer_id is not None]
        # The attackers run in a process of their own: in this one they would starve
        # the honest peers' event loop, which measures nothing about the master.
        attacker = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--attack-port", str(port),
            "--honest-ids", ",".join(map(str, honest_ids)), "--seconds", str(args.seconds),
            "--strangers", str(args.strangers), "--per-source", str(args.per_source),
            "--seed", str(args.seed), stdout=asyncio.subprocess.PIPE)
        clock = Flood(args, port)

        async def sample() -> None:
            while clock.live():
                samples.append((_rss_mb(master.pid), _fds(master.pid)))
                await asyncio.sleep(0.2)  # a sampling period, not a synchronisation

        started = time.monotonic()
        try:
            await asyncio.gather(honest(comms, clock, result), sample())
            async with asyncio.timeout(60):
                out, _ = await attacker.communicate()
            attack = json.loads(out)
        finally:
            if attacker.returncode is None:
                attacker.kill()
                await attacker.wait()
        elapsed = time.monotonic() - started
        result.update({
            "seconds": round(elapsed, 1),
            "peers": args.peers,
            "steps_per_second": round(result["steps"] / elapsed, 1),
            **attack,
            "master_rss_mb_before": round(base_rss, 1),
            "master_rss_mb_peak": round(max(s[0] for s in samples), 1),
            "master_max_connections": args.max_connections,
            "master_fds_before": base_fds,
            "master_fds_peak": max(s[1] for s in samples),
            "honest_world_size_after": comms[0].world_size,
        })
        await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)
    finally:
        await stop_process(master)
    return result


async def attack(args: argparse.Namespace) -> dict[str, Any]:
    """The attacker process (``--attack-port``): every attack until the deadline; what
    it did, as JSON on stdout."""
    flood = Flood(args, args.attack_port)
    honest_ids = [int(x) for x in args.honest_ids.split(",") if x]
    tasks = []
    k = 0
    for kind, n in (("silent", args.strangers), ("garbage", args.strangers // 4),
                    ("bomb_before_hello", args.strangers // 8),
                    ("doctor", args.strangers // 16),
                    ("insider", 2 if args.strangers else 0)):
        for _ in range(n):
            coro = (flood.insider(k, honest_ids) if kind == "insider"
                    else getattr(flood, kind)(k))
            tasks.append(asyncio.create_task(coro))
            k += 1
    await asyncio.sleep(max(0.0, flood.deadline - time.monotonic()))  # the attack's length
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"attacker_tasks": len(tasks),
            "attacker_sources": len({flood.source(i) for i in range(k)}),
            "attacks": dict(sorted(flood.counts.items()))}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--strangers", type=int, default=400,
                   help="silent connections held at once (and a quarter as many sending "
                        "garbage, an eighth pre-hello bombs, a sixteenth doctor sessions, "
                        "and two insiders; 0: no attack at all, the control run)")
    p.add_argument("--per-source", type=int, default=8,
                   help="attacker tasks sharing one source address (the master budgets "
                        "32 connections in the handshake per address)")
    p.add_argument("--max-connections", type=int, default=384,
                   help="the master's --max-connections: its bound on descriptors for "
                        "connections (peers, handshakes, relayed streams)")
    p.add_argument("--seed", type=int, default=36)
    p.add_argument("--out", type=Path)
    p.add_argument("--attack-port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--honest-ids", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    if args.attack_port:
        print(json.dumps(asyncio.run(attack(args))))
        sys.exit(0)
    res = asyncio.run(main(args))
    text = json.dumps({"command": " ".join(["python", *sys.argv]), **res}, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
