"""The sparse codec's cost (pccl.sparse, rust/sparse), beside numpy doing the selection
alone, in one run.

    python bench/sparse_codec.py --mi 16 --repeat 5

Times ``compress`` (top-k per chunk, codes, residual) and ``decode_add`` of one float32
tensor of --mi Mi elements for a few codecs (median of --repeat, one thread), and
numpy's ``argmax`` of magnitudes per chunk of 64 (the selection of k = 1 only) for scale.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from pccl.sparse import SparseCodec

CODECS = {"1/64, 2 bits": SparseCodec(1 / 64, 2, 64), "2/64, 2 bits": SparseCodec(2 / 64, 2, 64),
          "2/64, 4 bits": SparseCodec(2 / 64, 4, 64)}


def median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mi", type=int, default=16, help="elements, in Mi (2^20)")
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    n = a.mi << 20
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    rows = []
    for name, codec in CODECS.items():
        payload = codec.compress(x.copy())
        acc = x.copy()
        out = np.zeros(n, np.float32)
        c = median_s(lambda codec=codec, acc=acc: codec.compress(acc), a.repeat)
        d = median_s(lambda codec=codec, out=out, payload=payload: codec.decode_add(payload, out),
                     a.repeat)
        rows.append({"codec": name, "elements": n, "payload_bytes": len(payload),
                     "vs_fp32": round(4 * n / len(payload), 1),
                     "compress_ms": round(1e3 * c, 1), "decode_add_ms": round(1e3 * d, 1),
                     "compress_gb_s": round(4 * n / c / 1e9, 2)})
    mags = np.abs(x).reshape(-1, 64)
    rows.append({"codec": "numpy argmax per chunk (selection only, k = 1)", "elements": n,
                 "ms": round(1e3 * median_s(lambda: mags.argmax(axis=1), a.repeat), 1)})
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
