"""Smoke test of an installed pccl wheel; ``./dev.sh wheel`` runs it in a clean venv.

Not a pytest file (pytest never collects it: the name does not start with ``test_``).
Run it with the interpreter of a venv that has the wheel and numpy installed and no Rust
toolchain on PATH, from outside the repository::

    cd /tmp && env PATH=/usr/bin:/bin /path/to/venv/bin/python /path/to/tests/wheel_smoke.py

It checks that pccl and its extension come from that venv's site-packages (the abi3
build, ``pccl/_core.abi3.so``), not from a checkout, then runs a master and three
communicators in one asyncio program: joins, an all-reduce whose result is compared
element by element, and a shared-state sync after which every peer holds equal bytes.
Exits non-zero on the first failure.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEERS = 3
COUNT = 100_003  # float32 elements: not a multiple of the ring size, so chunks differ
DEADLINE = 120.0  # seconds for the whole cluster part


class SmokeFailure(Exception):
    pass


def check(ok: bool, what: str) -> None:
    if not ok:
        raise SmokeFailure(what)
    print(f"ok: {what}", flush=True)


def check_install() -> None:
    """pccl and pccl._core are the wheel's files in this interpreter's site-packages."""
    import pccl
    import pccl._core

    for tool in ("cargo", "rustc"):
        check(shutil.which(tool) is None, f"no {tool} on PATH")
    package = Path(pccl.__file__).resolve().parent
    check(REPO not in package.parents and package != REPO / "pccl",
          f"pccl imported from outside the repository ({package})")
    site = Path(sysconfig.get_paths()["platlib"]).resolve()
    check(package == site / "pccl", f"pccl imported from site-packages ({site})")
    core = Path(pccl._core.__file__).resolve()
    check(core == package / "_core.abi3.so", f"pccl._core is the abi3 build ({core.name})")
    extensions = sorted(p.name for p in package.glob("_core*.so"))
    check(extensions == ["_core.abi3.so"], f"one extension in the package ({extensions})")
    print(f"pccl {pccl.__version__} on Python {sys.version.split()[0]}", flush=True)


async def join(comms: list) -> None:
    """Connects every communicator; the first one (alone, so accepted at once) votes the
    others in, as in a PCCL-style training loop."""
    first, rest = comms[0], comms[1:]
    await first.connect()
    joins = [asyncio.create_task(c.connect()) for c in rest]
    try:
        while first.world_size < len(comms):
            if await first.are_peers_pending():
                await first.update_topology()
            else:
                await asyncio.sleep(0.05)
        await asyncio.gather(*joins)
    finally:
        for t in joins:
            t.cancel()
    check(all(c.world_size == len(comms) for c in comms), f"{len(comms)} peers accepted")


async def cluster() -> None:
    import numpy as np

    import pccl

    async with pccl.MasterNode(listen="127.0.0.1:0", status_listen="127.0.0.1:0") as master:
        comms = [pccl.Communicator(master=master.address, p2p_connection_pool_size=2)
                 for _ in range(PEERS)]
        try:
            await join(comms)

            # All-reduce: peer i holds (i + 1) * [0, 1, ..., COUNT - 1]. The sums are
            # integers below 2**24, exact in float32 whatever the order of additions.
            base = np.arange(COUNT, dtype=np.float32)
            grads = [base * (i + 1) for i in range(PEERS)]
            infos = await asyncio.gather(*(c.all_reduce(g, op=pccl.ReduceOp.SUM)
                                           for c, g in zip(comms, grads)))
            want = base * sum(range(1, PEERS + 1))
            check(all(np.array_equal(g, want) for g in grads),
                  f"all-reduce SUM of {COUNT} float32 exact on every peer")
            check(all(i.world_size == PEERS for i in infos), "all-reduce world size")

            # Shared state: two peers hold the same weights, the third zeros. The popular
            # content wins; the odd one out fetches it and all hashes agree.
            weights = [np.linspace(-1, 1, COUNT, dtype=np.float32) for _ in range(PEERS - 1)]
            weights.append(np.zeros(COUNT, dtype=np.float32))
            states = [pccl.SharedState([pccl.TensorInfo.from_numpy(w, "weights")])
                      for w in weights]
            for s in states:
                s.revision += 1
            syncs = await asyncio.gather(*(c.sync_shared_state(s)
                                           for c, s in zip(comms, states)))
            hashes = {pccl.content_hash(w) for w in weights}
            check(len(hashes) == 1, f"shared-state hashes equal on every peer ({hashes})")
            check(np.array_equal(weights[-1], weights[0]), "the odd peer got the weights")
            check(syncs[-1].rx_bytes == COUNT * 4, f"it fetched {COUNT * 4} bytes")
            check(all(c.last_synced_revision == 1 for c in comms), "revision 1 everywhere")

            # The status page ships in the wheel (a data file next to the code), and the
            # API counts what just happened.
            import json
            import urllib.request

            base = f"http://{master.status_address}"

            def fetch(path: str) -> bytes:
                with urllib.request.urlopen(base + path, timeout=10) as r:
                    return bytes(r.read())

            page = await asyncio.to_thread(fetch, "/")
            check(b"<title>pccl run status</title>" in page, "the status page is served")
            status = json.loads(await asyncio.to_thread(fetch, "/api/status"))
            check(status["collectives"]["ok"] == 1 and status["syncs"]["ok"] == 1,
                  "/api/status counts one all-reduce and one sync")
        finally:
            await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)


def main() -> int:
    t0 = time.perf_counter()
    try:
        check_install()
        asyncio.run(asyncio.wait_for(cluster(), DEADLINE))
    except SmokeFailure as e:
        print(f"wheel smoke FAILED: {e}", file=sys.stderr)
        return 1
    print(f"wheel smoke passed in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
