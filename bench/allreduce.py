"""All-reduce throughput of pccl next to what the machine and torch's gloo manage.

    python bench/allreduce.py [--peers 2 4] [--sizes-mib 1 16 64 256] [--iters N]
                              [--out bench/results/allreduce.json] [--skip-gloo]
                              [--skip-emulator]

One run measures, in this order:

1. loopback: k plain TCP streams at once (k sender and k receiver processes) for each k
   in --peers. A k-peer ring on one host moves its data over k such streams, so the
   aggregate rate divided by k bounds the busbw any ring all-reduce can reach here.
   With --secure-bound, also k clear and k encrypted streams of pccl's own transport at
   once (``secure_bench --streams k``, built with cargo): the encrypted aggregate / k
   bounds an encrypted ring's busbw (every byte is sealed and opened on these cores).
2. pccl: k peers, each in its own spawned process (the master in another), float32 SUM
   all-reduce of every --sizes-mib size, pool size --pool.
3. gloo: torch.distributed with the gloo backend, same k, sizes and timing.
4. emulator: 2 pccl peers whose ring links both go through pccl.testing.LinkEmulator
   (added one-way latency and a per-connection bandwidth cap), for each pool size in
   --emu-pools, all-reducing --emu-size-mib; the emulators run in a process of their own.

Timing, for pccl and gloo alike: before each call all peers meet at a
multiprocessing.Barrier, each times its own call, and an iteration's time is the
slowest peer's. --warmup iterations are dropped; median and best of the rest are kept.
algbw = bytes / time, busbw = algbw * 2(k-1)/k (the bytes each ring link carries per
second). Throughputs are in decimal units (1 GB/s = 1e9 B/s); sizes in MiB.

A table goes to stdout and every number (plus a record of the machine) to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (
    CTX,
    GB,
    MB,
    MIB,
    Children,
    busbw_factor,
    collect,
    fmt_size,
    get_one,
    iter_wall_times,
    machine_info,
    master_proc,
    median,
    phase,
    report_failure,
    summarize,
    write_results,
)

from pccl.testing import free_port

TCP_CHUNK = 4 * MIB  # bytes per send()/recv_into() in the loopback measurement
SETUP_TIMEOUT = 120.0  # seconds for spawning, joining and admitting a set of peers


def op_timeout(nbytes: int, floor_rate: float) -> float:
    """A generous bound for one collective of ``nbytes`` moving at ``floor_rate`` B/s."""
    return 60.0 + 4.0 * nbytes / floor_rate


def expected_sum(k: int) -> float:
    """Rank r contributes r + 1 everywhere, so every element must end up as this."""
    return k * (k + 1) / 2


# =====================================================================================
# 1. loopback TCP: the machine's limit
# =====================================================================================


def _stream_buffer(nbytes: int, cold: bool) -> memoryview:
    """What a loopback stream sends from / receives into: one ``TCP_CHUNK`` reused (stays
    in cache), or, ``cold``, a buffer of the whole ``nbytes`` walked through, as an
    all-reduce walks through a tensor (touched once here, so page faults stay out of
    the timing)."""
    buf = bytearray(nbytes if cold else TCP_CHUNK)
    if cold:
        buf[::4096] = b"\1" * len(range(0, nbytes, 4096))
    return memoryview(buf)


def _tcp_receiver(idx: int, nbytes: int, rounds: int, port_q: Any, q: Any,
                  timeout: float, cold: bool = False) -> None:
    try:
        with socket.create_server(("127.0.0.1", 0)) as srv:
            srv.settimeout(timeout)
            port_q.put({"done": True, "idx": idx, "port": srv.getsockname()[1]})
            conn, _ = srv.accept()
        with conn:
            conn.settimeout(timeout)
            view = _stream_buffer(nbytes, cold)
            for _ in range(rounds):
                left = nbytes
                while left:
                    at = nbytes - left if cold else 0
                    n = conn.recv_into(view[at:at + min(left, TCP_CHUNK)])
                    if n == 0:
                        raise ConnectionError("sender closed early")
                    left -= n
                conn.sendall(b"!")  # tells the sender that every byte has arrived
    except BaseException:
        report_failure(q, f"tcp receiver {idx}")
        sys.exit(1)


def _tcp_sender(idx: int, port: int, nbytes: int, rounds: int, barrier: Any, q: Any,
                timeout: float, cold: bool = False) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            payload = _stream_buffer(nbytes, cold)
            spans = []
            for _ in range(rounds):
                barrier.wait(timeout)
                t0 = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
                left = nbytes
                while left:
                    n = min(left, TCP_CHUNK)
                    at = nbytes - left if cold else 0
                    s.sendall(payload[at:at + n])
                    left -= n
                if s.recv(1) != b"!":
                    raise ConnectionError("receiver did not confirm")
                spans.append((t0, time.perf_counter()))
        q.put({"done": True, "idx": idx, "spans": spans})
    except BaseException:
        report_failure(q, f"tcp sender {idx}", barrier)
        sys.exit(1)


def bench_secure_loopback(k: int, mib: int, rounds: int) -> dict[str, Any]:
    """k clear and k encrypted streams of pccl's transport at once (Rust, one process
    of a tokio worker per core): ``secure_bench --streams k``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = ["cargo", "run", "--quiet", "--release", "--locked", "--bin", "secure_bench", "--",
           "--streams", str(k), "--mib", str(mib), "--rounds", str(rounds)]
    res = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=1800,
                         check=True)
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    out: dict[str, Any] = {"streams": k, "bytes_per_stream": mib * MIB, "command": " ".join(cmd)}
    for transport in ("clear", "encrypted"):
        aggs = [r["aggregate_GBps"] for r in rows if r["transport"] == transport]
        out[transport] = {"aggregate_GBps": aggs, "busbw_bound_GBps_median": median(aggs) / k,
                          "busbw_bound_GBps_best": max(aggs) / k}
    return out


def bench_loopback(k: int, nbytes: int, rounds: int, cold: bool = False) -> dict[str, Any]:
    timeout = op_timeout(nbytes * k, 50 * MB)
    port_q, q = CTX.Queue(), CTX.Queue()
    barrier = CTX.Barrier(k)
    with Children() as kids:
        for i in range(k):
            kids.start(_tcp_receiver, (i, nbytes, rounds, port_q, q, timeout, cold),
                       f"tcp-recv-{i}")
        ports = {m["idx"]: m["port"]
                 for m in collect(port_q, kids, k, SETUP_TIMEOUT, "loopback listeners")}
        for i in range(k):
            kids.start(_tcp_sender, (i, ports[i], nbytes, rounds, barrier, q, timeout, cold),
                       f"tcp-send-{i}")
        msgs = collect(q, kids, k, SETUP_TIMEOUT + rounds * timeout, "loopback streams")
    per_round = []
    for r in range(rounds):
        spans = [m["spans"][r] for m in msgs]
        wall = max(t1 for _, t1 in spans) - min(t0 for t0, _ in spans)
        per_round.append({
            "wall_s": wall,
            "aggregate_GBps": k * nbytes / wall / GB,
            "per_stream_GBps": [nbytes / (t1 - t0) / GB for t0, t1 in spans],
        })
    aggs = [r["aggregate_GBps"] for r in per_round]
    return {
        "streams": k,
        "bytes_per_stream": nbytes,
        "cold": cold,
        "rounds": per_round,
        "aggregate_GBps_median": median(aggs),
        "aggregate_GBps_best": max(aggs),
        "busbw_bound_GBps_median": median(aggs) / k,
        "busbw_bound_GBps_best": max(aggs) / k,
    }


# =====================================================================================
# pccl peers (used by sections 2 and 4)
# =====================================================================================


def _insecure() -> bool:
    """Clear-text pccl (insecure=True) when PCCL_BENCH_INSECURE=1 (set by
    bench/transport.py around a run; spawned children inherit it)."""
    return os.environ.get("PCCL_BENCH_INSECURE") == "1"


def _piece_kwargs() -> dict[str, int]:
    """The ring's piece size, ``PCCL_BENCH_PIECE_BYTES``, when set (else pccl's own
    default applies)."""
    value = os.environ.get("PCCL_BENCH_PIECE_BYTES")
    return {} if value is None else {"piece_bytes": int(value)}


def _mesh_max_bytes() -> int:
    """The master's mesh limit: ``PCCL_BENCH_MESH_MAX_BYTES`` (0: every collective on
    the ring), else pccl's default (-1: the cost model chooses)."""
    return int(os.environ.get("PCCL_BENCH_MESH_MAX_BYTES", "-1"))


def _master_options() -> dict[str, Any]:
    """The bench's master: a long heartbeat timeout (on a small, busy machine a peer's
    event loop can be late to answer a ping without being dead), the transport and the
    mesh limit the environment asks for."""
    return {"heartbeat_interval": 1.0, "heartbeat_timeout": 30.0, "insecure": _insecure(),
            "mesh_max_bytes": _mesh_max_bytes()}


async def _until(pred: Any, poll: float = 0.005) -> None:
    """Polls ``pred()`` until it holds (callers bound this with asyncio.timeout)."""
    while not pred():
        await asyncio.sleep(poll)


async def _pccl_peer(rank: int, k: int, master: str, pool: int, advertise: str | None,
                     ports: Any, admitted: Any, sizes: list[int], iters: int, warmup: int,
                     barrier: Any, q: Any, floor_rate: float,
                     out_of_place: bool = False) -> None:
    import numpy as np

    import pccl

    # Behind an emulator, the peer's port is chosen here and published before it
    # registers: the master checks at registration that the advertised address (the
    # emulator, which forwards to this port) reaches it, and a port published too late
    # made it "not reachable" now and then, and its ring links hole-punched (one stream).
    listen_port = free_port() if advertise else 0
    if advertise:
        ports[rank] = listen_port
    comm = pccl.Communicator(master=master, p2p_connection_pool_size=pool,
                             p2p_advertise_address=advertise, p2p_listen_port=listen_port,
                             peer_timeout=30.0, timeout=30.0, insecure=_insecure(),
                             **_piece_kwargs())

    def sync(timeout: float) -> Any:
        # In a thread, so the event loop keeps answering the master while we wait.
        return asyncio.to_thread(barrier.wait, timeout)

    try:
        async with asyncio.timeout(SETUP_TIMEOUT):
            # Peers join one at a time, in rank order, so the ring order is the rank order.
            await _until(lambda: admitted.value >= rank)
            join = asyncio.create_task(comm.connect())
            while True:  # publish our listening port as soon as it is bound
                with contextlib.suppress(pccl.InvalidUsageError):
                    ports[rank] = comm.p2p_port
                    break
                if join.done():
                    join.result()  # raises if connect() failed
                await asyncio.sleep(0.002)
            await join
            admitted.value = rank + 1
            # Every accepted peer votes the next joiner in, once it is registered and its
            # port is known (whoever dials it through an emulator needs that port).
            for j in range(rank + 1, k):
                await _until(lambda j=j: ports[j] != 0)
                # A poll of the plain query (are_peers_pending() is a collective); the
                # count stays up until the vote below, which every accepted peer joins.
                while not await comm.pending_peer_count():
                    await asyncio.sleep(0.01)
                await comm.update_topology()
                await _until(lambda j=j: admitted.value > j)
        world = comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE)
        if world != k:
            raise RuntimeError(f"world size is {world}, expected {k}")
        want = expected_sum(k)
        for nbytes in sizes:
            budget = op_timeout(nbytes, floor_rate)
            x = np.empty(nbytes // 4, dtype=np.float32)
            # Out of place: the result goes to y (pccl lands it there as the ring runs).
            y = np.empty_like(x) if out_of_place else None
            times: list[float] = []
            info = None
            cpu0 = time.process_time()
            for it in range(warmup + iters):
                x.fill(rank + 1)
                await sync(budget)
                t0 = time.perf_counter()
                async with asyncio.timeout(budget):
                    info = await comm.all_reduce(x, y, op=pccl.ReduceOp.SUM, tag=0)
                dt = time.perf_counter() - t0
                if it >= warmup:
                    times.append(dt)
                res = x if y is None else y
                if y is not None and x[0] != rank + 1:
                    raise RuntimeError("the out-of-place all-reduce wrote its input")
                for v in (res[0], res[len(res) // 2], res[-1]):
                    if v != want:
                        raise RuntimeError(f"wrong result {v} at size {nbytes}, expected {want}")
            assert info is not None
            q.put({"rank": rank, "size": nbytes, "times": times,
                   "cpu_s": time.process_time() - cpu0, "tx_bytes": info.tx_bytes,
                   "rx_bytes": info.rx_bytes, "world_size": info.world_size,
                   "algorithm": info.algorithm})
            del x, y
        lanes = comm.ring_lanes()
        ring_pos = comm.ring.index(comm.peer_id) if comm.peer_id in comm.ring else -1
        await sync(60.0)  # nobody leaves while another still runs its last call
    finally:
        await asyncio.wait_for(comm.close(), 30.0)
    q.put({"done": True, "rank": rank, "lanes": list(lanes), "ring_pos": ring_pos})


def _pccl_peer_proc(*args: Any) -> None:
    rank, barrier, q = args[0], args[10], args[11]
    try:
        asyncio.run(_pccl_peer(*args))
    except BaseException:
        report_failure(q, f"pccl peer {rank}", barrier)
        sys.exit(1)


def run_pccl(k: int, pool: int, sizes: list[int], iters: int, warmup: int,
             floor_rate: float, advertise: list[str] | None = None,
             ports: Any = None, out_of_place: bool = False) -> dict[str, Any]:
    """Runs k pccl peers (and a master) in their own processes over ``sizes``.

    Returns the per-peer messages grouped as {size: [times of rank 0, rank 1, ...]} and
    the per-peer extras. ``advertise``/``ports``: see the emulator section.
    """
    addr_q, q, stop = CTX.Queue(), CTX.Queue(), CTX.Event()
    barrier = CTX.Barrier(k)
    ports = ports if ports is not None else CTX.Array("i", k)
    admitted = CTX.Value("i", 0)
    total = SETUP_TIMEOUT + sum((warmup + iters + 1) * op_timeout(n, floor_rate) for n in sizes)
    with Children() as kids:
        try:
            kids.start(master_proc, (addr_q, stop, total + 60.0, _master_options()),
                       "pccl-master")
            master = get_one(addr_q, kids, SETUP_TIMEOUT, "pccl master")["address"]
            for r in range(k):
                adv = advertise[r] if advertise else None
                kids.start(_pccl_peer_proc, (r, k, master, pool, adv, ports, admitted, sizes,
                                             iters, warmup, barrier, q, floor_rate,
                                             out_of_place),
                           f"pccl-peer-{r}")
            msgs = collect(q, kids, k, total, f"pccl k={k} pool={pool}")
        finally:
            stop.set()
    by_size: dict[int, dict[int, dict[str, Any]]] = {}
    extras = {}
    for m in msgs:
        if m.get("done"):
            extras[m["rank"]] = {"lanes": m["lanes"], "ring_pos": m["ring_pos"]}
        else:
            by_size.setdefault(m["size"], {})[m["rank"]] = m
    return {"by_size": by_size, "peers": extras}


def pccl_rows(k: int, pool: int, sizes: list[int], res: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        per_rank = res["by_size"][n]
        times = iter_wall_times([per_rank[r]["times"] for r in range(k)])
        rows.append({
            "peers": k, "pool": pool, "size_bytes": n, "size_mib": n / MIB,
            **summarize(times, n, k),
            "tx_bytes_per_peer": [per_rank[r]["tx_bytes"] for r in range(k)],
            "tx_over_busbw_bytes": (per_rank[0]["tx_bytes"] / (n * busbw_factor(k))
                                    if k > 1 else None),
            "cpu_s_per_peer": [round(per_rank[r]["cpu_s"], 3) for r in range(k)],
            "ring_lanes_per_peer": [res["peers"][r]["lanes"] for r in range(k)],
            "algorithm": sorted({per_rank[r]["algorithm"] for r in range(k)}),
        })
    return rows


# =====================================================================================
# 3. torch.distributed gloo
# =====================================================================================


def _gloo_peer_proc(rank: int, k: int, port: int, sizes: list[int], iters: int, warmup: int,
                    barrier: Any, q: Any, floor_rate: float) -> None:
    try:
        # Keep gloo on the loopback device, as the pccl peers are.
        if os.path.exists("/sys/class/net/lo"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import datetime

        import torch
        import torch.distributed as dist

        # gloo reduces on its own threads; avoid intra-op threads fighting over few cores.
        torch.set_num_threads(1)
        longest = max(op_timeout(n, floor_rate) for n in sizes)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=k, timeout=datetime.timedelta(seconds=longest))
        want = expected_sum(k)
        try:
            for nbytes in sizes:
                budget = op_timeout(nbytes, floor_rate)
                x = torch.empty(nbytes // 4, dtype=torch.float32)
                times = []
                cpu0 = time.process_time()
                for it in range(warmup + iters):
                    x.fill_(rank + 1)
                    barrier.wait(budget)
                    t0 = time.perf_counter()
                    dist.all_reduce(x, op=dist.ReduceOp.SUM)
                    dt = time.perf_counter() - t0
                    if it >= warmup:
                        times.append(dt)
                    for v in (x[0], x[len(x) // 2], x[-1]):
                        if float(v) != want:
                            raise RuntimeError(f"wrong result {float(v)}, expected {want}")
                q.put({"rank": rank, "size": nbytes, "times": times,
                       "cpu_s": time.process_time() - cpu0})
                del x
            barrier.wait(60.0)
        finally:
            dist.destroy_process_group()
        q.put({"done": True, "rank": rank})
    except BaseException:
        report_failure(q, f"gloo peer {rank}", barrier)
        sys.exit(1)


def run_gloo(k: int, sizes: list[int], iters: int, warmup: int,
             floor_rate: float) -> list[dict[str, Any]]:
    q = CTX.Queue()
    barrier = CTX.Barrier(k)
    port = free_port()
    total = SETUP_TIMEOUT + sum((warmup + iters + 1) * op_timeout(n, floor_rate) for n in sizes)
    with Children() as kids:
        for r in range(k):
            kids.start(_gloo_peer_proc, (r, k, port, sizes, iters, warmup, barrier, q,
                                         floor_rate), f"gloo-peer-{r}")
        msgs = collect(q, kids, k, total, f"gloo k={k}")
    by_size: dict[int, dict[int, dict[str, Any]]] = {}
    for m in msgs:
        if not m.get("done"):
            by_size.setdefault(m["size"], {})[m["rank"]] = m
    rows = []
    for n in sizes:
        times = iter_wall_times([by_size[n][r]["times"] for r in range(k)])
        rows.append({"peers": k, "size_bytes": n, "size_mib": n / MIB,
                     **summarize(times, n, k),
                     "cpu_s_per_peer": [round(by_size[n][r]["cpu_s"], 3) for r in range(k)]})
    return rows


# =====================================================================================
# 4. pccl through the link emulator
# =====================================================================================


def _emulator_proc(ports: Any, n: int, latency: float, bandwidth: float | None,
                   chunk: int, addr_q: Any, stop: Any, life_s: float) -> None:
    from pccl.testing.link_emulator import LinkEmulator

    async def main() -> dict[str, Any]:
        # Emulator i fronts peer i's listener: it carries the ring link INTO peer i.
        emus = [LinkEmulator(target=lambda i=i: f"127.0.0.1:{ports[i]}", latency=latency,
                             bandwidth=bandwidth, chunk_size=chunk) for i in range(n)]
        stats = {"cpu_frac_max": 0.0, "loop_lag_max_ms": 0.0}

        async def watch() -> None:
            # Is this process keeping up? CPU share over ~0.5 s windows and how late a
            # 50 ms sleep wakes up (event-loop lag).
            w0, c0 = time.monotonic(), time.process_time()
            while True:
                t = time.monotonic()
                await asyncio.sleep(0.05)
                lag = time.monotonic() - t - 0.05
                stats["loop_lag_max_ms"] = max(stats["loop_lag_max_ms"], lag * 1e3)
                w1, c1 = time.monotonic(), time.process_time()
                if w1 - w0 >= 0.5:
                    stats["cpu_frac_max"] = max(stats["cpu_frac_max"], (c1 - c0) / (w1 - w0))
                    w0, c0 = w1, c1

        for e in emus:
            await e.start()
        watcher = asyncio.create_task(watch())
        try:
            addr_q.put({"done": True, "addresses": [e.address for e in emus]})
            end = time.monotonic() + life_s
            while not stop.is_set() and time.monotonic() < end:
                await asyncio.sleep(0.05)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            for e in emus:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(e.stop(), 10.0)
        stats["bytes_forwarded"] = sum(e.bytes_forwarded for e in emus)
        return stats

    try:
        stats = asyncio.run(main())
        addr_q.put({"done": True, "stats": stats})
    except BaseException:
        report_failure(addr_q, "link emulator")
        sys.exit(1)


def run_emulated(pool: int, nbytes: int, iters: int, warmup: int, latency: float,
                 bandwidth: float, chunk: int) -> dict[str, Any]:
    k = 2
    floor_rate = pool * bandwidth / 4  # op_timeout() then allows ~16x the ideal time
    addr_q, stop = CTX.Queue(), CTX.Event()
    ports = CTX.Array("i", k)
    life = SETUP_TIMEOUT * 2 + (warmup + iters + 1) * op_timeout(nbytes, floor_rate)
    with Children() as kids:
        try:
            kids.start(_emulator_proc, (ports, k, latency, bandwidth, chunk, addr_q, stop,
                                        life), "link-emulator")
            addrs = get_one(addr_q, kids, SETUP_TIMEOUT, "link emulator")["addresses"]
            res = run_pccl(k, pool, [nbytes], iters, warmup, floor_rate, advertise=addrs,
                           ports=ports)
        finally:
            stop.set()
        emu_stats = get_one(addr_q, kids, 30.0, "link emulator stats")["stats"]
    row = pccl_rows(k, pool, [nbytes], res)[0]
    f = busbw_factor(k)
    ideal = pool * bandwidth  # bytes/s a link of `pool` capped streams can carry
    busbw_med = nbytes * f / row["time_median_s"]
    busbw_best = nbytes * f / row["time_best_s"]
    return {
        **row,
        "busbw_MBps_median": busbw_med / MB,
        "busbw_MBps_best": busbw_best / MB,
        "ideal_MBps": ideal / MB,
        "ratio_to_ideal_median": busbw_med / ideal,
        "ratio_to_ideal_best": busbw_best / ideal,
        "emulator": emu_stats,
    }


# =====================================================================================
# driver
# =====================================================================================


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None or x != x else format(x, spec)


def print_tables(out: dict[str, Any]) -> None:
    loop = {r["streams"]: r for r in out["loopback"]}
    pccl = {(r["peers"], r["size_bytes"]): r for r in out["pccl"]}
    gloo = {(r["peers"], r["size_bytes"]): r for r in out["gloo"]}
    if loop:
        print("\n== loopback TCP: k parallel streams (the machine's limit) ==")
        print(f"{'k':>3} {'MiB/stream':>10} {'aggregate GB/s med':>19} {'best':>6} "
              f"{'bound/k GB/s med':>17} {'best':>6}")
        for k, r in sorted(loop.items()):
            print(f"{k:>3} {r['bytes_per_stream'] // MIB:>10} "
                  f"{r['aggregate_GBps_median']:>19.2f} {r['aggregate_GBps_best']:>6.2f} "
                  f"{r['busbw_bound_GBps_median']:>17.2f} {r['busbw_bound_GBps_best']:>6.2f}")

    sec = {r["streams"]: r for r in out.get("secure_loopback", [])}
    if sec:
        print("\n== pccl's transport, k streams at once (secure_bench --streams k) ==")
        print(f"{'k':>3} {'clear bound/k med':>18} {'best':>6} {'encrypted bound/k med':>22} "
              f"{'best':>6}")
        for k, r in sorted(sec.items()):
            c, e = r["clear"], r["encrypted"]
            print(f"{k:>3} {c['busbw_bound_GBps_median']:>18.2f} "
                  f"{c['busbw_bound_GBps_best']:>6.2f} "
                  f"{e['busbw_bound_GBps_median']:>22.2f} {e['busbw_bound_GBps_best']:>6.2f}")

    if pccl or gloo:
        print("\n== busbw GB/s, float32 SUM (median / best of the timed iterations; "
              "%bound against the best loopback bound/k) ==")
        print(f"{'k':>3} {'size':>9} {'bound/k':>8} | {'pccl med':>8} {'best':>6} {'%bound':>6} "
              f"{'ms med':>8} | {'gloo med':>8} {'best':>6} {'%bound':>6} {'ms med':>8} | "
              f"{'pccl/gloo':>9}")

    def cols(r: dict[str, Any] | None, bound: float | None) -> str:
        if r is None:
            return f"{'-':>8} {'-':>6} {'-':>6} {'-':>8}"
        med = r["busbw_GBps_median"]
        pct = 100 * med / bound if bound else None
        return (f"{med:>8.2f} {r['busbw_GBps_best']:>6.2f} {_fmt(pct, '.0f'):>6} "
                f"{1e3 * r['time_median_s']:>8.1f}")

    for k, n in sorted(set(pccl) | set(gloo)):
        bound = loop[k]["busbw_bound_GBps_best"] if k in loop else None
        p, g = pccl.get((k, n)), gloo.get((k, n))
        ratio = p["busbw_GBps_median"] / g["busbw_GBps_median"] if p and g else None
        ran = "/".join(p["algorithm"]) if p and "algorithm" in p else ""
        enc = ""
        if p and k in sec and not out["config"].get("insecure"):
            eb = sec[k]["encrypted"]["busbw_bound_GBps_best"]
            enc = f" {100 * p['busbw_GBps_median'] / eb:.0f}% of encrypted bound/k"
        print(f"{k:>3} {fmt_size(n):>9} {_fmt(bound):>8} | {cols(p, bound)} | "
              f"{cols(g, bound)} | {_fmt(ratio):>9} {ran}{enc}")
    emu = out.get("emulator")
    if emu and emu["runs"]:
        print(f"\n== pccl through the link emulator: 2 peers, {fmt_size(emu['size_bytes'])}, "
              f"+{emu['latency_s'] * 1e3:.0f} ms each way, "
              f"{emu['bandwidth_Bps'] / MB:.1f} MB/s per connection per direction ==")
        print(f"{'pool':>4} {'s med':>7} {'busbw MB/s med':>15} {'best':>7} "
              f"{'K x cap':>8} {'ratio med':>9} {'best':>6} {'vs pool1':>8} "
              f"{'emu cpu':>7} {'emu lag ms':>10}")
        for r in emu["runs"]:
            print(f"{r['pool']:>4} {r['time_median_s']:>7.2f} {r['busbw_MBps_median']:>15.1f} "
                  f"{r['busbw_MBps_best']:>7.1f} {r['ideal_MBps']:>8.1f} "
                  f"{r['ratio_to_ideal_median']:>9.2f} {r['ratio_to_ideal_best']:>6.2f} "
                  f"{_fmt(r.get('speedup_vs_pool1')):>8} "
                  f"{r['emulator']['cpu_frac_max']:>7.2f} "
                  f"{r['emulator']['loop_lag_max_ms']:>10.1f}")
    for e in out["errors"]:
        print(f"\n!! {e['phase']}: {e['error'].strip().splitlines()[-1]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, nargs="+", default=[2, 4],
                    help="peer counts k to measure (default: 2 4)")
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 64, 256],
                    help="all-reduce sizes in MiB (default: 1 16 64 256)")
    ap.add_argument("--iters", type=int, default=5, help="timed iterations per size")
    ap.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    ap.add_argument("--pool", type=int, default=4, help="pccl p2p connection pool size")
    ap.add_argument("--tcp-mib", type=int, default=512,
                    help="MiB per stream in the loopback measurement (default 512)")
    ap.add_argument("--tcp-rounds", type=int, default=3, help="loopback repetitions")
    ap.add_argument("--tcp-cold", action="store_true",
                    help="loopback streams send from and receive into buffers of --tcp-mib "
                         "walked through (memory, as an all-reduce's tensors) instead of "
                         f"one {TCP_CHUNK // MIB} MiB buffer reused (cache)")
    ap.add_argument("--out", default="bench/results/allreduce.json")
    ap.add_argument("--skip-loopback", action="store_true")
    ap.add_argument("--secure-bound", action="store_true",
                    help="also measure k streams of pccl's transport, clear and encrypted "
                         "(cargo builds secure_bench)")
    ap.add_argument("--skip-pccl", action="store_true")
    ap.add_argument("--out-of-place", action="store_true",
                    help="also run pccl out of place (all_reduce(x, out=y)), side by side")
    ap.add_argument("--skip-gloo", action="store_true")
    ap.add_argument("--skip-emulator", action="store_true")
    ap.add_argument("--emu-pools", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--emu-size-mib", type=float, default=64.0)
    ap.add_argument("--emu-latency-ms", type=float, default=50.0,
                    help="added one-way latency, each direction")
    ap.add_argument("--emu-bandwidth", type=float, default=20e6,
                    help="cap in bytes/s per connection per direction (default 20e6)")
    ap.add_argument("--emu-iters", type=int, default=3)
    ap.add_argument("--emu-chunk-kib", type=int, default=256,
                    help="emulator read size; larger is cheaper on CPU")
    args = ap.parse_args()
    if min(args.peers) < 2:
        ap.error("--peers must be >= 2")
    if not 1 <= args.pool <= 64 or not all(1 <= p <= 64 for p in args.emu_pools):
        ap.error("pool sizes must be in 1..64")
    if args.iters < 1 or args.emu_iters < 1 or args.warmup < 0:
        ap.error("--iters/--emu-iters must be >= 1 and --warmup >= 0")

    # Whole float32 elements, at least one.
    sizes = [max(4, int(s * MIB) // 4 * 4) for s in args.sizes_mib]
    emu_size = max(4, int(args.emu_size_mib * MIB) // 4 * 4)
    floor_rate = 10 * MB  # assume no collective here runs slower than this
    out: dict[str, Any] = {
        "machine": machine_info(),
        "config": {**vars(args), "sizes_bytes": sizes, "emu_size_bytes": emu_size,
                   "master_heartbeat_timeout_s": 30.0, "gloo_torch_num_threads": 1,
                   "insecure": _insecure(),
                   "units": "GB/s = 1e9 B/s, MB/s = 1e6 B/s, MiB = 2**20 B"},
        "loopback": [], "secure_loopback": [], "pccl": [], "pccl_out_of_place": [], "gloo": [],
        "emulator": {"peers": 2, "size_bytes": emu_size, "latency_s": args.emu_latency_ms / 1e3,
                     "bandwidth_Bps": args.emu_bandwidth,
                     "chunk_size": args.emu_chunk_kib * 1024, "runs": []},
        "errors": [],
    }
    m = out["machine"]
    print(f"pccl {m['pccl']} | torch {m['torch']} | python {m['python']} | "
          f"{m['nproc_usable']}/{m['nproc']} cpus | {m['cpu_model']} | {m['date']}", flush=True)

    if not args.skip_loopback:
        for k in args.peers:
            with phase(out["errors"], f"loopback k={k}"):
                r = bench_loopback(k, args.tcp_mib * MIB, args.tcp_rounds, args.tcp_cold)
                out["loopback"].append(r)
                print(f"loopback k={k}: {r['aggregate_GBps_median']:.2f} GB/s aggregate, "
                      f"{r['busbw_bound_GBps_median']:.2f} GB/s per stream", flush=True)
    if args.secure_bound:
        for k in args.peers:
            with phase(out["errors"], f"secure loopback k={k}"):
                r = bench_secure_loopback(k, args.tcp_mib, args.tcp_rounds)
                out["secure_loopback"].append(r)
                print(f"pccl transport k={k}: bound/k "
                      f"{r['clear']['busbw_bound_GBps_median']:.2f} GB/s clear, "
                      f"{r['encrypted']['busbw_bound_GBps_median']:.2f} encrypted", flush=True)
    if not args.skip_pccl:
        for k in args.peers:
            with phase(out["errors"], f"pccl k={k}"):
                res = run_pccl(k, args.pool, sizes, args.iters, args.warmup, floor_rate)
                for row in pccl_rows(k, args.pool, sizes, res):
                    out["pccl"].append(row)
                    print(f"pccl k={k} {fmt_size(row['size_bytes'])}: busbw "
                          f"{row['busbw_GBps_median']:.2f} GB/s median "
                          f"({'/'.join(row['algorithm'])})", flush=True)
            if args.out_of_place:
                with phase(out["errors"], f"pccl out of place k={k}"):
                    res = run_pccl(k, args.pool, sizes, args.iters, args.warmup, floor_rate,
                                   out_of_place=True)
                    for row in pccl_rows(k, args.pool, sizes, res):
                        out["pccl_out_of_place"].append(row)
                        print(f"pccl out of place k={k} {fmt_size(row['size_bytes'])}: busbw "
                              f"{row['busbw_GBps_median']:.2f} GB/s median", flush=True)
    if not args.skip_gloo:
        for k in args.peers:
            with phase(out["errors"], f"gloo k={k}"):
                for row in run_gloo(k, sizes, args.iters, args.warmup, floor_rate):
                    out["gloo"].append(row)
                    print(f"gloo k={k} {fmt_size(row['size_bytes'])}: busbw "
                          f"{row['busbw_GBps_median']:.2f} GB/s median", flush=True)
    if not args.skip_emulator:
        runs = out["emulator"]["runs"]
        for pool in args.emu_pools:
            with phase(out["errors"], f"emulator pool={pool}"):
                r = run_emulated(pool, emu_size, args.emu_iters, 1, args.emu_latency_ms / 1e3,
                                 args.emu_bandwidth, args.emu_chunk_kib * 1024)
                runs.append(r)
                print(f"emulator pool={pool}: {r['busbw_MBps_median']:.1f} MB/s "
                      f"({r['ratio_to_ideal_median']:.2f} of {pool} x cap)", flush=True)
        # Scaling against the measured single-stream rate, when pool 1 was measured.
        one = next((r for r in runs if r["pool"] == 1), None)
        for r in runs:
            if one is not None:
                r["speedup_vs_pool1"] = r["busbw_MBps_median"] / one["busbw_MBps_median"]
                r["ratio_to_pool_x_measured_pool1"] = r["speedup_vs_pool1"] / r["pool"]

    print_tables(out)
    write_results(out, args.out)
    print(f"\nwrote {args.out}")
    if out["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
