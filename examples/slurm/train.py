"""A linear model trained data-parallel by pccl peers that Slurm starts (train.sbatch).

Each peer is one process started by ``python -m pccl.launch.slurm``; it finds the
master in ``PCCL_MASTER`` (``pccl.Communicator.from_env()``), its index in
``PCCL_SLURM_PEER`` and whether it replaces a failed process in ``PCCL_SLURM_RESTART``.
Every step:

1. a small all-reduce (MAX) of two flags decides, for all peers alike, whether to stop
   (some peer found ``--stop-file``, or the steps are done) and whether training has
   started (the founding peers wait until ``PCCL_SLURM_PEERS`` of them are in);
2. ``sync_shared_state``: the weights and the revision; a replacement receives them
   here (RECEIVE_ONLY) and trains on from the running revision;
3. each peer's gradient on its own batch, averaged with one all-reduce, plus a probe
   (SUM of ``[1, revision]``: exactly ``[world, world * revision]``), both through
   ``all_reduce_multiple_with_retry`` (pccl's retry policy: a peer dying mid-reduce
   costs a retry, not the step);
4. admitting joiners (``are_peers_pending()`` / ``update_topology()``).

A joiner's first collective is step 1 of the step after the one that admitted it, the
same call the running peers make next.

SIGTERM (the job is cancelled or preempted, or only this step is): the peer finishes its
step, writes its checkpoint (``--checkpoint DIR``) if given, leaves the run and exits
with status 143; the others go on. The founding peers of a new run (a requeued job)
start from the newest checkpoint in ``DIR``.

Output, in ``--out``: ``peer<i>.jsonl`` (events of every process of peer ``i``: started,
joined, synced, every ``--report-every`` steps, left) and ``result-peer<i>.json`` (the
final revision, ``pccl.content_hash`` of the weights, the last probe), written by the
process of peer ``i`` that finished the run. numpy only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import pccl

CONTROL, GRAD, PROBE = 0, 1, 2  # all-reduce tags


class Peer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.index = int(os.environ.get("PCCL_SLURM_PEER", "0"))
        self.peers = int(os.environ.get("PCCL_SLURM_PEERS", "1"))
        self.restart = int(os.environ.get("PCCL_SLURM_RESTART", "0"))
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = (self.out / f"peer{self.index}.jsonl").open("a")
        self.leaving = False  # SIGTERM: leave after this step
        rng = np.random.default_rng(args.seed)
        self.true_w = rng.standard_normal(args.dim).astype(np.float32)
        self.weights = np.zeros(args.dim, dtype=np.float32)
        self.revision = 0
        if args.checkpoint and self.restart == 0:
            self._load_checkpoint()

    def emit(self, event: str, **fields: Any) -> None:
        line = {"event": event, "peer": self.index, "restart": self.restart,
                "pid": os.getpid(), "t": round(time.time(), 3), **fields}
        self.log.write(json.dumps(line) + "\n")
        self.log.flush()

    # --- checkpoints: what a requeued job starts from ------------------------------

    def _load_checkpoint(self) -> None:
        # Each peer wrote its own file; all hold the same weights at a given revision
        # (the peers left one or two steps apart): take the newest.
        newest: tuple[int, np.ndarray] | None = None
        for path in sorted(Path(self.args.checkpoint).glob("peer*.npz")):
            with np.load(path) as ck:
                if newest is None or int(ck["revision"]) > newest[0]:
                    newest = (int(ck["revision"]), ck["weights"].copy())
        if newest is not None:
            self.revision, self.weights[:] = newest
            self.emit("checkpoint_loaded", revision=self.revision)

    def _save_checkpoint(self) -> None:
        directory = Path(self.args.checkpoint)
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".peer{self.index}.{os.getpid()}.npz"
        np.savez(tmp, weights=self.weights, revision=self.revision)
        os.replace(tmp, directory / f"peer{self.index}.npz")  # whole files only

    # --- the run -------------------------------------------------------------------

    def batch(self, revision: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.args.seed, revision + 1, rank])
        x = rng.standard_normal((self.args.batch, self.args.dim)).astype(np.float32)
        y = x @ self.true_w + 0.01 * rng.standard_normal(self.args.batch).astype(np.float32)
        return x, y

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        main = asyncio.current_task()
        assert main is not None
        joined = False

        def on_sigterm() -> None:
            self.leaving = True
            if not joined:  # still waiting to be admitted: nothing to finish
                main.cancel()

        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
        self.emit("started", joiner=self.restart > 0)
        comm = pccl.Communicator.from_env()
        try:
            await comm.connect(n_attempts=self.args.connect_attempts)
            joined = True
            self.emit("joined", peer_id=comm.peer_id, world=comm.world_size)
            done = await self.train(comm)
        except asyncio.CancelledError:
            self.emit("left", reason="SIGTERM before joining")
            return 143
        finally:
            await comm.close()
            loop.remove_signal_handler(signal.SIGTERM)
        return 0 if done else 143

    async def train(self, comm: pccl.Communicator) -> bool:
        """Trains until the run stops (True) or this peer must leave (False)."""
        a = self.args
        state = pccl.SharedState([pccl.TensorInfo.from_numpy(self.weights, "weights")],
                                 revision=self.revision)
        stop_file = Path(a.stop_file) if a.stop_file else None
        trained = False
        probe_info: dict[str, Any] = {}
        deadline = time.monotonic() + a.gather_timeout
        for _ in range(a.max_iterations):
            if self.leaving:
                if a.checkpoint and trained:
                    self._save_checkpoint()
                self.emit("left", reason="SIGTERM", revision=state.revision)
                return False
            # 1. Stop? Started? One answer for every peer.
            stop = bool(stop_file and stop_file.exists()) or state.revision >= a.steps
            control = np.array([int(stop), int(trained)], dtype=np.int32)
            (told,) = await comm.all_reduce_multiple_with_retry(
                [pccl.ReduceDescriptor(control, op=pccl.ReduceOp.MAX, tag=CONTROL)])
            if control[0]:
                break
            # The reduce's world size is the master's, the same for everyone.
            go = bool(control[1]) or told.world_size >= self.peers
            if go:
                # 2. The shared state: a fresh process receives it.
                fresh = comm.last_synced_revision is None
                strategy = (pccl.SharedStateSyncStrategy.RECEIVE_ONLY
                            if fresh and self.restart > 0
                            else pccl.SharedStateSyncStrategy.ENFORCE_POPULAR)
                info = await comm.sync_shared_state(state, strategy=strategy)
                if fresh:
                    self.emit("synced", revision=state.revision, strategy=strategy.name,
                              rx_bytes=info.rx_bytes, world=comm.world_size,
                              weights_hash=pccl.content_hash(self.weights))
                # 3. A step of gradient descent on the mean squared error.
                x, y = self.batch(state.revision, comm.rank)
                err = x @ self.weights - y
                grad = (x.T @ err / a.batch).astype(np.float32)
                probe = np.array([1.0, float(state.revision)], dtype=np.float64)
                infos = await comm.all_reduce_multiple_with_retry([
                    pccl.ReduceDescriptor(grad, op=pccl.ReduceOp.AVG, tag=GRAD),
                    pccl.ReduceDescriptor(probe, op=pccl.ReduceOp.SUM, tag=PROBE)])
                self.weights -= np.float32(a.lr) * grad
                probe_info = {"probe": probe.tolist(), "probe_revision": state.revision,
                              "probe_world": infos[1].world_size}
                state.revision += 1
                self.revision = state.revision
                trained = True
                if state.revision % a.report_every == 0:
                    self.emit("step", revision=state.revision, world=comm.world_size,
                              loss=float(np.mean(err * err)))
            elif time.monotonic() > deadline:
                raise TimeoutError(f"only {comm.world_size} of {self.peers} peers joined "
                                   f"within {a.gather_timeout}s")
            # 4. Admit joiners; with nobody waiting and no training yet, ask again shortly.
            if await comm.are_peers_pending():
                await comm.update_topology()
            elif not go:
                await asyncio.sleep(0.05)
        else:
            raise RuntimeError(f"no end after {a.max_iterations} iterations")
        x, y = self.batch(-1, 0)  # held out: no step trains on revision -1
        # world: the peers that took the decision to stop (others may be leaving by now).
        result = {"peer": self.index, "restart": self.restart, "revision": state.revision,
                  "world": told.world_size, "weights_hash": pccl.content_hash(self.weights),
                  "loss": float(np.mean((x @ self.weights - y) ** 2)),
                  "loss_at_zero": float(np.mean(y * y)), **probe_info}
        (self.out / f"result-peer{self.index}.json").write_text(json.dumps(result))
        if a.checkpoint:
            self._save_checkpoint()
        self.emit("finished", revision=state.revision, weights_hash=result["weights_hash"])
        return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for event logs and results")
    p.add_argument("--steps", type=int, default=500, help="train up to this revision")
    p.add_argument("--stop-file", default=None,
                   help="when this file appears, every peer stops after the same step")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="each peer writes DIR/peer<i>.npz when it leaves or finishes; the "
                        "founding peers of a new run start from the newest")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-every", type=int, default=10)
    p.add_argument("--connect-attempts", type=int, default=20)
    p.add_argument("--gather-timeout", type=float, default=300.0,
                   help="seconds the founding peers wait for each other")
    p.add_argument("--max-iterations", type=int, default=10_000_000)
    args = p.parse_args()
    sys.exit(asyncio.run(Peer(args).run()))


if __name__ == "__main__":
    main()
