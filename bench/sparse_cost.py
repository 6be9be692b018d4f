"""SparseLoCo's codec against the inner steps it rides on, in one quiet process: the CPU
seconds of one outer step's codec work (compress this peer's accumulator, decode every
peer's payload) beside those of H inner steps of examples/train.py's model.

    python bench/sparse_cost.py --size medium --inner-steps 10 --peers 8

CPU time (``time.process_time``) on one thread for both, so a loaded machine (train.py
runs every peer on the same cores) does not inflate one side more than the other.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import stdlib_lm as lm  # noqa: E402

from pccl.sparse import SparseCodec  # noqa: E402

CODECS = {"2/64, 2 bits": SparseCodec(2 / 64, 2, 64), "1/64, 2 bits": SparseCodec(1 / 64, 2, 64),
          "1/128, 2 bits": SparseCodec(1 / 128, 2, 128)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="medium")
    p.add_argument("--inner-steps", type=int, default=10)
    p.add_argument("--peers", type=int, default=8, help="payloads decoded per outer step")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default="")
    a = p.parse_args()
    torch.set_num_threads(1)
    model = lm.tiny_lm(a.size, 0)
    params = [q for q in model.parameters()]
    n = sum(q.numel() for q in params)
    fused = {"fused": True} if model.size.pairs else {}
    opt = torch.optim.AdamW(params, lr=2e-3, weight_decay=0.0, **fused)
    corpus = lm.load_corpus()
    rng = np.random.default_rng(0)
    data = np.frombuffer(corpus.train, np.uint8)
    ctx = model.size.ctx

    def inner() -> None:
        starts = rng.integers(0, len(data) - ctx - 1, a.batch)
        x = torch.from_numpy(np.stack([data[s:s + ctx] for s in starts]).astype(np.int64))
        y = torch.from_numpy(np.stack([data[s + 1:s + ctx + 1] for s in starts]).astype(np.int64))
        opt.zero_grad()
        model.loss(x, y).backward()
        opt.step()

    inner()  # warm up
    acc = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    out = np.zeros(n, np.float32)
    rows = []
    for _ in range(a.repeat):
        t = time.process_time()
        for _ in range(a.inner_steps):
            inner()
        compute = time.process_time() - t
        for name, codec in CODECS.items():
            work = acc.copy()
            t = time.process_time()
            payload = codec.compress(work)
            for _ in range(a.peers):
                codec.decode_add(payload, out)
            codec_s = time.process_time() - t
            rows.append({"codec": name, "params": n, "inner_steps": a.inner_steps,
                         "peers": a.peers, "compute_cpu_s": round(compute, 4),
                         "codec_cpu_s": round(codec_s, 4),
                         "codec_share_of_compute": round(codec_s / compute, 4)})
    for r in rows:
        print(json.dumps(r))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
