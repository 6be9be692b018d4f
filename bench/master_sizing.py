"""What a master costs per peer: CPU, memory, descriptors and network, measured.

A real master process (``python -m pccl master --status off`` on 127.0.0.1) serves N
peers (``--procs`` peer processes holding N/procs communicators each, one peer group),
and for each N the peers go through these phases, each ``--seconds`` long:

* ``idle`` (twice as long): nothing but the master's heartbeats (a ping per peer per
  second and its answer);
* ``via_master``: 1 KiB all-reduces at each offered rate of ``--rates`` (collectives per
  second, the whole group together), then 64 KiB ones at ``--big-rate``. At or below
  ``via_master_max_bytes`` (64 KiB by default) every peer sends its tensor to the master,
  which reduces them and sends the result back: the tensors cross the master's link;
* ``ring``: 1 MiB all-reduces at ``--ring-rate`` per second, on the p2p ring (the master
  only coordinates: its messages, not the tensors). The master runs with
  ``--mesh-max-bytes 0`` so that the group's cost model does not pick the mesh instead.

Per phase, sampled from outside the master: its CPU (``/proc/PID/stat``, percent of one
core), RSS (``/proc/PID/status``), open descriptors (``/proc/PID/fd``) and the payload
bytes of its TCP sockets on the control port (``ss -tin``: ``bytes_received`` in,
``bytes_acked`` out; TCP/IP headers not counted), as Mbit/s; and the collectives per
second the group achieved. The summary derives per-peer rules of thumb from them.

    python bench/master_sizing.py --peers 8 32 64 --out bench/results/master_sizing.json

Each phase's offered rate is paced from one start time shared by every peer process;
a phase ends for the whole group at once (the lead peer sets a flag in the tensor of
the last collective due before the phase's end, and every peer sees it in the sum), so
a rate the machine cannot reach shows as a lower achieved rate, not as a hang.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

SELF = Path(__file__).resolve()
HERE = SELF.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from common import machine_info, write_results  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- the master, seen from outside -----------------------------------------------------


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        # The command name (field 2) may hold spaces: split after its closing paren.
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime (fields 14, 15)


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, every core (``/proc/stat``)."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    return sum(vals) - idle, sum(vals)


_FIELD = re.compile(r"\b(bytes_acked|bytes_received|data_segs_out|data_segs_in):(\d+)")


def socket_bytes(port: int) -> dict[tuple[str, str], dict[str, int]]:
    """Per established TCP socket whose local port is ``port`` (the master's side of
    every control connection): payload bytes acked (out) and received (in), and data
    segments, as the kernel counts them."""
    out = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    socks: dict[tuple[str, str], dict[str, int]] = {}
    key: tuple[str, str] | None = None
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):
            parts = line.split()
            key = (parts[-2], parts[-1]) if len(parts) >= 2 else None
        elif key is not None:
            socks[key] = {k: int(v) for k, v in _FIELD.findall(line)}
            key = None
    return socks


class Sample:
    """The master's counters at one moment."""

    def __init__(self, pid: int, port: int) -> None:
        self.t = time.monotonic()
        self.cpu = _cpu_ticks(pid)
        self.rss = _rss_bytes(pid)
        self.fds = _fds(pid)
        self.machine = _machine_ticks()
        self.socks = socket_bytes(port)


def between(a: Sample, b: Sample) -> dict[str, Any]:
    """What the master did from ``a`` to ``b``. A socket opened in between counts from
    zero; one closed in between is lost (``sockets_gone`` says how many)."""
    dt = b.t - a.t
    tot = {"bytes_received": 0, "bytes_acked": 0, "data_segs_in": 0, "data_segs_out": 0}
    for key, now in b.socks.items():
        before = a.socks.get(key, {})
        for f in tot:
            tot[f] += now.get(f, 0) - before.get(f, 0)
    busy = b.machine[0] - a.machine[0]
    total = b.machine[1] - a.machine[1]
    return {
        "window_s": round(dt, 3),
        "master_cpu_pct": round(100.0 * (b.cpu - a.cpu) / CLK_TCK / dt, 2),
        "master_rss_mb": round(b.rss / 2**20, 1),
        "master_fds": b.fds,
        "in_bytes": tot["bytes_received"],
        "out_bytes": tot["bytes_acked"],
        "in_mbit_s": round(tot["bytes_received"] * 8 / 1e6 / dt, 4),
        "out_mbit_s": round(tot["bytes_acked"] * 8 / 1e6 / dt, 4),
        "in_segs": tot["data_segs_in"],
        "out_segs": tot["data_segs_out"],
        "sockets": len(b.socks),
        "sockets_gone": len(set(a.socks) - set(b.socks)),
        "machine_busy_pct": round(100.0 * busy / total, 1) if total else None,
    }


# --- peer processes ---------------------------------------------------------------------


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _pace(comms: list[Any], cmd: dict[str, Any], lead: bool) -> dict[str, Any]:
    """One phase in a peer process: every communicator all-reduces once per tick of
    the offered rate until the lead's flag comes back in the sum."""
    import numpy as np

    rate, t0 = float(cmd["rate"]), float(cmd["t0"])
    t_end = t0 + float(cmd["seconds"])
    xs = [np.zeros(int(cmd["nbytes"]) // 4, dtype=np.float32) for _ in comms]
    max_k = int(rate * float(cmd["seconds"]) * 4) + 10  # the flag ends it long before
    done = world = 0
    algorithm, last = "", time.time()
    while done < max_k:
        due = t0 + done / rate
        now = time.time()
        if due > now:
            await asyncio.sleep(due - now)
        for x in xs:
            x.fill(0.0)
        if lead and max(due + 1 / rate, time.time()) >= t_end:
            xs[0][0] = 1.0  # the last collective due before the end
        infos = await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs,
                                                                        strict=True)))
        last = time.time()
        algorithm, world = str(infos[0].algorithm), infos[0].world_size
        done += 1
        if xs[0][0] > 0:
            break
    return {"collectives": done, "last": last, "t0": t0, "t_end": t_end,
            "algorithm": algorithm, "world_size": world}


async def peer_proc(args: argparse.Namespace) -> int:
    """A peer process: ``--count`` communicators; the lead's first connects alone and
    admits every other once they are all pending (``--world`` - 1 of them). Then runs
    the parent's phase commands (JSON lines on stdin), one reply line each."""
    import pccl

    _raise_nofile()
    comms = [pccl.Communicator(master=args.master, p2p_connection_pool_size=1)
             for _ in range(args.count)]
    joins: list[asyncio.Task[None]] = []
    try:
        if args.lead:
            await comms[0].connect()
            _emit({"event": "lead_accepted"})
            joins = [asyncio.create_task(c.connect()) for c in comms[1:]]
            deadline = time.monotonic() + 120
            while await comms[0].pending_peer_count() < args.world - 1:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"fewer than {args.world - 1} peers pending after 120s")
                await asyncio.sleep(0.1)
            await comms[0].update_topology()
        else:
            joins = [asyncio.create_task(c.connect()) for c in comms]
        async with asyncio.timeout(120):
            await asyncio.gather(*joins)
        _emit({"event": "joined",
               "world": comms[0].get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE)})
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd["cmd"] == "close":
                break
            _emit({"event": "done", **await _pace(comms, cmd, args.lead)})
    except Exception as e:  # told to the parent, which fails the run with it
        _emit({"event": "failed", "error": f"{type(e).__name__}: {e}"})
        return 1
    finally:
        for t in joins:
            t.cancel()
        await asyncio.gather(*joins, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)
    return 0


def _open_log(folder: str, name: str) -> TextIO:
    return open(os.path.join(folder, name), "w")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


class PeerProcs:
    """The peer processes of one run, always reaped."""

    def __init__(self, logdir: str) -> None:
        self.logdir = logdir
        self.procs: list[asyncio.subprocess.Process] = []
        self.logs: list[TextIO] = []

    async def start(self, master: str, count: int, world: int, lead: bool
                    ) -> asyncio.subprocess.Process:
        log = _open_log(self.logdir, f"peers{len(self.procs)}.log")
        self.logs.append(log)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(SELF), "--peer-proc", "--master", master,
            "--count", str(count), "--world", str(world), *(["--lead"] if lead else []),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.procs.append(proc)
        return proc

    async def expect(self, proc: asyncio.subprocess.Process, event: str,
                     timeout: float) -> dict[str, Any]:
        assert proc.stdout is not None
        async with asyncio.timeout(timeout):
            line = await proc.stdout.readline()
        msg: dict[str, Any] = json.loads(line) if line else {"event": "exited"}
        if msg.get("event") != event:
            raise RuntimeError(f"peer process {self.procs.index(proc)}: expected {event}, "
                               f"got {msg} (log: {self.tail(self.procs.index(proc))})")
        return msg

    def tail(self, i: int) -> str:
        with contextlib.suppress(OSError):
            return _read(self.logs[i].name)[-2000:]
        return ""

    async def send(self, cmd: dict[str, Any]) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write((json.dumps(cmd) + "\n").encode())
            await p.stdin.drain()

    def cpu_ticks(self) -> int:
        total = 0
        for p in self.procs:
            with contextlib.suppress(OSError, ValueError):
                total += _cpu_ticks(p.pid)
        return total

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.send({"cmd": "close"})
        for p in self.procs:
            try:
                async with asyncio.timeout(15):
                    await p.wait()
            except TimeoutError:
                p.kill()
                await p.wait()
        for log in self.logs:
            log.close()


# --- one run --------------------------------------------------------------------------


async def _master(port: int, log: TextIO) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pccl", "master", "--listen", f"127.0.0.1:{port}",
        "--status", "off", "--mesh-max-bytes", "0", stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while "listening on" not in _read(log.name):
        if proc.returncode is not None or time.monotonic() > deadline:
            raise RuntimeError(f"master did not start: {_read(log.name)[-2000:]}")
        await asyncio.sleep(0.1)
    return proc


async def run_peers(n: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every phase for ``n`` peers against a fresh master."""
    from pccl.testing import free_port
    from pccl.testing.processes import stop_process

    port = free_port()
    procs_n = max(1, min(args.procs or -(-n // 32), n))
    counts = [n // procs_n + (1 if i < n % procs_n else 0) for i in range(procs_n)]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pccl-sizing-") as logdir:
        mlog = _open_log(logdir, "master.log")
        master = await _master(port, mlog)
        peers = PeerProcs(logdir)
        try:
            await asyncio.sleep(1.0)  # let the fresh master settle before its baseline
            empty = Sample(master.pid, port)
            addr = f"127.0.0.1:{port}"
            t_join = time.monotonic()
            lead = await peers.start(addr, counts[0], n, lead=True)
            await peers.expect(lead, "lead_accepted", 60)
            for c in counts[1:]:
                await peers.start(addr, c, n, lead=False)
            for p in peers.procs:
                joined = await peers.expect(p, "joined", 150)
                if joined["world"] != n:
                    raise RuntimeError(f"world size {joined['world']}, expected {n}")
            join_s = time.monotonic() - t_join
            await asyncio.sleep(2.0)  # past the admission's dial-backs and first pings
            joined_at = Sample(master.pid, port)

            def row(phase: str, nbytes: int, offered: float | None, a: Sample, b: Sample,
                    peer_ticks: int, done: dict[str, Any] | None) -> dict[str, Any]:
                w = between(a, b)
                coll = done["collectives"] if done else 0
                r = {"peers": n, "phase": phase, "tensor_bytes": nbytes,
                     "offered_per_s": offered,
                     # On time, the phase's collectives over its length; behind, over
                     # the time until the last one ended.
                     "achieved_per_s": (round(coll / (max(done["last"], done["t_end"])
                                                      - done["t0"]), 2) if done else 0.0),
                     "collectives": coll, "algorithm": done["algorithm"] if done else "",
                     **w,
                     "peer_procs_cpu_pct": round(100.0 * peer_ticks / CLK_TCK / w["window_s"],
                                                 1)}
                print(f"  n={n:3d} {phase:10s} {offered or 0:5.1f}/s -> "
                      f"{r['achieved_per_s']:6.2f}/s  cpu {r['master_cpu_pct']:5.1f}%  "
                      f"in {r['in_mbit_s']:.3f} out {r['out_mbit_s']:.3f} Mbit/s  "
                      f"rss {r['master_rss_mb']} MB  fds {r['master_fds']}  "
                      f"(machine {r['machine_busy_pct']}% busy)", flush=True)
                return r

            # Heartbeats alone.
            a, pt = Sample(master.pid, port), peers.cpu_ticks()
            await asyncio.sleep(args.seconds * 2)  # its CPU is a few ticks: a longer look
            b = Sample(master.pid, port)
            rows.append(row("idle", 0, None, a, b, peers.cpu_ticks() - pt, None))

            phases = [("via_master", 1 << 10, r) for r in args.rates]
            if args.big_rate > 0:
                phases.append(("via_master", 64 << 10, args.big_rate))
            if args.ring_rate > 0:
                phases.append(("ring", 1 << 20, args.ring_rate))
            for phase, nbytes, rate in phases:
                # Sampled before the first collective starts (ss takes a while): the
                # window then holds all of the phase's traffic, and a moment of idle.
                t0 = time.time() + 0.5
                await peers.send({"cmd": "run", "nbytes": nbytes, "rate": rate,
                                  "seconds": args.seconds, "t0": t0})
                await asyncio.sleep(max(0.0, t0 - 0.25 - time.time()))
                a, pt = Sample(master.pid, port), peers.cpu_ticks()
                dones = [await peers.expect(p, "done", args.seconds * 4 + 60)
                         for p in peers.procs]
                b = Sample(master.pid, port)
                if len({d["collectives"] for d in dones}) != 1 or dones[0]["world_size"] != n:
                    raise RuntimeError(f"peer processes disagree: {dones}")
                done = {**dones[0], "last": max(d["last"] for d in dones)}
                rows.append(row(phase, nbytes, rate, a, b, peers.cpu_ticks() - pt, done))
        finally:
            await peers.close()
            await stop_process(master)
            mlog.close()
    return {"peers": n, "peer_procs": procs_n, "join_s": round(join_s, 2),
            "master_rss_empty_mb": round(empty.rss / 2**20, 1),
            "master_rss_joined_mb": round(joined_at.rss / 2**20, 1),
            "master_fds_empty": empty.fds, "master_fds_joined": joined_at.fds,
            "rss_per_peer_kb": round((joined_at.rss - empty.rss) / 1024 / n, 1),
            "rows": rows}


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-peer rules of thumb from every run: bytes per peer and second of heartbeats;
    per kind of collective (``via_master_1024``: 1 KiB through the master), bytes and
    master CPU per peer and collective beyond the heartbeats' (medians over the rows);
    RSS and fds per peer."""
    hb_in, hb_out, hb_cpu = [], [], []
    per_kind: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        n = run["peers"]
        idle = next(r for r in run["rows"] if r["phase"] == "idle")
        hb_in.append(idle["in_bytes"] / idle["window_s"] / n)
        hb_out.append(idle["out_bytes"] / idle["window_s"] / n)
        hb_cpu.append(idle["master_cpu_pct"] / 100 / n)
        for r in run["rows"]:
            if r["phase"] == "idle" or r["collectives"] == 0:
                continue
            # Take the heartbeats out: what is left is the collectives' own cost.
            w = r["window_s"] / idle["window_s"]
            per = r["collectives"] * n
            k = per_kind.setdefault(f"{r['phase']}_{r['tensor_bytes']}",
                                    {"in": [], "out": [], "cpu": []})
            k["in"].append((r["in_bytes"] - idle["in_bytes"] * w) / per)
            k["out"].append((r["out_bytes"] - idle["out_bytes"] * w) / per)
            k["cpu"].append((r["master_cpu_pct"] - idle["master_cpu_pct"]) / 100
                            * r["window_s"] / per)
    out: dict[str, Any] = {
        "heartbeat_in_bytes_per_peer_s": round(_median(hb_in), 1),
        "heartbeat_out_bytes_per_peer_s": round(_median(hb_out), 1),
        "heartbeat_cpu_us_per_peer_s": round(1e6 * _median(hb_cpu), 1),
    }
    for kind, k in sorted(per_kind.items()):
        out[f"{kind}_in_bytes_per_peer_collective"] = round(_median(k["in"]), 1)
        out[f"{kind}_out_bytes_per_peer_collective"] = round(_median(k["out"]), 1)
        out[f"{kind}_cpu_us_per_peer_collective"] = round(1e6 * _median(k["cpu"]), 1)
    out["rss_per_peer_kb"] = round(_median([r["rss_per_peer_kb"] for r in runs]), 1)
    if len(runs) >= 2:  # the slope between the smallest and largest run: no fixed costs
        lo, hi = min(runs, key=lambda r: r["peers"]), max(runs, key=lambda r: r["peers"])
        dn = hi["peers"] - lo["peers"]
        out["rss_per_peer_kb_slope"] = round(
            (hi["master_rss_joined_mb"] - lo["master_rss_joined_mb"]) * 1024 / dn, 1)
        out["fds_per_peer_slope"] = round(
            (hi["master_fds_joined"] - lo["master_fds_joined"]) / dn, 2)
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    for n in args.peers:
        print(f"-- {n} peers", flush=True)
        runs.append(await run_peers(n, args))
    return {"machine": machine_info(),
            "settings": {"seconds": args.seconds, "rates": args.rates,
                         "big_rate": args.big_rate, "ring_rate": args.ring_rate,
                         "procs": args.procs,
                         "master_flags": "--status off --mesh-max-bytes 0"},
            "summary": summarize(runs), "runs": runs}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--seconds", type=float, default=8.0, help="length of each phase")
    p.add_argument("--rates", type=float, nargs="+", default=[5.0, 20.0, 50.0],
                   help="offered 1 KiB via-master all-reduces per second")
    p.add_argument("--big-rate", type=float, default=5.0,
                   help="offered 64 KiB via-master all-reduces per second (the largest "
                        "that goes through the master by default; 0: none)")
    p.add_argument("--ring-rate", type=float, default=1.0,
                   help="offered 1 MiB ring all-reduces per second (0: none)")
    p.add_argument("--procs", type=int, default=0,
                   help="peer processes (0: one per 32 peers)")
    p.add_argument("--out", type=Path)
    p.add_argument("--peer-proc", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--lead", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    if args.peer_proc:
        import logging

        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        sys.exit(asyncio.run(peer_proc(args)))
    res = asyncio.run(main(args))
    res = {"command": " ".join(["python", *sys.argv]), **res}
    print(json.dumps(res["summary"], indent=1))
    if args.out:
        write_results(res, str(args.out))
