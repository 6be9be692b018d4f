"""Rings through NAT: how long a ring of 8 peers takes to form, and what it reduces at,
when some peers sit behind real kernel NAT (network namespaces, nftables masquerade;
``pccl.testing.netns``), side by side with an all-public ring in the same run.

    sudo python bench/nat.py [--peers 8] [--nat 4] [--mib 16] [--iters 3]
                             [--out bench/results/nat.json]

Layouts (same machine, same run):
- direct: every peer public;
- reverse: --nat peers behind NAT, joined alternately with public ones, so every ring
  link into a NAT'd peer is dialed by that peer (no relay);
- punch: the --nat NAT'd peers joined one after the other, so the links between them
  are hole-punched (their routers keep source ports), the rest reverse or direct;
- relay: the same behind "symmetric" NATs (a random public port per connection): the
  punch fails (after 5 s) and the links between them go through the master's relay.

For each: the time of the round that admits the last peer (every peer calls
update_topology(); the round rebuilds every ring link), measured from the test side
(RPC to the peer processes included), and the median time of a float32 SUM all-reduce
of --mib MiB (busbw = bytes * 2(k-1)/k / time). Needs root, iproute2 and nft.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import write_results

from pccl.testing import PeerProcess
from pccl.testing.netns import VirtualLan, nat_unavailable


async def layout(name: str, k: int, nat: int, count: int, iters: int) -> dict[str, Any]:
    async with VirtualLan() as lan:
        master = await lan.start_master(await lan.add_host("master"),
                                        heartbeat_interval=1.0, heartbeat_timeout=30.0)
        if name == "direct":
            kinds = ["pub"] * k
        elif name == "reverse":
            kinds = [("nat" if i % 2 else "pub") if i < 2 * nat else "pub" for i in range(k)]
        else:
            kinds = ["nat"] * nat + ["pub"] * (k - nat)
        symmetric = name == "relay"
        peers: list[PeerProcess] = []
        last_round = 0.0
        for i, kind in enumerate(kinds):
            host = await (lan.add_nat_host(f"home{i}", random_ports=symmetric)
                          if kind == "nat" else lan.add_host(f"pub{i}"))
            before = len(master.registered)
            proc = await lan.spawn_peer(host, master.address, reply_timeout=300.0,
                                        extra_args=["--peer-timeout", "60", "--pool", "2"])
            await master.wait_for(lambda m, b=before: len(m.registered) > b, timeout=120)
            t0 = time.perf_counter()
            if peers:
                await asyncio.gather(*(p.call("update_topology") for p in peers))
            await proc.wait_accepted(timeout=120)
            last_round = time.perf_counter() - t0
            peers.append(proc)
        for p in peers:
            await p.call("make_tensor", name="x", dtype="float32", count=count, seed=1)
        times = []
        for _ in range(iters + 1):
            t0 = time.perf_counter()
            res = await asyncio.gather(*(p.call("all_reduce", name="x") for p in peers))
            times.append(time.perf_counter() - t0)
            assert len({r["digest"] for r in res}) == 1 and res[0]["world_size"] == k
        med = statistics.median(times[1:])
        nbytes = 4 * count
        relayed = sum("relaying a stream" in line for line in master.log)
        reverse = sum("dialed in reverse" in line for line in master.log)
        punched = sum("is hole-punched" in line for line in master.log)
        return {"layout": name, "peers": k, "nat_peers": kinds.count("nat"),
                "ring_round_s": last_round, "allreduce_median_s": med,
                "busbw_MBps": nbytes * 2 * (k - 1) / k / med / 1e6,
                "relayed_streams_logged": relayed, "reverse_links_logged": reverse,
                "punch_links_logged": punched}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"config": vars(args), "runs": []}
    count = int(args.mib * (1 << 20)) // 4
    for name in ("direct", "reverse", "punch", "relay"):
        r = await layout(name, args.peers, args.nat, count, args.iters)
        out["runs"].append(r)
        print(f"{name:>8}: ring round {r['ring_round_s']:.2f} s, all-reduce "
              f"{r['allreduce_median_s'] * 1e3:.0f} ms ({r['busbw_MBps']:.0f} MB/s busbw), "
              f"routes logged over all rounds: {r['reverse_links_logged']} reverse, "
              f"{r['punch_links_logged']} punch, {r['relayed_streams_logged']} relayed "
              "stream(s)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=8)
    ap.add_argument("--nat", type=int, default=4)
    ap.add_argument("--mib", type=float, default=16.0)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", default="bench/results/nat.json")
    args = ap.parse_args()
    why = nat_unavailable()
    if why:
        sys.exit(f"bench/nat.py: {why}")
    out = asyncio.run(main_async(args))
    write_results(out, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
