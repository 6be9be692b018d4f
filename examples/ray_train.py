"""Data-parallel training on Ray with pccl: a master actor, peer actors, one killed.

    pip install "pccl[ray]"
    python examples/ray_train.py                      # a local Ray, 3 peers, 1 kill
    python examples/ray_train.py --peers 4 --kill-at 0  # no kill
    python examples/ray_train.py --address auto --listen ""   # on a running cluster

The model is a linear regression in numpy. Every peer holds its own shard of the data
(seeded by its rank, so a replacement gets the same shard) and, every step:

1. admits joiners waiting to get in (``ctx.admit_joiners()``);
2. computes its gradient and all-reduces ``[gradient, loss, 1]`` with SUM (pccl's retry
   policy: a peer dying mid-reduce costs a retry, not the step). The last element counts
   the peers that contributed;
3. applies the mean gradient to the weights and syncs the shared state (weights and step
   counter), which keeps every peer's weights bit-identical.

After ``--kill-at`` steps the driver kills one peer actor with ``ray.kill``. Ray restarts
it and runs the training function again; that new peer waits in ``connect()`` until the
others admit it. Its first collective is the step's reduce, which it joins with zeros
and a count of 0 (it has no weights yet, so nothing to contribute), exactly what the
others call next whether they admitted it between steps or inside a retried reduce;
the sync right after hands it the weights and the step. The run ends at the first step
at or after ``--steps`` that every peer trained, so a replacement always catches up.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

import pccl

DIM = 64  # weights
ROWS = 20_000  # samples per peer


def truth() -> np.ndarray:
    """The weights the data was made with (what training should find)."""
    return np.random.default_rng(0).standard_normal(DIM).astype(np.float32)


def shard(rank: int) -> tuple[np.ndarray, np.ndarray]:
    """The rank's data: the same on every start of that rank."""
    rng = np.random.default_rng(1 + rank)
    x = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    y = x @ truth() + np.float32(0.1) * rng.standard_normal(ROWS).astype(np.float32)
    return x, y


async def train(comm: pccl.Communicator, ctx: Any) -> dict[str, Any]:
    steps, lr = ctx.args
    x, y = shard(ctx.rank)
    weights = np.zeros(DIM, dtype=np.float32)
    step = np.zeros(1, dtype=np.int64)
    state = pccl.SharedState([pccl.TensorInfo.from_numpy(weights, "weights"),
                              pccl.TensorInfo.from_numpy(step, "step")])
    buf = np.zeros(DIM + 2, dtype=np.float32)  # gradient, loss, contributors
    fresh = ctx.restarted  # a replacement: no weights until its first sync
    if not fresh:
        await ctx.wait_for_peers(timeout=120.0)  # the founders gather
        await comm.sync_shared_state(state)      # and start from the same weights
    world = comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE)
    trained = 0
    for _ in range(10 * steps + 100):  # bounded; the run ends long before
        if not fresh:
            if int(step[0]) >= steps and world < ctx.num_peers:
                await ctx.wait_for_peers(timeout=120.0)  # a peer is missing: let it back in
            else:
                await ctx.admit_joiners()
        if fresh:
            buf[:] = 0.0
        else:
            err = x @ weights - y
            buf[:DIM] = x.T @ err / np.float32(ROWS)
            buf[DIM] = float(err @ err) / ROWS
            buf[DIM + 1] = 1.0
            trained += 1
        (info,) = await comm.all_reduce_multiple_with_retry(
            [pccl.ReduceDescriptor(buf, op=pccl.ReduceOp.SUM, tag=0)])
        world = comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE)
        contributors = int(buf[DIM + 1])
        if contributors:
            weights -= np.float32(lr) * (buf[:DIM] / np.float32(contributors))
        step[0] += 1
        state.revision += 1
        await comm.sync_shared_state(state)  # a replacement adopts weights and step here
        fresh = False
        loss = float(buf[DIM]) / max(contributors, 1)
        ctx.report(step=int(step[0]), world=info.world_size, loss=loss)
        if int(step[0]) >= steps and contributors == ctx.num_peers:
            break
    else:
        raise RuntimeError(f"rank {ctx.rank}: no step with all {ctx.num_peers} peers")
    return {"rank": ctx.rank, "incarnation": ctx.incarnation, "steps": int(step[0]),
            "trained": trained, "loss": loss, "hash": pccl.content_hash(weights),
            "error": float(np.abs(weights - truth()).max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--kill-at", type=int, default=5,
                        help="kill a peer actor once every peer did this many steps (0: never)")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--address", default=None,
                        help="a running Ray cluster ('auto'); default: start a local one")
    parser.add_argument("--listen", default="127.0.0.1:0",
                        help="the master's host:port; empty: the node's IP, port 48148")
    args = parser.parse_args()

    import ray

    from pccl.launch.ray import launch

    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)

    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.peers + 1, include_dashboard=False,
                 _node_ip_address="127.0.0.1", log_to_driver=False)
    say("Ray is up")
    try:
        with launch(train, args.peers, args=(args.steps, args.lr), name="pccl-ray-train",
                    namespace="pccl-example", listen=args.listen or None,
                    communicator_options={"p2p_connection_pool_size": 1},
                    max_restarts=2, connect_timeout=120.0) as run:
            say(f"master actor listening on {run.master_address}; {args.peers} peer actors "
                "started")
            killed = args.kill_at <= 0
            seen_world, next_print = 0, 0
            deadline = time.monotonic() + 300
            while not run.done() and time.monotonic() < deadline:
                time.sleep(0.1)  # the driver looks in on the peers ten times a second
                progress = run.progress(timeout=5.0)
                reports = [p for p in progress.values() if "step" in p]
                if not reports:
                    continue
                head = max(reports, key=lambda p: p["step"])
                if head["world"] != seen_world or head["step"] >= next_print:
                    say(f"step {head['step']}: world size {head['world']}, "
                        f"loss {head['loss']:.4f}")
                    seen_world, next_print = head["world"], head["step"] // 20 * 20 + 20
                if not killed and len(reports) == args.peers and \
                        min(p["step"] for p in reports) >= args.kill_at:
                    say(f"ray.kill(peer actor {args.kill_rank}, no_restart=False): Ray "
                        "restarts it and it comes back as a joiner")
                    ray.kill(run.peers[args.kill_rank], no_restart=False)
                    killed = True
            results = run.wait(timeout=60.0)
            restarts = run.incarnations()
        say("run finished; every peer's result:")
        for r in results:
            say(f"  rank {r['rank']} (start #{r['incarnation'] + 1}): trained "
                f"{r['trained']} of {r['steps']} steps, loss {r['loss']:.5f}, "
                f"|w - truth| {r['error']:.4f}, weights hash {r['hash']}")
        hashes = {r["hash"] for r in results}
        say(f"restarts by rank: {restarts}")
        say("parity: every peer holds bit-identical weights" if len(hashes) == 1
            else f"PARITY BROKEN: {len(hashes)} distinct weight hashes")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
