"""PCCL's blocking ``Communicator`` (and ``AsyncReduceHandle``) over
:class:`pccl.Communicator`, run on :mod:`pccl.blocking.runtime`'s loop, with PCCL's
retrying calls: ``sync_shared_state()`` and ``all_reduce_multiple_with_retry()`` (the
retry loop, :func:`_reduce_all_with_retry`). What a failure means and what to do before a
retry is :func:`pccl.recovery.decide`'s call, the one recovery policy of every layer."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import enum
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pccl import enums as _enums
from pccl import recovery
from pccl.blocking import runtime
from pccl.blocking.compat import (
    _CORE_ATTRIBUTE,
    ArgumentAssertionError,
    Attribute,
    Result,
    _reports_result,
    _tag_result,
    result_of,
)
from pccl.blocking.descriptors import (
    QuantizationOptions,
    ReduceInfo,
    ReduceOpDescriptor,
    ReduceOperandDescriptor,
    _reduce_arguments,
)
from pccl.blocking.runtime import _CANCEL_GRACE, _Loop, _Resource, _settle
from pccl.blocking.shared_state import SharedState
from pccl.communicator import Communicator as _AsyncCommunicator
from pccl.communicator import QuantizationOptions as _AsyncQuantizationOptions
from pccl.enums import ReduceOp, SharedStateSyncStrategy
from pccl.errors import (
    AuthenticationError,
    InvalidArgumentError,
    InvalidUsageError,
    MasterConnectionError,
    PCCLError,
    PendingAsyncOpsError,
    ProtocolError,
    TooFewPeersError,
)
from pccl.shared_state import SyncInfo, SyncProgress

log = logging.getLogger("pccl.blocking")

T = TypeVar("T")

# What a retry can fix, and what to do first: pccl.recovery decides (one policy for
# every layer).
_RETRYABLE = recovery.RETRYABLE
_SYNC_ATTEMPTS = 4  # tries of sync_shared_state() after retryable failures
_REDUCE_ROUNDS = 16  # relaunch rounds of all_reduce_multiple_with_retry()


class _PeerCore(_Resource):
    """The loop side of one :class:`Communicator`: the async communicator plus the
    bookkeeping that gives PCCL's recovery semantics. Touched on the loop thread only."""

    def __init__(self, address: str, auto_update_topology: bool) -> None:
        self.address = address
        self.auto_update_topology = auto_update_topology
        self.comm: _AsyncCommunicator | None = None
        self.in_flight: set[asyncio.Future[Any]] = set()  # the async API's reduce tasks

    def describe(self) -> str:
        peer = self.comm.peer_id if self.comm is not None else None
        return f"pccl.blocking.Communicator(peer {peer}, master {self.address})"

    async def aclose(self) -> None:
        if self.comm is not None:
            await self.comm.close()

    def require(self) -> _AsyncCommunicator:
        if self.comm is None:
            raise InvalidUsageError("the communicator is not connected; call connect() first")
        return self.comm

    async def settle(self) -> _AsyncCommunicator:
        """Returns the async communicator. (Recovery after a lost peer needs nothing
        here: the master rebuilds the ring on its own, the same for every peer.)"""
        return self.require()

    def group_size(self, comm: _AsyncCommunicator) -> int:
        return comm.get_attribute(_enums.Attribute.PEER_GROUP_WORLD_SIZE)

    def require_peers(self, comm: _AsyncCommunicator) -> None:
        world = self.group_size(comm)
        if world < 2:
            raise TooFewPeersError(
                f"the peer group has {world} peer; reduces need at least 2 (as in PCCL). "
                "Wait for peers: call update_topology() when are_peers_pending()")

    def launch(self, comm: _AsyncCommunicator, send: Any, out: Any, op: ReduceOp, tag: int,
               quantization: _AsyncQuantizationOptions | None) -> asyncio.Task[Any]:
        """Starts one reduce through the async API (argument errors raise here)."""
        raw = comm.all_reduce_async(send, out, op=op, tag=tag, quantization=quantization)
        self.in_flight.add(raw)
        raw.add_done_callback(self.in_flight.discard)
        return raw


class AsyncReduceHandle:
    """A reduce in flight, from :meth:`Communicator.all_reduce_async`."""

    def __init__(self, loop: _Loop, slot: list[asyncio.Future[Any]],
                 done: concurrent.futures.Future[Any]) -> None:
        self._loop = loop
        self._slot = slot
        self._done = done
        self._info: tuple[bool, int, ReduceInfo] | None = None
        self._error: PCCLError | None = None

    def wait(self) -> tuple[bool, int, ReduceInfo]:
        """Blocks (GIL released) until the reduce finished. Returns ``(is_success,
        status, info)`` like PCCL: a failure is reported, not raised; ``status`` is the
        :class:`Result` value and :attr:`error` holds pccl's error."""
        if self._info is not None:
            return self._info
        try:
            info = self._loop.wait(self._done, self._slot)
        except PCCLError as e:
            self._error = e
            _tag_result(e)
            self._info = (False, result_of(e).value, ReduceInfo(0, 0, 0))
        else:
            self._info = (True, Result.SUCCESS.value,
                          ReduceInfo(info.world_size, info.tx_bytes, info.rx_bytes))
        return self._info

    def done(self) -> bool:
        """Whether the reduce finished (``wait()`` would not block)."""
        return self._done.done()

    @property
    def error(self) -> PCCLError | None:
        """pccl's error after a failed ``wait()`` (its message says what happened)."""
        return self._error


class Communicator:
    """One peer of a run (PCCL's ``Communicator``), blocking.

    ``p2p_connection_pool_size=0`` means one stream per neighbour, as in PCCL. Keyword
    arguments beyond PCCL's go to :class:`pccl.Communicator` (``secret``, ``timeout``,
    ``peer_timeout``, ``collective_timeout``, ...). (``auto_update_topology`` is
    accepted and ignored: the master now rebuilds a ring that lost a peer on its own,
    as PCCL does, so nothing runs ``update_topology()`` behind the caller's back.)

    Example::

        comm = pccl.Communicator("127.0.0.1:48148", 0)
        comm.connect(n_attempts=15)
        comm.all_reduce(x, x, op=pccl.ReduceOp.SUM)
        comm.close()

    ``with Communicator(...) as comm:`` closes it at the end (it does not connect).
    """

    @_reports_result
    def __init__(self, address: str, peer_group: int = 0, p2p_connection_pool_size: int = 0,
                 **options: Any) -> None:
        if not isinstance(address, str) or ":" not in address:
            raise ArgumentAssertionError(
                f"Invalid address: {address}, expected format: ip:port")
        self.address = address
        self.peer_group = peer_group
        self.p2p_connection_pool_size = p2p_connection_pool_size or 1
        self._auto_update_topology = bool(options.pop("auto_update_topology", True))
        self._options = options
        self._make_async()  # checks the arguments now, as PCCL's constructor does
        self._lock = threading.Lock()
        self._core: _PeerCore | None = None
        self._loop: _Loop | None = None
        self._closed = False

    def _make_async(self) -> _AsyncCommunicator:
        return _AsyncCommunicator(master=self.address, peer_group=self.peer_group,
                                  p2p_connection_pool_size=self.p2p_connection_pool_size,
                                  **self._options)

    # --- lifecycle --------------------------------------------------------------------

    @_reports_result
    def connect(self, n_attempts: int = 5) -> None:
        """Joins the run; returns once the existing peers accepted this one (they do
        in ``update_topology()``). Tries ``n_attempts`` times, a second apart; then
        raises :class:`MasterConnectionError`."""
        if n_attempts < 1:
            raise InvalidArgumentError("n_attempts must be at least 1")
        with self._lock:
            if self._closed:
                raise InvalidUsageError("the communicator was closed")
            if self._core is not None:
                raise InvalidUsageError("connect() was already called on this communicator")
            core = self._core = _PeerCore(self.address, self._auto_update_topology)
        loop = runtime.current().acquire(core)
        try:
            loop.call(lambda: self._connect(core, n_attempts))
        except BaseException:
            with self._lock:
                self._core = None
            runtime.current().release(core)
            raise
        self._loop = loop

    async def _connect(self, core: _PeerCore, n_attempts: int) -> None:
        last: PCCLError | None = None
        for attempt in range(1, n_attempts + 1):
            comm = self._make_async()
            try:
                await comm.connect(n_attempts=1)
            except (AuthenticationError, ProtocolError, InvalidArgumentError):
                raise  # another attempt cannot help
            except PCCLError as e:
                last = e
                log.warning("connecting to the master at %s failed (attempt %d/%d): %s",
                            self.address, attempt, n_attempts, e)
                if attempt < n_attempts:
                    await asyncio.sleep(1.0)  # PCCL waits a second between attempts
                continue
            core.comm = comm
            return
        raise MasterConnectionError(
            f"Failed to connect to the master node at {self.address} after {n_attempts} "
            f"attempt(s): {last}")

    @_reports_result
    def close(self) -> None:
        """Leaves the run gracefully. Idempotent. The loop thread stops when the last
        communicator and master are closed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            core, loop = self._core, self._loop
        runtime.close(core, loop)

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # PCCL destroys the communicator with its Python object; do the same without
        # blocking (a finalizer may run on any thread, the loop's included).
        try:
            if not self._closed and self._core is not None and self._loop is not None:
                self._closed = True
                runtime.current().close_soon(self._loop, self._core)
        except Exception:  # interpreter teardown
            pass

    def _run(self, make: Callable[[_PeerCore], Awaitable[T]]) -> T:
        core, loop = self._core, self._loop
        if self._closed:
            raise InvalidUsageError("the communicator was closed")
        if core is None or loop is None:
            raise InvalidUsageError("the communicator is not connected; call connect() first")
        try:
            return loop.call(lambda: make(core))
        except PCCLError as e:  # the properties are not @_reports_result
            _tag_result(e)
            raise

    # --- membership -------------------------------------------------------------------

    @_reports_result
    def get_attribute(self, attribute: Attribute) -> int:
        """The run's shape: ``GLOBAL_WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` (the peer
        group's), ``NUM_DISTINCT_PEER_GROUPS``, ``LARGEST_PEER_GROUP_WORLD_SIZE``."""
        if isinstance(attribute, Attribute):
            core_attribute = _CORE_ATTRIBUTE[attribute]
        elif isinstance(attribute, _enums.Attribute):
            core_attribute = attribute
        else:
            raise InvalidArgumentError(f"unknown attribute {attribute!r}")

        async def get(core: _PeerCore) -> int:
            return (await core.settle()).get_attribute(core_attribute)

        return self._run(get)

    @property
    def rank(self) -> int:
        """This peer's rank in its peer group (``0 .. world_size - 1``, join order; see
        :attr:`pccl.Communicator.rank`). A pccl extension: PCCL has no ranks."""
        async def get(core: _PeerCore) -> int:
            return (await core.settle()).rank

        return self._run(get)

    @property
    def world_size(self) -> int:
        """How many peers the peer group has (``get_attribute(LOCAL_WORLD_SIZE)``)."""
        async def get(core: _PeerCore) -> int:
            return (await core.settle()).world_size

        return self._run(get)

    @property
    def last_synced_revision(self) -> int | None:
        """The shared-state revision of the last successful ``sync_shared_state()``
        (``None`` before the first one)."""
        async def get(core: _PeerCore) -> int | None:
            return (await core.settle()).last_synced_revision

        return self._run(get)

    @_reports_result
    def update_topology(self) -> None:
        """Collective over all accepted peers: admits pending peers, drops dead ones,
        rebuilds the rings. ``PendingAsyncOpsError`` while reduces are in flight."""
        async def update(core: _PeerCore) -> None:
            await (await core.settle()).update_topology()

        self._run(update)

    @_reports_result
    def are_peers_pending(self) -> bool:
        """Whether peers wait for ``update_topology()`` to admit them. A collective, as
        in PCCL: returns once every accepted peer asked, the same answer on all."""
        async def pending(core: _PeerCore) -> bool:
            return await (await core.settle()).are_peers_pending()

        return self._run(pending)

    @_reports_result
    def pending_peer_count(self) -> int:
        """How many peers wait to be admitted, as the master sees it now (an extension;
        not a collective: do not branch collective calls on it)."""
        async def count(core: _PeerCore) -> int:
            return await (await core.settle()).pending_peer_count()

        return self._run(count)

    @_reports_result
    def optimize_topology(self) -> None:
        """Measures bandwidths and re-orders the ring (collective). As in PCCL, needs at
        least two peers in the run (``InvalidUsageError``)."""
        async def optimize(core: _PeerCore) -> None:
            comm = await core.settle()
            world = comm.get_attribute(_enums.Attribute.GLOBAL_WORLD_SIZE)
            if world < 2:
                raise InvalidUsageError(
                    f"optimize_topology() needs at least 2 peers in the run, there are {world}")
            await comm.optimize_topology()

        self._run(optimize)

    # --- shared state -----------------------------------------------------------------

    @_reports_result
    def sync_shared_state(self, shared_state: SharedState,
                          strategy: SharedStateSyncStrategy =
                          SharedStateSyncStrategy.ENFORCE_POPULAR, *,
                          progress: Callable[[SyncProgress], object] | None = None,
                          progress_interval: float = 1.0) -> SyncInfo:
        """Brings ``shared_state`` to the content most peers of the group hold and sets
        its revision (collective). Returns ``tx_bytes`` / ``rx_bytes``. ``progress``
        (an extension) gets :class:`pccl.SyncProgress` reports as in the asyncio API; it
        is called on the background event-loop thread."""
        if not isinstance(shared_state, SharedState):
            raise InvalidArgumentError("shared_state must be a pccl.blocking.SharedState")
        try:
            strategy = SharedStateSyncStrategy(
                strategy.value if isinstance(strategy, enum.Enum) else strategy)
        except ValueError:
            raise InvalidArgumentError(f"unknown sync strategy {strategy!r}") from None

        async def sync(core: _PeerCore) -> SyncInfo:
            comm = await core.settle()
            if core.in_flight:
                raise PendingAsyncOpsError(
                    f"{len(core.in_flight)} reduce(s) in flight; wait() for them before "
                    "sync_shared_state()")
            # PCCL's sync does not fail because a holder died or peers were still in a
            # topology vote, and its programs do not catch that: retry here. Every peer
            # of the sync saw the same outcome, so all retry alike.
            return await recovery.with_retry(
                lambda: comm.sync_shared_state(shared_state._state, strategy,
                                               progress=progress,
                                               progress_interval=progress_interval),
                comm, attempts=_SYNC_ATTEMPTS, what=f"peer {comm.peer_id}: sync_shared_state()")

        return self._run(sync)

    # --- all-reduce -------------------------------------------------------------------

    def _start(self, send: Any, recv: Any, op: Any, tag: int,
               operand_descriptor: ReduceOperandDescriptor | None,
               quantization_options: QuantizationOptions | None
               ) -> tuple[_Loop, list[asyncio.Future[Any]], concurrent.futures.Future[Any]]:
        """Launches one reduce; returns what a caller needs to wait for it."""
        tensor, out, core_op, quantization = _reduce_arguments(
            send, recv, op, operand_descriptor, quantization_options)
        ready: concurrent.futures.Future[Any] = concurrent.futures.Future()
        ready.set_running_or_notify_cancel()
        launched: list[asyncio.Task[Any]] = []

        async def start(core: _PeerCore) -> asyncio.Task[Any]:
            comm = await core.settle()
            core.require_peers(comm)
            task = core.launch(comm, tensor, out, core_op, tag, quantization)
            launched.append(task)
            task.add_done_callback(lambda t: _settle(t, ready))
            return task

        try:
            task = self._run(start)
        except BaseException:
            loop = self._loop
            if launched and loop is not None:
                # Interrupted (Ctrl-C) after the reduce started: nobody will wait for it,
                # so call it off before returning, as a cancelled wait() does.
                with contextlib.suppress(RuntimeError):
                    loop.loop.call_soon_threadsafe(launched[0].cancel)
                concurrent.futures.wait([ready], timeout=_CANCEL_GRACE)
            raise
        assert self._loop is not None
        return self._loop, [task], ready

    @_reports_result
    def all_reduce(self, send: Any, recv: Any, *, op: ReduceOp, tag: int = 0,
                   operand_descriptor: ReduceOperandDescriptor | None = None,
                   quantization_options: QuantizationOptions | None = None) -> ReduceInfo:
        """All-reduces ``send`` into ``recv`` (the same tensor: in place) across the
        peer group; blocks until done. Both numpy arrays or both torch tensors (CPU, or
        CUDA on one device: staged through pinned host memory).
        On failure raises and leaves both tensors as they were.

        Example::

            info = comm.all_reduce(grads, grads, op=pccl.ReduceOp.AVG)
        """
        loop, slot, ready = self._start(send, recv, op, tag, operand_descriptor,
                                        quantization_options)
        info = loop.wait(ready, slot)
        return ReduceInfo(info.world_size, info.tx_bytes, info.rx_bytes)

    @_reports_result
    def all_reduce_async(self, send: Any, recv: Any, *, op: ReduceOp, tag: int = 0,
                         operand_descriptor: ReduceOperandDescriptor | None = None,
                         quantization_options: QuantizationOptions | None = None
                         ) -> AsyncReduceHandle:
        """Starts an all-reduce and returns a handle; ``handle.wait()`` returns
        ``(is_success, status, ReduceInfo)``. Several may be in flight (distinct tags);
        do not touch the tensors until ``wait()`` returned."""
        loop, slot, ready = self._start(send, recv, op, tag, operand_descriptor,
                                        quantization_options)
        return AsyncReduceHandle(loop, slot, ready)

    @_reports_result
    def all_reduce_multiple_with_retry(self, descriptors: list[ReduceOpDescriptor], *,
                                       max_in_flight: int = 4) -> ReduceInfo:
        """Runs every descriptor's reduce, at most ``max_in_flight`` at a time, and
        retries the ones that failed (a peer died) on the smaller world until all
        succeeded. Returns the summed bytes and the world size at the end. Raises
        ``TooFewPeersError`` when fewer than two peers are left, as PCCL does."""
        if not descriptors:
            raise InvalidArgumentError("descriptors must not be empty")
        if max_in_flight < 1:
            raise InvalidArgumentError("max_in_flight must be at least 1")
        prepared = []
        for d in descriptors:
            send, recv = d._tensors()
            rd = d.reduce_descriptor
            prepared.append((*_reduce_arguments(
                send, recv, rd.op, rd.operand_descriptor, rd.quantization_options,
                count=rd.count), rd.tag))
        if len({p[4] for p in prepared}) != len(prepared):
            raise InvalidUsageError("descriptors must have distinct tags")

        async def run(core: _PeerCore) -> ReduceInfo:
            comm = await core.settle()
            core.require_peers(comm)
            return await _reduce_all_with_retry(core, comm, prepared, max_in_flight)

        return self._run(run)


async def _reduce_all_with_retry(core: _PeerCore, comm: _AsyncCommunicator,
                                 prepared: list[tuple[Any, ...]],
                                 max_in_flight: int) -> ReduceInfo:
    """PCCL's retry loop: keep up to ``max_in_flight`` reduces going, awaited in order;
    after a failure let the others finish, move to the new topology, and relaunch what
    did not succeed. Every peer sees the same outcome per tag, so all relaunch alike."""
    tx = rx = rounds = 0
    todo = collections.deque(range(len(prepared)))
    running: dict[int, asyncio.Task[Any]] = {}
    try:
        while todo or running:
            while todo and len(running) < max_in_flight:
                i = todo.popleft()
                send, out, op, quantization, tag = prepared[i]
                running[i] = core.launch(comm, send, out, op, tag, quantization)
            i, task = next(iter(running.items()))
            try:
                info = await task
            except _RETRYABLE as e:
                if recovery.decide(e, rounds + 1) is recovery.Action.GIVE_UP:
                    raise
                log.info("peer %s: reduce with tag %d failed (%s); retrying the failed "
                         "reduces on the new topology", comm.peer_id, prepared[i][4], e)
                del running[i]
                failed = [i]
                for j, other in list(running.items()):
                    del running[j]
                    try:
                        done = await other
                    except _RETRYABLE:
                        failed.append(j)
                    else:
                        tx, rx = tx + done.tx_bytes, rx + done.rx_bytes
                todo = collections.deque(sorted([*failed, *todo]))
                rounds += 1
                if rounds > _REDUCE_ROUNDS:
                    raise
                # A lost peer needs nothing from us: the master rebuilds the ring and runs
                # the relaunched reduces on it. Peers in update_topology() (the reduce was
                # called off for them), or a ring that failed again, need our vote.
                if recovery.decide(e, rounds) is recovery.Action.UPDATE_TOPOLOGY:
                    await comm.update_topology()
                comm = await core.settle()
                # Down to this peer alone: the relaunch is a reduce over a world of one
                # (the input, unchanged), and the info says world 1, as PCCL's loop
                # expects ("all peers have left except this peer"); no TooFewPeersError.
                continue
            del running[i]
            tx, rx = tx + info.tx_bytes, rx + info.rx_bytes
    except BaseException as e:
        # Report the error once the rest finished (or, when the caller gave up, was
        # called off): nothing may write the tensors after this returns.
        if isinstance(e, asyncio.CancelledError):
            for t in running.values():
                t.cancel()
        await asyncio.gather(*running.values(), return_exceptions=True)
        raise
    return ReduceInfo(core.group_size(comm), tx, rx)
