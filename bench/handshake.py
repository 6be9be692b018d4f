"""What a handshake costs: the latency of a control-plane connect and of a new p2p
stream, over loopback, in one process (no other load).

    python bench/handshake.py [--iters 300] [--out bench/results/handshake.json]

1. control plane: a peer's ``FramedConnection.dial`` against a master-side
   ``FramedConnection.accept`` (the secure handshake only: no registration);
2. p2p stream: ``P2PNode.connect_pool`` of one stream from one node to another (TCP
   connect, the secure handshake and the stream hello, filed at the listener).

Each is measured per mode the library offers: clear text (``insecure``), anonymous,
a shared secret, and node identities (a certificate signed by a run key, checked on
every handshake) with and without a secret. (The "before" numbers in
docs/benchmarks.md are this script's first version, at f3308d3, on the build before
node identities.) Medians and p90
in milliseconds go to stdout and to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine_info  # noqa: E402

import pccl._core as core  # noqa: E402
from pccl.protocol.transport import FramedConnection  # noqa: E402

SECRET = "5f0c1a9e7d3b42c8a6e1f0b97c2d4e3a"


def _modes() -> dict[str, dict[str, Any]]:
    """name -> keyword arguments of the identity/secret for each end."""
    modes: dict[str, dict[str, Any]] = {
        "clear": {"insecure": True},
        "anonymous": {},
        "secret": {"secret": SECRET},
    }
    from pccl import identity as ident

    tmp = tempfile.mkdtemp(prefix="pccl-hs-bench-")
    run = ident.new_run_key(os.path.join(tmp, "run"))
    for who in ("master", "a", "b"):
        ident.new_node_key(os.path.join(tmp, who))
        ident.sign_node(run, os.path.join(tmp, f"{who}.pub"), name=who,
                        groups=["master"] if who == "master" else ["peer"], days=1,
                        out=os.path.join(tmp, f"{who}.cert"))
    trust = [os.path.join(tmp, "run.pub")]
    modes["identities"] = {"identity_dir": tmp, "trust": trust}
    modes["identities+secret"] = {"identity_dir": tmp, "trust": trust, "secret": SECRET}
    return modes


def _identity(mode: dict[str, Any], who: str) -> Any:
    if "identity_dir" not in mode:
        return None
    from pccl import identity as ident
    d = mode["identity_dir"]
    return ident.load(os.path.join(d, f"{who}.key"), os.path.join(d, f"{who}.cert"),
                               trust=mode["trust"])


async def control(mode: dict[str, Any], iters: int) -> list[float]:
    secret = mode.get("secret")
    insecure = bool(mode.get("insecure"))
    accepted: asyncio.Queue[None] = asyncio.Queue()
    master_id, peer_id = _identity(mode, "master"), _identity(mode, "a")

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conn = FramedConnection(r, w)
        try:
            await conn.accept(secret and secret.encode(), allow_clear=insecure,
                              identity=master_id)
        finally:
            accepted.put_nowait(None)
            await conn.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    out = []
    try:
        for _ in range(iters):
            t0 = time.perf_counter()
            r, w = await asyncio.open_connection("127.0.0.1", port)
            conn = FramedConnection(r, w)
            await conn.dial(secret and secret.encode(), insecure=insecure, identity=peer_id)
            out.append(time.perf_counter() - t0)
            await conn.close()
            await accepted.get()
    finally:
        server.close()
        await server.wait_closed()
    return out


async def p2p(mode: dict[str, Any], iters: int) -> list[float]:
    kw: dict[str, Any] = {"insecure": bool(mode.get("insecure"))}
    if mode.get("secret"):
        kw["secret"] = mode["secret"].encode()
    # Every node has a key; the master's roster names them.
    ia, ib = _identity(mode, "a") or core.Identity(), _identity(mode, "b") or core.Identity()
    a = await core.P2PNode.bind(1, **kw, identity=ia)
    b = await core.P2PNode.bind(2, **kw, identity=ib)
    try:
        keys = {1: ia.public_key, 2: ib.public_key}
        a.set_peer_keys(keys)
        b.set_peer_keys(keys)
        out = []
        for epoch in range(1, iters + 1):
            t0 = time.perf_counter()
            await a.connect_pool(f"127.0.0.1:{b.port}", 2, epoch, 1)
            out.append(time.perf_counter() - t0)
            b.retain_from_epoch(epoch + 1)
            a.retain_from_epoch(epoch + 1)
    finally:
        await a.close()
        await b.close()
    return out


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median_ms": statistics.median(xs) * 1e3,
            "p90_ms": xs[int(0.9 * (len(xs) - 1))] * 1e3, "n": len(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--out", default="bench/results/handshake.json")
    args = ap.parse_args()
    rows = []
    for name, mode in _modes().items():
        c = asyncio.run(control(mode, args.iters))
        p = asyncio.run(p2p(mode, args.iters))
        rows.append({"mode": name, "control": _stats(c), "p2p_stream": _stats(p)})
        print(f"{name:>18}: control connect {rows[-1]['control']['median_ms']:.3f} ms "
              f"(p90 {rows[-1]['control']['p90_ms']:.3f}), new p2p stream "
              f"{rows[-1]['p2p_stream']['median_ms']:.3f} ms "
              f"(p90 {rows[-1]['p2p_stream']['p90_ms']:.3f})", flush=True)
    with open(args.out, "w") as f:
        json.dump({"machine": machine_info(), "iters": args.iters, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
