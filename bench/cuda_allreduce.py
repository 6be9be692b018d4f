"""CUDA all-reduce at k=2 on one GPU host: staged (pccl.staging) vs host tensors vs a copy
to the host and back by hand; then a peer SIGKILLed mid-call.

    python bench/cuda_allreduce.py [--sizes-mib 64 128 256] [--iters 5] [--warmup 1]
                                   [--out bench/results/cuda_allreduce_<card>.json]

Two peer processes (and a master process) on this host, on GPU 0 (peer r on GPU r when
there are two). For each size, float32 SUM, per iteration (both peers meet at a barrier
before each call; an iteration's time is the slower peer's):

- host: the all-reduce of a CPU tensor (the floor: no device in the way);
- cuda: the all-reduce of the CUDA tensor, staged through pinned host buffers;
- manual: ``h = x.cpu(); all_reduce(h); x.copy_(h)`` (what users do by hand), synchronized.

Checks: the CUDA result equals the host result bit for bit (same inputs). Targets: cuda
<= 1.15 x host, manual / cuda >= 1.5. Last, the kill phase: peer 1 SIGKILLs itself
while a 256 MiB CUDA all-reduce runs (after one of its pieces finished); peer 0's call
must fail with a pccl error and leave its CUDA tensor exactly as it was. Exit status 0
when the checks (not the targets) hold.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import queue
import signal
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (
    CTX,
    MIB,
    Children,
    collect,
    get_one,
    machine_info,
    master_proc,
    report_failure,
    write_results,
)

SETUP_TIMEOUT = 120.0
MODES = ("host", "cuda", "manual")


async def _join(comm: Any, rank: int, admitted: Any) -> None:
    """Rank 0 joins first, then votes rank 1 in: the ring order is the rank order."""
    deadline = time.monotonic() + SETUP_TIMEOUT
    while admitted.value < rank:
        if time.monotonic() > deadline:
            raise TimeoutError("the peer before this one never joined")
        await asyncio.sleep(0.01)
    join = asyncio.create_task(comm.connect())
    if rank == 0:
        await join
        admitted.value = 1
        while not await comm.pending_peer_count():
            if time.monotonic() > deadline:
                raise TimeoutError("peer 1 never registered")
            await asyncio.sleep(0.01)
        await comm.update_topology()
    else:
        await join
        admitted.value = 2


async def _measure(comm: Any, rank: int, sync: Any, q: Any, sizes: list[int], iters: int,
                   warmup: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(1000 + rank)
    for nbytes in sizes:
        base = torch.randn(nbytes // 4, generator=gen)
        host = torch.empty_like(base)
        dev = torch.empty_like(base, device="cuda")
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        identical = True
        for it in range(warmup + iters):
            for mode in MODES:
                host.copy_(base)
                dev.copy_(base)
                torch.cuda.synchronize()
                await sync()
                t0 = time.perf_counter()
                if mode == "host":
                    info = await comm.all_reduce(host)
                elif mode == "cuda":
                    info = await comm.all_reduce(dev)
                else:
                    staged = dev.cpu()
                    info = await comm.all_reduce(staged)
                    dev.copy_(staged)
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                if it >= warmup:
                    times[mode].append(dt)
                if mode == "cuda":  # the host call ran on the same inputs just before
                    identical &= bool(torch.equal(dev.cpu().view(torch.int32),
                                                  host.view(torch.int32)))
                if info.world_size != 2:
                    raise RuntimeError(f"world size {info.world_size}")
        q.put({"rank": rank, "size": nbytes, "times": times, "identical": identical})
        del base, host, dev
        torch.cuda.empty_cache()


async def _kill_phase(comm: Any, rank: int, sync: Any, q: Any) -> None:
    import torch

    import pccl

    x = torch.randn(256 * MIB // 4, generator=torch.Generator().manual_seed(rank)).cuda()
    before = x.clone()
    await sync()
    ok = comm.metrics.collectives.labels("ok")
    reduced = ok._value.get()
    call = comm.all_reduce_async(x, tag=1)
    if rank == 1:
        deadline = time.monotonic() + 60.0  # die once a piece was reduced: mid-call
        while ok._value.get() <= reduced and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        await call
        outcome = "succeeded"
    except pccl.PCCLError as e:
        outcome = f"{type(e).__name__}: {e}"
    q.put({"rank": rank, "kill": outcome, "unchanged": bool(torch.equal(x, before))})


async def _peer(rank: int, master: str, admitted: Any, barrier: Any, q: Any,
                sizes: list[int], iters: int, warmup: int, kill: bool) -> None:
    import torch

    import pccl

    torch.cuda.set_device(rank % torch.cuda.device_count())
    comm = pccl.Communicator(master=master, insecure=True, timeout=30.0, peer_timeout=15.0,
                             collective_timeout=120.0)

    def sync() -> Any:
        return asyncio.to_thread(barrier.wait, 120.0)

    try:
        await _join(comm, rank, admitted)
        if kill:
            await _kill_phase(comm, rank, sync, q)
        else:
            await _measure(comm, rank, sync, q, sizes, iters, warmup)
            await sync()  # nobody leaves while the other still runs its last call
    finally:
        await asyncio.wait_for(comm.close(), 30.0)
    q.put({"done": True, "rank": rank})


def _peer_proc(*args: Any) -> None:
    rank, barrier, q = args[0], args[3], args[4]
    try:
        asyncio.run(_peer(*args))
    except BaseException:
        report_failure(q, f"peer {rank}", barrier)
        sys.exit(1)


def run(sizes: list[int], iters: int, warmup: int, kill: bool, budget: float) -> list[Any]:
    """One master and two peers: the measurements over ``sizes``, or (``kill``) the
    kill phase, where peer 1 dies and only peer 0 reports."""
    q, stop = CTX.Queue(), CTX.Event()
    with Children(grace=20.0) as kids:
        kids.start(master_proc, (q, stop, float("inf"), {
            "heartbeat_interval": 1.0, "heartbeat_timeout": 10.0, "insecure": True}), "master")
        master = get_one(q, kids, SETUP_TIMEOUT, "master")["address"]
        admitted, barrier = CTX.Value("i", 0), CTX.Barrier(2)
        for rank in range(2):
            kids.start(_peer_proc, (rank, master, admitted, barrier, q, sizes, iters, warmup,
                                    kill), f"peer-{rank}")
        try:
            if not kill:
                return collect(q, kids, 2, budget, "peers")
            got: list[Any] = []
            deadline = time.monotonic() + budget
            while not any(m.get("done") and m.get("rank") == 0 for m in got):
                if time.monotonic() > deadline:
                    raise TimeoutError("kill phase: peer 0 never reported")
                with contextlib.suppress(queue.Empty):
                    m = q.get(timeout=0.5)
                    if "error" in m:
                        raise RuntimeError(m["error"])
                    got.append(m)
            return got
        finally:
            stop.set()


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--no-kill", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark needs a GPU")
    card = torch.cuda.get_device_name(0)
    sizes = [m * MIB for m in args.sizes_mib]
    msgs = run(sizes, args.iters, args.warmup, False, args.budget_s)
    if not args.no_kill:
        msgs += run([], 0, 0, True, 120.0)
    rows = []
    for nbytes in sizes:
        per = [x for x in msgs if x.get("size") == nbytes]
        slow = {mode: [max(ts) for ts in zip(*(p["times"][mode] for p in per))]
                for mode in MODES}
        med = {mode: sorted(v)[len(v) // 2] for mode, v in slow.items()}
        row = {"size_mib": nbytes // MIB, "median_s": med, "times_s": slow,
               "cuda_over_host": med["cuda"] / med["host"],
               "manual_over_cuda": med["manual"] / med["cuda"],
               "bit_identical": all(p["identical"] for p in per)}
        rows.append(row)
        print(f"{row['size_mib']:4d} MiB  host {med['host'] * 1e3:8.1f} ms  cuda "
              f"{med['cuda'] * 1e3:8.1f} ms  manual {med['manual'] * 1e3:8.1f} ms  "
              f"cuda/host {row['cuda_over_host']:.2f} (target <= 1.15)  manual/cuda "
              f"{row['manual_over_cuda']:.2f} (target >= 1.5)  identical "
              f"{row['bit_identical']}")
    kill = [x for x in msgs if "kill" in x]
    for k in kill:
        print(f"kill phase, peer {k['rank']}: {k['kill']}; CUDA input unchanged: "
              f"{k['unchanged']}")
    out = {"card": card, "machine": machine_info(), "rows": rows, "kill": kill}
    slug = "".join(c if c.isalnum() else "_" for c in card).strip("_").lower()
    write_results(out, args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                "results", f"cuda_allreduce_{slug}.json"))
    ok = all(r["bit_identical"] for r in rows) and (args.no_kill or (bool(kill) and all(
        k["unchanged"] and k["kill"] != "succeeded" for k in kill)))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
