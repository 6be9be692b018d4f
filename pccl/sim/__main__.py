"""``python -m pccl.sim``: pccl at 100 to 10,000 peers, by simulation.

    python -m pccl.sim --peers 100 1000 10000 --out bench/results/scale.json
    python -m pccl.sim --calibrate           # the model against measured pccl runs only

Sections (each can be skipped):

1. **runs**: a whole run per size (``ScaleSim``): founders join within 5 s, every peer
   runs PCCL's training loop for ``--minutes`` of virtual time while peers are killed,
   hung, leave and join at the ``--churn-*`` rates (events per minute); the master's CPU
   per event,
   its events per CPU second, admission, update_topology, collective and sync latency,
   and the share of step attempts lost.
2. **algorithms**: the modelled time of one all-reduce per algorithm and size at each
   peer count (``pccl.sim.collectives``), peers in join order on the three continents.
3. **solver**: pccl's ring solver (``pccl.topology.solve``, the master's budget) on the
   model's bandwidth matrix: its time and the modelled ring time of what it returns,
   against join order and a region-sorted ring.
4. **calibration**: the same model with the links of bench/latency.py (5 ms per hop,
   the master 0 or 25 ms away) against the times measured there
   (bench/results/latency_mesh_k.json, latency_k.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from pccl import algorithms, topology
from pccl.sim import collectives
from pccl.sim.network import NetworkModel
from pccl.sim.scale import Churn, run

SIZES = {"4 KiB": 4 << 10, "1 MiB": 1 << 20, "64 MiB": 64 << 20}
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def section_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    per_s = 1 / 60
    for n in args.peers:
        churn = Churn(kills=args.churn_kills * per_s, hangs=args.churn_hangs * per_s,
                      leaves=args.churn_leaves * per_s, joins=args.churn_joins * per_s,
                      start=10.0, stop=args.minutes * 60 - 10.0)
        fig = run(n, seed=args.seed, duration=args.minutes * 60, churn=churn,
                  reduce_bytes=int(args.reduce_mib * (1 << 20)),
                  sync_bytes=int(args.sync_mib * (1 << 20)), group_size=args.group_size)
        fig["group_size"] = args.group_size
        rows.append(fig)
        c = fig["calls"]
        print(f"run {n:>6} peers: {fig['events']:>9} events in {fig['wall_s']:6.1f} s wall, "
              f"{fig['virtual_s']:7.1f} s virtual | master {fig['master_cpu_per_event_us']:6.0f}"
              f" us/event, {fig['master_events_per_cpu_s']:7.0f} events/CPU s, busy "
              f"{100 * fig['master_busy_fraction']:4.1f}% | admission median "
              f"{fig['admission'].get('median_s', float('nan')):6.2f} s | update median "
              f"{c.get('update', {}).get('median_s', float('nan')):6.2f} s | lost "
              f"{100 * fig['lost_fraction']:4.1f}% | violations {len(fig['violations'])}",
              flush=True)
    return rows


def section_algorithms(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for n in args.algorithm_peers:
        net = NetworkModel.sampled(n, args.seed)
        order = list(range(n))
        for label, size in SIZES.items():
            t = collectives.all_algorithms(net, order, size)
            rows.append({"peers": n, "size": label, "bytes": size, "seconds": t})
            best = min(t, key=lambda k: t[k])
            print(f"algorithms {n:>6} peers {label:>7}: "
                  + "  ".join(f"{k} {v * 1e3:.0f} ms" for k, v in t.items())
                  + f"  -> {best}", flush=True)
    return rows


def section_solver(args: argparse.Namespace) -> list[dict[str, Any]]:
    """pccl's solver on the model's matrices, told the bandwidths only and the
    latencies too (what the master hands it once probes timed their dials), against
    join order and the regions sorted by hand: the 64 MiB ring, and the 4 KiB mesh
    with each ring's order as ranks, except the latency-aware one's, which has the
    mesh order the master would send (pccl.algorithms.mesh_order)."""
    rows = []
    for n in args.solver_peers:
        net = NetworkModel.sampled(n, args.seed)
        order = list(range(n))
        lat, bw = net.matrix(order)
        t0 = time.perf_counter()
        ring = topology.solve(bw, time_budget=args.solver_budget)
        took = time.perf_counter() - t0
        t0 = time.perf_counter()
        near = topology.solve(bw, time_budget=args.solver_budget, latency=lat)
        took_near = time.perf_counter() - t0
        mesh = [near[i] for i in algorithms.mesh_order(n, lat[np.ix_(near, near)].item)]
        rings = {"join_order": order, "region_sorted": collectives.region_sorted(net, order),
                 "solver": ring, "solver_latency": near}
        meshes = {**rings, "solver_latency": mesh}
        row = {"peers": n, "solver_s": took, "solver_latency_s": took_near,
               "budget_s": args.solver_budget,
               "ring_seconds_64MiB": {k: collectives.ring_seconds(net, r, 64 << 20)
                                      for k, r in rings.items()},
               "mesh_seconds_4KiB": {k: collectives.mesh_seconds(net, r, 4 << 10)
                                     for k, r in meshes.items()},
               "bottleneck_MBps": {k: topology.ring_cost(r, bw)[0] / 1e6
                                   for k, r in rings.items()},
               "region_crossings": {k: sum(int(net.region[r[i]] != net.region[r[i - 1]])
                                           for i in range(len(r)))
                                    for k, r in rings.items()}}
        rows.append(row)
        r, q = row["ring_seconds_64MiB"], row["mesh_seconds_4KiB"]
        print(f"solver {n:>6} peers: {took:6.2f} s / {took_near:6.2f} s with latencies; "
              "64 MiB ring / 4 KiB mesh: "
              + ", ".join(f"{k} {r[k]:.1f} s / {q[k]:.2f} s" for k in rings), flush=True)
    return rows


def _measured(name: str) -> list[dict[str, Any]]:
    path = RESULTS / name
    if not path.exists():
        return []
    rows: list[dict[str, Any]] = json.loads(path.read_text())["rows"]
    return rows


def section_calibration(args: argparse.Namespace) -> dict[str, Any]:
    """The model with bench/latency.py's links against what that bench measured."""
    out: dict[str, Any] = {"data_plane": [], "end_to_end": []}
    for row in _measured("latency_mesh_k.json"):
        k = row["peers"]
        net = NetworkModel.sampled(k, args.seed, flat_ms=row["link_one_way_ms"],
                                   flat_master_ms=0.0)
        net.up[:] = net.down[:] = 1e9  # loopback, far above what 4 KiB needs
        order = list(range(k))
        model = {"ring": collectives.ring_seconds(net, order, row["bytes"]),
                 "mesh": collectives.mesh_seconds(net, order, row["bytes"])}
        meas = {a: row[a]["all_reduce_ms_median"] / 1e3 for a in ("ring", "mesh")}
        out["data_plane"].append({"peers": k, "model_s": model, "measured_s": meas})
        print(f"calibration data plane k={k:>2}: ring model {model['ring'] * 1e3:6.1f} ms "
              f"measured {meas['ring'] * 1e3:6.1f} | mesh model {model['mesh'] * 1e3:5.1f} ms "
              f"measured {meas['mesh'] * 1e3:5.1f}", flush=True)
    for row in _measured("latency_k.json"):
        k = row["peers"]
        net = NetworkModel(flat_ms=row["link_one_way_ms"],
                           flat_master_ms=row["master_one_way_ms"])
        got = {}
        for path, rate in (("via_master", 1.0), ("early", 0.0)):
            # The measured early path ran the ring (the mesh did not exist yet).
            fig = run(k, seed=args.seed, steps=6, net=net, reduce_bytes=row["bytes"],
                      sync_bytes=4096, via_master_rate=rate, founders_within=0.01,
                      loopback_bandwidth=1e9, algorithm="ring")
            got[path] = fig["collective_from_last_call"]["reduce1"]["median_s"]
        meas = {p: row[p]["all_reduce_ms_median"] / 1e3 for p in ("via_master", "early")}
        out["end_to_end"].append({"peers": k, "model_s": got, "measured_s": meas})
        print(f"calibration end to end k={k:>2}: via master sim {got['via_master'] * 1e3:6.1f}"
              f" ms measured {meas['via_master'] * 1e3:6.1f} | early ring sim "
              f"{got['early'] * 1e3:6.1f} ms measured {meas['early'] * 1e3:6.1f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pccl.sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, nargs="*", default=[100, 1000, 10000],
                    help="sizes of the whole-run simulations")
    ap.add_argument("--algorithm-peers", type=int, nargs="*",
                    default=[16, 100, 1000, 10000])
    ap.add_argument("--solver-peers", type=int, nargs="*", default=[16, 100, 1000])
    ap.add_argument("--solver-budget", type=float, default=1.0,
                    help="seconds (the master's default)")
    ap.add_argument("--minutes", type=float, default=3.0,
                    help="virtual minutes of each whole run (churn from 10 s to 10 s "
                         "before the end)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reduce-mib", type=float, default=0.0625,
                    help="bytes of each simulated all-reduce's tensor (MiB)")
    ap.add_argument("--sync-mib", type=float, default=16.0,
                    help="shared state a joiner fetches (MiB)")
    ap.add_argument("--group-size", type=int, default=None,
                    help="peers per peer group in the whole runs (default: one group); "
                         "collectives and syncs run per group, update_topology() spans all")
    ap.add_argument("--churn-kills", type=float, default=6.0, help="per minute")
    ap.add_argument("--churn-hangs", type=float, default=1.0, help="per minute")
    ap.add_argument("--churn-leaves", type=float, default=3.0, help="per minute")
    ap.add_argument("--churn-joins", type=float, default=12.0, help="per minute")
    ap.add_argument("--skip", nargs="*", default=[],
                    choices=["runs", "algorithms", "solver", "calibration"])
    ap.add_argument("--calibrate", action="store_true", help="only the calibration")
    ap.add_argument("--out", default=None, help="write every figure here (JSON)")
    args = ap.parse_args(argv)
    skip = set(args.skip)
    if args.calibrate:
        skip |= {"runs", "algorithms", "solver"}
    out: dict[str, Any] = {"config": vars(args), "date": time.strftime("%Y-%m-%d"),
                           "cpus": os.cpu_count()}
    if "calibration" not in skip:
        out["calibration"] = section_calibration(args)
    if "algorithms" not in skip:
        out["algorithms"] = section_algorithms(args)
    if "solver" not in skip:
        out["solver"] = section_solver(args)
    if "runs" not in skip:
        out["runs"] = section_runs(args)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"wrote {args.out}")
    bad = sum(len(r["violations"]) for r in out.get("runs", []))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
