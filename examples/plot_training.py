"""Draws the results of ``examples/train.py`` (its ``--json``) as PNGs.

    python examples/plot_training.py bench/results/training.json \
        bench/results/training-churn.json -o docs

- ``training-loss.png``: validation loss against step and against wall-clock seconds,
  one line per configuration (colour: mode, line style: quantization);
- ``training-bytes.png``: bytes sent per peer and the fraction of wall time spent in
  communication, per configuration;
- ``training-churn.png``: the churn run's loss curve with the kill and the join marked.

Needs matplotlib (only for plotting: ``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

COLORS = {"ddp": "tab:blue", "diloco": "tab:orange", "async-diloco": "tab:green"}
STYLES = {"none": "-", "int8": "--", "fp8": ":"}


def _name(r: dict[str, Any]) -> str:
    name = f"{r['mode']} / {r['quant']}"
    if r.get("outer_momentum") not in (None, 0.9):
        name += f", outer momentum {r['outer_momentum']:g}"
    if r.get("outer_lr") not in (None, 0.7):
        name += f", outer lr {r['outer_lr']:g}"
    return name


def _style(r: dict[str, Any]) -> dict[str, Any]:
    plain = r.get("outer_momentum") not in (None, 0.9)
    return {"color": COLORS[r["mode"]], "linestyle": STYLES.get(r["quant"], "dashdot"),
            "marker": "x" if plain else ".", "alpha": 0.55 if plain else 1.0,
            "label": _name(r)}


def _smooth(ys: list[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y - (ys[i - k] if i >= k else 0.0)
        out.append(acc / min(i + 1, k))
    return out


def plot(doc: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    runs = [r for r in doc["runs"] if not r["churn"]]
    churn = [r for r in doc["runs"] if r["churn"]]
    paths = []
    if runs:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        for r in runs:
            kw = _style(r)
            a1.plot([p["step"] for p in r["val_curve"]], [p["val"] for p in r["val_curve"]],
                    **kw)
            a2.plot([p["t"] for p in r["val_curve"]], [p["val"] for p in r["val_curve"]],
                    **kw)
        a1.set_xlabel("step (inner steps per peer; same tokens per peer)")
        a2.set_xlabel("wall-clock seconds (validation passes excluded)")
        a1.set_ylabel("validation loss (nats / byte), clipped at 6")
        a1.set_ylim(top=6.0)
        a1.legend(fontsize=7)
        for a in (a1, a2):
            a.grid(alpha=0.3)
        r0 = runs[0]
        fig.suptitle(f"{r0['peers']} peers, {r0['bandwidth'] / 1e6:g} MB/s and "
                     f"{r0['latency'] * 1e3:g} ms into each peer, H = {r0['inner_steps']}")
        fig.tight_layout()
        paths.append(out / "training-loss.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

        fig, (b0, b1, b2) = plt.subplots(1, 3, figsize=(18, 5),
                                         gridspec_kw={"width_ratios": [1, 1.4, 1.4]})
        for r in runs:
            kw = _style(r)
            kw.pop("marker")
            b0.plot([p[0] for p in r["tx_curve"]], [p[1] / 1e6 for p in r["tx_curve"]], **kw)
        b0.set_yscale("log")
        b0.set_xlabel("step")
        b0.set_ylabel("MB sent so far by one peer, log scale")
        b0.legend(fontsize=6, loc="lower right")
        b0.grid(alpha=0.3)
        short = {"ddp": "DDP", "diloco": "DiLoCo", "async-diloco": "async"}
        names = [f"{short[r['mode']]}\n{r['quant']}" + (
            f"\nmu={r['outer_momentum']:g}" if r.get("outer_momentum") not in (None, 0.9)
            else "") for r in runs]
        colors = [COLORS[r["mode"]] for r in runs]
        b1.bar(names, [r["tx_bytes_per_peer"] / 1e6 for r in runs], color=colors)
        b1.set_yscale("log")
        b1.set_ylabel("MB sent per peer (pccl tx_bytes), log scale")
        for i, r in enumerate(runs):
            b1.text(i, r["tx_bytes_per_peer"] / 1e6, f"{r['tx_bytes_per_peer'] / 1e6:.1f}",
                    ha="center", va="bottom", fontsize=8)
        b2.bar(names, [100 * r["comm_fraction"] for r in runs], color=colors)
        b2.set_ylabel("% of wall time in communication")
        b2.set_ylim(0, 100)
        for a in (b1, b2):
            a.tick_params(axis="x", labelsize=6.5)
            a.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        paths.append(out / "training-bytes.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    for r in churn:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        steps = [p[0] for p in r["train_curve"]]
        ax.plot(steps, _smooth([p[1] for p in r["train_curve"]], 10), color="tab:gray",
                label="training loss (mean over peers, 10-step average)")
        ax.plot([p["step"] for p in r["val_curve"]], [p["val"] for p in r["val_curve"]],
                color="tab:orange", marker="o", label="validation loss (global model)")
        if r.get("kill"):
            ax.axvline(r["kill"]["step"], color="tab:red", linestyle="--",
                       label=f"{r['kill']['peer']} SIGKILLed (outer step "
                             f"{r['kill']['during_outer_step']})")
        if r.get("join"):
            s = r["join"]["outer_step"] * r["inner_steps"]
            ax.axvline(s, color="tab:green", linestyle="--",
                       label=f"fresh peer joins at outer step {r['join']['outer_step']} "
                             f"({'bit-identical' if r['join']['bit_identical'] else 'DIFFERS'})")
        worlds: dict[int, int] = {}
        for o in r.get("outer_steps", []):
            if not o.get("flush"):
                worlds[o["outer_step"]] = max(worlds.get(o["outer_step"], 0), o["world"])
        if worlds:
            tw = ax.twinx()
            ks = sorted(worlds)
            tw.step([k * r["inner_steps"] for k in ks], [worlds[k] for k in ks], where="pre",
                    color="tab:purple", alpha=0.4, label="peers in the outer step's reduce")
            tw.set_ylim(0, r["peers"] + 1)
            tw.set_ylabel("peers in the reduce", color="tab:purple")
            tw.legend(fontsize=8, loc="center right")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats / byte)")
        ax.set_title(f"churn, {r['mode']}: {r['peers']} peers, H = {r['inner_steps']}; "
                     f"parity {'ok' if r['parity']['ok'] else 'FAILED'} at "
                     f"{r['parity']['points_compared']} outer steps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / ("training-churn.png" if r["mode"] == "diloco"
                            else f"training-churn-{r['mode']}.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json", nargs="*", default=["bench/results/training.json",
                                               "bench/results/training-churn.json"])
    p.add_argument("-o", "--out", default="docs")
    a = p.parse_args()
    runs = []
    for f in a.json:
        if Path(f).exists():
            runs += json.loads(Path(f).read_text())["runs"]
    for path in plot({"runs": runs}, Path(a.out)):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
