"""Whether pccl's encrypted ring scales with cores: busbw of a k-peer float32 SUM
all-reduce, encrypted next to clear, for each lane count, against what the lanes' AEAD
work and the host's transport allow, all measured in one run.

    python bench/secure_scaling.py [--peers 2] [--lanes 1 2 4 8] [--size-mib 64]
                                   [--iters 7] [--out bench/results/secure_scaling.json]

One run measures, in this order:

1. the AEAD: one core's AES-256-GCM seal and open rates at pccl's record size, with the
   code pccl picks on this CPU (``secure_bench --aead``; both codes are recorded). A
   byte a peer sends is sealed by it and opened by its neighbour, so one core that did
   both for a stream would carry ``R = 1 / (1/seal + 1/open)``. A lane's sealing and
   its neighbour's opening run on the tokio workers of two processes, so with ``c``
   cores per peer the lanes' AEAD work allows ``min(lanes, c) x R_seal`` of busbw (the
   column ``aead ceiling``; k peers on one host share its cores: c = cores // k).
2. the transport: for each lane count L, ``k x L`` clear and ``k x L`` encrypted streams
   of pccl's own transport at once (``secure_bench --streams``), aggregate / k: the busbw
   bound of a ring whose every link has L lanes, on this host.
3. pccl: k peers in their own processes (and a master), pool size L, the same call
   timed clear and encrypted, alternating, as in bench/allreduce.py (barrier before
   each call, slowest peer's time, median of --iters after --warmup).

On a host with few cores the transport (the kernel's TCP copies) is the limit and more
lanes cannot help; on a host with many, the encrypted ring should follow the clear one
(the issue's target: encrypted >= 0.9x clear with 4+ lanes on 16 cores).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from allreduce import bench_secure_loopback, pccl_rows, run_pccl
from common import MB, MIB, machine_info, median, phase, with_transport, write_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def aead_rates(mib: int, rounds: int) -> dict[str, Any]:
    """One core's seal and open rates (GB/s) with the AES-GCM code pccl picks on this
    CPU, and with each of its two codes (``secure_bench --aead``)."""
    import json

    cmd = ["cargo", "run", "--quiet", "--release", "--locked", "--bin", "secure_bench", "--",
           "--aead", "--mib", str(mib), "--rounds", str(rounds)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                         check=True)
    lines = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    chosen = next(x["chosen"] for x in lines if "chosen" in x)
    rows = [x for x in lines if "aead" in x]
    codes = {}
    for code in sorted({r["aead"] for r in rows}):
        seal = median([r["seal_GBps"] for r in rows if r["aead"] == code])
        opened = median([r["open_GBps"] for r in rows if r["aead"] == code])
        codes[code] = {"seal_GBps": seal, "open_GBps": opened,
                       "one_core_both_GBps": 1.0 / (1.0 / seal + 1.0 / opened)}
    return {"command": " ".join(cmd), "rounds": rows, "chosen": chosen, "codes": codes,
            **codes[chosen], "record_bytes": rows[0]["record_bytes"] if rows else None}


def run_one(k: int, lanes: int, nbytes: int, iters: int, warmup: int,
            insecure: bool) -> dict[str, Any]:
    """One pccl run (clear or encrypted): its row as bench/allreduce.py writes it."""
    res = with_transport(insecure, run_pccl, k, lanes, [nbytes], iters, warmup, 10 * MB)
    return pccl_rows(k, lanes, [nbytes], res)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=2, help="ring size k (default 2)")
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="p2p connection pool sizes (lanes per link) to measure")
    ap.add_argument("--size-mib", type=float, default=64.0)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--aead-mib", type=int, default=256)
    ap.add_argument("--stream-mib", type=int, default=256,
                    help="MiB over all the streams of one transport measurement")
    ap.add_argument("--out", default="bench/results/secure_scaling.json")
    args = ap.parse_args()
    if args.peers < 2 or not all(1 <= lanes <= 64 for lanes in args.lanes):
        ap.error("--peers must be >= 2 and --lanes in 1..64")
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters must be >= 1 and --warmup >= 0")
    k, nbytes = args.peers, max(4, int(args.size_mib * MIB) // 4 * 4)
    cores = len(os.sched_getaffinity(0))
    per_peer = max(1, cores // k)
    out: dict[str, Any] = {"machine": machine_info(), "config": vars(args),
                           "cores_usable": cores, "cores_per_peer": per_peer,
                           "aead": None, "rows": [], "errors": []}
    m = out["machine"]
    print(f"pccl {m['pccl']} | {cores} usable cores ({per_peer} per peer) | "
          f"{m['cpu_model']} | {m['date']}", flush=True)
    with phase(out["errors"], "aead"):
        out["aead"] = aead_rates(args.aead_mib, 3)
        a = out["aead"]
        for code, r in a["codes"].items():
            print(f"AES-256-GCM on one core, {code}{' (chosen)' if code == a['chosen'] else ''}"
                  f": seal {r['seal_GBps']:.2f} GB/s, open {r['open_GBps']:.2f}, both "
                  f"{r['one_core_both_GBps']:.2f}", flush=True)
    for lanes in args.lanes:
        row: dict[str, Any] = {"peers": k, "lanes": lanes, "size_bytes": nbytes}
        with phase(out["errors"], f"transport {k}x{lanes} streams"):
            mib = max(16, args.stream_mib // (k * lanes))
            t = bench_secure_loopback(k * lanes, mib, 1)
            row["transport"] = t
            row["bound_clear_GBps"] = median(t["clear"]["aggregate_GBps"]) / k
            row["bound_encrypted_GBps"] = median(t["encrypted"]["aggregate_GBps"]) / k
        # Clear and encrypted alternate (twice each) so drift hits both alike.
        runs: dict[str, list[dict[str, Any]]] = {"clear": [], "encrypted": []}
        for name in ("clear", "encrypted", "encrypted", "clear"):
            with phase(out["errors"], f"pccl {name} k={k} lanes={lanes}"):
                runs[name].append(run_one(k, lanes, nbytes, args.iters, args.warmup,
                                          name == "clear"))
        row["pccl"] = runs
        for name, rs in runs.items():
            times = [t for r in rs for t in r["times_s"]]
            row[f"{name}_busbw_GBps"] = (nbytes * 2 * (k - 1) / k / median(times) / 1e9
                                         if times else None)
        if out["aead"] is not None:
            row["aead_ceiling_GBps"] = min(lanes, per_peer) * out["aead"]["seal_GBps"]
        out["rows"].append(row)
        write_results(out, args.out)
    print(f"\n== k={k}, {args.size_mib:g} MiB float32 SUM, busbw GB/s (median) ==")
    print(f"{'lanes':>5} {'clear':>7} {'enc':>7} {'enc/clear':>9} | {'bound clear':>11} "
          f"{'bound enc':>9} {'enc %bound':>10} | {'aead ceiling':>12}")

    def f(x: Any, spec: str = ".2f") -> str:
        return "-" if x is None else format(x, spec)

    for r in out["rows"]:
        c, e = r.get("clear_busbw_GBps"), r.get("encrypted_busbw_GBps")
        be = r.get("bound_encrypted_GBps")
        print(f"{r['lanes']:>5} {f(c):>7} {f(e):>7} "
              f"{f(e / c if c and e else None):>9} | {f(r.get('bound_clear_GBps')):>11} "
              f"{f(be):>9} {f(100 * e / be if e and be else None, '.0f'):>10} | "
              f"{f(r.get('aead_ceiling_GBps')):>12}")
    write_results(out, args.out)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
