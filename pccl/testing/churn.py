"""Churn soak: a training-like run under sustained abuse, checked bit for bit.

    python -m pccl.testing.churn --peers 6 --minutes 10 --seed 1

An orchestrator (this process) runs a master process and N peer processes (the
``--worker`` mode of this module). Every peer runs the same deterministic loop; step k:

1. ``update_topology()`` when peers are pending;
2. three concurrent ``all_reduce_async`` with distinct tags: a float32 SUM, a bfloat16
   SUM (float16 without torch) and a quantized (uint8 MIN_MAX) float32 SUM. The
   gradients are integer-valued and the same on every peer, so every result is exactly
   ``world_size x gradient`` whatever the membership: each peer checks that;
3. an optimizer-like update of its state (params, a bfloat16 moment, an accumulator and
   the step) from the reduced values;
4. ``sync_shared_state`` (ENFORCE_POPULAR) with revision = k. Fresh joiners first sync
   RECEIVE_ONLY.

A failed step (any ``PCCLError``) leaves the state as before the step (it is restored if
the update was already applied), runs ``update_topology()`` and tries again. Because the
loop is deterministic, the state after step k is computable: the orchestrator replays
it and checks every hash a peer reports against the replay (a *parity violation* if they
differ).

Meanwhile the orchestrator keeps SIGKILLing random peers (some mid-all-reduce, some
mid-sync), closing others gracefully, spawning fresh joiners, resetting and black-holing
p2p links (each peer's inbound p2p traffic runs through a :class:`LinkEmulator`), and
killing and restarting the master. A watchdog fails the run, with a stack dump of every
thread and task of the stuck peer, when a live peer completes no step for
``--hang-timeout`` seconds. At the end every peer leaves gracefully and reports leaked
file descriptors / threads and RSS growth. The last line printed is a one-line summary;
the exit status is non-zero when hangs, parity violations, reduce violations or leaks
are not zero.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from pccl.testing.processes import free_port, master_process, stop_process

log = logging.getLogger("pccl.churn")

# --- the deterministic training step (shared by the workers and the replay) ----------


@dataclasses.dataclass(frozen=True)
class Sizes:
    params: int = 1 << 20  # float32 elements
    moment: int = 1 << 18  # bfloat16 elements
    quant: int = 1 << 17  # float32 elements, reduced quantized


def gradients(k: int, sz: Sizes) -> tuple[np.ndarray, np.ndarray, float]:
    """Step k's integer-valued gradients (identical on every peer): float32 params
    gradient, a moment gradient as float32 (exactly representable in bfloat16 and float16
    even when summed over up to 16 peers) and the constant of the quantized tensor."""
    rng = np.random.default_rng(1_000_003 * k + 17)
    g1 = rng.integers(-1000, 1001, size=sz.params).astype(np.float32)
    g2 = rng.integers(-8, 9, size=sz.moment).astype(np.float32)
    c3 = float(rng.integers(-50, 51))
    return g1, g2, c3


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bit patterns (finite inputs)."""
    b = x.astype(np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def initial_state(sz: Sizes) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(4242)
    return {
        "params": rng.standard_normal(sz.params).astype(np.float32),
        "moment": f32_to_bf16_bits(rng.standard_normal(sz.moment).astype(np.float32)),
        "accum": np.zeros(sz.quant, dtype=np.float32),
        "step": np.zeros(1, dtype=np.int64),
    }


def apply_update(state: dict[str, np.ndarray], k: int, g1: np.ndarray, g2: np.ndarray,
                 c3: float) -> dict[str, np.ndarray]:
    """State after step k from the state after step k-1 (pure; same bits everywhere)."""
    params = state["params"] * np.float32(0.999) - g1 * np.float32(1e-4)
    moment = f32_to_bf16_bits(bf16_bits_to_f32(state["moment"]) * np.float32(0.5)
                              + g2 * np.float32(0.5))
    accum = state["accum"] + np.float32(c3)
    return {"params": params.astype(np.float32), "moment": moment,
            "accum": accum.astype(np.float32), "step": np.array([k], dtype=np.int64)}


def state_digest(state: dict[str, np.ndarray]) -> str:
    from pccl import _core

    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(_core.content_hash(state[name].reshape(-1).view(np.uint8)))
    return h.hexdigest()


class Replay:
    """The expected state digest after step k, computed once per k."""

    def __init__(self, sz: Sizes) -> None:
        self.sz = sz
        self.state = initial_state(sz)
        self.k = 0
        self.digests = {0: state_digest(self.state)}

    def digest(self, k: int) -> str:
        while self.k < k:
            self.k += 1
            self.state = apply_update(self.state, self.k, *gradients(self.k, self.sz))
            self.digests[self.k] = state_digest(self.state)
        return self.digests[k]


# --- worker ----------------------------------------------------------------------------


def _emit(**obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _fds() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return out


def _describe_sockets(targets: list[str]) -> list[str]:
    """``socket:[inode]`` -> what /proc/net says about it (for leak reports)."""
    inodes = {t[8:-1]: t for t in targets if t.startswith("socket:[")}
    found = {}
    for table in ("tcp", "tcp6", "unix"):
        with contextlib.suppress(OSError), open(f"/proc/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                ino = cols[9] if table != "unix" else cols[6]
                if ino in inodes:
                    found[inodes[ino]] = f"{table} {' '.join(cols[1:4])}"
    return [f"{t} ({found.get(t, '?')})" for t in targets]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _dump_tasks(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        sys.stderr.write(f"--- {task!r}\n")
        task.print_stack(file=sys.stderr)
    sys.stderr.flush()


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        import pccl

        self.pccl = pccl
        self.args = args
        self.sz = Sizes(args.params, args.moment, args.quant)
        self.joiner = args.joiner
        self.tensors = (initial_state(self.sz) if not self.joiner else
                        {k: np.zeros_like(v) for k, v in initial_state(self.sz).items()})
        # torch when installed (moments in bfloat16), else None (numpy float16)
        self.torch: Any = None
        try:
            import torch
        except ImportError:
            pass
        else:
            self.torch = torch
        self.state = pccl.SharedState(
            [pccl.TensorInfo.from_numpy(self.tensors[k], k) for k in sorted(self.tensors)],
            revision=0)
        self.comm: Any = None
        self.leaving = asyncio.Event()
        self.progress = time.monotonic()
        self.steps = 0
        self.errors: Counter[str] = Counter()

    def _moment_tensor(self, values: np.ndarray) -> Any:
        """The moment gradient as a bfloat16 tensor (torch) or float16 (numpy only)."""
        if self.torch is not None:
            bits = f32_to_bf16_bits(values)
            return self.torch.from_numpy(bits.view(np.int16)).view(self.torch.bfloat16)
        return values.astype(np.float16)

    def _moment_values(self, t: Any) -> np.ndarray:
        if self.torch is not None:
            return bf16_bits_to_f32(t.view(self.torch.int16).numpy().view(np.uint16))
        values: np.ndarray = t.astype(np.float32)
        return values

    async def _reduce(self, k: int) -> tuple[np.ndarray, np.ndarray, float]:
        pccl = self.pccl
        g1, g2, c3 = gradients(k, self.sz)
        t1, t2 = g1.copy(), self._moment_tensor(g2)
        t3 = np.full(self.sz.quant, c3, dtype=np.float32)
        q = pccl.QuantizationOptions(pccl.QuantizationAlgorithm.MIN_MAX, pccl.DataType.UINT8)
        _emit(ev="phase", phase="reduce", step=k)
        handles = [self.comm.all_reduce_async(t1, op=pccl.ReduceOp.SUM, tag=1),
                   self.comm.all_reduce_async(t2, op=pccl.ReduceOp.SUM, tag=2),
                   self.comm.all_reduce_async(t3, op=pccl.ReduceOp.SUM, tag=3,
                                              quantization=q)]
        outcomes = await asyncio.gather(*handles, return_exceptions=True)
        results = []
        for r in outcomes:
            if isinstance(r, BaseException):
                raise r
            results.append(r)
        worlds = {r.world_size for r in results}
        if len(worlds) != 1:
            _emit(ev="violation", what=f"reduces of step {k} saw world sizes {sorted(worlds)}")
        w = np.float32(results[0].world_size)
        got1, got2, got3 = t1 / w, self._moment_values(t2) / w, t3 / w
        for name, got, want in (("float32", got1, g1), ("moment", got2, g2),
                                ("quantized", got3, np.full_like(t3, c3))):
            if not np.array_equal(got, want):
                bad = int(np.count_nonzero(got != want))
                _emit(ev="violation", what=f"{name} all-reduce of step {k} (world {int(w)}): "
                                           f"{bad} elements differ from world x gradient")
        return got1, got2, c3

    async def _sync(self, strategy: Any) -> None:
        _emit(ev="phase", phase="sync", step=self.state.revision)
        await self.comm.sync_shared_state(self.state, strategy)

    async def step(self) -> None:
        S = self.pccl.SharedStateSyncStrategy
        _emit(ev="phase", phase="topology", step=self.state.revision)
        if await self.comm.are_peers_pending():
            await self.comm.update_topology()
        # Agree on the step number first: a fresh joiner (0) learns it, and a peer left
        # behind (e.g. its sync failed where the others' succeeded) notices.
        mine = 0 if self.joiner else self.state.revision + 1
        agreed = np.array([mine], dtype=np.int64)
        await self.comm.all_reduce(agreed, op=self.pccl.ReduceOp.MAX, tag=0)
        k = int(agreed[0])
        g1, g2, c3 = await self._reduce(k)
        before = {name: t.copy() for name, t in self.tensors.items()}
        new = apply_update(self.tensors, k, g1, g2, c3)
        for name, t in new.items():
            self.tensors[name][...] = t
        prev_revision, self.state.revision = self.state.revision, k
        try:
            # Joiners and peers left behind adopt the popular state and revision; their
            # own update above was only their share of the step's collectives.
            await self._sync(S.ENFORCE_POPULAR if mine == k and not self.joiner
                             else S.RECEIVE_ONLY)
        except BaseException:
            for name, t in before.items():
                self.tensors[name][...] = t
            self.state.revision = prev_revision
            raise
        self.joiner = False
        self._report()

    def _report(self) -> None:
        self.steps += 1
        self.progress = time.monotonic()
        _emit(ev="step", revision=self.state.revision, digest=state_digest(self.tensors),
              peer_id=self.comm.peer_id, world=self.comm.get_attribute(
                  self.pccl.Attribute.PEER_GROUP_WORLD_SIZE))

    async def run(self) -> int:
        pccl = self.pccl
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=2))
        loop.add_signal_handler(signal.SIGUSR1, _dump_tasks, loop)
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
        stdin = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
        commands = asyncio.create_task(self._commands(stdin))
        # Warm up what lives for the whole process (tokio runtime, executor threads)
        # before taking the baseline for the leak figures.
        node = await pccl._core.P2PNode.bind(0, "127.0.0.1", 0, None)
        await node.close()
        await asyncio.gather(*(asyncio.to_thread(time.sleep, 0) for _ in range(2)))
        fds0, threads0 = _fds(), threading.active_count()
        rss0 = None
        try:
            # connect() fails when the master dies before this peer was admitted; a
            # joiner then simply tries again (bounded), as a user's launcher would.
            for attempt in range(5):
                self.comm = self._new_comm()
                try:
                    await self.comm.connect(n_attempts=30)
                    break
                except pccl.MasterConnectionError as e:
                    if attempt == 4:
                        raise
                    _emit(ev="retry", kind=type(e).__name__, message=f"connect: {e}"[:300])
            _emit(ev="accepted", peer_id=self.comm.peer_id)
            while not self.leaving.is_set():
                try:
                    await self.step()
                    if rss0 is None:
                        rss0 = _rss_mb()
                except pccl.PCCLError as e:
                    self.errors[type(e).__name__] += 1
                    _emit(ev="retry", kind=type(e).__name__, message=str(e)[:300])
                    if self.comm.state.name == "CLOSED" or (
                            isinstance(e, pccl.MasterConnectionError)
                            and "again within" in str(e)):
                        raise
                    if not isinstance(e, pccl.MasterConnectionError):
                        with contextlib.suppress(pccl.PCCLError):
                            await self.comm.update_topology()
        except pccl.PCCLError as e:
            _emit(ev="fatal", kind=type(e).__name__, message=str(e))
            await self.comm.close()
            return 1
        finally:
            commands.cancel()
            await asyncio.gather(commands, return_exceptions=True)
        await self.comm.close()
        # Let closed sockets and finished tasks go before counting.
        for _ in range(3):
            await asyncio.sleep(0)
        fds1 = _fds()
        extra = sorted(v for k, v in fds1.items() if fds0.get(k) != v)
        if extra:
            # Give sockets that tokio is still tearing down a bounded moment to go.
            for _ in range(50):
                await asyncio.sleep(0.02)
                fds1 = _fds()
                extra = sorted(v for k, v in fds1.items() if fds0.get(k) != v)
                if not extra:
                    break
        _emit(ev="bye", steps=self.steps, errors=dict(self.errors),
              fd_leak=len(fds1) - len(fds0), fd_extra=_describe_sockets(extra[:10]),
              thread_growth=threading.active_count() - threads0,
              rss_growth_mb=round(_rss_mb() - (rss0 or _rss_mb()), 1))
        return 0

    def _new_comm(self) -> Any:
        return self.pccl.Communicator(
            master=self.args.master, p2p_connection_pool_size=2,
            p2p_listen_host="127.0.0.1", p2p_listen_port=self.args.p2p_port,
            p2p_advertise_address=self.args.advertise or None,
            timeout=10.0, p2p_timeout=5.0, peer_timeout=self.args.peer_timeout,
            reconnect_timeout=self.args.reconnect_timeout)

    async def _commands(self, stdin: asyncio.StreamReader) -> None:
        while True:
            line = await stdin.readline()
            if not line or line.strip() == b"leave":
                self.leaving.set()
                return


def worker_main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(Worker(args).run())


# --- orchestrator ----------------------------------------------------------------------


@dataclasses.dataclass
class Peer:
    name: str
    proc: asyncio.subprocess.Process
    link: Any  # LinkEmulator in front of its p2p listener
    joiner: bool
    reader: asyncio.Task[None] | None = None
    phase: str = "start"
    steps: int = 0
    synced: bool = False  # completed at least one step: holds the run's state
    last_step: float = dataclasses.field(default_factory=time.monotonic)
    # Last time a step attempt ended, in success or in a typed error.
    last_attempt: float = dataclasses.field(default_factory=time.monotonic)
    leaving: bool = False
    killed: bool = False
    bye: dict[str, Any] | None = None
    stderr_path: Path | None = None


class Orchestrator:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.sz = Sizes(args.params, args.moment, args.quant)
        self.replay = Replay(self.sz)
        # --failover: two masters, the second a standby; a master "restart" SIGKILLs the
        # active one and starts it again as a standby, so the group fails over each time.
        self.ports = [free_port()] + ([free_port()] if args.failover else [])
        self.masters: list[asyncio.subprocess.Process | None] = [None] * len(self.ports)
        self.active = 0
        self.peers: dict[str, Peer] = {}
        self.n_spawned = 0
        self.figures: Counter[str] = Counter()
        self.violations: list[str] = []
        self.hangs: list[str] = []
        self.max_revision = 0
        self.run_dir = Path(args.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.retries: Counter[str] = Counter()
        self.leaks: list[str] = []
        self.max_rss_growth = 0.0
        self.kill_in_sync = False
        # The revision when a peer was last killed or cut off (see _may_disrupt).
        self.disrupted_at = -2
        self.last_master_kill = time.monotonic()
        self.longest_without_step = 0.0
        self.crashes: list[str] = []
        # Why peers gave up (their last error), for the report: a crash alone says little.
        self.fatal: list[str] = []
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- processes --

    @property
    def master_addresses(self) -> str:
        return ",".join(f"127.0.0.1:{port}" for port in self.ports)

    async def start_master(self, index: int = 0, standby: bool = False) -> None:
        log_path = self.run_dir / f"master-{self.figures['master_starts']}.log"
        self.figures["master_starts"] += 1
        with open(log_path, "wb") as out:  # noqa: ASYNC230 - a local log file
            self.masters[index] = await master_process(
                self.ports[index], "--heartbeat-interval", "0.5", "--heartbeat-timeout", "4",
                *(["--standby"] if standby else []),
                *(["--quorum"] if self.args.failover else []), log=out)

    async def kill_master(self) -> None:
        proc = self.masters[self.active]
        assert proc is not None
        proc.kill()
        await proc.wait()
        self.figures["master_kills"] += 1

    async def spawn(self, joiner: bool) -> Peer:
        from pccl.testing import LinkEmulator

        self.n_spawned += 1
        name = f"peer{self.n_spawned}"
        p2p_port = free_port()
        link = LinkEmulator(f"127.0.0.1:{p2p_port}")
        await link.start()
        stderr_path = self.run_dir / f"{name}.log"
        a = self.args
        with open(stderr_path, "wb") as err:  # noqa: ASYNC230 - a local log file
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "pccl.testing.churn", "--worker",
                "--master", self.master_addresses, "--p2p-port", str(p2p_port),
                "--advertise", link.address, "--params", str(a.params),
                "--moment", str(a.moment), "--quant", str(a.quant),
                "--peer-timeout", str(a.peer_timeout),
                "--reconnect-timeout", str(a.reconnect_timeout),
                "--log-level", a.worker_log_level, *(["--joiner"] if joiner else []),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=err,
                limit=1 << 20)
        peer = Peer(name, proc, link, joiner, stderr_path=stderr_path)
        peer.reader = asyncio.create_task(self._read(peer), name=f"churn-read-{name}")
        self.peers[name] = peer
        if joiner:
            self.figures["joins"] += 1
        return peer

    async def _read(self, peer: Peer) -> None:
        assert peer.proc.stdout is not None
        while True:
            line = await peer.proc.stdout.readline()
            if not line:
                if not (peer.killed or peer.leaving):
                    # It exited by itself: a crash or a peer that gave up.
                    peer.killed = True
                    self.crashes.append(f"{peer.name} exited on its own (see {peer.stderr_path})")
                    log.error("%s", self.crashes[-1])
                    self._own(self.reap(peer))
                return
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            kind = ev.get("ev")
            if kind == "phase":
                peer.phase = ev["phase"]
                if peer.phase == "sync" and self.kill_in_sync and peer.synced and \
                        not peer.killed and self._may_kill():
                    # Armed by the chaos loop: this peer just started a sync (serving
                    # or fetching state), kill it now.
                    self.kill_in_sync = False
                    self._kill(peer)
            elif kind == "step":
                peer.steps += 1
                peer.synced = True
                peer.phase = "idle"
                now = time.monotonic()
                self.longest_without_step = max(self.longest_without_step,
                                                now - peer.last_step)
                peer.last_step = peer.last_attempt = now
                r = int(ev["revision"])
                self.max_revision = max(self.max_revision, r)
                self.figures["steps_reported"] += 1
                want = self.replay.digest(r)
                if ev["digest"] != want:
                    self.violations.append(f"{peer.name} (peer {ev['peer_id']}) revision {r}: "
                                           f"state digest differs from the replay")
            elif kind == "violation":
                self.violations.append(f"{peer.name}: {ev['what']}")
            elif kind == "retry":
                self.retries[ev["kind"]] += 1
                peer.last_attempt = time.monotonic()
            elif kind == "bye":
                peer.bye = ev
            elif kind == "fatal":
                self.figures["fatal_errors"] += 1
                self.fatal.append(f"{peer.name}: {ev['kind']}: {ev['message']}"[:500])
                log.warning("%s gave up: %s: %s", peer.name, ev["kind"], ev["message"])

    async def reap(self, peer: Peer) -> None:
        """Waits for a peer process to end (bounded) and releases its link."""
        try:
            async with asyncio.timeout(30):
                await peer.proc.wait()
        except TimeoutError:
            self.hangs.append(f"{peer.name} did not exit within 30s of leaving")
            self._dump(peer)
            peer.proc.kill()
            await peer.proc.wait()
        if peer.reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await peer.reader
        await peer.link.stop()
        self.peers.pop(peer.name, None)
        if peer.bye is not None:
            self._account_bye(peer)

    def _account_bye(self, peer: Peer) -> None:
        bye = peer.bye or {}
        if bye.get("fd_leak", 0) > 0:
            self.leaks.append(f"{peer.name}: {bye['fd_leak']} file descriptors "
                              f"{bye.get('fd_extra')}")
        # Executor and tokio blocking-pool threads may outlive a call briefly; more than
        # that many extra threads is a leak.
        if bye.get("thread_growth", 0) > 4:
            self.leaks.append(f"{peer.name}: {bye['thread_growth']} threads")
        self.max_rss_growth = max(self.max_rss_growth, float(bye.get("rss_growth_mb", 0)))
        if bye.get("rss_growth_mb", 0) > self.args.max_rss_growth_mb:
            self.leaks.append(f"{peer.name}: RSS grew {bye['rss_growth_mb']} MB")

    def _dump(self, peer: Peer) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(peer.proc.pid, signal.SIGUSR1)

    # -- chaos --

    def live(self) -> list[Peer]:
        return [p for p in self.peers.values() if not p.leaving and not p.killed]

    async def chaos_once(self) -> None:
        live = self.live()
        synced = [p for p in live if p.synced]
        a = self.args
        # Never take the last holders of the state away (2 must stay).
        weights: dict[str, float] = {"link_reset": 0.6, "link_blackhole": 0.6}
        if not self._may_disrupt():
            del weights["link_blackhole"]
        if self._may_kill():
            weights.update(kill_reduce=2.0, kill_sync=2.0, kill_any=1.0, leave=1.0)
        if len(live) < a.max_peers:
            weights["join"] = 3.0 if len(live) <= a.min_peers else 1.5
        # A master restart every few seconds leaves nothing to measure: space them.
        if a.master_kills and time.monotonic() - self.last_master_kill > a.master_spacing:
            weights["master"] = 0.6
        what = self.rng.choices(list(weights), weights=list(weights.values()))[0]
        if a.master_kills and a.master_kill_every and \
                time.monotonic() - self.last_master_kill > a.master_kill_every:
            what = "master"  # on a schedule, not at random (a bounded run must have some)
        if what == "kill_sync":
            self.kill_in_sync = True  # the next peer to enter a sync is killed
            if len(live) < a.max_peers:
                await self.spawn(joiner=True)  # so that state is being transferred
        elif what.startswith("kill"):
            want = "reduce" if what == "kill_reduce" else None
            pool = [p for p in synced if want is None or p.phase == want] or synced
            self._kill(self.rng.choice(pool))
        elif what == "leave":
            victim = self.rng.choice(synced)
            victim.leaving = True
            self.disrupted_at = self.max_revision
            assert victim.proc.stdin is not None
            victim.proc.stdin.write(b"leave\n")
            self.figures["graceful_leaves"] += 1
            log.info("graceful leave of %s", victim.name)
            self._own(self.reap(victim))
        elif what == "join":
            peer = await self.spawn(joiner=True)
            log.info("fresh joiner %s", peer.name)
        elif what == "link_reset":
            victim = self.rng.choice(live)
            await victim.link.reset_all()
            self.figures["link_resets"] += 1
            log.info("reset the links of %s", victim.name)
        elif what == "link_blackhole":
            victim = self.rng.choice(live)
            victim.link.blackhole(True)
            self.disrupted_at = self.max_revision
            self.figures["link_blackholes"] += 1
            log.info("black-holed the links of %s", victim.name)
            self._own(self._unblackhole(victim, self.rng.uniform(0.5, 3.0)))
        elif what == "master":
            self.last_master_kill = time.monotonic()
            await self.kill_master()
            log.info("SIGKILL master")
            await asyncio.sleep(self.rng.uniform(0.2, 2.0))  # the master stays down a while
            # Alone it comes back as the master; with --failover as a standby, while the
            # group goes on with the other one.
            await self.start_master(self.active, standby=self.args.failover)
            if self.args.failover:
                self.active = 1 - self.active

    def _may_kill(self) -> bool:
        live = self.live()
        return sum(p.synced for p in live) > 2 and len(live) > self.args.min_peers \
            and self._may_disrupt()

    def _may_disrupt(self) -> bool:
        """Whether a peer may be killed, cut off or told to leave now. With
        ``--failover`` the group runs with quorums, which survive losing fewer than half
        of a ring at a time (docs/semantics.md): after each such fault the next waits
        until the group has completed two more steps (the first may have been in
        flight), so the ring in between was installed without the lost peer. Leaves
        count too: one made while the master is failing over reaches no master that
        holds the group, and the next one counts the peer as lost."""
        return not self.args.failover or self.max_revision >= self.disrupted_at + 2

    def _kill(self, victim: Peer) -> None:
        category = victim.phase if victim.phase in ("reduce", "sync") else "other"
        self.disrupted_at = self.max_revision
        victim.killed = True
        victim.proc.kill()
        self.figures[f"kills_mid_{category}"] += 1
        self.figures["kills"] += 1
        log.info("SIGKILL %s (mid-%s)", victim.name, category)
        self._own(self.reap(victim))

    async def _unblackhole(self, peer: Peer, after: float) -> None:
        await asyncio.sleep(after)  # the fault's duration
        peer.link.blackhole(False)

    def _own(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def watchdog(self) -> None:
        while True:
            await asyncio.sleep(1.0)  # a periodic check, not a synchronisation
            now = time.monotonic()
            for p in self.live():
                # Every wait in pccl is bounded, so every attempt must end (in a step
                # or a typed error) in bounded time, however hard the faults hit.
                if now - p.last_attempt > self.args.hang_timeout:
                    self.hangs.append(f"{p.name}: no step attempt ended for "
                                      f"{self.args.hang_timeout:.0f}s (phase {p.phase})")
                    log.error("HANG: %s; stack dump in %s", self.hangs[-1], p.stderr_path)
                    self._dump(p)
                    return

    # -- the run --

    async def run(self) -> dict[str, Any]:
        a = self.args
        started = time.monotonic()
        await self.start_master()
        if a.failover:
            await self.start_master(1, standby=True)
        try:
            for _ in range(a.peers):
                await self.spawn(joiner=False)
            # Faults start once every initial peer has completed a step.
            async with asyncio.timeout(a.hang_timeout):
                while not all(p.synced for p in self.peers.values()):  # noqa: ASYNC110
                    await asyncio.sleep(0.1)  # bounded poll of reported progress
            for p in self.peers.values():
                p.last_step = p.last_attempt = time.monotonic()
            watchdog = asyncio.create_task(self.watchdog())
            deadline = time.monotonic() + a.seconds
            while time.monotonic() < deadline and not self.hangs:
                await asyncio.sleep(self.rng.expovariate(1.0 / a.chaos_interval))
                if self.hangs or time.monotonic() >= deadline:
                    break
                await self.chaos_once()
            watchdog.cancel()
            await asyncio.gather(watchdog, return_exceptions=True)
            # Let every live peer do a last step after the chaos, then leave.
            if not self.hangs:
                await self._settle()
        finally:
            await self._shutdown()
        elapsed = time.monotonic() - started
        return self._figures(elapsed)

    async def _settle(self) -> None:
        """Every live peer must complete one more step once the faults stop."""
        for p in self.peers.values():
            p.link.blackhole(False)
        marks = {p.name: p.steps for p in self.live()}
        deadline = time.monotonic() + self.args.hang_timeout
        while time.monotonic() < deadline:
            stuck = [p for p in self.live() if p.steps <= marks.get(p.name, -1) + 1]
            if not stuck:
                return
            await asyncio.sleep(0.2)  # bounded poll of the peers' reported progress
        for p in self.live():
            if p.steps <= marks.get(p.name, -1) + 1:
                self.hangs.append(f"{p.name} made no progress after the faults stopped "
                                  f"(last phase: {p.phase})")
                self._dump(p)

    async def _shutdown(self) -> None:
        for p in list(self.live()):
            p.leaving = True
            if p.proc.stdin is not None and p.proc.returncode is None:
                with contextlib.suppress(ConnectionError):
                    p.proc.stdin.write(b"leave\n")
        await asyncio.gather(*(self.reap(p) for p in list(self.peers.values())),
                             return_exceptions=True)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for proc in self.masters:
            if proc is not None:
                await stop_process(proc)

    def _figures(self, elapsed: float) -> dict[str, Any]:
        f = self.figures
        return {
            "seed": self.args.seed,
            "peers": self.args.peers,
            "minutes": round(elapsed / 60, 2),
            "steps": self.max_revision,
            "peer_steps": f["steps_reported"],
            "kills": f["kills"],
            "kills_mid_reduce": f["kills_mid_reduce"],
            "kills_mid_sync": f["kills_mid_sync"],
            "kills_other": f["kills_mid_other"],
            "joins": f["joins"],
            "graceful_leaves": f["graceful_leaves"],
            "link_resets": f["link_resets"],
            "link_blackholes": f["link_blackholes"],
            "master_kills": f["master_kills"],
            "retries": dict(self.retries),
            "fatal_errors": f["fatal_errors"],
            "fatal_details": self.fatal[:20],
            "hangs": len(self.hangs),
            "hang_details": self.hangs,
            "parity_violations": len(self.violations),
            "violation_details": self.violations[:20],
            "crashes": len(self.crashes),
            "crash_details": self.crashes,
            "leaks": len(self.leaks),
            "leak_details": self.leaks,
            "max_rss_growth_mb": self.max_rss_growth,
            "longest_without_step_s": round(self.longest_without_step, 1),
        }


def summary_line(fig: dict[str, Any]) -> str:
    ok = (fig["hangs"] == 0 and fig["parity_violations"] == 0 and fig["leaks"] == 0
          and fig["crashes"] == 0)
    return (f"churn {'PASS' if ok else 'FAIL'}: seed {fig['seed']}, {fig['peers']} peers, "
            f"{fig['minutes']} min, {fig['steps']} steps, {fig['kills']} kills "
            f"({fig['kills_mid_reduce']} mid-reduce, {fig['kills_mid_sync']} mid-sync), "
            f"{fig['joins']} joins, {fig['graceful_leaves']} leaves, "
            f"{fig['link_resets'] + fig['link_blackholes']} link faults, "
            f"{fig['master_kills']} master restarts, {fig['hangs']} hangs, "
            f"{fig['parity_violations']} parity violations, {fig['crashes']} crashes, "
            f"{fig['leaks']} leaks, "
            f"max RSS growth {fig['max_rss_growth_mb']} MB")


def _record_markdown(path: Path, fig: dict[str, Any], command: str) -> None:
    header = ("| date | command | min | steps | kills (reduce/sync) | joins | leaves | "
              "link faults | master restarts | hangs | parity violations | crashes | leaks | "
              "max RSS growth |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    row = (f"| {time.strftime('%Y-%m-%d')} | `{command}` | {fig['minutes']} | {fig['steps']} | "
           f"{fig['kills']} ({fig['kills_mid_reduce']}/{fig['kills_mid_sync']}) | "
           f"{fig['joins']} | {fig['graceful_leaves']} | "
           f"{fig['link_resets'] + fig['link_blackholes']} | {fig['master_kills']} | "
           f"{fig['hangs']} | {fig['parity_violations']} | {fig['crashes']} | {fig['leaks']} | "
           f"{fig['max_rss_growth_mb']} MB |\n")
    text = path.read_text() if path.exists() else "# Reliability\n"
    marker = "### Churn soak runs\n"
    if marker not in text:
        text = text.rstrip("\n") + "\n\n" + marker + "\n" + header
    head, _, tail = text.partition(marker)
    # Rows go right after the table header of the section.
    hdr_end = tail.index("|---")
    hdr_end = tail.index("\n", hdr_end) + 1
    text = head + marker + tail[:hdr_end] + row + tail[hdr_end:]
    path.write_text(text)


def orchestrator_main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(message)s")
    if args.minutes is not None:
        args.seconds = args.minutes * 60
    fig = asyncio.run(Orchestrator(args).run())
    text = json.dumps(fig, indent=2)
    Path(args.json).write_text(text + "\n")
    print(text)
    if args.record:
        _record_markdown(Path(args.record), fig, "python -m pccl.testing.churn " +
                         " ".join(sys.argv[1:]))
    line = summary_line(fig)
    print(line, flush=True)
    return 0 if line.startswith("churn PASS") else 1


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pccl.testing.churn",
                                description="pccl churn soak (see the module docstring)")
    p.add_argument("--peers", type=int, default=6)
    p.add_argument("--minutes", type=float, default=None)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--chaos-interval", type=float, default=2.0,
                   help="mean seconds between faults")
    p.add_argument("--min-peers", type=int, default=3)
    p.add_argument("--max-peers", type=int, default=None)
    p.add_argument("--no-master-kills", dest="master_kills", action="store_false")
    p.add_argument("--master-kill-every", type=float, default=0.0, metavar="S",
                   help="kill the master whenever S seconds passed since the last kill "
                        "(0: only at random, spaced by --master-spacing)")
    p.add_argument("--failover", action="store_true",
                   help="two masters, the second a standby: each master kill fails the group "
                        "over to the other, which the killed one then backs up")
    p.add_argument("--hang-timeout", type=float, default=120.0,
                   help="a live peer whose step attempt does not end within this fails "
                        "the run (must exceed --reconnect-timeout)")
    p.add_argument("--master-spacing", type=float, default=20.0,
                   help="least seconds between two master kills")
    p.add_argument("--peer-timeout", type=float, default=5.0)
    p.add_argument("--reconnect-timeout", type=float, default=60.0)
    p.add_argument("--max-rss-growth-mb", type=float, default=256.0)
    p.add_argument("--params", type=int, default=Sizes.params)
    p.add_argument("--moment", type=int, default=Sizes.moment)
    p.add_argument("--quant", type=int, default=Sizes.quant)
    p.add_argument("--json", default="churn.json")
    p.add_argument("--record", default="", help="append the figures to this markdown file")
    p.add_argument("--run-dir", default="churn-logs")
    p.add_argument("--worker-log-level", default="WARNING")
    # worker mode
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--joiner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--master", default="", help=argparse.SUPPRESS)
    p.add_argument("--p2p-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--advertise", default="", help=argparse.SUPPRESS)
    p.add_argument("--log-level", default="WARNING", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.max_peers is None:
        args.max_peers = args.peers + 2
    sys.exit(worker_main(args) if args.worker else orchestrator_main(args))


if __name__ == "__main__":
    main()
