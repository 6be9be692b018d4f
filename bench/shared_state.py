"""Shared-state sync: time for a fresh RECEIVE_ONLY joiner to fetch S bytes of state from
1 and from 3 up-to-date peers, next to raw loopback TCP measured in the same run; and
content-hash throughput next to memcpy.

    python bench/shared_state.py --gib 1

Peers run in one process (the bytes move in Rust on tokio threads, peer to peer), and
again with each holder in its own process (the joiner here). Next to each case, the
same steps done by plain threads and sockets (:func:`plain_sync_gbps`): the limit this
machine sets for that work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from typing import Any

import numpy as np

import pccl
from pccl import _core
from pccl.testing import Cluster, LinkEmulator, PeerProcess, free_port
from pccl.testing.data import deterministic_tensor

MiB = 1 << 20


def hash_landed(view: memoryview, done: int, got: int, part: int) -> int:
    """A receiver's check of what landed: hashes each whole 4 MiB slice of
    ``view[done:got]`` (and the rest once all ``part`` bytes are in), on this thread;
    returns how far it hashed."""
    while got - done >= 4 * MiB or done < got == part:
        end = min(done + 4 * MiB, got)
        _core.content_hash(view[done:end], threads=1)
        done = end
    return done


def loopback_gbps(nbytes: int, fresh: bool = False, whole: bool = False,
                  streams: int = 1, hashed: bool = False) -> float:
    """Plain TCP on 127.0.0.1: ``streams`` connections, each a sender and a receiver
    thread (GIL released) moving ``nbytes / streams`` bytes 4 MiB per call; the rate is
    ``nbytes`` over the wall time of all of them. Default: both ends reuse one 4 MiB
    buffer (cache-hot). ``fresh``: the receivers land the bytes in freshly allocated
    memory (as a joiner must), so every page is touched for the first time while bytes
    arrive. ``whole``: the bytes go from an ``nbytes`` buffer into another, already
    touched one (the memory traffic of a sync into existing tensors, without hashing).
    ``hashed``: also the hashing a verified sync cannot skip, on the same cores: each
    sender hashes its part before sending (its vote), each receiver hashes every 4 MiB
    slice as it lands."""
    part = nbytes // streams
    src = np.ones(nbytes if whole else 4 * MiB, dtype=np.uint8)
    landing = np.full(nbytes, 7, dtype=np.uint8) if whole else None  # touched
    start = threading.Barrier(2 * streams + 1)

    def receive(srv: socket.socket, i: int) -> None:
        conn, _ = srv.accept()
        if fresh:
            dst, step = memoryview(np.empty(part, dtype=np.uint8)), 4 * MiB
        elif landing is not None:
            dst, step = memoryview(landing)[i * part:(i + 1) * part], 4 * MiB
        else:
            dst, step = memoryview(bytearray(4 * MiB)), 0
        start.wait()
        got = done = 0  # bytes received / hashed
        with conn:
            while got < part:
                at = got if step else 0
                got += conn.recv_into(dst[at:at + min(4 * MiB, part - got)])
                if hashed and step:
                    done = hash_landed(dst, done, got, part)

    def send(port: int, i: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as s:
            view = memoryview(src)[i * part:(i + 1) * part] if whole else memoryview(src)
            start.wait()
            if hashed:
                _core.content_hash(view, threads=1)
            sent = 0
            while sent < part:
                n = min(part - sent, 4 * MiB)
                at = sent if whole else 0
                s.sendall(view[at:at + n])
                sent += n

    servers = [socket.create_server(("127.0.0.1", 0)) for _ in range(streams)]
    threads = [threading.Thread(target=receive, args=(srv, i)) for i, srv in enumerate(servers)]
    threads += [threading.Thread(target=send, args=(srv.getsockname()[1], i))
                for i, srv in enumerate(servers)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    for srv in servers:
        srv.close()
    return part * streams / dt / 1e9


def plain_sync_gbps(nbytes: int, holders: int, *, staged: bool, touched: bool,
                    streams: int = 4) -> float:
    """The steps of one joiner case, done by plain threads and sockets with nothing of
    pccl around them (no master, no asyncio, no protocol): the machine's limit for that
    work on these cores. Every holder hashes its whole ``nbytes`` (its vote; a staged
    joiner hashes its own tensors at the same time, to skip equal ones); then
    ``streams`` TCP connections carry ``nbytes / streams`` each, stream i from holder
    ``i % holders``, into the joiner's tensor memory (in place) or a fresh scratch
    buffer (staged), the receiver hashing every 4 MiB slice as it lands; staged ends
    with the copy from scratch into the tensors. Tensors are fresh memory unless
    ``touched``. GB/s of ``nbytes`` over the whole."""
    part = nbytes // streams
    sources = [np.full(nbytes, 1 + h, dtype=np.uint8) for h in range(holders)]
    dst = np.full(nbytes, 7, dtype=np.uint8) if touched else np.empty(nbytes, dtype=np.uint8)
    land = np.empty(nbytes, dtype=np.uint8) if staged else dst
    servers = [socket.create_server(("127.0.0.1", 0)) for _ in range(streams)]
    conns = [socket.create_connection(("127.0.0.1", srv.getsockname()[1])) for srv in servers]
    accepted = [srv.accept()[0] for srv in servers]
    voted = threading.Barrier(holders + int(staged) + 2 * streams)

    def vote(buf: np.ndarray) -> None:
        _core.content_hash(buf)
        voted.wait()

    def send(i: int) -> None:
        voted.wait()
        view = memoryview(sources[i % holders])[i * part:(i + 1) * part]
        for at in range(0, part, 4 * MiB):
            conns[i].sendall(view[at:at + 4 * MiB])

    def receive(i: int) -> None:
        voted.wait()
        view = memoryview(land)[i * part:(i + 1) * part]
        got = done = 0
        while got < part:
            got += accepted[i].recv_into(view[got:min(got + 4 * MiB, part)])
            done = hash_landed(view, done, got, part)

    threads = [threading.Thread(target=vote, args=(b,)) for b in sources]
    if staged:
        threads.append(threading.Thread(target=vote, args=(dst,)))
    threads += [threading.Thread(target=f, args=(i,)) for i in range(streams)
                for f in (send, receive)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if staged:
        _core.copy_into(dst, land)
    dt = time.perf_counter() - t0
    for sock in [*servers, *conns, *accepted]:
        sock.close()
    return part * streams / dt / 1e9


def prewarm(gib: float) -> None:
    """Touches and frees ``gib`` GiB. On this VM the host takes back guest memory a few
    seconds after the guest frees it (measured: the same 3-holder staged sync took
    0.68-0.86 s run back to back, 2.0-2.7 s after a 5 s pause), and touching such memory
    again costs several times a normal page fault; each joiner case is measured right
    after a prewarm so that "fresh" means new to the process, as on a host that keeps
    its memory."""
    warm = [np.ones(1 << 30, dtype=np.uint8) for _ in range(int(gib))]
    del warm


def first_touch_gbps(nbytes: int) -> float:
    """Writing freshly allocated memory once (page faults included)."""
    a = np.empty(nbytes, dtype=np.uint8)
    t = time.perf_counter()
    a.fill(1)
    return nbytes / (time.perf_counter() - t) / 1e9


def hash_vs_memcpy(nbytes: int) -> dict[str, float]:
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)
    out = {}
    for name, fn in [("memcpy", lambda: np.copyto(b, a)),
                     ("hash_all_threads", lambda: _core.content_hash(a)),
                     ("hash_1_thread", lambda: _core.content_hash(a, threads=1))]:
        best = min(_timed(fn) for _ in range(3))
        out[f"{name}_GBps"] = nbytes / best / 1e9
    return out


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


async def timed_join(holders: list, states: list[pccl.SharedState], joiner: Any,
                     mine: pccl.SharedState, in_place: bool = False) -> tuple[float, list]:
    """The holders sync ``states`` while ``joiner`` syncs ``mine`` RECEIVE_ONLY: the
    seconds until everyone returned, and the SyncInfos (the joiner's last)."""
    t0 = time.perf_counter()
    infos = await asyncio.gather(
        *(c.sync_shared_state(s) for c, s in zip(holders, states)),
        joiner.sync_shared_state(mine, strategy=pccl.SharedStateSyncStrategy.RECEIVE_ONLY,
                                 in_place=in_place))
    return time.perf_counter() - t0, infos


async def joiner_sync(total: int, sources: int, tensors: int = 4,
                      touched: bool = False, in_place: bool = False) -> dict[str, float]:
    per = total // tensors // 4
    async with Cluster(sources, pool_size=1, master_kwargs={"heartbeat_timeout": 60.0}) as cl:
        states = []
        for _ in range(sources):
            ts = [np.full(per, 1.5, dtype=np.float32) for _ in range(tensors)]
            states.append(pccl.SharedState(
                [pccl.TensorInfo.from_numpy(t, f"t{i}") for i, t in enumerate(ts)]))
        await asyncio.gather(*(c.sync_shared_state(s) for c, s in zip(cl.comms, states)))
        joiner = cl.new_comm()
        await cl.admit([joiner])
        # A fresh joiner's tensors are new memory; "touched" ones were written before
        # (a peer that fell behind).
        mine = [np.zeros(per, dtype=np.float32) for _ in range(tensors)]
        if touched:
            for t in mine:
                t.fill(0.25)
        fresh = pccl.SharedState([pccl.TensorInfo.from_numpy(t, f"t{i}")
                                  for i, t in enumerate(mine)])
        for s in states:
            s.revision += 1
        dt, infos = await timed_join(cl.comms[:sources], states, joiner, fresh, in_place)
        assert all((t == 1.5).all() for t in mine)
        return {"sources": sources, "bytes": infos[-1].rx_bytes, "seconds": dt,
                "GBps": infos[-1].rx_bytes / dt / 1e9,
                "served_by": [i.tx_bytes for i in infos[:-1]]}


async def joiner_sync_processes(total: int, sources: int, tensors: int = 4,
                                touched: bool = False, in_place: bool = False) -> dict:
    """Like :func:`joiner_sync`, but each holder is its own process (its own interpreter,
    runtime and hashing threads); the joiner runs here."""
    per = total // tensors // 4
    names = [f"t{i}" for i in range(tensors)]
    async with Cluster(0, pool_size=1, master_kwargs={"heartbeat_timeout": 60.0}) as cl:
        joiner = cl.new_comm()
        await cl.admit([joiner])
        procs = [PeerProcess(cl.master.address, pool_size=1) for _ in range(sources)]
        try:
            for p in procs:
                await p.start()
            await cl.master.wait_for(lambda s: len(s.pending()) == sources, timeout=60)
            await joiner.update_topology()
            for p in procs:
                await p.wait_accepted()
                for n in names:
                    await p.call("make_tensor", name=n, dtype="int32", count=per, seed=7)

            async def sync_all(mine: list[np.ndarray], revision: int) -> tuple[float, dict]:
                state = pccl.SharedState([pccl.TensorInfo.from_numpy(t, n)
                                          for n, t in zip(names, mine)])
                calls = [asyncio.create_task(p.call("sync", names=names, revision=revision,
                                                    digests=False)) for p in procs]
                t0 = time.perf_counter()
                info = await joiner.sync_shared_state(
                    state, strategy=pccl.SharedStateSyncStrategy.RECEIVE_ONLY,
                    in_place=in_place)
                dt = time.perf_counter() - t0
                served = [(await c)["tx_bytes"] for c in calls]
                return dt, {"rx": info.rx_bytes, "served_by": served}

            await sync_all([np.zeros(per, dtype=np.int32) for _ in names], 0)  # warm-up
            mine = [np.zeros(per, dtype=np.int32) for _ in names]
            if touched:
                for t in mine:
                    t.fill(3)
            dt, info = await sync_all(mine, 1)
            # The joiner holds what the holders made (same seed, same generator).
            assert np.array_equal(mine[0], deterministic_tensor("int32", per, 7))
        finally:
            for p in procs:
                await p.close()
    return {"sources": sources, "bytes": info["rx"], "seconds": dt,
            "GBps": info["rx"] / dt / 1e9, "served_by": info["served_by"],
            "joiner_tensors": "touched" if touched else "fresh", "in_place": in_place}


async def slow_sources(nbytes: int, sources: int, bandwidth: float,
                       pool_size: int = 1) -> dict[str, float]:
    """A RECEIVE_ONLY joiner fetches one tensor of ``nbytes`` from ``sources`` holders,
    each behind its own LinkEmulator that caps every connection at ``bandwidth`` bytes/s
    (a per-flow limit like a long internet path's); ``pool_size`` is the peers'
    ``p2p_connection_pool_size`` (the least number of streams a large tensor is
    fetched over)."""
    emus, comms = [], []
    async with Cluster(0, pool_size=pool_size,
                       master_kwargs={"heartbeat_timeout": 60.0}) as cl:
        try:
            for _ in range(sources):
                port = free_port()
                emu = LinkEmulator(f"127.0.0.1:{port}", bandwidth=bandwidth,
                                   chunk_size=256 * 1024)
                await emu.start()
                emus.append(emu)
                comms.append(cl.new_comm(p2p_listen_port=port,
                                         p2p_advertise_address=emu.address))
            await cl.admit(comms)
            data = np.arange(nbytes // 4, dtype=np.int32)
            states = [pccl.SharedState([pccl.TensorInfo.from_numpy(data.copy(), "w")])
                      for _ in range(sources)]
            await asyncio.gather(*(c.sync_shared_state(s) for c, s in zip(comms, states)))
            joiner = cl.new_comm()
            await cl.admit([joiner])
            mine = np.zeros_like(data)
            for s in states:
                s.revision += 1
            dt, infos = await timed_join(comms, states, joiner, pccl.SharedState(
                [pccl.TensorInfo.from_numpy(mine, "w")]))
            assert np.array_equal(mine, data)
        finally:
            for emu in emus:
                await emu.stop()
    return {"sources": sources, "pool_size": pool_size, "bytes": nbytes,
            "link_MBps": bandwidth / 1e6, "seconds": dt, "MBps": nbytes / dt / 1e6,
            "served_by": [i.tx_bytes for i in infos[:-1]]}


async def many_small(count: int, each: int, latency: float) -> dict:
    """A joiner fetches ``count`` tensors of ``each`` bytes from one holder behind a
    LinkEmulator with ``latency`` seconds each way: a whole sync, and the fetches alone
    on 4 streams: one request per round trip (4 in flight) with and without reusing
    transfer streams, and pipelined (4 batches, every request of a batch sent up
    front, as a sync now fetches small tensors)."""
    port = free_port()
    out: dict = {"tensors": count, "bytes_each": each, "latency_ms": latency * 1e3}
    async with LinkEmulator(f"127.0.0.1:{port}", latency=latency) as emu:
        async with Cluster(0, pool_size=1, master_kwargs={"heartbeat_timeout": 60.0}) as cl:
            src = cl.new_comm(p2p_listen_port=port, p2p_advertise_address=emu.address)
            await cl.admit([src])
            joiner = cl.new_comm()
            await cl.admit([joiner])
            theirs = {f"t{i}": np.full(each // 4, i, dtype=np.float32) for i in range(count)}
            mine = {k: np.zeros_like(t) for k, t in theirs.items()}
            accepted = emu.connections_accepted
            out["sync_seconds"], _ = await timed_join(
                [src], [pccl.SharedState([pccl.TensorInfo.from_numpy(t, k)
                                          for k, t in theirs.items()])],
                joiner, pccl.SharedState([pccl.TensorInfo.from_numpy(t, k)
                                          for k, t in mine.items()]))
            out["sync_connections"] = emu.connections_accepted - accepted
            assert all(np.array_equal(mine[k], theirs[k]) for k in theirs)
            # The fetches alone, straight on the node, with and without reuse.
            for k, t in theirs.items():
                src._node.serve(k, t.reshape(-1).view(np.uint8))
            addr = cl.master.state.peers[src.peer_id].p2p_addr
            limit = asyncio.Semaphore(4)
            for reuse in (False, True):
                async def one(k: str, t: np.ndarray, reuse: bool = reuse) -> None:
                    async with limit:
                        await joiner._node.fetch_into(addr, src.peer_id, k,
                                                      np.empty(t.nbytes, np.uint8),
                                                      reuse=reuse)
                t0 = time.perf_counter()
                await asyncio.gather(*(one(k, t) for k, t in theirs.items()))
                out[f"fetch_seconds_reuse_{reuse}"] = time.perf_counter() - t0
                joiner._node.drop_idle_transfers()
            keys = list(theirs)
            t0 = time.perf_counter()
            await asyncio.gather(*(joiner._node.fetch_many_into(
                addr, src.peer_id, keys[i::4], [np.empty(theirs[k].nbytes, np.uint8)
                                                for k in keys[i::4]]) for i in range(4)))
            out["fetch_seconds_pipelined"] = time.perf_counter() - t0
            joiner._node.drop_idle_transfers()
            src._node.unserve_all()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--slow-mib", type=int, default=128,
                    help="tensor size of the slow-link case (one tensor, 1 and 3 holders)")
    ap.add_argument("--slow-bandwidth", type=float, default=40e6,
                    help="bytes/s per connection behind each holder's link emulator")
    ap.add_argument("--reps", type=int, default=3, help="runs of each joiner case (median)")
    ap.add_argument("--no-processes", dest="processes", action="store_false",
                    help="skip the cases with each holder in its own process")
    ap.add_argument("--prewarm-gib", type=float, default=6.0,
                    help="touch and free this much memory before each case (0: off), so "
                         "that 'fresh' means new to the process, not pages the VM host "
                         "took back")
    args = ap.parse_args()
    total = int(args.gib * (1 << 30))
    references = {
        "loopback_1_stream_GBps": lambda: loopback_gbps(total // 2),
        "loopback_1_stream_fresh_memory_GBps": lambda: loopback_gbps(total, fresh=True),
        "loopback_1_stream_whole_buffers_GBps": lambda: loopback_gbps(total, whole=True),
        # The joiner fetches 4-6 ranges/tensors at once, one stream each.
        "loopback_4_streams_whole_buffers_GBps":
            lambda: loopback_gbps(total, whole=True, streams=4),
        "loopback_4_streams_whole_buffers_hashed_GBps":
            lambda: loopback_gbps(total, whole=True, streams=4, hashed=True),
        "first_touch_GBps": lambda: first_touch_gbps(total),
    }
    asyncio.run(joiner_sync(64 * MiB, 1))  # warm-up: runtime, pools, allocator
    cases = [(touched, in_place, k)
             for touched, in_place in ((False, False), (True, False), (False, True),
                                       (True, True))
             for k in (1, 3)]
    # Repetitions go round the references and all cases (not case after case), so the
    # machine's slow and fast phases spread over all of them; each reports its median.
    proc_cases = [(touched, in_place, k)
                  for touched, in_place in ((False, False), (False, True), (True, True))
                  for k in (1, 3)] if args.processes else []
    ref_runs: dict[str, list[float]] = {name: [] for name in references}
    runs: dict[tuple[bool, bool, int], list[dict]] = {c: [] for c in cases}
    # The same steps in plain threads, next to each case: what this machine allows.
    plain_runs: dict[tuple[bool, bool, int], list[float]] = {c: [] for c in cases}
    proc_runs: dict[tuple[bool, bool, int], list[dict]] = {c: [] for c in proc_cases}
    for _ in range(args.reps):
        for name, measure in references.items():
            prewarm(args.prewarm_gib)
            ref_runs[name].append(measure())
        for touched, in_place, k in cases:
            prewarm(args.prewarm_gib)
            plain_runs[(touched, in_place, k)].append(
                plain_sync_gbps(total, k, staged=not in_place, touched=touched))
            prewarm(args.prewarm_gib)
            runs[(touched, in_place, k)].append(
                asyncio.run(joiner_sync(total, k, touched=touched, in_place=in_place)))
        for touched, in_place, k in proc_cases:
            prewarm(args.prewarm_gib)
            proc_runs[(touched, in_place, k)].append(asyncio.run(joiner_sync_processes(
                total, k, touched=touched, in_place=in_place)))
    result: dict = {"prewarm_GiB": args.prewarm_gib, "reps": args.reps}
    for name, xs in ref_runs.items():
        result[name] = sorted(xs)[len(xs) // 2]
        result[name.replace("_GBps", "_samples_GBps")] = xs
    result["hash"] = hash_vs_memcpy(total // 2)
    result["joiner"] = []
    for case, rs in runs.items():
        touched, in_place, _ = case
        rs.sort(key=lambda r: r["seconds"])
        plain = sorted(plain_runs[case])
        row = {**rs[len(rs) // 2], "samples_s": [r["seconds"] for r in rs],
               "joiner_tensors": "touched" if touched else "fresh", "in_place": in_place,
               "plain_same_work_GBps": plain[len(plain) // 2],
               "plain_same_work_samples_GBps": plain_runs[case]}
        row["vs_plain_same_work"] = row["GBps"] / row["plain_same_work_GBps"]
        row["plain_same_work_vs_loopback"] = (row["plain_same_work_GBps"]
                                              / result["loopback_1_stream_GBps"])
        result["joiner"].append(row)
    result["joiner_holders_in_processes"] = []
    for rs in proc_runs.values():
        rs.sort(key=lambda r: r["seconds"])
        result["joiner_holders_in_processes"].append(
            {**rs[len(rs) // 2], "samples_s": [r["seconds"] for r in rs]})
    result["many_small"] = [asyncio.run(many_small(256, 256 * 1024, lat)) for lat in (0.0, 0.02)]
    result["slow_links"] = [asyncio.run(slow_sources(args.slow_mib * MiB, k,
                                                     args.slow_bandwidth, pool))
                            for pool in (1, 4) for k in (1, 3)]
    lo, lo_fresh = result["loopback_1_stream_GBps"], result["loopback_1_stream_fresh_memory_GBps"]
    for r in result["joiner"] + result["joiner_holders_in_processes"]:
        r["vs_loopback"] = r["GBps"] / lo
        r["vs_loopback_fresh_memory"] = r["GBps"] / lo_fresh
        r["vs_loopback_whole_buffers"] = r["GBps"] / result["loopback_1_stream_whole_buffers_GBps"]
        r["vs_loopback_4_streams_whole_buffers"] = (
            r["GBps"] / result["loopback_4_streams_whole_buffers_GBps"])
        r["vs_loopback_4_streams_whole_buffers_hashed"] = (
            r["GBps"] / result["loopback_4_streams_whole_buffers_hashed_GBps"])
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
