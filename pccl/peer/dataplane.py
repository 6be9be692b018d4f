"""The data plane of a peer: what the machine's data-plane commands
(:data:`DATA_PLANE_COMMANDS`) do to the tensors of the calls they name. The machine
(:mod:`pccl.peer.state`) decides; this only carries out: it starts and stops ring ops of
the Rust extension, commits or rolls back their results, runs a sync's fetches
(:mod:`pccl.peer.fetch`) and commits what they fetched, and feeds back what ended
(``RingDone``, ``Fetched``). Every task it starts is the driver's (owned, cancelled on
close)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from pccl import _core
from pccl.enums import ReduceOp
from pccl.errors import ErrorKind, MasterConnectionError, PCCLError
from pccl.peer import state as ps
from pccl.peer.fetch import Fetcher, SyncReporter, prefault_all
from pccl.peer.metrics import PeerMetrics
from pccl.peer.options import PeerOptions, QuantizationOptions
from pccl.protocol import messages as m
from pccl.shared_state import SharedState, SyncProgress
from pccl.tensors import RawTensor

#: The commands :meth:`DataPlane.execute` carries out: an all-reduce's, then a sync's.
REDUCE_COMMANDS = (ps.RunRing, ps.AbortRing, ps.ArmRing, ps.Rollback, ps.Commit,
                   ps.ApplyResult)
SYNC_COMMANDS = (ps.Fetch, ps.AbortFetch, ps.CommitSync)
DATA_PLANE_COMMANDS = REDUCE_COMMANDS + SYNC_COMMANDS


class Host(Protocol):
    """What the data plane needs of its driver."""

    _node: _core.P2PNode | None
    _master_addr: str
    options: PeerOptions
    metrics: PeerMetrics

    @property
    def peer_id(self) -> int | None: ...

    def _feed(self, ev: ps.Event) -> None: ...

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]: ...


@dataclasses.dataclass
class ReduceRun:
    """What the data-plane commands of one all-reduce act on: the call's tensors, and
    its ring op while there is one (``tx``/``rx``: what that op moved)."""

    q: QuantizationOptions
    src: RawTensor
    dst: RawTensor
    op: ReduceOp
    ring: Any = None
    algorithm: str = "local"
    tx: int = 0
    rx: int = 0
    # An all-gather (``dst`` is ``src``): every peer's bytes, rank order, once committed.
    gather: bool = False
    gathered: bytearray | None = None


@dataclasses.dataclass
class SyncRun:
    """What the data-plane commands of the running sync act on."""

    state: SharedState
    by_key: dict[str, RawTensor]
    in_place: bool
    progress: Callable[[SyncProgress], object] | None
    progress_interval: float
    served_before: int
    fetched: dict[str, Any] = dataclasses.field(default_factory=dict)
    fetch: asyncio.Task[None] | None = None
    error: BaseException | None = None  # not a PCCLError: a bug, raised to the caller
    # Set when the call ends: progress reports (what this peer served) go on until then.
    ended: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


class DataPlane:
    """Carries out the machine's data-plane commands (see the module docstring)."""

    def __init__(self, host: Host) -> None:
        self._host = host
        # Each running all-reduce's tensors and ring op by tag (registered before the
        # call's StartCollective: an early start runs its ring at once), and the running
        # sync's (registered right after its StartSync).
        self.reduces: dict[int, ReduceRun] = {}
        self.sync_run: SyncRun | None = None

    def execute(self, c: ps.Command) -> None:
        if isinstance(c, REDUCE_COMMANDS):
            self._reduce_command(c)
        elif isinstance(c, SYNC_COMMANDS):
            self._sync_command(c)
        else:  # pragma: no cover - the driver hands over DATA_PLANE_COMMANDS only
            raise TypeError(c)

    def _reduce_command(self, c: ps.RunRing | ps.AbortRing | ps.ArmRing | ps.Rollback
                        | ps.Commit | ps.ApplyResult) -> None:
        run = self.reduces[c.tag]  # (registered before the call's StartCollective)
        if isinstance(c, ps.RunRing):
            self._start_ring(c, run)
        elif isinstance(c, ps.AbortRing):
            if run.ring is not None:
                run.ring.abort()
        elif isinstance(c, ps.ArmRing):
            if run.ring is not None:
                run.ring.arm()
        elif isinstance(c, ps.Rollback):
            # In place, the ring wrote the caller's tensor as it went: the original
            # bytes go back. Out of place only `out` was written (an all-gather: only
            # its own buffer, dropped here).
            ring, run.ring, run.gathered = run.ring, None, None
            if ring is not None:
                ring.rollback()
        elif isinstance(c, ps.Commit):
            if c.local:
                if run.gather:
                    run.gathered = bytearray(run.src.data)  # a group of one
                elif run.dst.data is not run.src.data:
                    _core.copy_into(run.dst.data, run.src.data)
            else:
                ring, run.ring = run.ring, None
                ring.commit(run.gathered if run.gather else run.dst.data)
        elif run.gather:
            run.gathered = bytearray(c.data)  # gathered by the master
        else:
            _core.copy_into(run.dst.data, c.data)  # reduced by the master

    def _start_ring(self, c: ps.RunRing, run: ReduceRun) -> None:
        """Starts the ring op; a task waits for its end and feeds RingDone."""
        p = c.perform
        try:
            if self._host._node is None:
                raise MasterConnectionError("the communicator was closed")
            node, piece_bytes = self._host._node, self._host.options.piece_bytes
            if run.gather:
                # Every peer's bytes land in a buffer of the call's own, in rank order.
                run.gathered = bytearray(p.world * run.src.nbytes)
                ring = node.start_all_gather(p.op_id, p.rank, p.world, run.src.data,
                                             run.gathered, piece_bytes=piece_bytes,
                                             armed=c.armed)
            else:
                # The results land in `dst` as the ring computes them: no copy after the
                # outcome. Out of place `src` is never written, so a failed collective
                # loses nothing; in place the original bytes move to a backup as the
                # ring goes, and a Rollback puts them back.
                in_place = run.dst.data is run.src.data
                ring = node.start_all_reduce(
                    p.op_id, p.rank, p.world, run.src.data, int(run.src.dtype), int(run.op),
                    piece_bytes=piece_bytes, quant_algorithm=int(run.q.algorithm),
                    quant_dtype=int(run.q.dtype), out=None if in_place else run.dst.data,
                    armed=c.armed, in_place=in_place)
        except PCCLError as e:
            asyncio.get_running_loop().call_soon(
                self._host._feed, ps.RingDone(c.tag, False, ErrorKind.of(e), str(e)))
            return
        run.ring, run.algorithm = ring, str(ring.algorithm)
        self._host._spawn(self._ring_op(c.tag, run, ring),
                          f"pccl-ring-{self._host.peer_id}-{c.tag}")

    async def _ring_op(self, tag: int, run: ReduceRun, ring: Any) -> None:
        running = ring.run()
        try:
            # Shielded: a cancelled task (close()) stops the op through its token and
            # waits for it instead of dropping it mid-frame.
            run.tx, run.rx = await asyncio.shield(running)
        except asyncio.CancelledError:
            ring.abort()
            with contextlib.suppress(Exception):
                await running
            self._host._feed(ps.RingDone(tag, False, ErrorKind.CollectiveAbortedError,
                                         "the communicator was closed"))
            raise
        except PCCLError as e:
            self._host._feed(ps.RingDone(tag, False, ErrorKind.of(e), str(e)))
            return
        self._host._feed(ps.RingDone(tag, True))

    def _sync_command(self, c: ps.Fetch | ps.AbortFetch | ps.CommitSync) -> None:
        run = self.sync_run
        assert run is not None  # (set right after the sync's StartSync)
        if isinstance(c, ps.Fetch):
            run.fetch = self._host._spawn(self._fetch(run, c.plan),
                                          f"pccl-fetch-{self._host.peer_id}")
        elif isinstance(c, ps.AbortFetch):
            if run.fetch is not None:
                run.fetch.cancel()
        else:
            # Not awaited on purpose: the commit must not be interrupted halfway. The
            # copy releases the GIL and runs on all cores.
            for key, scratch in run.fetched.items():
                if scratch is not run.by_key[key].data:
                    _core.copy_into(run.by_key[key].data, scratch)
            run.state.revision = c.revision

    async def _fetch(self, run: SyncRun, plan: m.SyncPlan) -> None:
        """This peer's fetches of a sync plan; feeds Fetched."""
        assert self._host._node is not None
        prefault: asyncio.Task[None] | None = None
        try:
            if not run.in_place and plan.fetch_keys:
                # Back the tensors the commit will write with pages while the bytes
                # travel (contents untouched), so the commit is a plain copy.
                prefault = asyncio.create_task(asyncio.to_thread(
                    prefault_all, [run.by_key[k].data for k in plan.fetch_keys]))
            host = self._host
            fetcher = Fetcher(host._node, host.peer_id, host.options.p2p_connection_pool_size,
                              host.options.peer_timeout, host._master_addr)
            report = SyncReporter(lambda: host._node, host.peer_id, run.progress,
                                  run.progress_interval, run.served_before, fetcher,
                                  run.fetched,
                                  [run.by_key[k].nbytes for k in plan.fetch_keys])

            def sync_progress(report: SyncReporter = report) -> tuple[int, int]:
                snap = report.snapshot()
                return snap.rx_bytes, snap.rx_total

            self._host.metrics.sync_progress = sync_progress
            async with report:
                errors = await fetcher.fetch_planned(plan, run.by_key, run.in_place,
                                                     run.fetched)
                bugs = [r for r in errors if not isinstance(r, PCCLError)]
                if bugs:
                    run.error = bugs[0]
                    self._host._feed(ps.Fetched(False, ErrorKind.PCCLError, repr(bugs[0])))
                elif errors:
                    self._host._feed(ps.Fetched(False, ErrorKind.of(errors[0]), str(errors[0])))
                else:
                    if prefault is not None:
                        await prefault
                    self._host._feed(ps.Fetched(True))
                await run.ended.wait()  # (the others may still fetch from this peer)
        except asyncio.CancelledError:
            self._host._feed(ps.Fetched(False, ErrorKind.CollectiveAbortedError, "stopped"))
            raise
        except PCCLError as e:
            self._host._feed(ps.Fetched(False, ErrorKind.of(e), str(e)))
        finally:
            if prefault is not None and not prefault.done():
                prefault.cancel()  # the thread finishes on its own; nothing is written
