"""One peer of a multi-host run: numpy only, configured from the environment.

    PCCL_MASTER=203.0.113.7:48148 PCCL_SECRET_FILE=run.secret python examples/peer.py

Start the master first (``pccl-master --listen 0.0.0.0:48148 --secret-file run.secret``)
and this script on every machine; ``PCCL_PEER_NAME``, ``PCCL_P2P_PORT`` and the rest of
``python -m pccl.config`` apply too. The README's loop, and:

- SIGTERM / SIGINT (``systemctl stop``, Ctrl-C) end the step in flight and ``close()``
  the communicator: the master records a leave, and the others carry on at once. A
  second signal stops the process outright.
- A pause (laptop sleep, swap, SIGSTOP, a Wi-Fi drop) longer than the master's heartbeat
  timeout makes the master drop this peer: the call in flight raises
  ``MasterConnectionError`` (nothing written), the communicator registers again by
  itself, and the loop carries on from the group's state. Other failures go through
  pccl's recovery policy (:mod:`pccl.recovery`): retry, or vote first, or give up.
- Checkpoints: the weights and revision right after a sync, written atomically every
  ``--checkpoint-every`` revisions, loaded at start. Which state wins at a sync: in a
  running group, the group's. A process started from a checkpoint is a fresh joiner,
  and fresh joiners do not vote while a peer that synced in this run is present; a
  peer that lost the master syncs ``RECEIVE_ONLY`` once (it missed steps). The
  checkpoints count when the whole group starts cold: every peer votes, the most
  common revision wins (ties: the higher) and, per tensor, the most common content
  (ties: the earliest-joined peer's), so start the peer with the newest checkpoint first.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from pathlib import Path

import numpy as np

import pccl
from pccl import recovery

DIM = 256
S = pccl.SharedStateSyncStrategy


def load(path: Path, weights: np.ndarray) -> int:
    """The revision of the checkpoint at ``path`` (its weights into ``weights``), or 0."""
    if not path.exists():
        return 0
    with np.load(path) as f:
        weights[:] = f["weights"]
        return int(f["revision"])


def save(path: Path, weights: np.ndarray, revision: int) -> None:
    """Writes a checkpoint atomically: a crash mid-write leaves the previous one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, weights=weights, revision=revision)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


async def train(comm: pccl.Communicator, args: argparse.Namespace) -> None:
    # Your model and data: here, least squares on data only this peer sees.
    rng = np.random.default_rng()
    x = rng.standard_normal((64, DIM), dtype=np.float32)
    y = x @ np.linspace(-1, 1, DIM, dtype=np.float32)
    weights = np.zeros(DIM, dtype=np.float32)
    grads = np.zeros_like(weights)
    state = pccl.SharedState([pccl.TensorInfo.from_numpy(weights, "weights")],
                             revision=load(args.checkpoint, weights))
    strategy = S.ENFORCE_POPULAR
    vote = False  # the recovery policy asked for update_topology() before the retry
    failures = 0
    while True:
        try:
            if vote or await comm.are_peers_pending():   # collective: the same answer for all
                await comm.update_topology()             # admit joiners, rebuild the ring
                vote = False
            if comm.world_size < args.peers:             # wait for company (polls the master)
                await asyncio.sleep(0.1)
                continue
            if comm.last_synced_revision is not None:    # one revision per sync, retries too
                state.revision = comm.last_synced_revision + 1
            await comm.sync_shared_state(state, strategy)
            strategy, failures = S.ENFORCE_POPULAR, 0
            if state.revision % args.checkpoint_every == 0 or state.revision >= args.steps:
                save(args.checkpoint, weights, state.revision)
            print(f"revision {state.revision}: {comm.world_size} peers, "
                  f"weights {pccl.content_hash(weights)[:8]}", flush=True)  # equal on every peer
            if state.revision >= args.steps:
                return
            err = x @ weights - y                        # your backward pass here
            grads[:] = x.T @ err / len(x)
            await comm.all_reduce_multiple_with_retry(
                [pccl.ReduceDescriptor(grads, op=pccl.ReduceOp.AVG)])
            weights -= args.lr * grads
        except pccl.MasterConnectionError as e:
            # The master is gone or dropped this peer (a pause past its heartbeat
            # timeout): nothing was written, and the communicator registers again by
            # itself (the next call waits for that, up to reconnect_timeout). This peer
            # missed steps: it takes the group's state. (If every peer lost the master,
            # nobody offers state; the next attempt votes again.)
            failures += 1
            print(f"{e}; carrying on", flush=True)
            strategy = S.RECEIVE_ONLY
        except pccl.NoSharedStateAvailableError:
            failures += 1
            strategy = S.ENFORCE_POPULAR                 # every peer asked to receive
        except pccl.PCCLError as e:
            failures += 1
            action = recovery.decide(e, failures)
            if action is recovery.Action.GIVE_UP:
                raise
            print(f"{type(e).__name__}: {e}; {action.value}", flush=True)
            vote = action is recovery.Action.UPDATE_TOPOLOGY
        if failures > args.max_failures:
            raise RuntimeError(f"{failures} failed steps in a row; giving up")


async def main(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None

    def stop() -> None:  # the first signal leaves gracefully; a second one kills
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        task.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    try:
        async with pccl.Communicator.from_env() as comm:  # close() on the way out: a leave
            await train(comm, args)
    except asyncio.CancelledError:
        print("stopped by a signal: left the run", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1000, help="revision to train up to")
    p.add_argument("--peers", type=int, default=2,
                   help="train only in a group of at least this many peers (else wait)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--checkpoint", type=Path, default=Path("peer.ckpt.npz"))
    p.add_argument("--checkpoint-every", type=int, default=50, metavar="N")
    p.add_argument("--max-failures", type=int, default=20,
                   help="failed steps in a row before giving up")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(p.parse_args()))
