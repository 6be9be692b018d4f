"""Small-collective latency with a distant master: issue 21's "one master round trip per
collective", early start against the two round trips of waiting for the master's perform.

One process: a master, ``k`` peers, and link emulators (pccl.testing.LinkEmulator). Every
peer reaches the master through an emulator adding ``--master-ms`` one way, and every
peer's inbound p2p link has its own emulator adding ``--link-ms`` one way (so a ring hop
costs that much). For each k it measures, side by side:

- the master round trip as a peer sees it (``pending_peer_count()``, a plain query);
- a ``--bytes`` (1 KiB) float32 all-reduce (SUM), every peer calling at once, wall time
  of the slowest, in three modes on the same peers, alternating iteration by iteration:
  ``via_master`` (the default up to 64 KiB: the tensors travel with the requests and the
  master answers with the result; one round trip, no ring), ``early`` (the ring starts
  when called; one round trip after the ring) and ``perform_first`` (the ring waits for
  the master's perform; two round trips);

and prints them against "one master round trip + the ring's own latency (2 (k - 1)
hops) + 2 ms", the issue's target::

    python bench/latency.py --peers 2 8 --iters 20 --out bench/results/latency.json
    python bench/latency.py --peers 4 8 16 32 --master-ms 0 --bytes 4096   # the ring alone

With ``--algorithms`` it compares the algorithms between peers instead (nothing goes
via the master): the ring (``MasterNode(mesh_max_bytes=0)``), the mesh (recursive
doubling, forced) and what pccl picks by itself (the cost model, from the dials it
measured), each on its own cluster, and reports the mesh limit the master chose::

    python bench/latency.py --algorithms --peers 4 8 16 32 --master-ms 0 --bytes 4096
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine_info, write_results

import pccl
from pccl.algorithms import mesh_rounds
from pccl.testing import LinkEmulator
from pccl.testing.cluster import connect_all


@contextlib.asynccontextmanager
async def emulated_cluster(k: int, master_ms: float, link_ms: float,
                           master_kwargs: dict[str, Any] | None = None,
                           comm_kwargs: dict[str, Any] | None = None,
                           ) -> AsyncIterator[tuple[pccl.MasterNode, list[pccl.Communicator]]]:
    """A master and ``k`` admitted peers in this process: every peer reaches the master
    through an emulator adding ``master_ms`` one way, and its inbound p2p link through
    its own emulator adding ``link_ms`` one way. Everything is closed on exit."""
    master = pccl.MasterNode(listen="127.0.0.1:0", heartbeat_interval=1.0,
                             **{"heartbeat_timeout": 30.0, **(master_kwargs or {})})
    await master.start()
    emus: list[LinkEmulator] = []
    comms: list[pccl.Communicator] = []
    try:
        to_master = LinkEmulator(master.address, latency=master_ms / 1e3)
        await to_master.start()
        emus.append(to_master)
        for _ in range(k):
            inbound = LinkEmulator(latency=link_ms / 1e3)
            await inbound.start()
            emus.append(inbound)
            comm = pccl.Communicator(master=to_master.address, p2p_connection_pool_size=1,
                                     p2p_advertise_address=inbound.address, timeout=60.0,
                                     **(comm_kwargs or {}))
            inbound.target = lambda comm=comm: f"127.0.0.1:{comm.p2p_port}"
            comms.append(comm)
        await connect_all(master, comms)
        yield master, comms
    finally:
        await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)
        for e in emus:
            await e.stop()
        await master.stop()


async def measure(k: int, iters: int, master_ms: float, link_ms: float,
                  count: int) -> dict[str, Any]:
    async with emulated_cluster(k, master_ms, link_ms) as (master, comms):
        xs = [np.full(count, float(i + 1), dtype=np.float32) for i in range(k)]
        want = float(k * (k + 1) // 2)
        rtt: list[float] = []
        # mode -> (via_master_max_bytes, early_start_max_bytes)
        modes = {"via_master": (64 << 10, 4 << 20), "early": (0, 4 << 20),
                 "perform_first": (0, 0)}
        reduce: dict[str, list[float]] = {mode: [] for mode in modes}
        for it in range(iters + 2):  # two warm-up rounds
            t0 = time.perf_counter()
            await comms[0].pending_peer_count()
            if it >= 2:
                rtt.append(time.perf_counter() - t0)
            for mode, (via_master, early) in modes.items():
                for c in comms:
                    c.options = dataclasses.replace(c.options, via_master_max_bytes=via_master,
                                                    early_start_max_bytes=early)
                for i, x in enumerate(xs):
                    x.fill(i + 1)
                t0 = time.perf_counter()
                await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs)))
                if it >= 2:
                    reduce[mode].append(time.perf_counter() - t0)
                if not all(float(x[0]) == want and float(x[-1]) == want for x in xs):
                    raise RuntimeError(f"wrong all-reduce result at k={k}")
        ring_s = 2 * (k - 1) * link_ms / 1e3
        rtt_med = statistics.median(rtt)
        row: dict[str, Any] = {
            "peers": k, "bytes": count * 4, "iters": iters,
            "master_one_way_ms": master_ms, "link_one_way_ms": link_ms,
            "master_rtt_ms_median": rtt_med * 1e3,
            "ring_latency_ms": ring_s * 1e3,
            "target_ms": (rtt_med + ring_s + 0.002) * 1e3,
            "paths": dict(master.state.collective_paths),
        }
        for mode, times in reduce.items():
            row[mode] = {
                "all_reduce_ms_median": statistics.median(times) * 1e3,
                "all_reduce_ms_min": min(times) * 1e3,
                "master_rtts_spent": ((statistics.median(times) - ring_s) / rtt_med
                                      if rtt_med > 0 else None),
            }
        return row


async def measure_algorithm(k: int, iters: int, master_ms: float, link_ms: float,
                            count: int, mesh_max_bytes: int) -> dict[str, Any]:
    """Median all-reduce time of ``count`` float32 on a fresh cluster whose master was
    given ``mesh_max_bytes``, and what ran."""
    async with emulated_cluster(
            k, master_ms, link_ms,
            master_kwargs={"heartbeat_timeout": 60.0, "mesh_max_bytes": mesh_max_bytes},
            comm_kwargs={"via_master_max_bytes": 0, "peer_timeout": 60.0}) as (master, comms):
        xs = [np.full(count, float(i + 1), dtype=np.float32) for i in range(k)]
        want = float(k * (k + 1) // 2)
        times: list[float] = []
        ran: set[str] = set()
        for it in range(iters + 2):  # two warm-up rounds
            for i, x in enumerate(xs):
                x.fill(i + 1)
            t0 = time.perf_counter()
            infos = await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs)))
            if it >= 2:
                times.append(time.perf_counter() - t0)
            ran |= {i.algorithm for i in infos}
            if not all(float(x[0]) == want and float(x[-1]) == want for x in xs):
                raise RuntimeError(f"wrong all-reduce result at k={k}")
        limit = master.state.mesh_limits.get(0, 0)
        return {"all_reduce_ms_median": statistics.median(times) * 1e3,
                "all_reduce_ms_min": min(times) * 1e3, "ran": sorted(ran),
                "mesh_max_bytes": limit,
                "cost_model_inputs": master.state.mesh_inputs.get(0)}


async def compare_algorithms(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for k in args.peers:
        row: dict[str, Any] = {"peers": k, "bytes": args.bytes, "iters": args.iters,
                               "master_one_way_ms": args.master_ms,
                               "link_one_way_ms": args.link_ms,
                               "ring_hops_ms": 2 * (k - 1) * args.link_ms,
                               "mesh_hops_ms": mesh_rounds(k) * args.link_ms}
        for name, limit in (("ring", 0), ("mesh", 1 << 30), ("auto", -1)):
            row[name] = await measure_algorithm(k, args.iters, args.master_ms, args.link_ms,
                                                args.bytes // 4, limit)
        rows.append(row)
        print(f"k={k}: {args.bytes} B all-reduce median ms: ring "
              f"{row['ring']['all_reduce_ms_median']:.1f} ({row['ring_hops_ms']:.0f} ms of "
              f"hops), mesh {row['mesh']['all_reduce_ms_median']:.1f} "
              f"({row['mesh_hops_ms']:.0f} ms of hops); pccl picks {row['auto']['ran']} "
              f"(mesh up to {row['auto']['mesh_max_bytes']} B, from "
              f"{row['auto']['cost_model_inputs']}) in "
              f"{row['auto']['all_reduce_ms_median']:.1f}", flush=True)
    return {"machine": machine_info(), "rows": rows}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    if args.algorithms:
        return await compare_algorithms(args)
    rows = []
    for k in args.peers:
        row = await measure(k, args.iters, args.master_ms, args.link_ms, args.bytes // 4)
        rows.append(row)
        times = ", ".join(f"{mode} {row[mode]['all_reduce_ms_median']:.1f}"
                          for mode in ("via_master", "early", "perform_first"))
        print(f"k={k}: master RTT {row['master_rtt_ms_median']:.1f} ms, {row['bytes']} B "
              f"all-reduce median ms: {times} (ring alone {row['ring_latency_ms']:.0f} ms; "
              f"target {row['target_ms']:.1f} ms)", flush=True)
    return {"machine": machine_info(), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--master-ms", type=float, default=25.0, help="one way, to the master")
    ap.add_argument("--link-ms", type=float, default=5.0, help="one way, per ring hop")
    ap.add_argument("--bytes", type=int, default=1024)
    ap.add_argument("--algorithms", action="store_true",
                    help="compare ring, mesh and pccl's own pick instead of the paths")
    ap.add_argument("--out", default="bench/results/latency.json")
    args = ap.parse_args()
    out = asyncio.run(main_async(args))
    out["config"] = vars(args)
    write_results(out, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
