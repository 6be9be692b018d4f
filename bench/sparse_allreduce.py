"""Bytes on the ring per peer for one reduce of a float32 tensor, side by side in one run:
the dense all-reduce (float32, int8), the sparse all-reduce (``pccl.sparse.all_reduce``:
payloads in one ring all-gather) and the carrier it replaced (the payloads in one uint8
SUM all-reduce of a buffer with a slot per rank).

    python bench/sparse_allreduce.py --peers 3 8 --mi 1

An in-process cluster per world size, the ring forced (``via_master_max_bytes=0``);
``tx`` is what ``ReduceInfo`` / ``GatherInfo`` count (payload and piece headers), the
same on every peer of a ring. Times are loopback times (median of --repeat), not a
link's: the point is the bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import numpy as np

import pccl
from pccl import sparse
from pccl.testing import Cluster

CODEC = sparse.SparseCodec(density=1 / 64, bits=2, chunk=64)
INT8 = pccl.QuantizationOptions(pccl.QuantizationAlgorithm.MIN_MAX, pccl.DataType.UINT8)


async def one_world(k: int, n: int, repeat: int) -> dict[str, dict[str, float]]:
    async with Cluster(k, comm_kwargs={"via_master_max_bytes": 0}) as c:
        await asyncio.gather(*(x.update_topology() for x in c.comms))
        rng = np.random.default_rng(0)
        xs = [rng.standard_normal(n).astype(np.float32) for _ in range(k)]
        ring = c.comms[0].ring
        rank = {x.peer_id: ring.index(x.peer_id) for x in c.comms}
        slot = 4 + CODEC.payload_bytes(n)

        async def dense(q):
            return await asyncio.gather(*(x.all_reduce(v.copy(), quantization=q)
                                          for x, v in zip(c.comms, xs)))

        async def gather():
            return await asyncio.gather(*(sparse.all_reduce(x, CODEC, v.copy(),
                                                            np.empty(n, np.float32))
                                          for x, v in zip(c.comms, xs)))

        async def carrier():
            bufs = []
            for x, v in zip(c.comms, xs):
                b = np.zeros(k * slot, np.uint8)
                r = rank[x.peer_id]
                b[r * slot:r * slot + 4] = np.frombuffer(int(x.peer_id).to_bytes(4, "little"),
                                                         np.uint8)
                b[r * slot + 4:(r + 1) * slot] = np.frombuffer(CODEC.compress(v.copy()), np.uint8)
                bufs.append(b)
            return await asyncio.gather(*(x.all_reduce(b) for x, b in zip(c.comms, bufs)))

        out = {}
        for name, fn in (("dense fp32", lambda: dense(None)), ("dense int8", lambda: dense(INT8)),
                         ("sparse, slot all-reduce (before)", carrier),
                         ("sparse, all-gather", gather)):
            times, tx = [], 0
            for _ in range(repeat):
                t = time.perf_counter()
                infos = await fn()
                times.append(time.perf_counter() - t)
                tx = max(i.tx_bytes for i in infos)
            out[name] = {"tx_bytes_per_peer": tx, "seconds": statistics.median(times)}
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peers", type=int, nargs="+", default=[3, 8])
    p.add_argument("--mi", type=float, default=1.0, help="float32 elements, in Mi")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default="")
    a = p.parse_args()
    n = int(a.mi * (1 << 20))
    results = {}
    print(f"{n} float32, codec {CODEC}; tx bytes per peer per reduce")
    for k in a.peers:
        r = asyncio.run(one_world(k, n, a.repeat))
        results[k] = r
        fp32 = r["dense fp32"]["tx_bytes_per_peer"]
        int8 = r["dense int8"]["tx_bytes_per_peer"]
        for name, v in r.items():
            tx = v["tx_bytes_per_peer"]
            print(f"k={k:2d} {name:34s} {tx:12,d} B  {fp32 / tx:6.1f}x fp32  "
                  f"{int8 / tx:5.1f}x int8  {v['seconds'] * 1e3:8.1f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"elements": n, "codec": str(CODEC), "worlds": results}, f, indent=1)


if __name__ == "__main__":
    main()
