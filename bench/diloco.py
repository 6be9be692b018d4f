"""DiLoCo overlap: does inner compute really run while a pseudo-gradient reduce moves?

    python bench/diloco.py                       # both parts, defaults below
    python bench/diloco.py --part gil --mib 128
    python bench/diloco.py --part overlap --bandwidth 20e6 --layers 4 --inner-steps 8

``gil``: two in-process peers all-reduce ``--mib`` MiB of float32 while a worker thread
runs a pure-Python loop (it holds the GIL except at the interpreter's switch points).
The loop's iteration rate during the reduce, relative to its rate alone, says whether
the ring lets Python run; the reduce's time relative to its time alone says whether
Python starves the ring. (On a machine with few cores the two also compete for CPU.)

``overlap``: three in-process peers train an MLP with DiLoCo, every peer's incoming
ring link capped at ``--bandwidth`` bytes/s per TCP stream (4 streams per link) by a
LinkEmulator, inner steps in worker
threads (``DiLoCo.inner_step``). Reports the wall time per outer step in sync and async
mode, next to the inner compute alone and the reduce alone, and how many inner steps of
async mode finished while a reduce was in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

import numpy as np

import pccl
from pccl.testing import Cluster, LinkEmulator


async def gil(mib: int, iters: int) -> dict:
    n = mib * (1 << 20) // 4
    async with Cluster(2, pool_size=4, master_kwargs={"heartbeat_timeout": 60.0}) as cluster:
        xs = [np.ones(n, dtype=np.float32) for _ in range(2)]

        async def reduce(tag: int) -> float:
            t0 = time.perf_counter()
            await asyncio.gather(*(c.all_reduce(x, tag=tag) for c, x in zip(cluster.comms, xs)))
            return time.perf_counter() - t0

        def spin(stop: threading.Event, out: list[float]) -> None:
            count, t0 = 0, time.perf_counter()
            while not stop.is_set():
                for _ in range(1000):
                    count += 1
            out.append(count / (time.perf_counter() - t0))

        await reduce(0)  # warm-up: buffers, pools
        alone = [await reduce(1 + i) for i in range(iters)]
        stop, rate_alone = threading.Event(), []
        th = threading.Thread(target=spin, args=(stop, rate_alone))
        th.start()
        await asyncio.sleep(0.5)  # measurement window for the loop alone
        stop.set()
        await asyncio.to_thread(th.join)
        together, rate_together = [], []
        for i in range(iters):
            stop = threading.Event()
            th = threading.Thread(target=spin, args=(stop, rate_together))
            th.start()
            together.append(await reduce(100 + i))
            stop.set()
            await asyncio.to_thread(th.join)
        return {
            "part": "gil", "mib": mib,
            "reduce_s_alone": min(alone), "reduce_s_with_python_loop": min(together),
            "python_rate_alone": rate_alone[0],
            "python_rate_during_reduce": float(np.median(rate_together)),
            "python_rate_ratio": float(np.median(rate_together)) / rate_alone[0],
        }


async def overlap(bandwidth: float, layers: int, width: int, inner_steps: int,
                  rounds: int, batch: int) -> dict:
    import torch

    from pccl.diloco import DiLoCo

    torch.set_num_threads(1)
    torch.optim.SGD([torch.zeros(1, requires_grad=True)]).step()  # lazy imports, up front

    def make_model() -> torch.nn.Module:
        torch.manual_seed(0)
        mods: list[torch.nn.Module] = []
        for _ in range(layers):
            mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
        return torch.nn.Sequential(*mods)

    async def with_peers(body):
        """Runs ``body(comms)`` on three fresh peers behind capped links (a fresh run per
        measurement: a communicator's shared-state revisions belong to one DiLoCo)."""
        emus = [LinkEmulator(bandwidth=bandwidth, chunk_size=256 << 10) for _ in range(3)]
        for e in emus:
            await e.start()
        try:
            async with Cluster(0, pool_size=4,
                               master_kwargs={"heartbeat_timeout": 60.0}) as cluster:
                comms = []
                for emu in emus:
                    comm = cluster.new_comm(p2p_advertise_address=emu.address,
                                            peer_timeout=120.0)
                    emu.target = (lambda c: lambda: f"127.0.0.1:{c.p2p_port}")(comm)
                    comms.append(comm)
                await cluster.admit(comms)
                return await body(comms)
        finally:
            for e in emus:
                await e.stop()

    models = [make_model() for _ in range(3)]
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in models]
    n_params = sum(p.numel() for p in models[0].parameters())
    data = [(torch.randn(batch, width), torch.randn(batch, width)) for _ in range(3)]

    def loss_fn(i: int):
        x, y = data[i]
        return lambda: torch.nn.functional.mse_loss(models[i](x), y)

    def one_step(i: int) -> None:
        opts[i].zero_grad()
        loss_fn(i)().backward()
        opts[i].step()

    async def compute_round() -> None:
        await asyncio.gather(*(asyncio.to_thread(
            lambda i=i: [one_step(i) for _ in range(inner_steps)]) for i in range(3)))

    # Baselines: inner compute alone (all three peers at once, as in training) and the
    # reduce alone.
    await compute_round()
    t0 = time.perf_counter()
    await compute_round()
    compute_s = time.perf_counter() - t0

    async def reduce_alone(comms) -> float:
        buf = [np.zeros(n_params, dtype=np.float32) for _ in comms]
        await asyncio.gather(*(c.all_reduce(b, op=pccl.ReduceOp.AVG, tag=1)
                               for c, b in zip(comms, buf)))
        t0 = time.perf_counter()
        await asyncio.gather(*(c.all_reduce(b, op=pccl.ReduceOp.AVG, tag=2)
                               for c, b in zip(comms, buf)))
        return time.perf_counter() - t0

    result = {"part": "overlap", "params": n_params,
              "pseudo_gradient_mib": n_params * 4 / (1 << 20), "bandwidth": bandwidth,
              "inner_steps": inner_steps, "compute_round_s": compute_s,
              "reduce_s": await with_peers(reduce_alone)}
    for mode in ("sync", "async"):
        async def train_run(comms, mode=mode) -> None:
            ds = [DiLoCo(m, o, c, inner_steps=inner_steps, async_mode=mode == "async")
                  for m, o, c in zip(models, opts, comms)]
            await asyncio.gather(*(d.start() for d in ds))
            overlapped = [0]

            async def train(i: int, d: DiLoCo) -> None:
                for _ in range(inner_steps):
                    await d.inner_step(loss_fn(i))
                    overlapped[0] += int(d.reduce_in_flight)

            # A warm-up round (async mode: it starts the pipeline).
            await asyncio.gather(*(train(i, d) for i, d in enumerate(ds)))
            overlapped[0] = 0
            t0 = time.perf_counter()
            for _ in range(rounds):
                await asyncio.gather(*(train(i, d) for i, d in enumerate(ds)))
            result[f"{mode}_outer_step_s"] = (time.perf_counter() - t0) / rounds
            if mode == "async":
                result["async_inner_steps_with_reduce_in_flight"] = (
                    overlapped[0] / (3 * rounds * inner_steps))
            await asyncio.gather(*(d.flush() for d in ds))
            await asyncio.gather(*(d.close() for d in ds))

        await with_peers(train_run)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["gil", "overlap", "both"], default="both")
    ap.add_argument("--mib", type=int, default=128, help="gil: MiB all-reduced")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--bandwidth", type=float, default=20e6, help="overlap: bytes/s per TCP stream")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--inner-steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.part in ("gil", "both"):
        print(json.dumps(asyncio.run(gil(args.mib, args.iters))))
    if args.part in ("overlap", "both"):
        print(json.dumps(asyncio.run(overlap(args.bandwidth, args.layers, args.width,
                                             args.inner_steps, args.rounds, args.batch))))


if __name__ == "__main__":
    main()
