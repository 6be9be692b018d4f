"""A synchronous training loop written against PCCL's Python bindings, run on pccl.

Apart from the import below (``import pccl`` with PrimeIntellect's bindings) this is a
PCCL script: a master that ``run()``s and falls off the end of ``main()``, and peers
that ``connect()``, admit joiners with ``are_peers_pending()`` / ``update_topology()``,
reduce numpy arrays and torch tensors, mixed across peers (``all_reduce``,
``all_reduce_async().wait()``, ``all_reduce_multiple_with_retry``), keep a
``SharedState`` in sync, and carry on when a peer dies. ::

    python examples/pccl_style.py master --listen 127.0.0.1:48148
    python examples/pccl_style.py peer --master 127.0.0.1:48148 --weight 1 --world 3 \\
        --torch &
    python examples/pccl_style.py peer --master 127.0.0.1:48148 --weight 2 --world 3 &
    python examples/pccl_style.py peer --master 127.0.0.1:48148 --weight 4 --world 3 \\
        --die-at 2:multiple &
    python examples/pccl_style.py peer --master 127.0.0.1:48148 --weight 8 --late

Each peer contributes tensors scaled by its ``--weight`` (powers of two, so a sum says
exactly who took part) and checks every result element against that sum. ``--die-at
STEP:multiple|async`` makes a peer SIGKILL itself at that point of a step; the others
recover. Progress goes to stdout as JSON lines (``tests/system/test_blocking.py`` reads them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import sys
import time
from typing import Any

import numpy as np

import pccl.blocking as pccl

N = 1 << 16  # elements per gradient tensor
STATE_N = 1 << 15  # elements of the shared weights


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "t": round(time.time(), 3), **fields}), flush=True)


def digest(array: Any) -> str:
    data = array.numpy() if hasattr(array, "numpy") else array
    return hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()


def run_master(args: argparse.Namespace) -> None:
    master = pccl.MasterNode(listen_address=args.listen)
    master.run()
    emit("listening", address=getattr(master, "address", args.listen))
    # Like PCCL's master scripts, return here: the master serves until interrupted.


def admit_until(comm: pccl.Communicator, world: int, timeout: float = 60.0) -> None:
    """Admits joiners until the run has ``world`` peers (every accepted peer runs this)."""
    deadline = time.monotonic() + timeout
    while comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the run did not reach {world} peers in {timeout}s")
        if comm.are_peers_pending():
            comm.update_topology()
        else:
            time.sleep(0.02)  # nobody waiting yet: ask again shortly


def check_sum(result: Any, base: Any) -> dict[str, Any]:
    """The sum of weights this result implies, and whether every element agrees."""
    result, base = np.asarray(result, dtype=np.float64), np.asarray(base, dtype=np.float64)
    total = float(result[1] / base[1])
    return {"sum": total, "exact": bool(np.array_equal(result, base * total))}


def reduce_phase(comm: pccl.Communicator, w: int, torch: Any) -> dict[str, Any]:
    """Every kind of reduce once, at a fixed world size."""
    out: dict[str, Any] = {}
    base32 = np.arange(N, dtype=np.float32)

    x = base32 * w  # in place
    info = comm.all_reduce(x, x, op=pccl.ReduceOp.SUM)
    out["numpy_sum"] = check_sum(x, base32)
    out["world"] = info.local_world_size

    send = np.arange(N, dtype=np.float64) * w  # into another buffer
    recv = np.zeros(N, dtype=np.float64)
    info = comm.all_reduce(send, recv, op=pccl.ReduceOp.AVG, tag=1)
    world = info.local_world_size
    total = float(round(recv[1] * world))
    out["numpy_avg"] = {"sum": total,
                        "exact": bool(np.array_equal(recv, (np.arange(N) * total) / world)),
                        "send_untouched": bool(np.array_equal(send, np.arange(N) * w))}

    # Two in flight at once, on distinct tags.
    y = base32 * w
    h1 = comm.all_reduce_async(y, y, op=pccl.ReduceOp.SUM, tag=2)
    z = np.full(N, w, dtype=np.int64)
    h2 = comm.all_reduce_async(z, z, op=pccl.ReduceOp.MAX, tag=3)
    ok1, status1, info1 = h1.wait()
    ok2, status2, _ = h2.wait()
    out["async"] = {"ok": [ok1, ok2], "status": [status1, status2],
                    "sum": check_sum(y, base32), "max": int(z.max()),
                    "max_exact": bool((z == z[0]).all()), "world": info1.local_world_size}

    # PCCL's raw-pointer descriptor next to the numpy one.
    a = base32 * w
    b = base32 * w
    descriptors = [
        pccl.ReduceOpDescriptor.from_numpy(a, a, pccl.ReduceDescriptor(
            count=N, op=pccl.ReduceOp.SUM, tag=10,
            operand_descriptor=pccl.ReduceOperandDescriptor(
                datatype=pccl.DataType.FLOAT, distribution_hint=pccl.DistributionHint.NORMAL),
            quantization_options=pccl.QuantizationOptions(
                quantized_datatype=pccl.DataType.FLOAT,
                algorithm=pccl.QuantizationAlgorithm.NONE))),
        pccl.ReduceOpDescriptor(b.ctypes.data, b.ctypes.data, pccl.ReduceDescriptor(
            count=N, op=pccl.ReduceOp.SUM, tag=11,
            operand_descriptor=pccl.ReduceOperandDescriptor(pccl.DataType.FLOAT),
            quantization_options=pccl.QuantizationOptions(
                pccl.DataType.FLOAT, pccl.QuantizationAlgorithm.NONE))),
    ]
    info = comm.all_reduce_multiple_with_retry(descriptors, max_in_flight=2)
    out["multiple"] = {"a": check_sum(a, base32), "b": check_sum(b, base32),
                       "world": info.local_world_size, "tx_positive": info.tx_bytes > 0}

    # The same reduces on this peer's own kind of tensor (torch or numpy): peers may mix.
    def tensor(values: np.ndarray) -> Any:
        return torch.from_numpy(values) if torch is not None else values

    t = tensor(np.full(N, w, dtype=np.float16))  # small integers: exact in float16
    comm.all_reduce(t, t, op=pccl.ReduceOp.SUM, tag=20)
    u = tensor(np.arange(N, dtype=np.float64) * w)
    ok, _, _ = comm.all_reduce_async(u, u, op=pccl.ReduceOp.SUM, tag=21).wait()
    m = tensor(np.full(N, w, dtype=np.int32))
    comm.all_reduce(m, m, op=pccl.ReduceOp.MIN, tag=22)
    t, u, m = (np.asarray(v) for v in (t, u, m))
    out["tensors"] = {"kind": "torch" if torch is not None else "numpy",
                      "f16_sum": float(t[0]), "f16_exact": bool((t == t[0]).all()),
                      "f64": check_sum(u, np.arange(N)), "async_ok": ok,
                      "min": int(m.min()), "min_exact": bool((m == m[0]).all())}
    return out


def die_here() -> None:
    emit("dying")
    os.kill(os.getpid(), signal.SIGKILL)


def train_step(comm: pccl.Communicator, state: pccl.SharedState, weights: np.ndarray,
               step: int, w: int, die_at: tuple[int, str] | None, torch: Any
               ) -> dict[str, Any]:
    if comm.are_peers_pending():
        comm.update_topology()
    if die_at == (step, "multiple"):
        die_here()

    base = np.arange(N, dtype=np.float32)
    grads = [base * w, base * (w * step)]
    descriptors = [pccl.ReduceOpDescriptor.from_numpy(g, g, pccl.ReduceDescriptor(
        count=N, op=pccl.ReduceOp.SUM, tag=i,
        operand_descriptor=pccl.ReduceOperandDescriptor(pccl.DataType.FLOAT),
        quantization_options=pccl.QuantizationOptions(pccl.DataType.FLOAT,
                                                      pccl.QuantizationAlgorithm.NONE)))
        for i, g in enumerate(grads)]
    # Constant values survive 8-bit min-max quantization exactly.
    quantized = np.full(N, float(w), dtype=np.float32)
    descriptors.append(pccl.ReduceOpDescriptor.from_numpy(
        quantized, quantized, pccl.ReduceDescriptor(
            count=N, op=pccl.ReduceOp.SUM, tag=len(grads),
            operand_descriptor=pccl.ReduceOperandDescriptor(pccl.DataType.FLOAT),
            quantization_options=pccl.QuantizationOptions(
                pccl.DataType.UINT8, pccl.QuantizationAlgorithm.MIN_MAX))))
    own = np.arange(N, dtype=np.float32) * w  # this peer's kind of tensor, as above
    tg = torch.from_numpy(own) if torch is not None else own
    from_tensors = pccl.ReduceOpDescriptor.from_torch if torch is not None else \
        pccl.ReduceOpDescriptor.from_numpy
    descriptors.append(from_tensors(tg, tg, pccl.ReduceDescriptor(
        count=N, op=pccl.ReduceOp.SUM, tag=len(descriptors),
        operand_descriptor=pccl.ReduceOperandDescriptor(pccl.DataType.FLOAT),
        quantization_options=pccl.QuantizationOptions(
            pccl.DataType.FLOAT, pccl.QuantizationAlgorithm.NONE))))
    info = comm.all_reduce_multiple_with_retry(descriptors, max_in_flight=2)
    multiple = {"world": info.local_world_size, "grad": check_sum(grads[0], base),
                "grad_step": check_sum(grads[1], base * step),
                "quantized": float(quantized[0]),
                "quantized_exact": bool((quantized == quantized[0]).all())}
    multiple["own"] = check_sum(own, base)

    if die_at == (step, "async"):
        die_here()
    # PCCL-style manual retry: a failed handle reports, the topology recovers, relaunch.
    stats = np.array([w, 1], dtype=np.int64)
    attempts = 0
    while True:
        attempts += 1
        ok, status, stats_info = comm.all_reduce_async(
            stats, stats, op=pccl.ReduceOp.SUM, tag=100).wait()
        if ok:
            break
        if attempts >= 5:
            raise RuntimeError(f"stats reduce still failing (status {status})")
    world = comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE)

    weights += grads[0][:STATE_N] / np.float32(info.local_world_size)
    state.revision += 1
    sync = comm.sync_shared_state(state)
    return {"step": step, "multiple": multiple, "stats_sum": int(stats[0]),
            "stats_count": int(stats[1]), "stats_world": stats_info.local_world_size,
            "attempts": attempts, "world": world, "revision": state.revision,
            "digest": digest(weights), "rx_bytes": sync.rx_bytes}


def run_peer(args: argparse.Namespace) -> None:
    torch = None
    if args.torch:
        import torch
    w = args.weight
    die_at = None
    if args.die_at:
        step, where = args.die_at.split(":")
        die_at = (int(step), where)

    if args.hold:
        sys.stdin.readline()
    comm = pccl.Communicator(args.master, 0, p2p_connection_pool_size=2)
    comm.connect(n_attempts=15)
    emit("connected", world=comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE))

    # Every peer starts from the same weights except a late joiner, which must adopt
    # the run's through the shared state.
    if args.late:
        weights = np.random.default_rng(w).standard_normal(STATE_N).astype(np.float32)
    else:
        weights = np.linspace(-1, 1, STATE_N, dtype=np.float32)
    entries = [pccl.TensorInfo.from_numpy(weights, "weights")]
    momentum = np.full(STATE_N, -1.0 if args.late else 0.5, dtype=np.float64)
    if torch is not None:
        entries.append(pccl.TensorInfo.from_torch(torch.from_numpy(momentum), "momentum"))
    else:
        entries.append(pccl.TensorInfo.from_numpy(momentum, "momentum"))
    state = pccl.SharedState(entries)

    if not args.late:
        admit_until(comm, args.world)
        comm.optimize_topology()
        emit("joined", world=comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE),
             local=comm.get_attribute(pccl.Attribute.LOCAL_WORLD_SIZE))
        emit("reduced", **reduce_phase(comm, w, torch))
        sync = comm.sync_shared_state(state)
        emit("synced", revision=state.revision, digest=digest(weights))
        admit_until(comm, args.world + 1)  # the late joiner
        state.revision += 1
    sync = comm.sync_shared_state(state)
    emit("synced", revision=state.revision, digest=digest(weights), rx_bytes=sync.rx_bytes,
         momentum=digest(momentum))

    for step in range(1, args.steps + 1):
        emit("step", **train_step(comm, state, weights, step, w, die_at, torch))

    emit("done", digest=digest(weights), revision=state.revision)
    comm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="role", required=True)
    m = sub.add_parser("master")
    m.add_argument("--listen", default="0.0.0.0:48148")
    p = sub.add_parser("peer")
    p.add_argument("--master", default="127.0.0.1:48148")
    p.add_argument("--weight", type=int, default=1)
    p.add_argument("--world", type=int, default=2, help="peers to wait for before starting")
    p.add_argument("--late", action="store_true", help="join a run that is under way")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--die-at", default="", help="STEP:multiple or STEP:async")
    p.add_argument("--torch", action="store_true",
                   help="hold torch tensors instead of numpy arrays where it can (peers mix)")
    p.add_argument("--hold", action="store_true",
                   help="read a line from stdin before connecting (start early, join later)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.role == "master":
        run_master(args)
    else:
        run_peer(args)


if __name__ == "__main__":
    main()
