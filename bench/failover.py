"""How long a group takes to re-form on a standby master after the active one is
SIGKILLed (docs/scale.md, "No single master").

Two master processes (the second ``--standby``) on 127.0.0.1 and ``k`` peers in this
process, given both addresses. Each trial: the group all-reduces, the active master
is SIGKILLed, and the clock runs until (a) the standby has accepted every peer and
(b) every peer's next all-reduce (retried on ``MasterConnectionError``, as documented)
has completed with the exact sum. The dead master is then started again as a standby
at the end of the list, so the next trial fails over the other way.

With ``--vanish`` the active master's host vanishes instead: the peers reach each
master through a LinkEmulator, and the trial blackholes the active one's (no reset,
new connections hang), so the peers learn of the loss only from the master's silence
(its heartbeat timeout, 3 s here) and their scan of the masters meets one that never
answers (``Communicator(timeout=10)``).

    python bench/failover.py --peers 3 8 --trials 5 --out bench/results/failover.json
    python bench/failover.py --peers 3 8 --trials 3 --vanish \
        --out bench/results/failover_vanish.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import pccl
from pccl.testing import free_port
from pccl.testing.link_emulator import LinkEmulator
from pccl.testing.processes import master_process

HEARTBEAT = ("--heartbeat-interval", "0.5", "--heartbeat-timeout", "3")


async def start_master(port: int, standby: bool) -> asyncio.subprocess.Process:
    proc = await master_process(port, *HEARTBEAT, "--quorum",
                                *(["--standby"] if standby else []))
    for _ in range(200):  # bounded: until it listens
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return proc
        except OSError:
            await asyncio.sleep(0.05)
    raise RuntimeError(f"master on port {port} did not start")


async def reduce_exact(comm: pccl.Communicator, k: int, tag: int) -> None:
    deadline = time.perf_counter() + 120.0
    while time.perf_counter() < deadline:  # bounded by time: a failed call may be quick
        x = np.full(256, comm.peer_id or 0, dtype=np.float32)
        try:
            info = await comm.all_reduce(x, tag=tag)
        except (pccl.MasterConnectionError, pccl.PeerConnectionError):
            await asyncio.sleep(0.02)  # back-off before the documented retry
            continue
        if info.world_size == k:
            return
    raise RuntimeError("no reduce over the whole group")


async def trial_set(k: int, trials: int, vanish: bool) -> list[dict[str, float]]:
    ports = [free_port(), free_port()]
    procs = {ports[0]: await start_master(ports[0], False),
             ports[1]: await start_master(ports[1], True)}
    links = {p: LinkEmulator(f"127.0.0.1:{p}") for p in ports} if vanish else {}
    for link in links.values():
        await link.start()
    order = [links[p].address if vanish else f"127.0.0.1:{p}" for p in ports]
    comms = [pccl.Communicator(order, p2p_listen_host="127.0.0.1", reconnect_timeout=60,
                               timeout=10.0)
             for _ in range(k)]
    out = []
    try:
        await comms[0].connect()
        for i, c in enumerate(comms[1:], start=1):
            task = asyncio.create_task(c.connect())
            for _ in range(400):  # bounded poll of a plain query
                if await comms[0].pending_peer_count():
                    break
                await asyncio.sleep(0.025)
            await asyncio.gather(*(x.update_topology() for x in comms[:i]))
            await task
        active = ports[0]
        for t in range(trials):
            await asyncio.gather(*(reduce_exact(c, k, 1) for c in comms))
            before = [c.reconnects for c in comms]
            t0 = time.perf_counter()
            if vanish:
                links[active].blackhole()
            else:
                procs[active].kill()
                await procs[active].wait()
            await asyncio.gather(*(reduce_exact(c, k, 2) for c in comms))
            t_reduce = time.perf_counter() - t0
            assert all(c.reconnects == b + 1 for c, b in zip(comms, before))
            out.append({"k": k, "trial": t, "first_reduce_s": t_reduce, "vanish": vanish})
            print(json.dumps(out[-1]), flush=True)
            if vanish:  # the host comes back with a fresh master behind the same link
                procs[active].kill()
                await procs[active].wait()
                links[active].blackhole(False)
                await links[active].reset_all()
            # The dead one comes back as a standby; the other is now the active one.
            procs[active] = await start_master(active, True)
            active = ports[1] if active == ports[0] else ports[0]
    finally:
        await asyncio.gather(*(c.close() for c in comms))
        for link in links.values():
            link.blackhole(False)
            await link.stop()
        for proc in procs.values():
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, nargs="+", default=[3, 8])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--vanish", action="store_true",
                    help="blackhole the active master's link instead of SIGKILLing it")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = []
    for k in args.peers:
        rows += await trial_set(k, args.trials, args.vanish)
    summary = {str(k): statistics.median(r["first_reduce_s"] for r in rows if r["k"] == k)
               for k in args.peers}
    print("median seconds from", "the blackhole" if args.vanish else "SIGKILL",
          "to the next exact all-reduce:", summary)
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows,
                                        "median_first_reduce_s": summary}, indent=1) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
