"""Time for N in-process peers to connect and be admitted by one update_topology().

    python bench/membership.py --peers 64 256 --pool 1

Each size runs in a fresh master: the first peer is admitted alone, the other N-1
register, then one update_topology() admits them all and builds the p2p rings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import time

import pccl
from pccl.testing import connect_all


async def run(n: int, pool: int) -> dict[str, float]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    async with pccl.MasterNode(listen="127.0.0.1:0", heartbeat_interval=2.0,
                               heartbeat_timeout=30.0) as master:
        comms = [pccl.Communicator(master=master.address, p2p_connection_pool_size=pool)
                 for _ in range(n)]
        t0 = time.perf_counter()
        await connect_all(master, comms)
        t1 = time.perf_counter()
        assert all(c.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) == n for c in comms)
        assert all(c.ring_lanes() == (pool, pool) for c in comms) or n == 1
        # A second update with nothing to do: the cost of the vote alone.
        t2 = time.perf_counter()
        await asyncio.gather(*(c.update_topology() for c in comms))
        t3 = time.perf_counter()
        await asyncio.gather(*(c.close() for c in comms))
    return {"peers": n, "pool": pool, "connect_and_admit_s": t1 - t0, "noop_vote_s": t3 - t2}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--pool", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    for n in args.peers:
        runs = [asyncio.run(run(n, args.pool)) for _ in range(args.repeat)]
        best = min(runs, key=lambda r: r["connect_and_admit_s"])
        print(json.dumps({**best, "median_connect_and_admit_s":
                          sorted(r["connect_and_admit_s"] for r in runs)[len(runs) // 2]}))


if __name__ == "__main__":
    main()
