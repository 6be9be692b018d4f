"""Shared plumbing for the benchmarks in this folder: spawned worker processes that are
always reaped, bounded result collection, statistics and a record of the machine.

Nothing here imports torch, so spawned children that only need pccl stay light.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.metadata
import json
import multiprocessing as mp
import os
import platform
import queue as _queue
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

MIB = 1 << 20
GB = 1e9  # throughput is reported in decimal units (GB/s, MB/s)
MB = 1e6

CTX = mp.get_context("spawn")


class BenchError(RuntimeError):
    """A benchmark phase failed or ran out of time; the message says which child and why."""


# --- processes -----------------------------------------------------------------------


class Children:
    """The spawned processes of one benchmark phase.

    Used as a context manager so that, however the phase ends, every child is joined;
    children still alive after ``grace`` seconds are terminated and then killed::

        with Children() as kids:
            kids.start(worker, args)
            ...
    """

    def __init__(self, grace: float = 10.0) -> None:
        self.grace = grace
        self.procs: list[Any] = []

    def start(self, target: Callable[..., Any], args: tuple[Any, ...], name: str = "") -> Any:
        proc = CTX.Process(target=target, args=args, name=name or target.__name__, daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc

    def dead(self) -> list[Any]:
        """Children that already exited with a non-zero code."""
        return [p for p in self.procs if p.exitcode not in (None, 0)]

    def reap(self) -> None:
        deadline = time.monotonic() + self.grace
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(3.0)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(3.0)
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.close()

    def __enter__(self) -> Children:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            self.grace = min(self.grace, 0.5)  # the phase failed: no point in waiting
        self.reap()


def report_failure(q: Any, who: str, barrier: Any = None) -> None:
    """Called by a child in its ``except`` block: sends the traceback to the parent and
    breaks the shared barrier so that the other children stop waiting at once."""
    with contextlib.suppress(Exception):
        q.put({"error": f"{who}: {traceback.format_exc()}"})
    if barrier is not None:
        with contextlib.suppress(Exception):
            barrier.abort()


def collect(q: Any, kids: Children, count: int, timeout: float, what: str) -> list[dict[str, Any]]:
    """Gathers ``count`` messages whose ``"done"`` key is true (and every message before
    them) from the children, or raises :class:`BenchError` on the first error message,
    on a child that died, or when ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    got: list[dict[str, Any]] = []
    done = 0
    dead_seen_at: float | None = None
    while done < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BenchError(f"{what}: no result after {timeout:.0f}s "
                             f"({done}/{count} workers finished)")
        try:
            msg = q.get(timeout=min(left, 0.5))
        except _queue.Empty:
            if kids.dead():
                # Give a crashed child's own error report a moment to arrive first.
                now = time.monotonic()
                if dead_seen_at is None:
                    dead_seen_at = now
                elif now - dead_seen_at > 2.0:
                    codes = [(p.name, p.exitcode) for p in kids.dead()]
                    raise BenchError(f"{what}: worker(s) exited early: {codes}") from None
            continue
        if "error" in msg:
            raise BenchError(f"{what}: {msg['error']}")
        got.append(msg)
        if msg.get("done"):
            done += 1
    return got


def get_one(q: Any, kids: Children, timeout: float, what: str) -> Any:
    """One message from a child (an address, a port), bounded like :func:`collect`."""
    msgs = collect(q, kids, 1, timeout, what)
    return msgs[-1]


# --- numbers -------------------------------------------------------------------------


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def busbw_factor(k: int) -> float:
    """Bytes each ring link carries per byte all-reduced: 2(k-1)/k."""
    return 2.0 * (k - 1) / k if k > 1 else 0.0


def iter_wall_times(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per iteration, the slowest peer's wall time for the call (max over peers)."""
    return [max(ts) for ts in zip(*per_rank, strict=True)]


def summarize(times: Sequence[float], nbytes: int, k: int) -> dict[str, Any]:
    """Median and best (shortest) time, with the algbw/busbw they imply."""
    t_med, t_best = median(times), min(times)
    f = busbw_factor(k)
    return {
        "times_s": [round(t, 6) for t in times],
        "time_median_s": t_med,
        "time_best_s": t_best,
        "algbw_GBps_median": nbytes / t_med / GB,
        "algbw_GBps_best": nbytes / t_best / GB,
        "busbw_GBps_median": nbytes * f / t_med / GB,
        "busbw_GBps_best": nbytes * f / t_best / GB,
    }


def fmt_size(nbytes: int) -> str:
    if nbytes % MIB == 0:
        return f"{nbytes // MIB} MiB"
    return f"{nbytes / MIB:.2f} MiB"


# --- the machine ---------------------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


def _mem_total_bytes() -> int | None:
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return None


def _git(repo: str, *args: str) -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True,
                             timeout=10)
        if out.returncode == 0:
            return out.stdout.strip()
    return None


def machine_info() -> dict[str, Any]:
    """Where and with what the numbers were taken (no torch import: metadata only)."""
    import pccl
    import pccl._core as core

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    status = _git(repo, "status", "--porcelain", "--untracked-files=no")
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        affinity = None
    core_file = getattr(core, "__file__", None)
    return {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "nproc": os.cpu_count(),
        "nproc_usable": affinity,
        "mem_total_bytes": _mem_total_bytes(),
        "python": sys.version.split()[0],
        "numpy": _version("numpy"),
        "torch": _version("torch"),
        "pccl": getattr(pccl, "__version__", None),
        "pccl_core_file": core_file,
        "pccl_core_mtime": (_dt.datetime.fromtimestamp(os.path.getmtime(core_file),
                                                       _dt.UTC).isoformat(
                                timespec="seconds") if core_file else None),
        "git_commit": _git(repo, "rev-parse", "HEAD"),
        "git_dirty_files": status.splitlines() if status else [],
    }


def master_proc(q: Any, stop: Any, life_s: float, options: dict[str, Any]) -> None:
    """A child process's body: a pccl master on a free loopback port, made with
    ``MasterNode(**options)``; puts ``{"address": ...}`` on ``q``, then serves until
    ``stop`` is set or ``life_s`` seconds passed."""
    import asyncio

    import pccl

    async def main() -> None:
        master = pccl.MasterNode(listen="127.0.0.1:0", **options)
        await master.start()
        try:
            q.put({"done": True, "address": master.address})
            end = time.monotonic() + life_s
            while not stop.is_set() and time.monotonic() < end:
                await asyncio.sleep(0.05)
        finally:
            await asyncio.wait_for(master.stop(), 10.0)

    try:
        asyncio.run(main())
    except BaseException:
        report_failure(q, "master")
        sys.exit(1)


def with_transport(clear: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with pccl peers spawned meanwhile on the clear (``insecure=True``)
    or the encrypted transport: ``PCCL_BENCH_INSECURE``, which bench/allreduce.py's
    peers read and spawned children inherit."""
    old = os.environ.get("PCCL_BENCH_INSECURE")
    os.environ["PCCL_BENCH_INSECURE"] = "1" if clear else "0"
    try:
        return fn(*args)
    finally:
        if old is None:
            del os.environ["PCCL_BENCH_INSECURE"]
        else:
            os.environ["PCCL_BENCH_INSECURE"] = old


def write_results(out: dict[str, Any], path: str) -> None:
    """Writes a run's results as indented JSON at ``path`` (its folder made if need be),
    through a temporary file so an interrupted run never leaves half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, path)


@contextlib.contextmanager
def phase(errors: list[dict[str, Any]], name: str) -> Iterator[None]:
    """Runs one measurement; a failure is printed and recorded, and the run goes on."""
    t0 = time.monotonic()
    try:
        yield
    except BenchError as e:
        print(f"  !! {name} failed: {e}", flush=True)
        errors.append({"phase": name, "error": str(e)})
    except Exception as e:  # anything else unexpected in the parent's own code
        print(f"  !! {name} failed: {e!r}", flush=True)
        errors.append({"phase": name, "error": traceback.format_exc()})
    finally:
        print(f"  ({name}: {time.monotonic() - t0:.1f}s)", flush=True)
