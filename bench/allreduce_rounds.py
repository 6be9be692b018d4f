"""Runs ``bench/allreduce.py`` several times in a row and summarizes pccl / gloo per round.

On a shared 2-core VM one run's ratio moves by 10% or more from run to run (gloo's own
busbw does). Each round here is one whole ``allreduce.py`` run, so pccl and gloo stay
side by side within it; the summary gives, per (k, size), every round's ratio and their
median, for in place and (with ``--out-of-place``) out of place, next to the loopback
bound/k of each round when it was measured.

    python bench/allreduce_rounds.py --rounds 3 --out bench/results/rounds.json -- \\
        --peers 4 --sizes-mib 64 256 --iters 5 --skip-emulator --out-of-place

Everything after ``--`` goes to ``allreduce.py`` (``--out`` excepted: each round writes
its own file next to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any


def _by_key(rows: list[dict[str, Any]]) -> dict[tuple[int, int], float]:
    return {(r["peers"], r["size_bytes"]): r["busbw_GBps_median"] for r in rows}


def summarize(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (k, size): busbw and ratios to gloo of every round, and medians."""
    out = []
    gloo = [_by_key(r["gloo"]) for r in rounds]
    inplace = [_by_key(r["pccl"]) for r in rounds]
    oop = [_by_key(r.get("pccl_out_of_place", [])) for r in rounds]
    bounds = [{lb["streams"]: lb["busbw_bound_GBps_median"] for lb in r.get("loopback", [])}
              for r in rounds]
    for key in sorted(set().union(*gloo)):
        row: dict[str, Any] = {"peers": key[0], "size_bytes": key[1],
                               "gloo": [g.get(key) for g in gloo],
                               "bound_per_k": [b.get(key[0]) for b in bounds]}
        for name, runs in (("in_place", inplace), ("out_of_place", oop)):
            vals = [p.get(key) for p in runs]
            if not any(v is not None for v in vals):
                continue
            ratios = [v / g[key] for v, g in zip(vals, gloo, strict=True)
                      if v is not None and g.get(key)]
            row[name] = vals
            row[f"{name}_over_gloo"] = ratios
            row[f"{name}_over_gloo_median"] = statistics.median(ratios) if ratios else None
        out.append(row)
    return out


def _fmt(vals: list[float | None]) -> str:
    return " / ".join("-" if v is None else f"{v:.2f}" for v in vals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results/allreduce_rounds.json")
    ap.add_argument("rest", nargs=argparse.REMAINDER,
                    help="-- then the arguments of bench/allreduce.py")
    args = ap.parse_args()
    rest = [a for a in args.rest if a != "--"]
    if "--out" in rest:
        ap.error("--out belongs before --: each round writes its own file")
    out = Path(args.out)
    here = Path(__file__).resolve().parent
    rounds = []
    for i in range(1, args.rounds + 1):
        path = out.with_name(f"{out.stem}_round{i}.json")
        print(f"== round {i}/{args.rounds}", flush=True)
        subprocess.run([sys.executable, str(here / "allreduce.py"), *rest, "--out", str(path)],
                       check=True)
        rounds.append(json.loads(path.read_text()))
    rows = summarize(rounds)
    print("\n== per round: busbw GB/s (round 1 / 2 / ...), ratio to gloo, median ratio ==")
    for r in rows:
        print(f"k={r['peers']} {r['size_bytes'] / (1 << 20):g} MiB: gloo {_fmt(r['gloo'])}; "
              f"bound/k {_fmt(r['bound_per_k'])}")
        for name in ("in_place", "out_of_place"):
            if name in r:
                med = r[f"{name}_over_gloo_median"]
                print(f"    {name.replace('_', ' ')}: {_fmt(r[name])}; / gloo "
                      f"{_fmt(r[f'{name}_over_gloo'])}; median "
                      f"{'-' if med is None else f'{med:.2f}'}")
    out.write_text(json.dumps({"rounds": args.rounds, "args": rest, "summary": rows,
                               "round_files": [f"{out.stem}_round{i}.json"
                                               for i in range(1, args.rounds + 1)]},
                              indent=1) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
