"""Join-order ring vs optimized ring for an emulated world with a skewed bandwidth
matrix, in one run; the best ring by brute force for reference.

    python bench/topology.py --peers 6 --mib 16 --seed 1
    python bench/topology.py --peers 8 --regions 2 --region-ms 15 --min-mbps 40 \
        --max-mbps 40 --mib 4 --small-kib 64

Every peer's incoming links pass through a LinkEmulator that caps each connection by
its sending peer (per-pair matrix, log-uniform between --min-mbps and --max-mbps).
With --regions R, peer i sits in region i % R (join order crosses between regions at
every hop) and a connection between regions pays --region-ms of one-way latency each
way; --small-kib also times a small all-reduce (the mesh or the ring, as the master's
cost model picks; never through the master).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from contextlib import AsyncExitStack

import numpy as np

from pccl.algorithms import mesh_steps
from pccl.testing import Cluster
from pccl.topology import ring_cost


async def time_reduce(comms, n: int, iters: int, used: set[str] | None = None) -> float:
    """Median seconds of ``iters`` all-reduces of ``n`` floats; ``used`` collects the
    algorithms that ran them."""
    times = []
    for it in range(iters):
        xs = [np.ones(n, np.float32) for _ in comms]
        t0 = time.perf_counter()
        infos = await asyncio.gather(*(c.all_reduce(x, tag=it) for c, x in zip(comms, xs)))
        times.append(time.perf_counter() - t0)
        assert all((x == len(comms)).all() for x in xs)
        if used is not None:
            used.update(i.algorithm for i in infos)
    return sorted(times)[len(times) // 2]


async def run(peers: int, mib: int, seed: int, lo: float, hi: float, iters: int,
              regions: int = 1, region_ms: float = 0.0, small_kib: int = 0,
              mesh_max_bytes: int = -1) -> dict:
    rng = np.random.default_rng(seed)
    bw = np.exp(rng.uniform(np.log(lo), np.log(hi), size=(peers, peers)))
    np.fill_diagonal(bw, 0)
    async with AsyncExitStack() as stack:
        cluster = await stack.enter_async_context(
            Cluster(0, pool_size=2, master_kwargs={"heartbeat_timeout": 60.0,
                                                    "insecure": True,
                                                    "mesh_max_bytes": mesh_max_bytes}))

        def delay(i: int, j: int) -> float:
            return region_ms / 1e3 if i % regions != j % regions else 0.0
        # Clear text: the emulators tell senders apart by the id in their p2p hello,
        # which the default encrypted transport hides. Matrix index = join index.
        comms = await cluster.admit_shaped(
            stack, peers, lambda i, j: float(bw[i, j]), delay if regions > 1 else None,
            peer_timeout=120.0, via_master_max_bytes=0)
        index = {c.peer_id: k for k, c in enumerate(comms)}
        n = mib * (1 << 20) // 4
        join_ring = list(range(peers))
        small = small_kib * 1024 // 4
        t_join = await time_reduce(comms, n, iters)
        used_join: set[str] = set()
        used_opt: set[str] = set()
        t_join_small = await time_reduce(comms, small, iters, used_join) if small else None
        mesh_limit_before = cluster.master.state.mesh_limits.get(0)
        t0 = time.perf_counter()
        await asyncio.gather(*(c.optimize_topology() for c in comms))
        t_opt_call = time.perf_counter() - t0
        opt_ring = [index[p] for p in comms[0].ring]
        t_opt = await time_reduce(comms, n, iters)
        t_opt_small = await time_reduce(comms, small, iters, used_opt) if small else None
        state = cluster.master.state
        mesh_order = [index[p] for p in state.mesh_orders.get(0, [])]
        measured_ms = {f"{index[a]}->{index[b]}": round(v * 1e3, 3)
                       for (a, b), (v, _) in sorted(state.latency.items())}
        mesh_limit = state.mesh_limits.get(0)

    def crossings(ring: list[int]) -> int:
        return sum(ring[k] % regions != ring[k - 1] % regions for k in range(len(ring)))

    def mesh_crossings(order: list[int]) -> int:  # steps of the mesh that cross
        return sum(any(order[a] % regions != order[b] % regions for a, b in step)
                   for step in mesh_steps(len(order)))
    # By brute force, (k - 1)! rings: up to 10 peers (11 would take minutes).
    def rank(r: list[int]) -> tuple[float, float]:
        bottleneck, cost = ring_cost(r, bw)
        return bottleneck, -cost
    best = max((list((0, *p)) for p in itertools.permutations(range(1, peers))), key=rank) \
        if peers <= 10 else opt_ring
    return {
        "peers": peers, "mib": mib, "seed": seed,
        "join_ring": join_ring, "join_bottleneck_MBps": ring_cost(join_ring, bw)[0] / 1e6,
        "optimized_ring": opt_ring, "optimized_bottleneck_MBps": ring_cost(opt_ring, bw)[0] / 1e6,
        "best_ring": best, "best_bottleneck_MBps": ring_cost(best, bw)[0] / 1e6,
        "join_reduce_s": t_join, "optimized_reduce_s": t_opt, "speedup": t_join / t_opt,
        "optimize_topology_call_s": t_opt_call,
        "optimized_vs_best_bottleneck": ring_cost(best, bw)[0] / ring_cost(opt_ring, bw)[0],
        "best_by_brute_force": peers <= 10,
        "regions": regions, "region_ms": region_ms,
        "join_region_crossings": crossings(join_ring),
        "optimized_region_crossings": crossings(opt_ring),
        "small_kib": small_kib, "join_small_reduce_s": t_join_small,
        "optimized_small_reduce_s": t_opt_small, "mesh_limit_before": mesh_limit_before,
        "mesh_limit_after": mesh_limit, "mesh_max_bytes_asked": mesh_max_bytes,
        "small_algorithms_before": sorted(used_join), "small_algorithms_after": sorted(used_opt),
        "mesh_order_after": mesh_order,
        "mesh_step_crossings_before": mesh_crossings(join_ring),
        "mesh_step_crossings_after": mesh_crossings(mesh_order) if mesh_order else None,
        "mesh_step_crossings_ring_rotations": min(
            mesh_crossings(opt_ring[k:] + opt_ring[:k]) for k in range(peers)),
        "measured_one_way_ms": measured_ms,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", type=int, default=6)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--min-mbps", type=float, default=5.0)
    ap.add_argument("--max-mbps", type=float, default=100.0)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--regions", type=int, default=1)
    ap.add_argument("--region-ms", type=float, default=0.0,
                    help="one-way latency between regions, each way")
    ap.add_argument("--small-kib", type=int, default=0)
    ap.add_argument("--mesh-max-bytes", type=int, default=-1,
                    help="the master's mesh limit: -1 the cost model's (default), 0 no "
                         "mesh, N > 0 every all-reduce up to N bytes on the mesh")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = asyncio.run(run(args.peers, args.mib, args.seed, args.min_mbps * 1e6,
                          args.max_mbps * 1e6, args.iters, args.regions, args.region_ms,
                          args.small_kib, args.mesh_max_bytes))
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
