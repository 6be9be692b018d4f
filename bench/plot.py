"""Draws the JSON written by bench/allreduce.py as a PNG.

    python bench/plot.py [bench/results/allreduce.json] [-o bench/results/allreduce.png]

Left panel: busbw against all-reduce size, pccl (solid) and gloo (dashed) for each peer
count k, with the loopback bound (aggregate TCP rate of k streams / k) as a dotted line.
Right panel: busbw through the link emulator against the pool size (TCP streams per
ring link), next to the ideal K x per-connection cap.

Needs matplotlib (a bench-only dependency: pip install matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt


def _by_k(rows: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["peers"], []).append(r)
    for rs in out.values():
        rs.sort(key=lambda r: r["size_bytes"])
    return out


def plot_sizes(ax: Any, data: dict[str, Any]) -> None:
    pccl, gloo = _by_k(data.get("pccl", [])), _by_k(data.get("gloo", []))
    loop = {r["streams"]: r for r in data.get("loopback", [])}
    ks = sorted(set(pccl) | set(gloo) | set(loop))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, k in enumerate(ks):
        c = colors[i % len(colors)]
        for rows, style, name in ((pccl.get(k), "-o", "pccl"), (gloo.get(k), "--s", "gloo")):
            if not rows:
                continue
            x = [r["size_mib"] for r in rows]
            med = [r["busbw_GBps_median"] for r in rows]
            best = [r["busbw_GBps_best"] for r in rows]
            ax.plot(x, med, style, color=c, label=f"{name} k={k} (median)")
            # The band up to the best iteration shows the spread of the runs.
            ax.fill_between(x, med, best, color=c, alpha=0.12, linewidth=0)
        if k in loop:
            ax.axhline(loop[k]["busbw_bound_GBps_best"], color=c, linestyle=":",
                       label=f"loopback bound k={k}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("all-reduce size (MiB, float32)")
    ax.set_ylabel("busbw (GB/s) = bytes/time x 2(k-1)/k")
    pool = next((r["pool"] for r in data.get("pccl", [])), None)
    ax.set_title("busbw vs size" + (f" (pccl pool {pool})" if pool else ""))
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    if ks:
        ax.legend(fontsize=7)


def plot_emulator(ax: Any, data: dict[str, Any]) -> None:
    emu = data.get("emulator") or {}
    runs = sorted(emu.get("runs", []), key=lambda r: r["pool"])
    if not runs:
        ax.text(0.5, 0.5, "no emulator runs", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_axis_off()
        return
    pools = [r["pool"] for r in runs]
    ax.plot(pools, [r["busbw_MBps_median"] for r in runs], "-o", label="pccl (median)")
    ax.plot(pools, [r["busbw_MBps_best"] for r in runs], "^", alpha=0.6, label="pccl (best)")
    ax.plot(pools, [r["ideal_MBps"] for r in runs], "k--", label="K x per-connection cap")
    for r in runs:
        ax.annotate(f"{r['ratio_to_ideal_median']:.2f}", (r["pool"], r["busbw_MBps_median"]),
                    textcoords="offset points", xytext=(4, -12), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xticks(pools, [str(p) for p in pools])
    ax.set_xlabel("TCP streams per ring link (pool size K)")
    ax.set_ylabel("busbw (MB/s)")
    ax.set_title(f"2 peers via link emulator: {emu['size_bytes'] / (1 << 20):g} MiB, "
                 f"+{emu['latency_s'] * 1e3:g} ms/way, {emu['bandwidth_Bps'] / 1e6:g} MB/s/conn",
                 fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="?", default="bench/results/allreduce.json")
    ap.add_argument("-o", "--out", default=None,
                    help="PNG path (default: the JSON path with .png)")
    args = ap.parse_args()
    with open(args.json) as f:
        data = json.load(f)
    out = args.out or os.path.splitext(args.json)[0] + ".png"
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    plot_sizes(left, data)
    plot_emulator(right, data)
    m = data.get("machine", {})
    fig.suptitle(f"pccl {m.get('pccl')} vs torch {m.get('torch')} gloo | "
                 f"{m.get('nproc')} cpus ({m.get('cpu_model')}) | {m.get('date')}", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
