"""Draws the results of ``examples/train.py`` (its ``--json``) as PNGs.

    python examples/plot_training.py bench/results/training.json \
        bench/results/training-churn.json -o docs

- ``training-loss.png``: validation loss against step and against wall-clock seconds,
  one line per configuration (colour: mode, or the SparseLoCo setting; line style:
  quantization);
- ``training-loss-bytes.png``: validation loss against the bytes the link emulators
  forwarded per peer (p2p and master links) and against wall-clock seconds, with the
  target loss of the invocation (JSON from train.py runs that counted link bytes);
- ``training-bytes.png``: bytes sent per peer and the fraction of wall time spent in
  communication, per configuration;
- ``training-churn.png``: the churn run's loss curve with the kill and the join marked.

``--prefix`` replaces ``training`` in these names (train.py uses ``training-<preset>``).

Needs matplotlib (only for plotting: ``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

COLORS = {"ddp": "tab:blue", "diloco": "tab:orange", "async-diloco": "tab:green"}
STYLES = {"none": "-", "int8": "--", "fp8": ":"}
SPARSE_COLORS = {"sparse-1/64-2b": "tab:red", "sparse-2/64-2b": "tab:purple",
                 "sparse-2/64-4b": "tab:brown"}


def _name(r: dict[str, Any]) -> str:
    name = f"{r['mode']} / {r['quant']}"
    if r.get("outer_momentum") not in (None, 0.9):
        name += f", outer momentum {r['outer_momentum']:g}"
    if r.get("outer_lr") not in (None, 0.7):
        name += f", outer lr {r['outer_lr']:g}"
    return name


def _style(r: dict[str, Any]) -> dict[str, Any]:
    if r["quant"].startswith("sparse"):
        # SparseLoCo always runs without outer momentum: the outer lr tells rows apart.
        lr3 = r.get("outer_lr") not in (None, 0.7)
        return {"color": SPARSE_COLORS.get(r["quant"], "tab:gray"), "linestyle": "-.",
                "marker": "s" if lr3 else "^", "markersize": 3.5,
                "alpha": 1.0 if lr3 else 0.55, "label": _name(r)}
    plain = r.get("outer_momentum") not in (None, 0.9)
    return {"color": COLORS[r["mode"]], "linestyle": STYLES.get(r["quant"], "dashdot"),
            "marker": "x" if plain else ".", "alpha": 0.55 if plain else 1.0,
            "label": _name(r)}


def _link(r: dict[str, Any]) -> str:
    return (f"{r['peers']} peers, {r['bandwidth'] / 1e6:g} MB/s and "
            f"{r['latency'] * 1e3:g} ms on each peer's links, H = {r['inner_steps']}, "
            f"{r['params']:,} parameters")


def _smooth(ys: list[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y - (ys[i - k] if i >= k else 0.0)
        out.append(acc / min(i + 1, k))
    return out


def plot(doc: dict[str, Any], out: Path, prefix: str = "training") -> list[Path]:
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
        fig.suptitle(_link(runs[0]))
        fig.tight_layout()
        paths.append(out / f"{prefix}-loss.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    counted = [r for r in runs if r["val_curve"] and "link_bytes" in r["val_curve"][0]]
    if counted:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        for r in counted:
            kw = _style(r)
            vals = [p["val"] for p in r["val_curve"]]
            a1.plot([p["link_bytes"] / 1e6 for p in r["val_curve"]], vals, **kw)
            a2.plot([p["t"] for p in r["val_curve"]], vals, **kw)
        target = counted[0].get("target_loss")
        if target is not None:
            for a in (a1, a2):
                a.axhline(target, color="black", linewidth=0.8, linestyle=":",
                          label=f"target {target:.3f}" if a is a1 else None)
        a1.set_xscale("log")
        a1.set_xlabel("MB through the link emulators per peer (p2p + master, both ways), "
                      "log scale")
        a2.set_xlabel("wall-clock seconds (validation passes excluded)")
        a1.set_ylabel("validation loss (nats / byte), clipped at 6")
        a1.set_ylim(top=min(6.0, max(p["val"] for r in counted for p in r["val_curve"])
                            + 0.1))
        a1.legend(fontsize=7)
        for a in (a1, a2):
            a.grid(alpha=0.3)
        fig.suptitle(_link(counted[0]))
        fig.tight_layout()
        paths.append(out / f"{prefix}-loss-bytes.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    if runs:

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
        names = [f"{short[r['mode']]}\n" + r["quant"].replace("sparse-", "sparse\n") + (
            f"\nmu={r['outer_momentum']:g}" if r.get("outer_momentum") not in (None, 0.9)
            else "") + (f"\nlr={r['outer_lr']:g}" if r.get("outer_lr") not in (None, 0.7)
                        else "") for r in runs]
        colors = [_style(r)["color"] for r in runs]
        # The emulators' count when every run has it (it includes the master link).
        key = ("link_bytes_per_peer" if all(r.get("p2p_link_bytes_per_peer") is not None
                                            for r in runs) else "tx_bytes_per_peer")
        b1.bar(names, [r[key] / 1e6 for r in runs], color=colors)
        b1.set_yscale("log")
        b1.set_ylabel("MB per peer through the link emulators (p2p + master), log scale"
                      if key == "link_bytes_per_peer"
                      else "MB sent per peer (pccl tx_bytes), log scale")
        for i, r in enumerate(runs):
            b1.text(i, r[key] / 1e6, f"{r[key] / 1e6:.3g}", ha="center", va="bottom",
                    fontsize=8)
        b2.bar(names, [100 * r["comm_fraction"] for r in runs], color=colors)
        b2.set_ylabel("% of wall time in communication")
        b2.set_ylim(0, 100)
        for a in (b1, b2):
            a.tick_params(axis="x", labelsize=6.5)
            a.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        paths.append(out / f"{prefix}-bytes.png")
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
        paths.append(out / (f"{prefix}-churn.png" if r["mode"] == "diloco"
                            else f"{prefix}-churn-{r['mode']}.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json", nargs="*", default=["bench/results/training.json",
                                               "bench/results/training-churn.json"])
    p.add_argument("-o", "--out", default="docs")
    p.add_argument("--prefix", default="training", help="file names start with this")
    a = p.parse_args()
    runs = []
    for f in a.json:
        if Path(f).exists():
            runs += json.loads(Path(f).read_text())["runs"]
    for path in plot({"runs": runs}, Path(a.out), a.prefix):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
