"""End-to-end all-reduce through bandwidth-capped links, quantized vs not, in one run.

    python bench/quantized.py --mib 256 --bandwidth 50e6 --pool 4

Two peers (in one process; bytes move in Rust) whose ring links both pass through a
LinkEmulator capping each TCP connection at --bandwidth bytes/s per direction.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np

import pccl
from pccl.testing import Cluster, LinkEmulator


async def run(mib: int, bandwidth: float, pool: int, iters: int) -> list[dict]:
    n = mib * (1 << 20) // 4
    async with LinkEmulator(bandwidth=bandwidth, chunk_size=256 << 10) as e1, \
            LinkEmulator(bandwidth=bandwidth, chunk_size=256 << 10) as e2:
        async with Cluster(0, pool_size=pool,
                           master_kwargs={"heartbeat_timeout": 60.0}) as cluster:
            comms = []
            for emu in (e1, e2):
                comm = cluster.new_comm(p2p_advertise_address=emu.address, peer_timeout=120.0)
                emu.target = (lambda c: lambda: f"127.0.0.1:{c.p2p_port}")(comm)
                comms.append(comm)
            await cluster.admit(comms)
            rng = np.random.default_rng(0)
            xs = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
            exact = xs[0].astype(np.float64) + xs[1]
            rows = []
            configs = [("none", None)] + [
                (f"{a.name}/{w.name}", pccl.QuantizationOptions(a, w))
                for a in (pccl.QuantizationAlgorithm.MIN_MAX,)
                for w in (pccl.DataType.UINT8, pccl.DataType.FLOAT8_E4M3)]
            for name, q in configs:
                times = []
                for it in range(iters):
                    ts = [x.copy() for x in xs]
                    t0 = time.perf_counter()
                    infos = await asyncio.gather(*(c.all_reduce(t, quantization=q, tag=it)
                                                   for c, t in zip(comms, ts)))
                    times.append(time.perf_counter() - t0)
                err = float(np.max(np.abs(ts[0] - exact)))
                rows.append({"quantization": name, "seconds_median": sorted(times)[len(times) // 2],
                             "tx_bytes": infos[0].tx_bytes, "max_abs_error": err})
            base = rows[0]["seconds_median"]
            for r in rows:
                r["speedup"] = base / r["seconds_median"]
            return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--bandwidth", type=float, default=50e6)
    ap.add_argument("--pool", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    rows = asyncio.run(run(args.mib, args.bandwidth, args.pool, args.iters))
    print(json.dumps({"config": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
