"""A program that ends while pccl operations are still running exits cleanly.

The Rust runtime's threads hand operations' outcomes (and log records) to Python. At
interpreter exit they must not enter Python any more: CPython ends a foreign thread that
attaches while it finalizes (SIGABRT), or it touches freed interpreter state (SIGSEGV).
pccl closes one gate on all such attaches in an ``atexit`` hook (``pccl/_shutdown.py``).

Each child program below starts operations that finish around the moment it ends
(probes, dials to a port nobody listens on, binds), cancels some of them, leaves the
others running, logs from Rust at debug level, and returns. Each must exit with status
0 and say nothing on stderr but what it logged.

Python threads other than the main one (daemon threads) may be inside a pccl call with
the GIL released as the program ends: they must stay there rather than take the GIL
back while CPython finalizes (a forced unwind through Rust frames: SIGSEGV). And real
peer processes (a master, three peers, ring all-reduces) ending right after ``close()``,
with an all-reduce in flight or cancelled, with debug logging, under CPU load, exit
cleanly: the bounded version of ``bench/exit_soak.py``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

_SOAK_PATH = Path(__file__).resolve().parents[2] / "bench" / "exit_soak.py"
_spec = importlib.util.spec_from_file_location("exit_soak", _SOAK_PATH)
assert _spec is not None and _spec.loader is not None
exit_soak = importlib.util.module_from_spec(_spec)
sys.modules["exit_soak"] = exit_soak  # its dataclasses look their module up
_spec.loader.exec_module(exit_soak)

CHILD = textwrap.dedent("""
    import asyncio, logging, random, sys
    import pccl
    from pccl import _core

    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
    logging.getLogger("pccl").setLevel(logging.DEBUG)  # Rust records from runtime threads

    async def main(seed):
        rng = random.Random(seed)
        a = await _core.P2PNode.bind(1, insecure=True)
        b = await _core.P2PNode.bind(2, insecure=True)
        dead = await _core.P2PNode.bind(3, insecure=True)
        dead_port = dead.port
        await dead.close()
        ops = []
        for _ in range(6):
            kind = rng.randrange(3)
            if kind == 0:
                ops.append(a.probe(f"127.0.0.1:{b.port}", 2, seconds=rng.uniform(0.001, 0.02)))
            elif kind == 1:
                ops.append(a.connect_pool(f"127.0.0.1:{dead_port}", 3, 1, 1))
            else:
                ops.append(_core.P2PNode.bind(9, insecure=True))
        tasks = [asyncio.ensure_future(op) for op in ops]
        await asyncio.sleep(rng.uniform(0.0, 0.01))
        for t in tasks[::2]:
            t.cancel()
        # The others are left running; asyncio.run cancels them as the program ends.

    asyncio.run(main(int(sys.argv[1])))
    print("ENDED")
""")

CHILDREN = int(os.environ.get("PCCL_EXIT_CHILDREN", "24"))


def _run(seed: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-X", "faulthandler", "-c", CHILD, str(seed)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(300)
def test_programs_ending_with_operations_in_flight_exit_cleanly() -> None:
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(_run, range(CHILDREN)))
    for seed, p in enumerate(done):
        assert p.returncode == 0, f"seed {seed}: exit {p.returncode}\n{p.stderr[-3000:]}"
        # (Runtime threads may log into the same line until the exit hook.)
        assert "ENDED" in p.stdout, f"seed {seed}: {p.stdout[-2000:]}"
        assert p.stderr == "", f"seed {seed}: {p.stderr[-3000:]}"


def test_a_pccl_call_after_the_exit_hook_stays_pending_instead_of_crashing() -> None:
    # An atexit hook registered before ``import pccl`` runs after pccl's: its awaited
    # call never resolves (documented), so it must bound its own wait.
    code = textwrap.dedent("""
        import asyncio, atexit

        def late():
            from pccl import _core
            async def go():
                try:
                    await asyncio.wait_for(_core.P2PNode.bind(1, insecure=True), 0.5)
                except TimeoutError:
                    print("PENDING")
            asyncio.run(go())

        atexit.register(late)
        import pccl  # noqa: E402  (its hook registered after ours: runs first)
    """)
    p = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "PENDING", p.stdout + p.stderr


DAEMONS = textwrap.dedent("""
    import sys, threading
    import numpy as np
    from pccl import _core

    src = np.arange(1 << 20, dtype=np.uint8)

    def gil_free_calls(which, started):
        dst = np.empty_like(src)
        started.set()
        while True:  # ends with the process, inside one of these calls
            if which == 0:
                _core.content_hash(src, threads=1)
            elif which == 1:
                _core.copy_into(dst, src)
            else:
                _core.star_all_reduce([src, dst], 0, 0)  # float16 SUM

    for which in range(3):
        started = threading.Event()
        threading.Thread(target=gil_free_calls, args=(which, started), daemon=True).start()
        started.wait()
    print("ENDED")
""")


def _run_daemons(_: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-X", "faulthandler", "-c", DAEMONS],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(300)
def test_daemon_threads_inside_gil_releasing_pccl_calls_at_exit() -> None:
    # Before the exit hook parked them, every one of these died of SIGSEGV: the daemon
    # thread took the GIL back while the interpreter finalized, and CPython's
    # pthread_exit unwound through the Rust frames of the call.
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(_run_daemons, range(int(os.environ.get("PCCL_EXIT_CHILDREN",
                                                                      "24")) // 3)))
    for i, p in enumerate(done):
        assert p.returncode == 0, f"child {i}: exit {p.returncode}\n{p.stderr[-3000:]}"
        assert p.stdout.strip() == "ENDED" and p.stderr == "", p.stdout + p.stderr


def test_the_main_thread_still_returns_from_gil_releasing_calls_after_the_exit_hook() -> None:
    # Only other threads stay parked: the thread that finalizes runs later atexit hooks,
    # which may hash or copy (registered before ``import pccl``, so they run after its).
    code = textwrap.dedent("""
        import atexit

        def late():
            from pccl import _core
            data = bytes(range(256)) * 4096
            out = bytearray(len(data))
            _core.copy_into(out, data)
            print("LATE", _core.content_hash_hex(out) == _core.content_hash_hex(data))

        atexit.register(late)
        import pccl  # noqa: E402
    """)
    p = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "LATE True", p.stdout + p.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
async def test_peer_processes_ending_at_awkward_moments_exit_cleanly() -> None:
    # bench/exit_soak.py's rounds: 8 rounds of a master here and three peer processes that
    # all-reduce, then end (close, close with an all-reduce in flight, an all-reduce
    # cancelled, one left running; debug logging; a daemon thread in pccl calls), while
    # another process spins on the CPU.
    exits = int(os.environ.get("PCCL_EXIT_CHILDREN", "24"))
    s = await exit_soak.soak(exits, peers=3, load=1, seed=36, timeout=120.0, verbose=False)
    assert s.exits >= exits
    assert (s.crashes, s.hangs, s.errors) == (0, 0, 0), s.failures
    assert s.reduces > 0  # the ring ran before the ends
