"""A pccl peer in its own process, remote-controlled over stdin/stdout (JSON lines).

Run by :class:`pccl.testing.PeerProcess`; not meant to be started by hand::

    python -m pccl.testing.peer_worker --master 127.0.0.1:48148 --group 0 --pool 2

Requests are ``{"id": n, "cmd": name, ...args}``; each gets one reply
``{"id": n, "ok": true, "value": ...}`` or ``{"id": n, "ok": false, "kind": ErrorClass,
"message": ...}``. Requests run concurrently. The worker first prints
``{"event": "accepted", "peer_id": ...}`` (or ``{"event": "failed", ...}`` and exits 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import Any

import numpy as np

import pccl
from pccl import _core
from pccl.testing.data import deterministic_tensor, digest


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Worker:
    def __init__(self, comm: pccl.Communicator) -> None:
        self.comm = comm
        self.closed = asyncio.Event()
        self.tensors: dict[str, np.ndarray] = {}

    async def cmd_make_tensor(self, name: str, dtype: str, count: int, seed: int) -> str:
        self.tensors[name] = deterministic_tensor(dtype, count, seed)
        return digest(self.tensors[name])

    async def cmd_digest(self, name: str) -> str:
        return digest(self.tensors[name])

    async def cmd_content_hash(self, names: list[str]) -> dict[str, str]:
        """pccl's own content hash (the one shared-state sync compares), hex."""
        return {n: _core.content_hash_hex(self.tensors[n].reshape(-1).view(np.uint8))
                for n in names}

    async def cmd_sync(self, names: list[str], revision: int,
                       strategy: str = "ENFORCE_POPULAR", digests: bool = True) -> dict[str, Any]:
        state = pccl.SharedState([pccl.TensorInfo.from_numpy(self.tensors[n], n) for n in names],
                                 revision=revision)
        info = await self.comm.sync_shared_state(
            state, strategy=pccl.SharedStateSyncStrategy[strategy])
        return {"revision": state.revision, "tx_bytes": info.tx_bytes, "rx_bytes": info.rx_bytes,
                "digests": {n: digest(self.tensors[n]) for n in names} if digests else {}}

    async def cmd_all_reduce(self, name: str, op: str = "SUM", tag: int = 0) -> dict[str, Any]:
        info = await self.comm.all_reduce(self.tensors[name], op=pccl.ReduceOp[op], tag=tag)
        return {"digest": digest(self.tensors[name]), "world_size": info.world_size,
                "tx_bytes": info.tx_bytes, "rx_bytes": info.rx_bytes,
                "algorithm": info.algorithm}

    async def cmd_update_topology(self) -> None:
        await self.comm.update_topology()

    async def cmd_are_peers_pending(self) -> bool:
        """The collective query: answered once every accepted peer of the run asked."""
        return await self.comm.are_peers_pending()

    async def cmd_pending_peer_count(self) -> int:
        """The plain query: answered at once, waits for nobody (a hint)."""
        return await self.comm.pending_peer_count()

    async def cmd_attributes(self) -> dict[str, int]:
        return {a.name: self.comm.get_attribute(a) for a in pccl.Attribute}

    async def cmd_info(self) -> dict[str, Any]:
        return {"peer_id": self.comm.peer_id, "epoch": self.comm.epoch,
                "p2p_port": self.comm.p2p_port,
                "ring": self.comm.ring, "lanes": list(self.comm.ring_lanes())}

    async def cmd_close(self) -> None:
        await self.comm.close()
        self.closed.set()

    async def run_request(self, req: dict[str, Any]) -> None:
        rid = req.pop("id", None)
        name = req.pop("cmd", "")
        handler = getattr(self, f"cmd_{name}", None)
        try:
            if handler is None:
                raise pccl.InvalidArgumentError(f"unknown command {name!r}")
            value = await handler(**req)
            _emit({"id": rid, "ok": True, "value": value})
        except Exception as e:  # reported to the test, which asserts on the kind
            _emit({"id": rid, "ok": False, "kind": type(e).__name__, "message": str(e)})


async def _main(args: argparse.Namespace) -> int:
    comm = pccl.Communicator(master=args.master, peer_group=args.group,
                             p2p_connection_pool_size=args.pool,
                             secret=bytes.fromhex(args.secret_hex) if args.secret_hex else None,
                             peer_timeout=args.peer_timeout, p2p_timeout=args.p2p_timeout,
                             p2p_advertise_address=args.p2p_advertise_address or None,
                             p2p_listen_port=args.p2p_port,
                             allow_relay=not args.no_relay)
    try:
        await comm.connect(n_attempts=args.attempts)
    except pccl.PCCLError as e:
        _emit({"event": "failed", "kind": type(e).__name__, "message": str(e)})
        return 1
    _emit({"event": "accepted", "peer_id": comm.peer_id})
    worker = Worker(comm)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks: set[asyncio.Task[None]] = set()
    closed = asyncio.create_task(worker.closed.wait())
    while not worker.closed.is_set():
        read = asyncio.create_task(reader.readline())
        await asyncio.wait({read, closed}, return_when=asyncio.FIRST_COMPLETED)
        if not read.done():
            read.cancel()
            break
        line = read.result()
        if not line:
            break  # the test went away: leave
        task = asyncio.create_task(worker.run_request(json.loads(line)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks, return_exceptions=True)
    closed.cancel()
    await comm.close()
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--master", required=True)
    parser.add_argument("--group", type=int, default=0)
    parser.add_argument("--pool", type=int, default=2)
    parser.add_argument("--attempts", type=int, default=10)
    parser.add_argument("--secret-hex", default="")
    parser.add_argument("--peer-timeout", type=float, default=30.0)
    parser.add_argument("--p2p-timeout", type=float, default=10.0)
    parser.add_argument("--p2p-advertise-address", default="")
    parser.add_argument("--p2p-port", type=int, default=0)
    parser.add_argument("--no-relay", action="store_true", help="allow_relay=False")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level, stream=sys.stderr)
    sys.exit(asyncio.run(_main(args)))


if __name__ == "__main__":
    main()
