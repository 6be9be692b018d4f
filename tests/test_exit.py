"""A program that ends while pccl operations are still running exits cleanly.

The Rust runtime's threads hand operations' outcomes (and log records) to Python. At
interpreter exit they must not enter Python any more: CPython ends a foreign thread that
attaches while it finalizes (SIGABRT), or it touches freed interpreter state (SIGSEGV).
pccl closes one gate on all such attaches in an ``atexit`` hook (``pccl/_shutdown.py``).

Each child program below starts operations that finish around the moment it ends
(probes, dials to a port nobody listens on, binds), cancels some of them, leaves the
others running, logs from Rust at debug level, and returns. Each must exit with status
0 and say nothing on stderr but what it logged.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

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
