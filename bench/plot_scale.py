"""Plots of ``python -m pccl.sim --out FILE`` for docs/scale.md.

    python bench/plot_scale.py bench/results/scale.json -o docs/scale.png
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="JSON files of python -m pccl.sim (merged)")
    ap.add_argument("-o", "--out", default="docs/scale.png")
    args = ap.parse_args()
    data: dict[str, Any] = {"runs": [], "algorithms": [], "calibration": None}
    for path in args.results:
        with open(path) as f:
            d = json.load(f)
        data["runs"] += d.get("runs", [])
        data["algorithms"] += d.get("algorithms", [])
        data["calibration"] = d.get("calibration") or data["calibration"]
    runs = sorted(data["runs"], key=lambda r: r["peers"])

    fig, ax = plt.subplots(2, 3, figsize=(17, 9.5))
    n = [r["peers"] for r in runs]

    a = ax[0][0]
    a.plot(n, [r["master_events_per_cpu_s"] for r in runs], "o-", label="events per CPU second")
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("peers")
    a.set_ylabel("master events / CPU s")
    b = a.twinx()
    b.plot(n, [r["master_cpu_per_event_us"] for r in runs], "s--", color="C3",
           label="CPU per event")
    b.set_ylabel("master CPU per event (us)")
    b.set_yscale("log")
    a.set_title("master throughput (measured on this machine)")
    a.legend(loc="upper left")
    b.legend(loc="lower left")

    a = ax[0][1]
    for key, label in (("admission", "admission"), ("update", "update_topology()"),
                       ("reduce1", "small all-reduce (from the last call)"),
                       ("sync", "sync_shared_state()")):
        ys = []
        for r in runs:
            if key == "admission":
                ys.append(r["admission"].get("median_s"))
            elif key == "reduce1":
                ys.append(r["collective_from_last_call"].get("reduce1", {}).get("median_s"))
            else:
                ys.append(r["calls"].get(key, {}).get("median_s"))
        a.plot(n, ys, "o-", label=label)
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("peers")
    a.set_ylabel("median seconds (virtual)")
    a.set_title("latencies in the simulated runs, with churn")
    a.legend(fontsize=8)

    a = ax[0][2]
    a.plot(n, [100 * r["lost_fraction"] for r in runs], "o-", label="step attempts lost")
    a.plot(n, [100 * r["master_busy_fraction"] for r in runs], "s--", label="master busy")
    a.set_xscale("log")
    a.set_xlabel("peers")
    a.set_ylabel("%")
    a.set_title("churn losses and master load")
    a.legend()

    algs = data["algorithms"]
    for i, size in enumerate(("4 KiB", "1 MiB", "64 MiB")):
        a = ax[1][i]
        rows = sorted((r for r in algs if r["size"] == size), key=lambda r: r["peers"])
        if not rows:
            continue
        for name in rows[0]["seconds"]:
            a.plot([r["peers"] for r in rows], [r["seconds"][name] for r in rows], "o-",
                   label=name)
        a.set_xscale("log")
        a.set_yscale("log")
        a.set_xlabel("peers (three continents, home links)")
        a.set_ylabel("modelled seconds per all-reduce")
        a.set_title(f"all-reduce of {size}")
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)

    cal = data["calibration"]
    if cal:
        fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
        dp = cal["data_plane"]
        k = [r["peers"] for r in dp]
        for alg in ("ring", "mesh"):
            ax[0].plot(k, [1e3 * r["model_s"][alg] for r in dp], "o--", label=f"{alg} model")
            ax[0].plot(k, [1e3 * r["measured_s"][alg] for r in dp], "s-",
                       label=f"{alg} measured")
        ax[0].set_title("4 KiB all-reduce, 5 ms hops, master next door")
        e2e = cal["end_to_end"]
        k2 = [r["peers"] for r in e2e]
        for path in ("via_master", "early"):
            ax[1].plot(k2, [1e3 * r["model_s"][path] for r in e2e], "o--",
                       label=f"{path} simulated")
            ax[1].plot(k2, [1e3 * r["measured_s"][path] for r in e2e], "s-",
                       label=f"{path} measured")
        ax[1].set_title("4 KiB all-reduce, 5 ms hops, master 25 ms away")
        for a in ax:
            a.set_xlabel("peers")
            a.set_ylabel("ms")
            a.set_xscale("log", base=2)
            a.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.out.replace(".png", "_calibration.png"), dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
