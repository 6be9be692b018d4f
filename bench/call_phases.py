"""Where the time of one all-reduce call goes, phase by phase, on each peer.

    python bench/call_phases.py [--peers 2] [--mib 1] [--iters 40] [--pool 4]
                                [--insecure] [--out-of-place] [--out FILE]

Runs bench/allreduce.py's harness (k peer processes and a master; a barrier before each
call) with the peer's own methods wrapped to note the time (``time.perf_counter``) at
each step of a call, relative to the user's ``await comm.all_reduce(...)``:

- ``ring_started``: the ring op handed to Rust (``DataPlane._start_ring``: at once for
  an early start, else when the master's go arrives);
- ``ring_done``: the Rust ring op ended and its outcome was fed to the peer's state
  machine (``RingDone``: then reported to the master);
- ``commit``: the master's verdict arrived and was applied (``Commit``);
- ``returned``: the call returned to the caller.

The medians over the timed iterations go to stdout, per peer. The wrappers add a few
microseconds per mark. This is a diagnostic: it reaches into pccl's internals
(``pccl.peer.dataplane.DataPlane``, ``pccl.peer.driver.Driver``), which may change.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pccl.communicator as _communicator
import pccl.peer.dataplane as _dataplane
import pccl.peer.driver as _driver
import pccl.peer.state as _state

MARKS = ("ring_started", "ring_done", "commit", "returned")
_marks: dict[str, float] = {}


def _install(trace_dir: str) -> None:
    """Wraps the methods that mark each phase (in every process that imports this
    module as its main: spawned peers re-import it)."""
    start_ring = _dataplane.DataPlane._start_ring
    reduce_command = _dataplane.DataPlane._reduce_command
    feed = _driver.Driver._feed
    all_reduce = _communicator.Communicator.all_reduce

    def _start_ring(self: Any, c: Any, run: Any) -> None:
        _marks["ring_started"] = time.perf_counter()
        start_ring(self, c, run)

    def _reduce_command(self: Any, c: Any) -> None:
        reduce_command(self, c)
        if isinstance(c, _state.Commit):
            _marks["commit"] = time.perf_counter()

    def _feed(self: Any, ev: Any) -> None:
        if isinstance(ev, _state.RingDone):
            _marks["ring_done"] = time.perf_counter()
        feed(self, ev)

    def _record(called: float) -> None:
        # (A small append, after the call's last mark: outside what is timed.)
        with open(os.path.join(trace_dir, f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps({k: (v - called) * 1e3 for k, v in _marks.items()}) + "\n")

    async def _all_reduce(self: Any, *args: Any, **kwargs: Any) -> Any:
        _marks.clear()
        called = time.perf_counter()
        info = await all_reduce(self, *args, **kwargs)
        _marks["returned"] = time.perf_counter()
        _record(called)
        return info

    _dataplane.DataPlane._start_ring = _start_ring  # type: ignore[method-assign]
    _dataplane.DataPlane._reduce_command = _reduce_command  # type: ignore[method-assign]
    _driver.Driver._feed = _feed  # type: ignore[method-assign]
    _communicator.Communicator.all_reduce = _all_reduce  # type: ignore[method-assign]


if os.environ.get("PCCL_CALL_PHASES_DIR"):
    _install(os.environ["PCCL_CALL_PHASES_DIR"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--mib", type=float, default=1.0)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--pool", type=int, default=4)
    ap.add_argument("--insecure", action="store_true", help="clear-text transport")
    ap.add_argument("--out-of-place", action="store_true")
    ap.add_argument("--out", help="write the per-peer medians here as JSON")
    args = ap.parse_args()
    if args.peers < 2 or args.iters < 1 or args.warmup < 0:
        ap.error("--peers must be >= 2, --iters >= 1, --warmup >= 0")
    nbytes = max(4, int(args.mib * (1 << 20)) // 4 * 4)
    with tempfile.TemporaryDirectory(prefix="pccl-phases-") as trace_dir:
        # Spawned peers inherit the environment and import this module as their main.
        os.environ["PCCL_CALL_PHASES_DIR"] = trace_dir
        os.environ["PCCL_BENCH_INSECURE"] = "1" if args.insecure else "0"
        from allreduce import run_pccl

        res = run_pccl(args.peers, args.pool, [nbytes], args.iters, args.warmup, 10e6,
                       out_of_place=args.out_of_place)
        peers = []
        for name in sorted(os.listdir(trace_dir)):
            with open(os.path.join(trace_dir, name)) as f:
                rows = [json.loads(line) for line in f][args.warmup:]
            peers.append({m: statistics.median(r[m] for r in rows if m in r)
                          for m in MARKS if any(m in r for r in rows)})
    times = [statistics.median(r["times"]) * 1e3 for r in res["by_size"][nbytes].values()]
    print(f"k={args.peers} {args.mib:g} MiB float32 SUM "
          f"{'clear' if args.insecure else 'encrypted'}"
          f"{', out of place' if args.out_of_place else ''}, pool {args.pool}: "
          f"median ms after the call, per peer")
    print("  " + " ".join(f"{m:>13}" for m in MARKS))
    for p in peers:
        print("  " + " ".join(f"{p.get(m, float('nan')):>13.3f}" for m in MARKS))
    print("  call time (the bench's own timer), per peer: "
          + ", ".join(f"{t:.3f}" for t in times))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": vars(args), "peers": peers, "call_ms": times}, f, indent=1)


if __name__ == "__main__":
    main()
