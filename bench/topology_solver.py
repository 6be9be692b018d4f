"""Ring solver (pccl.topology): wall time and bottleneck quality on random matrices.

    python bench/topology_solver.py                          # about 15 s
    python bench/topology_solver.py --budget 0.1 0.5 2 --heuristic-sizes 64 256 512

Bandwidths are log-uniform between 1 MB/s and 1 GB/s, every link drawn independently
(so the matrices are asymmetric). For each size, ``--instances`` matrices are solved:

* exact rows time :func:`solve_exact` (quality is 1 by definition);
* heuristic rows time :func:`solve_heuristic` at each ``--budget`` and report its
  bottleneck as a fraction of the exact optimum where ``n`` allows exact solving
  (``n <= 16``), otherwise of an upper bound (the largest threshold at which the fast
  links still give every peer a distinct successor and connect everybody; no ring can
  beat it, so a ratio of 1.000 is optimal and below 1 is at most that far off).

``join_order`` is the bottleneck of the ring in peer-id order, the ring one gets
without optimising, on the same scale. A table goes to stdout, then one JSON object
(also written to ``--json`` if given).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine_info  # noqa: E402

from pccl import topology  # noqa: E402
from pccl.topology import ring_cost, solve_exact, solve_heuristic  # noqa: E402

EXACT_LIMIT = 16  # largest n for which the heuristic rows are checked against exact


def random_matrix(n: int, rng: np.random.Generator) -> np.ndarray:
    bw = np.exp(rng.uniform(math.log(1e6), math.log(1e9), (n, n)))
    np.fill_diagonal(bw, 0.0)
    return bw


def upper_bound(bw: np.ndarray) -> float:
    """No ring's bottleneck exceeds this (see pccl.topology._ring_bound)."""
    w = topology._weights(bw)
    values = np.unique(w[w > 0])
    order = np.argsort(-w, axis=1, kind="stable")
    index, _ = topology._ring_bound(w, order, values, math.inf)
    return float(values[index]) if index >= 0 else 0.0


def reference(bw: np.ndarray) -> tuple[str, float]:
    if len(bw) <= EXACT_LIMIT:
        ring = solve_exact(bw)
        assert ring is not None
        return "exact", ring_cost(ring, bw)[0]
    return "bound", upper_bound(bw)


def summarize(mode: str, n: int, budget: float | None, ref: str, times: list[float],
              ratios: list[float], join: list[float]) -> dict[str, Any]:
    return {
        "mode": mode, "n": n, "budget_s": budget, "instances": len(times), "vs": ref,
        "time_median_s": statistics.median(times), "time_max_s": max(times),
        "ratio_min": min(ratios), "ratio_median": statistics.median(ratios),
        "at_reference": sum(r >= 1.0 for r in ratios),
        "join_order_ratio_median": statistics.median(join),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--exact-sizes", type=int, nargs="*", default=[8, 12, 16])
    ap.add_argument("--heuristic-sizes", type=int, nargs="*", default=[16, 64, 256])
    ap.add_argument("--budget", type=float, nargs="+", default=[0.05, 0.5],
                    help="heuristic time budgets in seconds (one row each)")
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the JSON record to this file")
    args = ap.parse_args()

    rows: list[dict[str, Any]] = []
    header = (f"{'mode':<9} {'n':>4} {'budget':>7} {'vs':>5} {'t_med':>8} {'t_max':>8} "
              f"{'ratio_min':>9} {'ratio_med':>9} {'at_ref':>6} {'join_ord':>8}")
    print(header)
    print("-" * len(header))

    def emit(row: dict[str, Any]) -> None:
        rows.append(row)
        budget = "-" if row["budget_s"] is None else f"{row['budget_s']:g}s"
        print(f"{row['mode']:<9} {row['n']:>4} {budget:>7} {row['vs']:>5} "
              f"{row['time_median_s']:>7.3f}s {row['time_max_s']:>7.3f}s "
              f"{row['ratio_min']:>9.3f} {row['ratio_median']:>9.3f} "
              f"{row['at_reference']:>3}/{row['instances']:<2} "
              f"{row['join_order_ratio_median']:>8.3f}", flush=True)

    for n in args.exact_sizes:
        rng = np.random.default_rng([args.seed, n])
        times, join = [], []
        for _ in range(args.instances):
            bw = random_matrix(n, rng)
            start = time.perf_counter()
            ring = solve_exact(bw)
            times.append(time.perf_counter() - start)
            assert ring is not None
            best = ring_cost(ring, bw)[0]
            join.append(ring_cost(list(range(n)), bw)[0] / best)
        emit(summarize("exact", n, None, "exact", times, [1.0] * len(times), join))

    for n in args.heuristic_sizes:
        rng = np.random.default_rng([args.seed, n])
        matrices = [random_matrix(n, rng) for _ in range(args.instances)]
        refs = [reference(bw) for bw in matrices]
        join = [ring_cost(list(range(n)), bw)[0] / ref for bw, (_, ref) in zip(matrices, refs)]
        for budget in args.budget:
            times, ratios = [], []
            for k, (bw, (_, ref)) in enumerate(zip(matrices, refs)):
                start = time.perf_counter()
                ring = solve_heuristic(bw, rng=np.random.default_rng(k), time_budget=budget)
                times.append(time.perf_counter() - start)
                ratios.append(ring_cost(ring, bw)[0] / ref)
            emit(summarize("heuristic", n, budget, refs[0][0], times, ratios, join))

    record = {"benchmark": "topology_solver", "seed": args.seed,
              "machine": machine_info(), "rows": rows}
    print(json.dumps(record))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
