"""Exit soak: many short pccl peer processes, each ending at an awkward moment.

Issue 36: a peer process must never die at interpreter exit (SIGSEGV, SIGABRT, a Rust
panic, "Fatal Python error"), whatever pccl was doing when the program ended. Each
round starts a master in this process and ``--peers`` peer processes; the peers admit
each other, run a few ring all-reduces, and then end in one of these ways (drawn per
peer):

* ``close``: ``await comm.close()``, then the program returns at once;
* ``close_inflight``: an all-reduce started, then ``close()`` while it runs;
* ``cancel``: an all-reduce started and cancelled a moment later, no ``close()``;
* ``inflight``: an all-reduce started and left running (``asyncio.run`` cancels it);

and, independently, with Rust logging at debug level (records from runtime threads
into Python's ``logging``) and/or with a daemon thread that keeps calling pccl
functions that release the GIL (``content_hash``, ``copy_into``) while the program ends.
``--load`` processes spin on the CPU meanwhile.

    python bench/exit_soak.py --exits 200 --peers 3 --load 1

Prints one line per round and a summary (JSON with ``--json``); exits 1 if any peer
crashed or hung. A crash is a negative exit status (killed by a signal), 134 or 139 (the
shell's spelling of the same), or stderr containing "Fatal Python error" or "panicked".
A hang is a peer still running after ``--timeout`` seconds (killed). Any other non-zero
status, a missing "ENDED" line, or a Traceback on stderr is an error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

MODES = ("close", "close_inflight", "cancel", "inflight")

PEER = r"""
import asyncio, logging, random, sys, threading
import numpy as np
import pccl
from pccl import _core

addr, world, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
debug, daemon, seed = sys.argv[4] == "1", sys.argv[5] == "1", int(sys.argv[6])
rng = random.Random(seed)
logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
if debug:
    logging.getLogger("pccl").setLevel(logging.DEBUG)
COUNT = 1 << 16  # float32: 256 KiB, above via_master_max_bytes, so it runs on the ring
ROUNDS = 3


def gil_free_calls(started):
    src = np.arange(1 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    started.set()
    while True:  # a daemon thread: ends with the process
        _core.content_hash(src, threads=1)
        _core.copy_into(dst, src)


async def main():
    comm = pccl.Communicator(master=addr, p2p_connection_pool_size=1, timeout=10.0,
                             p2p_timeout=10.0, peer_timeout=5.0, collective_timeout=20.0)
    await comm.connect()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    x = np.full(COUNT, 1.0, dtype=np.float32)
    try:
        # The accepted peers admit the others (update_topology is collective: a peer
        # that sees a joiner first waits in it for the rest to see it too).
        while comm.world_size < world and loop.time() < deadline:
            if await comm.pending_peer_count() > 0:
                await comm.update_topology(timeout=15)
            else:
                await asyncio.sleep(0.02)  # polling the master, bounded by the deadline
        for tag in range(ROUNDS):
            info = await asyncio.wait_for(comm.all_reduce(x, tag=tag, timeout=15), 30)
            print("REDUCED", info.world_size, flush=True)
    except (pccl.PCCLError, TimeoutError) as e:
        print("collective failed:", type(e).__name__, e)  # a peer left early: fine here
    if daemon:
        started = threading.Event()
        threading.Thread(target=gil_free_calls, args=(started,), daemon=True).start()
        started.wait()
    if mode == "close":
        await comm.close()
    elif mode == "close_inflight":
        comm.all_reduce_async(x, tag=99)
        await asyncio.sleep(rng.uniform(0.0, 0.005))
        await comm.close()
    elif mode == "cancel":
        t = comm.all_reduce_async(x, tag=99)
        await asyncio.sleep(rng.uniform(0.0, 0.005))
        t.cancel()
    else:  # inflight: asyncio.run cancels it as the program ends
        comm.all_reduce_async(x, tag=99)

asyncio.run(main())
print("ENDED", flush=True)
"""

SPIN = "import os\nos.nice(5)\nwhile True:\n    pass\n"


@dataclass
class Exit:
    """One peer process's end."""

    round: int
    mode: str
    debug: bool
    daemon: bool
    returncode: int | None  # None: still running at the timeout (killed)
    stderr_tail: str = ""
    ended: bool = False
    reduces: int = 0  # all-reduces it completed before its end

    @property
    def crashed(self) -> bool:
        rc = self.returncode
        return (rc is not None and (rc < 0 or rc in (134, 139))) or any(
            s in self.stderr_tail for s in ("Fatal Python error", "panicked"))

    @property
    def hung(self) -> bool:
        return self.returncode is None

    @property
    def errored(self) -> bool:
        return not self.crashed and not self.hung and (
            self.returncode != 0 or not self.ended or "Traceback" in self.stderr_tail)


@dataclass
class Summary:
    exits: int = 0
    crashes: int = 0
    hangs: int = 0
    errors: int = 0
    reduces: int = 0
    by_kind: dict[str, list[int]] = field(default_factory=dict)  # kind: [exits, crashes]
    failures: list[dict[str, Any]] = field(default_factory=list)

    def add(self, e: Exit) -> None:
        self.exits += 1
        self.crashes += e.crashed
        self.hangs += e.hung
        self.errors += e.errored
        self.reduces += e.reduces
        kinds = [e.mode] + (["debug"] if e.debug else []) + (["daemon"] if e.daemon else [])
        for k in kinds:
            row = self.by_kind.setdefault(k, [0, 0])
            row[0] += 1
            row[1] += e.crashed or e.hung
        if e.crashed or e.hung or e.errored:
            self.failures.append(asdict(e))


async def _peer(addr: str, world: int, mode: str, debug: bool, daemon: bool, seed: int,
                rnd: int, timeout: float) -> Exit:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-X", "faulthandler", "-c", PEER, addr, str(world), mode,
        str(int(debug)), str(int(daemon)), str(seed),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        out, err = await proc.communicate()
        return Exit(rnd, mode, debug, daemon, None, err.decode(errors="replace")[-3000:])
    return Exit(rnd, mode, debug, daemon, proc.returncode, err.decode(errors="replace")[-3000:],
                b"ENDED" in out, out.count(b"REDUCED "))


async def run_round(rnd: int, peers: int, rng: random.Random, timeout: float,
                    modes: tuple[str, ...] = MODES, daemon_p: float = 0.25,
                    debug_p: float = 0.5) -> list[Exit]:
    """One master (here), ``peers`` peer processes; their ends."""
    import pccl  # here, so that importing this file (the test does) costs nothing

    async with pccl.MasterNode(listen="127.0.0.1:0", heartbeat_interval=0.25,
                               heartbeat_timeout=3.0) as master:
        return list(await asyncio.gather(*(
            _peer(master.address, peers, rng.choice(modes), rng.random() < debug_p,
                  rng.random() < daemon_p, rng.randrange(1 << 30), rnd, timeout)
            for _ in range(peers))))


async def soak(exits: int, peers: int, load: int, seed: int, timeout: float,
               modes: tuple[str, ...] = MODES, daemon_p: float = 0.25, verbose: bool = True
               ) -> Summary:
    rng = random.Random(seed)
    spinners = [await asyncio.create_subprocess_exec(sys.executable, "-c", SPIN)
                for _ in range(load)]
    summary = Summary()
    try:
        rnd = 0
        while summary.exits < exits:
            t0 = time.monotonic()
            ends = await run_round(rnd, peers, rng, timeout, modes, daemon_p)
            for e in ends:
                summary.add(e)
            if verbose:
                marks = " ".join(f"{e.mode}{'+d' if e.debug else ''}{'+t' if e.daemon else ''}"
                                 f"={e.returncode}/{e.reduces}" for e in ends)
                print(f"round {rnd:3d} ({time.monotonic() - t0:4.1f} s): {marks}", flush=True)
            rnd += 1
    finally:
        for s in spinners:
            with contextlib.suppress(ProcessLookupError):
                s.kill()
            await s.wait()
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--exits", type=int, default=200,
                    help="peer-process exits at least (whole rounds)")
    ap.add_argument("--peers", type=int, default=3, help="peer processes per round")
    ap.add_argument("--load", type=int, default=1, help="CPU-spinning processes meanwhile")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per peer process")
    ap.add_argument("--modes", default=",".join(MODES), help="ends to draw from")
    ap.add_argument("--daemon-p", type=float, default=0.25,
                    help="probability of a daemon thread in pccl calls at exit")
    ap.add_argument("--json", help="write the summary here")
    a = ap.parse_args()
    modes = tuple(a.modes.split(","))
    if a.exits < 1 or a.peers < 2 or not set(modes) <= set(MODES):
        ap.error("need --exits >= 1, --peers >= 2 and --modes among " + ",".join(MODES))
    t0 = time.monotonic()
    s = asyncio.run(soak(a.exits, a.peers, a.load, a.seed, a.timeout, modes, a.daemon_p))
    took = time.monotonic() - t0
    for f in s.failures:
        print(json.dumps(f), flush=True)
    print(f"{s.exits} peer exits in {took:.0f} s: {s.crashes} crashed, {s.hangs} hung, "
          f"{s.errors} other errors; {s.reduces} all-reduces before them; "
          f"per kind [exits, crashed or hung]: {s.by_kind}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "seconds": took, **asdict(s)}, f, indent=1)
    return 1 if s.crashes or s.hangs else 0


if __name__ == "__main__":
    raise SystemExit(main())
