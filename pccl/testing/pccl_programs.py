"""PCCL's own usage patterns under churn: the loops PCCL's stress and example programs
run, as worker processes, against a master, with peers SIGKILLed and spawned every
0.5-2 s (the rates of PCCL's stress orchestrator).

    python -m pccl.testing.pccl_programs --idiom ddp --api blocking --minutes 10

Idioms (each written the way PCCL's programs write it; no step agreement):

- ``stress``: ``if are_peers_pending(): update_topology()`` (retried up to 10 times),
  ``sync_shared_state`` when the topology was updated (and first thing for a fresh
  peer), then 10 tagged reduces through ``all_reduce_multiple_with_retry``;
- ``cross-step``: the same, with the reduces on a background thread (a task for the
  asyncio API) that crosses into the next step; the question is asked while it runs,
  and it is joined before ``update_topology()``;
- ``ddp``: MNIST-DDP's loop: ``update_topology()`` every step (retried), sync every
  step, four tagged ``all_reduce_async`` launched at once, each waited, failed ones
  relaunched, then the update and ``revision += 1``.

``--api blocking`` runs them through :mod:`pccl.blocking` (PCCL's API), ``--api asyncio``
through :class:`pccl.Communicator`. Checked, all must be zero: *hangs* (no step completed
anywhere for ``--hang-timeout`` s while peers are alive; every worker's threads and
tasks are dumped to its log), *crashes* (a worker that exits by itself with an error),
*parity violations* (a digest after a sync that differs from the replay of that
revision: the state is ``S_0 + sum of g(k)`` for k up to the revision, identical on
every peer), *rollbacks* (a peer whose synced revision goes down) and *reduce
violations* (a result that is not exactly ``world x gradient``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import hashlib
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from pccl.testing.processes import free_port, master_process

log = logging.getLogger("pccl.programs")

IDIOMS = ("stress", "cross-step", "ddp")
APIS = ("blocking", "asyncio")
# Worlds the checks accept (gradients are integers of at most 8: sums stay exact in
# float32 far beyond this).
MAX_WORLD = 4096
REDUCE_ELEMENTS = 16384  # PCCL's stress programs reduce 128 x 128 floats per tag


def initial_state(n: int) -> np.ndarray:
    return np.random.default_rng(7).integers(-100, 101, size=n).astype(np.float32)


def gradient(k: int, n: int, salt: int = 0) -> np.ndarray:
    """Integer-valued, never zero, the same on every peer: a reduce of it is exactly
    ``world x gradient``, and the state stays exact in float32."""
    rng = np.random.default_rng(1_000_003 * k + salt)
    g = rng.integers(1, 9, size=n).astype(np.float32)
    return g * np.where(rng.integers(0, 2, size=n) == 1, 1, -1).astype(np.float32)


def digest(x: np.ndarray) -> str:
    return hashlib.sha256(x.tobytes()).hexdigest()[:32]


class Replay:
    """Digest of the state at revision r, computed incrementally."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.state = initial_state(n)
        self.digests = [digest(self.state)]

    def digest(self, r: int) -> str:
        while len(self.digests) <= r:
            self.state = self.state + gradient(len(self.digests), self.n)
            self.digests.append(digest(self.state))
        return self.digests[r]


def _emit(**obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# --- the worker: one PCCL program -----------------------------------------------------


class Program:
    """State, checks and reporting shared by both APIs."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.n = args.elements
        self.w = initial_state(self.n)
        self.synced_revision = -1
        self.leaving = threading.Event()
        self.grads = [np.zeros(REDUCE_ELEMENTS, np.float32) for _ in range(10)]

    def fill(self, revision: int, tags: int) -> list[np.ndarray]:
        want = [gradient(revision, REDUCE_ELEMENTS, salt=1 + t) for t in range(tags)]
        for g, x in zip(self.grads, want):
            g[...] = x
        return want

    def check(self, want: list[np.ndarray], worlds: list[int] | None = None) -> None:
        for t, g in enumerate(want):
            got = self.grads[t]
            q = got / g
            w = worlds[t] if worlds is not None else int(round(float(q[0])))
            if not (1 <= w <= MAX_WORLD and np.array_equal(got, g * np.float32(w))):
                ratios = np.unique(np.round(q, 3))
                _emit(ev="violation", what=f"reduce tag {t}: result is not {w} x gradient "
                      f"(result / gradient: {ratios[:5].tolist()}"
                      f"{'...' if len(ratios) > 5 else ''})")

    def synced(self, revision: int) -> None:
        if revision < self.synced_revision:
            _emit(ev="rollback", before=self.synced_revision, after=revision)
        self.synced_revision = revision
        _emit(ev="synced", revision=revision, digest=digest(self.w))

    def advance(self, state: Any) -> None:
        """The optimizer step: revision + 1 and the state that goes with it."""
        state.revision += 1
        self.w += gradient(state.revision, self.n)


class BlockingProgram(Program):
    def run(self) -> None:
        import pccl.blocking as pccl

        self.pccl = pccl
        comm = pccl.Communicator(self.args.master, 0, 1, p2p_listen_host="127.0.0.1",
                                 peer_timeout=self.args.peer_timeout,
                                 collective_timeout=self.args.collective_timeout)
        comm.connect(n_attempts=30)
        _emit(ev="accepted")
        state = pccl.SharedState([pccl.TensorInfo.from_numpy(self.w, "w")])
        try:
            getattr(self, self.args.idiom.replace("-", "_"))(comm, state)
        finally:
            comm.close()

    def reduce_all(self, comm: Any, revision: int, tags: int = 10) -> None:
        pccl = self.pccl
        want = self.fill(revision, tags)
        descs = [pccl.ReduceOpDescriptor.from_numpy(g, g, pccl.ReduceDescriptor(
            count=g.size, op=pccl.ReduceOp.SUM, tag=t,
            operand_descriptor=pccl.ReduceOperandDescriptor(
                datatype=pccl.DataType.FLOAT, distribution_hint=pccl.DistributionHint.NORMAL),
            quantization_options=pccl.QuantizationOptions(
                quantized_datatype=pccl.DataType.FLOAT,
                algorithm=pccl.QuantizationAlgorithm.NONE)))
            for t, g in enumerate(self.grads[:tags])]
        comm.all_reduce_multiple_with_retry(descs, max_in_flight=8)
        self.check(want)

    def world(self, comm: Any) -> int:
        return int(comm.get_attribute(self.pccl.Attribute.GLOBAL_WORLD_SIZE))

    def stress(self, comm: Any, state: Any, cross_step: bool = False) -> None:
        it = 0
        thread: threading.Thread | None = None
        failure: list[BaseException] = []
        while not self.leaving.is_set():
            updated = it == 0
            if it > 0:
                for retry in range(10):  # PCCL's program retries the pair as a whole
                    try:
                        if comm.are_peers_pending():
                            if thread is not None:
                                thread.join()
                            comm.update_topology()
                            updated = True
                        break
                    except self.pccl.PCCLError as e:
                        _emit(ev="retry", what=f"topology: {type(e).__name__}: {e}"[:300])
                        if retry == 9:
                            raise
            if failure:
                raise failure[0]
            if self.world(comm) < 2:
                time.sleep(1)  # PCCL's program waits for company the same way
                it += 1
                continue
            if updated:
                if thread is not None:
                    thread.join()
                comm.sync_shared_state(state)
                self.synced(state.revision)
                self.advance(state)
            revision = state.revision
            if cross_step:
                if thread is not None:
                    thread.join()

                def reduce_in_background(r: int = revision) -> None:
                    try:
                        self.reduce_all(comm, r)
                        _emit(ev="step", revision=r)
                    except BaseException as e:  # noqa: BLE001 - reported by the main loop
                        failure.append(e)

                thread = threading.Thread(target=reduce_in_background, name="ReduceThread")
                thread.start()
            else:
                self.reduce_all(comm, revision)
                _emit(ev="step", revision=revision)
            it += 1
        if thread is not None:
            thread.join()

    def cross_step(self, comm: Any, state: Any) -> None:
        self.stress(comm, state, cross_step=True)

    def ddp(self, comm: Any, state: Any) -> None:
        pccl = self.pccl
        it = 0
        while not self.leaving.is_set():
            it += 1
            if it > 1:
                for retry in range(50):
                    try:
                        comm.update_topology()
                        break
                    except pccl.PCCLError as e:
                        _emit(ev="retry", what=f"update: {type(e).__name__}: {e}"[:300])
                        if retry == 49:
                            raise
            if self.world(comm) < 2:
                time.sleep(1)
                continue
            comm.sync_shared_state(state)
            self.synced(state.revision)
            want = self.fill(state.revision + 1, 4)
            worlds = [0] * 4
            todo = list(range(4))
            for _ in range(50):  # relaunch what failed, as MNIST-DDP's peer does
                handles = {t: comm.all_reduce_async(self.grads[t], self.grads[t],
                                                    op=pccl.ReduceOp.SUM, tag=t)
                           for t in todo}
                failed = []
                for t, h in handles.items():
                    ok, _, info = h.wait()
                    if ok:
                        worlds[t] = info.local_world_size
                    else:
                        failed.append(t)
                        self.grads[t][...] = want[t]  # untouched anyway; as a program would
                if not failed:
                    break
                todo = failed
            else:
                raise RuntimeError("reduces kept failing")
            self.check(want, worlds)
            self.advance(state)
            _emit(ev="step", revision=state.revision)


class AsyncProgram(Program):
    async def run(self) -> None:
        import pccl

        self.pccl = pccl
        comm = pccl.Communicator(self.args.master, p2p_connection_pool_size=1,
                                 p2p_listen_host="127.0.0.1",
                                 peer_timeout=self.args.peer_timeout,
                                 collective_timeout=self.args.collective_timeout)
        await comm.connect(n_attempts=30)
        _emit(ev="accepted")
        state = pccl.SharedState([pccl.TensorInfo.from_numpy(self.w, "w")], revision=0)
        try:
            await getattr(self, self.args.idiom.replace("-", "_"))(comm, state)
        finally:
            await comm.close()

    async def reduce_all(self, comm: Any, revision: int, tags: int = 10) -> None:
        pccl = self.pccl
        want = self.fill(revision, tags)
        infos = await comm.all_reduce_multiple_with_retry(
            [pccl.ReduceDescriptor(g, op=pccl.ReduceOp.SUM, tag=t)
             for t, g in enumerate(self.grads[:tags])], max_in_flight=8)
        self.check(want, [i.world_size for i in infos])

    async def sync(self, comm: Any, state: Any) -> None:
        """What the docs tell an asyncio user: these failures are retryable (a lost
        holder; a call-off because peers vote: join them)."""
        pccl = self.pccl
        for attempt in range(4):
            try:
                await comm.sync_shared_state(state)
                self.synced(state.revision)
                return
            except (pccl.PeerConnectionError, pccl.CollectiveAbortedError) as e:
                if attempt == 3 or isinstance(e, pccl.OperationTimeoutError):
                    raise
                _emit(ev="retry", what=f"sync: {type(e).__name__}: {e}"[:300])
                if type(e) is pccl.CollectiveAbortedError:
                    await comm.update_topology()

    def world(self, comm: Any) -> int:
        return int(comm.get_attribute(self.pccl.Attribute.GLOBAL_WORLD_SIZE))

    async def stress(self, comm: Any, state: Any, cross_step: bool = False) -> None:
        pccl = self.pccl
        it = 0
        task: asyncio.Task[None] | None = None
        while not self.leaving.is_set():
            updated = it == 0
            if it > 0:
                for retry in range(10):
                    try:
                        if await comm.are_peers_pending():
                            if task is not None:
                                await task
                            await comm.update_topology()
                            updated = True
                        break
                    except pccl.PCCLError as e:
                        _emit(ev="retry", what=f"topology: {type(e).__name__}: {e}"[:300])
                        if retry == 9:
                            raise
            if self.world(comm) < 2:
                await asyncio.sleep(1)  # waiting for company, as PCCL's program does
                it += 1
                continue
            if updated:
                if task is not None:
                    await task
                await self.sync(comm, state)
                self.advance(state)
            revision = state.revision
            if cross_step:
                if task is not None:
                    await task

                async def reduce_in_background(r: int = revision) -> None:
                    await self.reduce_all(comm, r)
                    _emit(ev="step", revision=r)

                task = asyncio.create_task(reduce_in_background())
            else:
                await self.reduce_all(comm, revision)
                _emit(ev="step", revision=revision)
            it += 1
        if task is not None:
            await task

    async def cross_step(self, comm: Any, state: Any) -> None:
        await self.stress(comm, state, cross_step=True)

    async def ddp(self, comm: Any, state: Any) -> None:
        pccl = self.pccl
        it = 0
        while not self.leaving.is_set():
            it += 1
            if it > 1:
                for retry in range(50):
                    try:
                        await comm.update_topology()
                        break
                    except pccl.PCCLError as e:
                        _emit(ev="retry", what=f"update: {type(e).__name__}: {e}"[:300])
                        if retry == 49:
                            raise
            if self.world(comm) < 2:
                await asyncio.sleep(1)
                continue
            await self.sync(comm, state)
            want = self.fill(state.revision + 1, 4)
            worlds = [0] * 4
            todo = list(range(4))
            for _ in range(50):
                handles = {t: comm.all_reduce_async(self.grads[t], tag=t) for t in todo}
                failed = []
                for t, h in handles.items():
                    try:
                        worlds[t] = (await h).world_size
                    except pccl.PCCLError:
                        failed.append(t)
                if not failed:
                    break
                todo = failed
            else:
                raise RuntimeError("reduces kept failing")
            self.check(want, worlds)
            self.advance(state)
            _emit(ev="step", revision=state.revision)


def worker_main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    cls = BlockingProgram if args.api == "blocking" else AsyncProgram
    program = cls(args)

    def watch_stdin() -> None:
        for line in sys.stdin:
            if line.strip() == "leave":
                break
        program.leaving.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    try:
        if isinstance(program, AsyncProgram):
            asyncio.run(program.run())
        else:
            program.run()
    except BaseException as e:
        _emit(ev="crash", kind=type(e).__name__, message=str(e)[:500])
        log.exception("the program failed")
        return 1
    _emit(ev="bye")
    return 0


# --- the orchestrator ------------------------------------------------------------------


class Peer:
    def __init__(self, name: str, proc: asyncio.subprocess.Process, log_path: Path) -> None:
        self.name = name
        self.proc = proc
        self.log_path = log_path
        self.killed = False
        self.leaving = False
        self.accepted = False
        self.synced = -1
        self.reader: asyncio.Task[None] | None = None


class Orchestrator:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.port = free_port()
        self.run_dir = Path(args.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.replay = Replay(args.elements)
        self.peers: list[Peer] = []
        self.master: asyncio.subprocess.Process | None = None
        self.fig: Counter[str] = Counter()
        self.problems: list[str] = []
        self.last_step = time.monotonic()
        self.max_revision = 0

    async def start_master(self) -> None:
        with open(self.run_dir / "master.log", "wb") as out:  # noqa: ASYNC230 - local log
            self.master = await master_process(
                self.port, "--heartbeat-interval", "0.5", "--heartbeat-timeout", "4", log=out)

    async def spawn(self) -> None:
        a = self.args
        name = f"peer{len(self.peers) + 1}"
        path = self.run_dir / f"{name}.log"
        with open(path, "wb") as err:  # noqa: ASYNC230 - a local log file
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "pccl.testing.pccl_programs", "--worker",
                "--idiom", a.idiom, "--api", a.api, "--master", f"127.0.0.1:{self.port}",
                "--elements", str(a.elements), "--peer-timeout", str(a.peer_timeout),
                "--collective-timeout", str(a.collective_timeout),
                "--log-level", a.worker_log_level,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=err,
                limit=1 << 20)
        peer = Peer(name, proc, path)
        peer.reader = asyncio.create_task(self.read(peer))
        self.peers.append(peer)
        self.fig["spawned"] += 1

    def live(self) -> list[Peer]:
        return [p for p in self.peers if not p.killed and not p.leaving
                and p.proc.returncode is None]

    async def read(self, peer: Peer) -> None:
        assert peer.proc.stdout is not None
        while True:
            line = await peer.proc.stdout.readline()
            if not line:
                break
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            kind = ev.get("ev")
            if kind == "accepted":
                peer.accepted = True
            elif kind == "synced":
                r = int(ev["revision"])
                self.fig["syncs_checked"] += 1
                if ev["digest"] != self.replay.digest(r):
                    self.problems.append(f"parity: {peer.name} at revision {r}")
                    self.fig["parity_violations"] += 1
                if r < peer.synced:
                    self.fig["rollbacks"] += 1
                    self.problems.append(f"rollback: {peer.name} {peer.synced} -> {r}")
                peer.synced = r
                self.max_revision = max(self.max_revision, r)
            elif kind == "rollback":
                self.fig["rollbacks"] += 1
                self.problems.append(f"rollback reported by {peer.name}: {ev}")
            elif kind == "step":
                self.fig["steps"] += 1
                self.last_step = time.monotonic()
            elif kind == "violation":
                self.fig["reduce_violations"] += 1
                self.problems.append(f"{peer.name}: {ev['what']}")
            elif kind == "retry":
                self.fig["retries"] += 1
            elif kind == "crash":
                if not peer.killed:
                    self.problems.append(f"crash: {peer.name}: {ev['kind']}: {ev['message']}")
        code = await peer.proc.wait()
        if code != 0 and not peer.killed:
            self.fig["crashes"] += 1
            if not any(peer.name in p for p in self.problems):
                self.problems.append(f"crash: {peer.name} exited with {code}")

    async def chaos(self) -> None:
        live = self.live()
        synced = [p for p in live if p.synced >= 0]
        a = self.args
        # Any peer may die (joiners mid-join or mid-sync too), as long as two peers
        # that hold the state are left: losing every holder is a lost run, not a hang.
        victims = live if len(synced) > 2 else [p for p in live if p.synced < 0]
        can_spawn = len(live) < a.max_peers
        if victims and (not can_spawn or self.rng.random() < 0.5):
            victim = self.rng.choice(victims)
            victim.killed = True
            victim.proc.kill()
            self.fig["kills"] += 1
        elif can_spawn:
            await self.spawn()
            self.fig["joins"] += 1

    async def dump_all(self) -> None:
        for p in self.live():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.proc.pid, signal.SIGUSR1)

    async def run(self) -> dict[str, Any]:
        a = self.args
        started = time.monotonic()
        await self.start_master()
        try:
            for _ in range(a.peers):
                await self.spawn()
            async with asyncio.timeout(a.hang_timeout * 2):
                while not all(p.synced >= 0 for p in self.peers):  # noqa: ASYNC110
                    await asyncio.sleep(0.1)  # bounded poll of the workers' reports
            self.last_step = time.monotonic()
            end = time.monotonic() + a.seconds
            while time.monotonic() < end:
                await asyncio.sleep(self.rng.uniform(a.chaos_min, a.chaos_max))
                if self.stalled():
                    break
                await self.chaos()
            # After the chaos the survivors must keep stepping.
            mark = self.fig["steps"]
            settle = time.monotonic() + a.hang_timeout
            while (time.monotonic() < settle and self.fig["steps"] < mark + 3  # noqa: ASYNC110
                   and not self.stalled()):
                await asyncio.sleep(0.2)  # bounded poll of the workers' reports
            if self.fig["steps"] < mark + 3 and not self.fig["hangs"]:
                self.fig["hangs"] += 1
                self.problems.append("no steps after the chaos stopped")
                await self.dump_all()
                await asyncio.sleep(1.0)  # let the dumps reach the logs
        finally:
            await self.shutdown()
        return self.figures(time.monotonic() - started)

    def stalled(self) -> bool:
        if time.monotonic() - self.last_step > self.args.hang_timeout and self.live():
            self.fig["hangs"] += 1
            self.problems.append(f"hang: no step anywhere for {self.args.hang_timeout:.0f}s "
                                 f"with {len(self.live())} peers alive (stacks in the logs)")
            asyncio.get_running_loop().create_task(self.dump_all())
            return True
        return False

    async def shutdown(self) -> None:
        await asyncio.sleep(0.5 if self.fig["hangs"] else 0)  # let stack dumps land
        for p in self.live():
            p.leaving = True
            if p.proc.stdin is not None:
                with contextlib.suppress(ConnectionError):
                    p.proc.stdin.write(b"leave\n")
        for p in self.peers:
            try:
                async with asyncio.timeout(self.args.collective_timeout + 30):
                    await p.proc.wait()
            except TimeoutError:
                p.killed = True
                p.proc.kill()
                await p.proc.wait()
        await asyncio.gather(*(p.reader for p in self.peers if p.reader),
                             return_exceptions=True)
        if self.master is not None and self.master.returncode is None:
            self.master.kill()
            await self.master.wait()

    def figures(self, elapsed: float) -> dict[str, Any]:
        f = self.fig
        return {"idiom": self.args.idiom, "api": self.args.api, "seed": self.args.seed,
                "minutes": round(elapsed / 60, 2), "steps": f["steps"],
                "syncs_checked": f["syncs_checked"], "max_revision": self.max_revision,
                "kills": f["kills"], "joins": f["joins"], "retries": f["retries"],
                "hangs": f["hangs"], "crashes": f["crashes"],
                "parity_violations": f["parity_violations"], "rollbacks": f["rollbacks"],
                "reduce_violations": f["reduce_violations"], "problems": self.problems[:20]}


def summary_line(fig: dict[str, Any]) -> str:
    bad = fig["hangs"] + fig["crashes"] + fig["parity_violations"] + fig["rollbacks"] \
        + fig["reduce_violations"]
    return (f"pccl-programs {'PASS' if bad == 0 else 'FAIL'}: {fig['idiom']} via "
            f"{fig['api']}, seed {fig['seed']}, {fig['minutes']} min, {fig['steps']} steps, "
            f"{fig['syncs_checked']} syncs checked (revision {fig['max_revision']}), "
            f"{fig['kills']} kills, {fig['joins']} joins, {fig['hangs']} hangs, "
            f"{fig['crashes']} crashes, {fig['parity_violations']} parity violations, "
            f"{fig['rollbacks']} rollbacks, {fig['reduce_violations']} reduce violations")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pccl.testing.pccl_programs",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--idiom", choices=IDIOMS, default="stress")
    p.add_argument("--api", choices=APIS, default="blocking")
    p.add_argument("--peers", type=int, default=4, help="peers at the start")
    p.add_argument("--max-peers", type=int, default=10)
    p.add_argument("--minutes", type=float, default=0.0)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--chaos-min", type=float, default=0.5)
    p.add_argument("--chaos-max", type=float, default=2.0)
    p.add_argument("--hang-timeout", type=float, default=30.0)
    p.add_argument("--elements", type=int, default=1 << 18, help="shared-state floats")
    p.add_argument("--peer-timeout", type=float, default=10.0)
    p.add_argument("--collective-timeout", type=float, default=60.0)
    p.add_argument("--run-dir", default="pccl-programs-logs")
    p.add_argument("--json", default="")
    p.add_argument("--worker-log-level", default="WARNING")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--master", default="", help=argparse.SUPPRESS)
    p.add_argument("--log-level", default="WARNING", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        sys.exit(worker_main(args))
    if args.minutes:
        args.seconds = args.minutes * 60
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    fig = asyncio.run(Orchestrator(args).run())
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1))
    for problem in fig["problems"]:
        print(problem)
    line = summary_line(fig)
    print(line)
    sys.exit(0 if line.startswith("pccl-programs PASS") else 1)


if __name__ == "__main__":
    main()
