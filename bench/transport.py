"""Encrypted vs clear-text pccl, side by side in one run, with the machine's limit and
gloo next to them.

    python bench/transport.py [--peers 2 4] [--sizes-mib 64 256] [--iters 5]
                              [--emu-bandwidth 20e6] [--out bench/results/transport.json]

1. loopback: k plain TCP streams at once (the bound on a k-ring's busbw is that / k);
2. pccl, encrypted (the default) and clear (insecure=True on every node), alternating
   per k, float32 SUM all-reduce of each size (bench/allreduce.py's harness);
3. gloo at the same k and sizes (clear text; it has no encryption);
4. 2 pccl peers whose ring links cross pccl.testing.LinkEmulator with a
   per-connection cap (--emu-bandwidth B/s per direction, +--emu-latency-ms one way),
   encrypted vs clear: on a network-bound link the cipher should cost nothing.

Every number goes to --out; a table to stdout. busbw as in bench/allreduce.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from allreduce import bench_loopback, pccl_rows, run_emulated, run_gloo, run_pccl
from common import MB, MIB, fmt_size, machine_info, phase, with_transport


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[64, 256])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--pool", type=int, default=4)
    ap.add_argument("--tcp-mib", type=int, default=512)
    ap.add_argument("--skip-gloo", action="store_true")
    ap.add_argument("--emu-size-mib", type=float, default=32.0)
    ap.add_argument("--emu-bandwidth", type=float, default=20e6)
    ap.add_argument("--emu-latency-ms", type=float, default=25.0)
    ap.add_argument("--emu-pool", type=int, default=4)
    ap.add_argument("--out", default="bench/results/transport.json")
    args = ap.parse_args()
    sizes = [int(s * MIB) // 4 * 4 for s in args.sizes_mib]
    floor = 10 * MB
    out: dict[str, Any] = {"machine": machine_info(), "config": vars(args), "loopback": {},
                           "pccl": [], "gloo": [], "emulator": [], "errors": []}
    for k in args.peers:
        with phase(out["errors"], f"loopback k={k}"):
            out["loopback"][k] = bench_loopback(k, args.tcp_mib * MIB, 3)
        for clear in (False, True):
            with phase(out["errors"], f"pccl k={k} clear={clear}"):
                res = with_transport(clear, run_pccl, k, args.pool, sizes, args.iters, 1,
                                      floor)
                for row in pccl_rows(k, args.pool, sizes, res):
                    out["pccl"].append({**row, "clear": clear})
        if not args.skip_gloo:
            with phase(out["errors"], f"gloo k={k}"):
                out["gloo"].extend(run_gloo(k, sizes, args.iters, 1, floor))
    emu = int(args.emu_size_mib * MIB) // 4 * 4
    for clear in (False, True):
        with phase(out["errors"], f"emulator clear={clear}"):
            r = with_transport(clear, run_emulated, args.emu_pool, emu, 3, 1,
                                args.emu_latency_ms / 1e3, args.emu_bandwidth, 256 * 1024)
            out["emulator"].append({**r, "clear": clear})

    print(f"\n== busbw GB/s (median), float32 SUM, pool {args.pool} ==")
    print(f"{'k':>3} {'size':>9} {'bound/k':>8} {'encrypted':>10} {'clear':>7} "
          f"{'enc/clear':>9} {'gloo':>6} {'enc/gloo':>8}")
    for k in args.peers:
        bound = out["loopback"].get(k, {}).get("busbw_bound_GBps_median")
        for n in sizes:
            enc = next((r for r in out["pccl"] if (r["peers"], r["size_bytes"], r["clear"])
                        == (k, n, False)), None)
            clr = next((r for r in out["pccl"] if (r["peers"], r["size_bytes"], r["clear"])
                        == (k, n, True)), None)
            glo = next((r for r in out["gloo"] if (r["peers"], r["size_bytes"]) == (k, n)),
                       None)
            e = enc["busbw_GBps_median"] if enc else float("nan")
            c = clr["busbw_GBps_median"] if clr else float("nan")
            g = glo["busbw_GBps_median"] if glo else float("nan")
            print(f"{k:>3} {fmt_size(n):>9} {bound or float('nan'):>8.2f} {e:>10.2f} "
                  f"{c:>7.2f} {e / c:>9.2f} {g:>6.2f} {e / g:>8.2f}")
    if out["emulator"]:
        print(f"\n== 2 peers through the link emulator: {args.emu_pool} streams x "
              f"{args.emu_bandwidth / MB:.0f} MB/s cap, +{args.emu_latency_ms:.0f} ms, "
              f"{fmt_size(emu)} ==")
        for r in out["emulator"]:
            print(f"{'clear' if r['clear'] else 'encrypted':>10}: busbw "
                  f"{r['busbw_MBps_median']:.1f} MB/s median "
                  f"({r['ratio_to_ideal_median']:.2f} of the cap)")
        if len(out["emulator"]) == 2:
            e, c = out["emulator"]
            print(f"encrypted / clear: {e['busbw_MBps_median'] / c['busbw_MBps_median']:.3f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"\nwrote {args.out}")
    for e in out["errors"]:
        print(f"!! {e['phase']}: {e['error'].strip().splitlines()[-1]}")
    sys.exit(1 if out["errors"] else 0)


if __name__ == "__main__":
    main()
