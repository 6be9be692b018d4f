"""Sharded nodes: FSDP-style sharding inside each node, pccl across nodes.

    python examples/sharded_nodes.py                  # gloo on CPU; the whole story
    python examples/sharded_nodes.py --backend nccl   # one GPU per local rank

A *node* is a small torch.distributed group (``LOCAL_WORLD`` processes, gloo or nccl).
Each local rank owns a contiguous slice of the model's flattened parameters and of the
optimizer state, FSDP-style. A step:

1. inside the node (torch.distributed): all-gather the slices into the full flat
   parameters, forward and backward on the rank's micro-batch, reduce-scatter the
   gradient so each rank holds the node's average gradient for its own slice;
2. across nodes (pccl): local rank ``r`` of every node is a peer of pccl **peer group
   r** and all-reduces (AVG) only its slice, so pccl never moves the whole model and
   every group is its own ring;
3. the optimizer (SGD with momentum) updates the slice.

Nodes join and die as a whole and the run goes on. Three rules make that work
(``NodeRank`` below):

- **Decide as a node.** ``update_topology()`` is collective over every accepted peer of
  every group, and the ranks of a node also wait on each other inside torch.distributed.
  So after every pccl call the node's ranks agree (a one-element gloo all-reduce) on
  whether it worked; if any failed, all of them call ``update_topology()`` together and
  restart the step (from its ``are_peers_pending()``). Each group's outcome is the same
  on every node (pccl is all-or-nothing per group), so every node restarts together; a
  node that went ahead has its next pccl call refused or called off because the others
  vote, and joins the vote.
- **Nothing changes before the step succeeded.** Parameters and momentum change only
  after both slices' all-reduces succeeded on every rank of the node, so a restarted
  step recomputes the same gradients from the same parameters.
- **Join rank by rank, start whole.** pccl admits whichever peers are pending when a
  vote ends, so a node's ranks might be admitted in different rounds. Rank ``r + 1``
  registers only after rank ``r`` was accepted, so a node that is only partly in holds
  a prefix of its ranks, and the run is whole exactly when every group has the same
  size (``GLOBAL_WORLD_SIZE == LOCAL_WORLD * LARGEST_PEER_GROUP_WORLD_SIZE``). An
  accepted rank keeps calling ``update_topology()`` (which admits the next rank of its
  node) until the run is whole; then the node starts training, its first sync of every
  group being ``RECEIVE_ONLY``. A join that overlaps a node dying can see sizes
  that look whole for a moment; that case is not handled here (the node's
  torch.distributed timeout ends it).

Every attempt of a step starts with ``are_peers_pending()``, asked by every accepted rank
of every node: it is a collective over the whole run (one answer for all, given once all
of them asked), so all ranks ask it at that one point, which every join and every vote
leads back to; while it says yes, the nodes vote. Then ``sync_shared_state`` of the
rank's slice (parameters, momentum, step counter): cheap while every node agrees, and
the point where joiners catch up.

When a node dies, the master rebuilds each group's ring from the peers left on its own,
and the survivors' collectives that waited for the dead node run on the new rings;
only a collective already moving bytes fails (typed error, vote, restart). With
``MasterNode(repair_rings=False)`` every collective fails until the nodes voted.

This script starts an in-process ``pccl.MasterNode`` and every rank as a process of its
own (this file with ``--worker``), drives them over stdin (``join``, ``allow N``: run up
to step N, ``finish``) so the story is the same every time, and prints what happened.
Workers report JSON lines on stdout; ``tests/system/test_sharded_nodes.py`` drives the same
workers and checks every step bit for bit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

import pccl
from pccl.testing import free_port

log = logging.getLogger("sharded_nodes")

LOCAL_WORLD = 2  # processes per node
IN, HIDDEN, OUT, BATCH = 8, 32, 4, 16  # the model and the micro-batch per rank
LR, MOMENTUM = 0.05, 0.9
REDUCE_TAG = 0
SCRIPT = Path(__file__).resolve()
MAX_RESTARTS = 50  # per step: failed pccl calls before the worker gives up
DIST_TIMEOUT = 60.0  # seconds: torch.distributed waits inside a node
JOIN_TIMEOUT = 60.0  # seconds a node may take to be admitted as a whole

# Errors that a new topology can fix: call update_topology() and retry. Anything else
# (usage errors, a lost master) ends the worker.
RETRYABLE = (pccl.PeerConnectionError, pccl.CollectiveAbortedError,
             pccl.UpdateTopologyFailedError, pccl.NoSharedStateAvailableError)


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# --- the model, flattened and sharded ----------------------------------------------------


def make_model() -> Any:
    """The same initial weights on every node (seeded, without touching the caller's
    RNG state)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(),
                                   torch.nn.Linear(HIDDEN, OUT))


def shard_numel(numel: int, local_world: int) -> int:
    return -(-numel // local_world)


def initial_shards(local_world: int = LOCAL_WORLD) -> list[np.ndarray]:
    """Every rank's slice of the initial flat parameters (zero-padded at the end)."""
    import torch

    flat = torch.cat([p.detach().reshape(-1) for p in make_model().parameters()])
    n = shard_numel(flat.numel(), local_world)
    padded = torch.zeros(n * local_world)
    padded[:flat.numel()] = flat
    return [padded[r * n:(r + 1) * n].numpy().copy() for r in range(local_world)]


def batch(node: int, local_rank: int, step: int) -> tuple[Any, Any]:
    """The micro-batch of ``local_rank`` of ``node`` at ``step``: a fixed teacher's
    outputs on random inputs (every node sees different data)."""
    import torch

    teacher = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(1_000_003 * step + 1_009 * node + local_rank)
    x = torch.randn(BATCH, IN, generator=g)
    return x, torch.sin(x @ teacher)


class ShardedModel:
    """One local rank's slice of the flat parameters and momentum (host float32: what
    pccl reduces and syncs), and the node-local forward/backward over the full model."""

    def __init__(self, local_rank: int, local_world: int, device: Any) -> None:
        import torch

        self.torch = torch
        self.local_rank, self.local_world, self.device = local_rank, local_world, device
        self.module = make_model().to(device)
        self.layout = [(name, p.shape, p.numel()) for name, p in self.module.named_parameters()]
        self.numel = sum(n for _, _, n in self.layout)
        self.n = shard_numel(self.numel, local_world)
        self.params = torch.from_numpy(initial_shards(local_world)[local_rank])
        self.momentum = torch.zeros(self.n)
        self.lr = torch.tensor(LR, dtype=torch.float32)
        self.mu = torch.tensor(MOMENTUM, dtype=torch.float32)

    def gradient(self, x: Any, y: Any) -> tuple[float, Any]:
        """All-gather the slices, forward/backward, reduce-scatter the gradient; returns
        the local loss and the node's average gradient for this rank's slice (host)."""
        torch, dist = self.torch, self.torch.distributed
        full = torch.empty(self.n * self.local_world, device=self.device)
        dist.all_gather_into_tensor(full, self.params.to(self.device))
        full.requires_grad_(True)
        views, offset = {}, 0
        for name, shape, n in self.layout:
            views[name] = full[offset:offset + n].view(shape)
            offset += n
        out = torch.func.functional_call(self.module, views, (x.to(self.device),))
        loss = torch.nn.functional.mse_loss(out, y.to(self.device))
        loss.backward()
        assert full.grad is not None
        grad = torch.empty(self.n, device=self.device)
        dist.reduce_scatter_tensor(grad, full.grad, op=dist.ReduceOp.SUM)
        grad /= self.local_world
        return loss.item(), grad.cpu().contiguous()

    def apply(self, grad: Any) -> None:
        """SGD with momentum on the slice; separate float32 roundings (no fused
        multiply-add), so ``tests/`` can repeat it in numpy bit for bit."""
        self.momentum.mul_(self.mu).add_(grad)
        self.params.sub_(self.momentum * self.lr)


# --- one local rank of one node ------------------------------------------------------------


class Gate:
    """The driver's commands: ``join``, ``allow N`` (steps up to N may run), ``finish``
    (leave at the next step that is not allowed)."""

    def __init__(self, allowed: int) -> None:
        self.allowed = allowed
        self.join = False
        self.finishing = False
        self._changed = asyncio.Event()

    def apply(self, line: str) -> None:
        cmd, _, arg = line.partition(" ")
        if cmd == "join":
            self.join = True
        elif cmd == "allow":
            self.allowed = max(self.allowed, int(arg))
        elif cmd == "finish":
            self.finishing = True
        else:
            raise ValueError(f"unknown command {line!r}")
        self._changed.set()

    async def _until(self, done: Callable[[], bool]) -> None:
        while not done():
            self._changed.clear()
            await self._changed.wait()

    async def joined(self) -> None:
        await self._until(lambda: self.join)

    async def reach(self, step: int) -> bool:
        """Whether ``step`` may run (False: leave)."""
        await self._until(lambda: step <= self.allowed or self.finishing)
        return step <= self.allowed


class NodeRank:
    """Local rank ``rank`` of node ``node``: torch.distributed inside the node, a pccl
    peer of group ``rank`` across nodes."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.node, self.rank, self.local_world = args.node, args.rank, args.local_world
        self.gate = Gate(args.allow)
        self.comm: pccl.Communicator | None = None
        self.synced_revision: int | None = None  # of this rank's last successful sync
        self.offer = False  # nobody had state: offer our (seeded) initial state
        self.step_no = 0  # the step being worked on, for reports

    # --- torch.distributed inside the node -------------------------------------------

    def _init_dist(self) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        backend = self.args.backend
        if backend == "nccl":
            torch.cuda.set_device(self.rank)
            self.device = torch.device("cuda", self.rank)
        else:
            self.device = torch.device("cpu")
        timeout = timedelta(seconds=DIST_TIMEOUT)
        self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                   self.local_world, is_master=self.rank == 0,
                                   timeout=timeout, wait_for_workers=False)
        dist.init_process_group(backend, store=self.store, rank=self.rank,
                                world_size=self.local_world, timeout=timeout)
        # The node's yes/no agreements are tiny host tensors: gloo, whatever the backend.
        self.ctrl = None if backend == "gloo" else dist.new_group(backend="gloo")
        self.model = ShardedModel(self.rank, self.local_world, self.device)
        self.step_t = torch.zeros(1, dtype=torch.int64)  # steps completed by the run

    async def _node_all(self, ok: bool) -> bool:
        """Whether every rank of the node says yes (ranks wait for each other)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([1 if ok else 0], dtype=torch.int32)
        await asyncio.to_thread(dist.all_reduce, t, op=dist.ReduceOp.MIN, group=self.ctrl)
        return bool(t.item())

    async def _node_any(self, yes: bool) -> bool:
        return not await self._node_all(not yes)

    # --- joining --------------------------------------------------------------------

    async def _join(self) -> None:
        """Registers after the previous local rank was accepted, then votes until every
        node of the run is whole (see the module docstring)."""
        assert self.comm is not None
        if self.rank > 0:
            await asyncio.to_thread(self.store.wait, [f"accepted/{self.rank - 1}"],
                                    timedelta(seconds=JOIN_TIMEOUT))
        await self.comm.connect()
        self.store.set(f"accepted/{self.rank}", "1")
        deadline = asyncio.get_running_loop().time() + JOIN_TIMEOUT
        while not self._run_is_whole():
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"the run was not whole within {JOIN_TIMEOUT}s")
            await self._attempt("update_topology", self.comm.update_topology())
        _emit({"event": "joined", "node": self.node, "rank": self.rank,
               "peer_id": self.comm.peer_id,
               "global_world": self.comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE)})

    def _run_is_whole(self) -> bool:
        assert self.comm is not None
        world = self.comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE)
        largest = self.comm.get_attribute(pccl.Attribute.LARGEST_PEER_GROUP_WORLD_SIZE)
        return world == self.local_world * largest

    # --- pccl calls ------------------------------------------------------------------

    async def _attempt(self, phase: str, call: Any) -> bool:
        """Runs one pccl call; a retryable failure is reported and returns False."""
        try:
            await call
            return True
        except RETRYABLE as e:
            if isinstance(e, pccl.NoSharedStateAvailableError):
                self.offer = True
            # Before its first sync a joiner does not know the run's step yet.
            step = self.step_no if self.synced_revision is not None else None
            _emit({"event": "failure", "node": self.node, "rank": self.rank, "step": step,
                   "phase": phase, "kind": type(e).__name__, "message": str(e)})
            return False

    async def _vote(self) -> None:
        """``update_topology()`` on every rank of the node, until all of them succeeded."""
        assert self.comm is not None
        for _ in range(MAX_RESTARTS):
            ok = await self._attempt("update_topology", self.comm.update_topology())
            if await self._node_all(ok):
                return
        raise RuntimeError(f"update_topology() kept failing ({MAX_RESTARTS} attempts)")

    async def _admit_pending(self) -> None:
        """Votes with the whole run until ``are_peers_pending()`` says nobody waits.

        ``are_peers_pending()`` is a collective over every accepted peer of every group:
        it is answered once all of them asked (or are voting), with one answer for all.
        So every rank of every node asks it at the same point: here, at the top of every
        attempt of a step, which is also where every vote and every join leads."""
        assert self.comm is not None
        deadline = asyncio.get_running_loop().time() + JOIN_TIMEOUT
        while await self._node_any(await self.comm.are_peers_pending()):
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"peers were still pending after {JOIN_TIMEOUT}s")
            await self._vote()

    async def _sync(self) -> None:
        """This rank's slice (parameters, momentum, step) in its group's shared state."""
        assert self.comm is not None
        fresh = self.synced_revision is None
        strategy = (pccl.SharedStateSyncStrategy.RECEIVE_ONLY if fresh and not self.offer
                    else pccl.SharedStateSyncStrategy.ENFORCE_POPULAR)
        state = pccl.SharedState([
            pccl.TensorInfo.from_torch(self.model.params, "params"),
            pccl.TensorInfo.from_torch(self.model.momentum, "momentum"),
            pccl.TensorInfo.from_torch(self.step_t, "step"),
        ], revision=0 if fresh else self.synced_revision + 1)
        info = await self.comm.sync_shared_state(state, strategy=strategy)
        self.synced_revision = state.revision
        self.last_sync = {"strategy": strategy.name, "rx_bytes": info.rx_bytes,
                          "revision": state.revision}

    async def _reduce(self, grad: Any) -> None:
        """The node's gradient of this rank's slice, averaged over the nodes (in place)."""
        assert self.comm is not None
        self.last_reduce = await self.comm.all_reduce(grad, op=pccl.ReduceOp.AVG,
                                                      tag=REDUCE_TAG)

    # --- the training loop -------------------------------------------------------------

    async def _train(self) -> None:
        assert self.comm is not None
        restart = False
        restarts = 0
        while True:
            self.step_no = int(self.step_t.item()) + 1
            if not restart:
                restarts = 0
                if not await self.gate.reach(self.step_no):
                    return
            elif restarts > MAX_RESTARTS:
                raise RuntimeError(f"step {self.step_no} failed {restarts} times")
            restart = True
            restarts += 1
            # 0. Admit joiners: every accepted rank of the run asks here, after a join,
            # after a vote and at every step (a collective: all hear one answer).
            await self._admit_pending()
            # 1. Shared state: a no-op while the nodes agree; joiners catch up here.
            ok = await self._attempt("sync_shared_state", self._sync())
            if not await self._node_all(ok):
                await self._vote()
                continue
            self.step_no = int(self.step_t.item()) + 1  # a joiner learned it just now
            # 2. Inside the node: the node's average gradient of this rank's slice.
            x, y = batch(self.node, self.rank, self.step_no)
            loss, grad = await asyncio.to_thread(self.model.gradient, x, y)
            grad_in = grad.numpy().copy()
            # 3. Across nodes: average the slice over the nodes (pccl peer group = rank).
            ok = await self._attempt("all_reduce", self._reduce(grad))
            if not await self._node_all(ok):
                await self._vote()
                continue
            # 4. The optimizer, on the slice only.
            self.model.apply(grad)
            self.step_t += 1
            restart = False
            params = self.model.params.numpy()
            _emit({"event": "step", "node": self.node, "rank": self.rank,
                   "step": self.step_no, "peer_id": self.comm.peer_id,
                   "ring": list(self.comm.ring), "world": self.last_reduce.world_size,
                   "loss": loss, "restarts": restarts - 1, "sync": self.last_sync,
                   "grad_in": grad_in.tobytes().hex(), "grad_out": grad.numpy().tobytes().hex(),
                   "params": params.tobytes().hex(),
                   "momentum": self.model.momentum.numpy().tobytes().hex(),
                   "params_hash": pccl._core.content_hash(params.view(np.uint8)).hex()})

    # --- lifecycle ----------------------------------------------------------------------

    async def _read_commands(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        try:
            while line := await reader.readline():
                self.gate.apply(line.decode().strip())
        finally:
            transport.close()
        if not self.gate.finishing:
            os._exit(2)  # the driver is gone: nobody will ever tell this rank to go on

    async def run(self) -> None:
        commands = asyncio.create_task(self._read_commands())
        try:
            await asyncio.to_thread(self._init_dist)
            _emit({"event": "ready", "node": self.node, "rank": self.rank,
                   "shard_numel": self.model.n})
            await self.gate.joined()
            self.comm = pccl.Communicator(master=self.args.master, peer_group=self.rank,
                                          p2p_connection_pool_size=2,
                                          peer_timeout=self.args.peer_timeout)
            try:
                await self._join()
                await self._train()
            finally:
                await self.comm.close()
            import torch.distributed as dist

            dist.destroy_process_group()
            _emit({"event": "left", "node": self.node, "rank": self.rank})
        finally:
            commands.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await commands


def worker_main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format=f"node {args.node} rank {args.rank} %(levelname)s "
                               "%(name)s: %(message)s")
    try:
        asyncio.run(NodeRank(args).run())
    except BaseException:
        _emit({"event": "crashed", "node": args.node, "rank": args.rank,
               "error": traceback.format_exc()})
        raise SystemExit(1) from None
    # Everything is closed and reported. The interpreter's teardown with torch loaded
    # takes seconds; skip it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- the driver: a master and the nodes' processes ------------------------------------------


class RankProcess:
    """One worker process; its JSON lines go to the run's event log."""

    def __init__(self, run: ShardedRun, node: int, rank: int, args: list[str],
                 env: dict[str, str]) -> None:
        self.run, self.node, self.rank, self.args, self.env = run, node, rank, args, env
        self.proc: asyncio.subprocess.Process | None = None
        self.killed = False
        self.left = False
        self.peer_id: int | None = None
        self._reader: asyncio.Task[None] | None = None
        self.stderr_path = (run.log_dir / f"node{node}-rank{rank}.stderr"
                            if run.log_dir is not None else None)

    async def start(self) -> None:
        err = self.stderr_path.open("wb") if self.stderr_path is not None else None
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, str(SCRIPT), "--worker", *self.args,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=err, env=self.env)
        finally:
            if err is not None:
                err.close()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            ev = json.loads(line)
            if ev["event"] == "joined":
                self.peer_id = ev["peer_id"]
            elif ev["event"] == "left":
                self.left = True
            elif ev["event"] == "crashed":
                self.run.fail(f"node {self.node} rank {self.rank} crashed:\n{ev['error']}")
            self.run.record(ev)
        code = await self.proc.wait()
        if not self.killed and not (self.left and code == 0):
            self.run.fail(f"node {self.node} rank {self.rank} exited with {code}"
                          f"{self._stderr_tail()}")
        self.run.record({"event": "exited", "node": self.node, "rank": self.rank,
                         "code": code})

    def _stderr_tail(self) -> str:
        if self.stderr_path is None or not self.stderr_path.exists():
            return ""
        lines = self.stderr_path.read_text(errors="replace").splitlines()[-30:]
        return "; stderr:\n" + "\n".join(lines)

    def send(self, line: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        if self.proc.returncode is None:
            self.proc.stdin.write((line + "\n").encode())

    def kill(self) -> None:
        """SIGKILL: no goodbye; the kernel resets its sockets."""
        if self.proc is not None and self.proc.returncode is None:
            self.killed = True
            self.proc.kill()

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    async def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            self.killed = True
            self.proc.kill()
        await self.proc.wait()
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await self._reader
        if self.proc.stdin is not None:
            self.proc.stdin.close()
            with contextlib.suppress(Exception):
                await self.proc.stdin.wait_closed()
        transport = getattr(self.proc, "_transport", None)
        if transport is not None:
            transport.close()


class Node:
    """``LOCAL_WORLD`` rank processes sharing one torch.distributed group."""

    def __init__(self, run: ShardedRun, node_id: int) -> None:
        self.run, self.id = run, node_id
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        self.ranks = [RankProcess(run, node_id, r, [
            "--node", str(node_id), "--rank", str(r), "--local-world", str(run.local_world),
            "--master", run.master.address, "--backend", run.backend,
            "--peer-timeout", str(run.peer_timeout), "--log-level", run.log_level,
        ], env) for r in range(run.local_world)]

    def send(self, line: str) -> None:
        for p in self.ranks:
            p.send(line)

    def kill(self) -> None:
        for p in self.ranks:
            p.kill()

    @property
    def peer_ids(self) -> list[int | None]:
        return [p.peer_id for p in self.ranks]


class ShardedRun:
    """A master plus nodes of worker processes; everything is torn down on exit.

    Example::

        async with ShardedRun() as run:
            a, b = await run.start_nodes(2)
            await run.join(a); await run.join(b)
            run.allow([a, b], 3)
            await run.wait_steps([a, b], 3)
    """

    def __init__(self, *, backend: str = "gloo", local_world: int = LOCAL_WORLD,
                 peer_timeout: float = 5.0, log_level: str = "ERROR",
                 log_dir: Path | None = None, wait_timeout: float = 60.0,
                 master_options: dict[str, Any] | None = None) -> None:
        self.backend, self.local_world = backend, local_world
        self.peer_timeout, self.log_level, self.log_dir = peer_timeout, log_level, log_dir
        self.wait_timeout = wait_timeout
        self.master = pccl.MasterNode(listen="127.0.0.1:0", **{
            "heartbeat_interval": 0.25, "heartbeat_timeout": 3.0, **(master_options or {})})
        self.nodes: list[Node] = []
        self.events: list[dict[str, Any]] = []
        self.failure: str | None = None
        self._changed = asyncio.Event()

    # --- events ---------------------------------------------------------------------

    def record(self, ev: dict[str, Any]) -> None:
        self.events.append(ev)
        self._changed.set()

    def fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = why
        self._changed.set()

    async def wait_for(self, done: Callable[[], bool], what: str) -> None:
        """Waits until ``done()`` (re-checked on every event), bounded by wait_timeout;
        raises at once when a worker crashed."""
        try:
            async with asyncio.timeout(self.wait_timeout):
                while not done():
                    if self.failure is not None:
                        raise RuntimeError(self.failure)
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise TimeoutError(f"no {what} within {self.wait_timeout}s") from None

    def reports(self, step: int | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events
                if e["event"] == "step" and (step is None or e["step"] == step)]

    def failures(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "failure"]

    def _has(self, kind: str, node: Node, **match: Any) -> bool:
        ranks = {e["rank"] for e in self.events
                 if e["event"] == kind and e["node"] == node.id
                 and all(e.get(k) == v for k, v in match.items())}
        return len(ranks) == self.local_world

    # --- orchestration ----------------------------------------------------------------

    async def start_nodes(self, n: int) -> list[Node]:
        """Starts ``n`` nodes' processes (they wait for ``join``)."""
        new = [Node(self, len(self.nodes) + i) for i in range(n)]
        self.nodes += new
        for node in new:
            for p in node.ranks:
                await p.start()
        await self.wait_for(lambda: all(self._has("ready", node) for node in new),
                            "ready nodes")
        return new

    async def join(self, node: Node) -> None:
        """Tells ``node`` to join; returns once it is in (an empty run admits it alone)
        or its first rank waits to be admitted by the others' next vote."""
        empty = not self.master.state.accepted()
        node.send("join")
        if empty:
            await self.wait_for(lambda: self._has("joined", node), f"node {node.id} joined")
        else:
            await self.master.wait_for(lambda s: bool(s.pending()), timeout=self.wait_timeout)

    def allow(self, nodes: Iterable[Node], step: int) -> None:
        for node in nodes:
            node.send(f"allow {step}")

    async def wait_steps(self, nodes: Iterable[Node], step: int) -> None:
        nodes = list(nodes)
        await self.wait_for(lambda: all(self._has("step", n, step=step) for n in nodes),
                            f"step {step} on nodes {[n.id for n in nodes]}")

    async def kill(self, node: Node) -> None:
        node.kill()
        await self.wait_for(lambda: all(p.returncode is not None for p in node.ranks),
                            f"node {node.id} to die")

    async def finish(self, nodes: Iterable[Node]) -> None:
        """Lets ``nodes`` leave gracefully after their last allowed step."""
        nodes = list(nodes)
        for node in nodes:
            node.send("finish")
        await self.wait_for(lambda: all(p.returncode is not None
                                        for n in nodes for p in n.ranks), "workers to exit")

    async def __aenter__(self) -> ShardedRun:
        await self.master.start()
        return self

    async def close(self) -> None:
        for node in self.nodes:
            for p in node.ranks:
                await p.close()
        await self.master.stop()

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()


# --- the story --------------------------------------------------------------------------------


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def describe_step(run: ShardedRun, step: int) -> str:
    reps = run.reports(step)
    nodes = sorted({r["node"] for r in reps})
    shards = []
    for rank in range(run.local_world):
        hashes = {r["params_hash"] for r in reps if r["rank"] == rank}
        shards.append(f"slice {rank} {next(iter(hashes))[:12]}"
                      f"{'' if len(hashes) == 1 else ' MISMATCH'}")
    loss = np.mean([r["loss"] for r in reps])
    restarts = max(r["restarts"] for r in reps)
    return (f"step {step}: nodes {nodes}, pccl world {reps[0]['world']}, loss {loss:.4f}, "
            f"{', '.join(shards)}" + (f", restarted {restarts}x" if restarts else ""))


async def story(args: argparse.Namespace) -> int:
    async with ShardedRun(backend=args.backend, log_level=args.log_level) as run:
        say(f"pccl master on {run.master.address}; starting 3 nodes x {run.local_world} "
            f"processes ({args.backend})")
        a, b, c = await run.start_nodes(3)
        numel = next(e for e in run.events if e["event"] == "ready")["shard_numel"]
        say(f"each rank owns {numel} of the model's flat parameters; pccl peer group r "
            "holds local rank r of every node")

        await run.join(a)
        say(f"node 0 joined an empty run (pccl peers {a.peer_ids})")
        await run.join(b)
        run.allow([a, b], 3)
        await run.wait_steps([a, b], 3)
        say(f"node 1 joined (pccl peers {b.peer_ids}); the first sync found no state, so "
            "both nodes offered their (identical, seeded) initial weights")
        for step in (1, 2, 3):
            say("  " + describe_step(run, step))

        say("node 2 knocks; nodes 0 and 1 admit it at the start of step 4")
        await run.join(c)
        run.allow([a, b, c], 5)
        await run.wait_steps([a, b, c], 5)
        first = min((r for r in run.reports() if r["node"] == c.id), key=lambda r: r["step"])
        fetched = sum(r["sync"]["rx_bytes"] for r in run.reports(first["step"])
                      if r["node"] == c.id)
        say(f"node 2 (pccl peers {c.peer_ids}) synced RECEIVE_ONLY in both groups "
            f"({fetched} bytes fetched) and trained from step {first['step']}")
        for step in (4, 5):
            say("  " + describe_step(run, step))

        say("SIGKILL both processes of node 0 while nodes 1 and 2 start step 6")
        run.allow([b, c], 6)
        await run.kill(a)
        run.allow([b, c], 8)
        await run.wait_steps([b, c], 8)
        kinds = sorted({f["kind"] for f in run.failures() if f["step"] == 6})
        if kinds:
            say(f"nodes 1 and 2 saw {kinds} at step 6, called update_topology() as a node "
                "and retried")
        else:
            say("step 6 cost nodes 1 and 2 no error: the master dropped node 0, rebuilt "
                "both groups' rings from nodes 1 and 2, and step 6 ran on them")
        for step in (6, 7, 8):
            say("  " + describe_step(run, step))

        await run.finish([b, c])
        bad = [s for s in range(1, 9) if "MISMATCH" in describe_step(run, s)]
        say("nodes 1 and 2 left; every step's slices were bit-identical across nodes"
            if not bad else f"slices differed across nodes at steps {bad}")
        return 1 if bad else 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"],
                   help="torch.distributed backend inside a node")
    p.add_argument("--log-level", default="ERROR")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--node", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--local-world", type=int, default=LOCAL_WORLD, help=argparse.SUPPRESS)
    p.add_argument("--master", default="", help=argparse.SUPPRESS)
    p.add_argument("--allow", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--peer-timeout", type=float, default=5.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args)
    else:
        logging.basicConfig(level=args.log_level)
        sys.exit(asyncio.run(story(args)))


if __name__ == "__main__":
    main()
