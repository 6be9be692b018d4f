"""pccl on a Ray cluster: the master in a detached actor, every peer in an actor that Ray
restarts when it dies.

Install the extra first: ``pip install "pccl[ray]"``. Only this module imports Ray;
``import pccl`` never does.

How a run is laid out
---------------------

- **The master** is an async actor holding a :class:`pccl.MasterNode` on the actor's own
  event loop. It is *detached* and named (``name`` in ``namespace``), so it outlives the
  driver that created it: another driver finds it with ``ray.get_actor(name,
  namespace=namespace)`` and reads its address with ``ray.get(actor.address.remote())``;
  :func:`stop_master` (or :meth:`RayRun.stop`) ends it. It
  listens on ``listen``; by default on port 48148 of the IP of the node Ray placed it on.
- **Every peer** is an async actor that builds a :class:`pccl.Communicator`, connects,
  and awaits your function ``fn(comm, ctx)``; what it returns is that peer's result.
  The actor has ``max_restarts``: when it dies (a crashed node, ``ray.kill(actor,
  no_restart=False)``, an out-of-memory kill), Ray starts a new one and runs ``fn``
  again in it. The new peer is a *joiner*: it waits in ``connect()`` until the peers
  still running admit it with ``update_topology()``, and takes the running state with
  its first ``sync_shared_state()``. ``ctx.restarted`` tells ``fn`` which case it is in.

Writing ``fn``
--------------

``fn`` is an ``async def`` taking the connected communicator and a :class:`PeerContext`
(rank, number of peers, incarnation, your ``args``). pccl's rules apply as in any
program: every peer calls the same collectives in the same order, admits joiners
between steps (``await ctx.admit_joiners()``), and a joiner's first collective must be
the one the running peers call next after admitting it. ``ctx.report(**fields)``
publishes small JSON-like progress that the driver reads with :meth:`RayRun.progress`.

Example (runs as is on a laptop)::

    import numpy as np
    import ray
    import pccl
    from pccl.launch.ray import launch

    async def train(comm, ctx):
        weights = np.zeros(4, dtype=np.float32)
        state = pccl.SharedState([pccl.TensorInfo.from_numpy(weights, "weights")])
        if not ctx.restarted:
            await ctx.wait_for_peers()        # the founders gather first
        await comm.sync_shared_state(state)   # a replacement adopts the run's weights here
        for step in range(5):
            await ctx.admit_joiners()
            grad = np.full(4, ctx.rank + 1, dtype=np.float32)
            await comm.all_reduce_multiple_with_retry(
                [pccl.ReduceDescriptor(grad, op=pccl.ReduceOp.AVG, tag=0)])
            weights -= 0.1 * grad
            state.revision += 1
            await comm.sync_shared_state(state)
            ctx.report(step=step + 1)
        return pccl.content_hash(weights)

    ray.init(num_cpus=4, include_dashboard=False)
    with launch(train, num_peers=3, listen="127.0.0.1:0", namespace="demo") as run:
        print(run.wait(timeout=120))          # three equal hashes
    ray.shutdown()

``examples/ray_train.py`` is a longer example: a numpy model trained by three actors,
one of them killed midway and replaced.

API
---

- ``launch(fn, num_peers, *, args=(), name="pccl-master", namespace="pccl",
  listen=None, secret=None, peer_group=0, master_options=None,
  communicator_options=None, max_restarts=3, peer_actor_options=None,
  master_actor_options=None, connect_attempts=30, connect_timeout=None) -> RayRun``:
  starts the master actor, then the peers (rank ``0 .. num_peers - 1``) each running
  ``fn``.
- :class:`RayRun`: ``master_address``, ``master`` and ``peers`` (actor handles),
  ``wait(timeout)`` (the results in rank order), ``done()``, ``progress(timeout)``,
  ``incarnations()``, ``master_status()``, ``kill_peer(rank)``, ``stop()``; a context
  manager that stops on exit.
- :func:`start_master` / :func:`stop_master`: the detached master alone (peers started
  elsewhere connect to its address).
- :class:`PeerContext`: what ``fn`` receives next to the communicator.

Errors: a bad argument raises :class:`pccl.InvalidArgumentError` in the driver, before
any actor starts; calling without ``ray.init()`` first, or a master name already taken,
raises :class:`pccl.InvalidUsageError`. An exception raised by ``fn`` comes out of
:meth:`RayRun.wait` as Ray delivers it (an instance of both ``ray.exceptions.RayTaskError``
and the original class, so ``except pccl.PCCLError`` works). A peer that died more than
``max_restarts`` times makes :meth:`RayRun.wait` raise ``ray.exceptions.RayActorError``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

try:
    import ray
    import ray.exceptions
except ImportError as e:  # an optional extra: say how to get it
    raise ModuleNotFoundError(
        'pccl.launch.ray needs Ray, which is not installed: pip install "pccl[ray]"',
        name="ray") from e

from pccl import recovery
from pccl.communicator import Communicator
from pccl.enums import Attribute
from pccl.errors import InvalidArgumentError, InvalidUsageError
from pccl.master import MasterNode
from pccl.protocol.auth import DEFAULT_PORT

__all__ = ["PeerContext", "PeerFunction", "RayRun", "launch", "start_master", "stop_master"]

#: What :func:`launch` runs in every peer actor.
PeerFunction = Callable[[Communicator, "PeerContext"], Awaitable[Any]]

_UNSPECIFIED_HOSTS = ("0.0.0.0", "::", "[::]", "")


# --- what runs inside the actors -------------------------------------------------------


@dataclasses.dataclass
class PeerContext:
    """What a peer's function gets next to its communicator."""

    rank: int  #: this actor's index, ``0 .. num_peers - 1``; kept across restarts
    num_peers: int  #: how many peer actors the run started
    incarnation: int  #: 0 in the first actor of this rank, n after Ray's n-th restart
    master_address: str  #: the "host:port" the communicator connected to
    args: tuple[Any, ...]  #: ``launch(args=...)``, the same for every peer
    comm: Communicator = dataclasses.field(repr=False)
    _progress: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def restarted(self) -> bool:
        """True in an actor that Ray restarted: this peer joins a run that is under way."""
        return self.incarnation > 0

    def report(self, **fields: Any) -> None:
        """Publishes ``fields`` (small, picklable values) for :meth:`RayRun.progress`;
        later calls update earlier ones."""
        self._progress.update(fields)

    async def admit_joiners(self, *, max_attempts: int = 8) -> bool:
        """Asks whether peers wait to be admitted and, if so, votes them in with
        ``update_topology()``. A collective: every accepted peer calls it at the same
        point of its loop, and all take the same branch. A failure that
        :func:`pccl.recovery.retryable` allows (a peer died during the vote) is retried,
        question and vote, up to ``max_attempts`` times. Returns whether a vote ran."""
        async def admit() -> bool:
            if not await self.comm.are_peers_pending():
                return False
            await self.comm.update_topology()
            return True

        # (No separate vote before a retry: the retry asks and votes again.)
        return await recovery.with_retry(admit, None, attempts=max_attempts,
                                         what="admitting joiners")

    async def wait_for_peers(self, world_size: int | None = None, *, timeout: float = 120.0,
                             poll_interval: float = 0.05) -> int:
        """Admits joiners until the run has ``world_size`` peers (default: ``num_peers``)
        and returns the world size. A collective like :meth:`admit_joiners`: call it at
        the same point on every accepted peer, where they share one view of the
        membership (at the start, or right after a reduce or ``update_topology()``).
        Raises :class:`TimeoutError` after ``timeout`` seconds."""
        want = self.num_peers if world_size is None else world_size
        deadline = time.monotonic() + timeout
        while (world := self.comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE)) < want:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"peer rank {self.rank}: the run has {world} of {want} peers after "
                    f"{timeout} s")
            if not await self.admit_joiners():
                await asyncio.sleep(poll_interval)  # nobody knocked yet: ask again
        return world


@dataclasses.dataclass(frozen=True)
class _PeerSpec:
    fn: PeerFunction
    rank: int
    num_peers: int
    master_address: str
    args: tuple[Any, ...]
    communicator_options: dict[str, Any]
    connect_attempts: int
    connect_timeout: float | None


def _node_ip() -> str:
    """The IP address of the node this process runs on, as Ray knows it."""
    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


def _advertised(address: str) -> str:
    """``address`` with an unspecified host (0.0.0.0) replaced by this node's IP."""
    host, _, port = address.rpartition(":")
    if host in _UNSPECIFIED_HOSTS:
        host = _node_ip()
    return f"{host}:{port}"


class _MasterActor:
    """The master in an async actor (its tasks run on the actor's event loop between
    method calls). Also counts the incarnations of every peer rank."""

    def __init__(self, listen: str | None, secret: bytes | None,
                 options: dict[str, Any]) -> None:
        self._listen = listen
        self._secret = secret
        self._options = options
        self._master: MasterNode | None = None
        self._incarnations: dict[int, int] = {}

    async def start(self) -> str:
        if self._master is None:
            listen = self._listen or f"{_node_ip()}:{DEFAULT_PORT}"
            master = MasterNode(listen=listen, secret=self._secret, **self._options)
            await master.start()
            self._master = master
        return _advertised(self._master.address)

    def address(self) -> str:
        """The "host:port" peers connect to ("" before :meth:`start`)."""
        return "" if self._master is None else _advertised(self._master.address)

    def check_in(self, rank: int) -> int:
        self._incarnations[rank] = self._incarnations.get(rank, -1) + 1
        return self._incarnations[rank]

    def incarnations(self) -> dict[int, int]:
        return dict(self._incarnations)

    def status(self) -> dict[str, int]:
        if self._master is None:
            return {"accepted": 0, "pending": 0}
        state = self._master.state
        return {"accepted": len(state.accepted()), "pending": len(state.pending())}

    async def stop(self) -> None:
        if self._master is not None:
            await self._master.stop()


class _PeerActor:
    """One peer: connects, runs the user's function, closes."""

    def __init__(self, spec: _PeerSpec, master: Any) -> None:
        self._spec = spec
        self._master = master
        self._progress: dict[str, Any] = {}
        self._incarnation = -1

    async def run(self) -> Any:
        spec = self._spec
        self._incarnation = int(await self._master.check_in.remote(spec.rank))
        comm = Communicator(master=spec.master_address, **spec.communicator_options)
        try:
            connect = comm.connect(n_attempts=spec.connect_attempts)
            if spec.connect_timeout is None:
                await connect
            else:
                try:
                    await asyncio.wait_for(connect, spec.connect_timeout)
                except TimeoutError:
                    raise TimeoutError(
                        f"peer rank {spec.rank} was not admitted within "
                        f"{spec.connect_timeout} s: the running peers must call "
                        "update_topology() (ctx.admit_joiners())") from None
            ctx = PeerContext(rank=spec.rank, num_peers=spec.num_peers,
                              incarnation=self._incarnation,
                              master_address=spec.master_address, args=spec.args,
                              comm=comm, _progress=self._progress)
            return await spec.fn(comm, ctx)
        finally:
            await comm.close()

    def progress(self) -> dict[str, Any]:
        return {**self._progress, "rank": self._spec.rank, "incarnation": self._incarnation}


# --- the driver's side -----------------------------------------------------------------


def _require_ray() -> None:
    if not ray.is_initialized():
        raise InvalidUsageError(
            "Ray is not initialized: call ray.init() first (ray.init(address='auto') to "
            "join a running cluster)")


def _check_name(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"{what} must be a non-empty string, got {value!r}")
    return value


def _secret_bytes(secret: bytes | str | None) -> bytes | None:
    if secret is None or isinstance(secret, bytes):
        return secret
    if isinstance(secret, str):
        return secret.encode()
    raise InvalidArgumentError(f"secret must be bytes, str or None, got {type(secret).__name__}")


def _options(value: Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise InvalidArgumentError(f"{what} must be a mapping of keyword arguments, got "
                                   f"{value!r}")
    return dict(value)


def _construct(cls: Callable[..., Any], what: str, **kwargs: Any) -> None:
    """Builds ``cls(**kwargs)`` once in the driver, so that a bad option fails here and
    not later inside an actor (neither class touches the network before it starts)."""
    try:
        cls(**kwargs)
    except TypeError as e:
        raise InvalidArgumentError(f"{what}: {e}") from None


def _actor_class(cls: type, what: str, **options: Any) -> Any:
    """``ray.remote(cls).options(**options)``; Ray's refusal of an option becomes an
    :class:`InvalidArgumentError` naming ``what``."""
    try:
        return ray.remote(cls).options(**options)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"{what}: {e}") from None


def start_master(*, name: str = "pccl-master", namespace: str = "pccl",
                 listen: str | None = None, secret: bytes | str | None = None,
                 master_options: Mapping[str, Any] | None = None,
                 actor_options: Mapping[str, Any] | None = None,
                 timeout: float = 60.0) -> tuple[Any, str]:
    """Starts the detached master actor ``name`` in ``namespace``; returns its handle and
    the address peers connect to once it listens.

    ``listen`` is the "host:port" it binds on its node (default: the node's IP, port
    48148; port 0 picks a free port). ``master_options`` are :class:`pccl.MasterNode`
    keyword arguments (``heartbeat_timeout``, ``status_listen``, ...), ``actor_options``
    Ray actor options (it asks for no CPU unless you say otherwise). The actor outlives
    this driver: end it with :func:`stop_master`."""
    _require_ray()
    _check_name(name, "name")
    _check_name(namespace, "namespace")
    if listen is not None:
        _check_name(listen, "listen")
    key = _secret_bytes(secret)
    opts = _options(master_options, "master_options")
    for reserved in ("listen", "secret"):
        if reserved in opts:
            raise InvalidArgumentError(
                f"pass {reserved}= to start_master()/launch(), not in master_options")
    _construct(MasterNode, "master_options",
               listen=listen or f"127.0.0.1:{DEFAULT_PORT}", secret=key, **opts)
    actor_opts = {"num_cpus": 0, **_options(actor_options, "actor_options")}
    taken = InvalidUsageError(
        f"an actor named {name!r} already runs in Ray namespace {namespace!r} (a master "
        "left by an earlier driver?): stop it with "
        f"pccl.launch.ray.stop_master({name!r}, {namespace!r}) or pick another name")
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        pass  # not taken: the usual case
    else:
        raise taken
    # Handles are untyped here: Ray's generics do not follow .options() on a class
    # decorated at run time.
    configured: Any = _actor_class(_MasterActor, "actor_options", name=name,
                                   namespace=namespace, lifetime="detached", max_restarts=0,
                                   **actor_opts)
    try:
        handle: Any = configured.remote(listen, key, opts)
    except ValueError as e:  # taken since the look above
        raise taken from e
    try:
        address = ray.get(handle.start.remote(), timeout=timeout)
    except BaseException:
        ray.kill(handle, no_restart=True)
        raise
    return handle, str(address)


def stop_master(name: str = "pccl-master", namespace: str = "pccl", *,
                timeout: float = 10.0) -> bool:
    """Stops the detached master actor ``name`` in ``namespace`` (its peers see the
    master gone) and kills the actor. Returns False when there was none."""
    _require_ray()
    try:
        handle = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    _stop_master_actor(handle, timeout)
    return True


def _stop_master_actor(handle: Any, timeout: float) -> None:
    try:
        ray.get(handle.stop.remote(), timeout=timeout)
    except (ray.exceptions.RayError, TimeoutError):
        pass  # dead or stuck already: the kill below ends it either way
    ray.kill(handle, no_restart=True)


class RayRun:
    """A master actor and its peer actors, as :func:`launch` started them."""

    def __init__(self, master: Any, master_address: str, peers: list[Any],
                 runs: list[Any]) -> None:
        self.master = master  #: the detached master actor's handle
        self.master_address = master_address  #: the "host:port" the peers connect to
        self.peers = peers  #: the peer actors' handles, in rank order
        self._runs = runs
        self._stopped = False

    def wait(self, timeout: float | None = None) -> list[Any]:
        """Waits for every peer's function to return; its results in rank order. A
        restarted peer's result is the one its last incarnation returned. A failure (an
        exception from ``fn``, a peer dead for good) is raised as soon as it happens, the
        other peers left running (:meth:`stop` ends them). Raises :class:`TimeoutError`
        naming the ranks still running after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        running = list(self._runs)
        while running:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, running = ray.wait(running, num_returns=1, timeout=left)
            if not ready:
                ranks = sorted(self._runs.index(r) for r in running)
                raise TimeoutError(f"peer rank(s) {ranks} still running after {timeout} s")
            ray.get(ready)  # raises that peer's failure now
        return list(ray.get(self._runs))

    def done(self) -> bool:
        """Whether every peer's function has returned (or failed); does not wait."""
        ready, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        return len(ready) == len(self._runs)

    def progress(self, timeout: float = 10.0) -> dict[int, dict[str, Any]]:
        """What each peer last published with ``ctx.report()`` (plus ``rank`` and
        ``incarnation``), by rank. A peer that does not answer within ``timeout`` s (it
        is being restarted, say) or has died for good is left out."""
        refs = [p.progress.remote() for p in self.peers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        out: dict[int, dict[str, Any]] = {}
        for rank, ref in enumerate(refs):
            if ref in ready:
                try:
                    out[rank] = ray.get(ref)
                except ray.exceptions.RayActorError:
                    continue
        return out

    def incarnations(self, timeout: float = 10.0) -> dict[int, int]:
        """How many times Ray restarted each rank's actor so far (0: never), as the
        master actor counted the starts."""
        return dict(ray.get(self.master.incarnations.remote(), timeout=timeout))

    def master_status(self, timeout: float = 10.0) -> dict[str, int]:
        """The master's view: ``{"accepted": n, "pending": m}`` peers."""
        return dict(ray.get(self.master.status.remote(), timeout=timeout))

    def kill_peer(self, rank: int) -> None:
        """Kills the actor of ``rank`` the hard way (``ray.kill(..., no_restart=False)``),
        as a crash would: Ray restarts it and it comes back as a joiner. For drills and
        tests."""
        if not 0 <= rank < len(self.peers):
            raise InvalidArgumentError(f"rank must be in 0..{len(self.peers) - 1}, got {rank}")
        ray.kill(self.peers[rank], no_restart=False)

    def stop(self, timeout: float = 10.0) -> None:
        """Kills the peer actors (no restarts), then stops and kills the master actor.
        Idempotent. Call :meth:`wait` first for a graceful end: each peer closes its
        communicator when its function returns."""
        if self._stopped:
            return
        self._stopped = True
        for peer in self.peers:
            ray.kill(peer, no_restart=True)
        _stop_master_actor(self.master, timeout)

    def __enter__(self) -> RayRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _is_async(fn: object) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))  # noqa: B004 (an object with an async __call__)


def launch(fn: PeerFunction, num_peers: int, *, args: Sequence[Any] = (),
           name: str = "pccl-master", namespace: str = "pccl", listen: str | None = None,
           secret: bytes | str | None = None, peer_group: int | Sequence[int] = 0,
           master_options: Mapping[str, Any] | None = None,
           communicator_options: Mapping[str, Any] | None = None, max_restarts: int = 3,
           peer_actor_options: Mapping[str, Any] | None = None,
           master_actor_options: Mapping[str, Any] | None = None,
           connect_attempts: int = 30, connect_timeout: float | None = None) -> RayRun:
    """Starts a pccl run on the Ray cluster this driver is connected to: the detached
    master actor (see :func:`start_master` for ``name``, ``namespace``, ``listen``,
    ``master_options``), then ``num_peers`` peer actors, each awaiting
    ``fn(comm, ctx)`` (see :class:`PeerContext`).

    ``secret`` goes to the master and every communicator. ``peer_group`` is one group
    for all peers or one per rank. ``communicator_options`` are further
    :class:`pccl.Communicator` keyword arguments (``p2p_connection_pool_size``,
    ``peer_timeout``, ...). ``max_restarts`` is how often Ray may restart each peer
    actor (-1: without limit); ``peer_actor_options`` are Ray actor options for the
    peers (``num_cpus``, ``num_gpus``, ``resources``, ``runtime_env``, ...).
    ``connect_attempts`` bounds the tries to reach the master, ``connect_timeout``
    (seconds, default None: no limit) the wait to be admitted."""
    if not _is_async(fn):
        raise InvalidArgumentError(
            f"fn must be an async function taking (comm, ctx), got {fn!r}: define it with "
            "'async def'")
    if isinstance(num_peers, bool) or not isinstance(num_peers, int) or num_peers < 1:
        raise InvalidArgumentError(f"num_peers must be an integer >= 1, got {num_peers!r}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) \
            or max_restarts < -1:
        raise InvalidArgumentError(
            f"max_restarts must be an integer >= 0 (or -1: no limit), got {max_restarts!r}")
    if isinstance(connect_attempts, bool) or not isinstance(connect_attempts, int) \
            or connect_attempts < 1:
        raise InvalidArgumentError(
            f"connect_attempts must be an integer >= 1, got {connect_attempts!r}")
    if connect_timeout is not None and (
            isinstance(connect_timeout, bool) or not isinstance(connect_timeout, (int, float))
            or not connect_timeout > 0):
        raise InvalidArgumentError(
            f"connect_timeout must be a positive number of seconds or None, got "
            f"{connect_timeout!r}")
    groups = [peer_group] * num_peers if isinstance(peer_group, int) else list(peer_group)
    if len(groups) != num_peers:
        raise InvalidArgumentError(
            f"peer_group must be one int or one per peer ({num_peers}), got {len(groups)}")
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise InvalidArgumentError(f"args must be a sequence (a tuple), got {args!r}")
    key = _secret_bytes(secret)
    comm_opts = _options(communicator_options, "communicator_options")
    for reserved in ("master", "secret", "peer_group"):
        if reserved in comm_opts:
            raise InvalidArgumentError(
                f"pass {reserved}= to launch(), not in communicator_options")
    for group in groups:  # Communicator checks the group and every option
        _construct(Communicator, "communicator_options", master=f"127.0.0.1:{DEFAULT_PORT}",
                   peer_group=group, secret=key, **comm_opts)
    peer_opts = _options(peer_actor_options, "peer_actor_options")
    for reserved in ("max_restarts", "max_task_retries", "lifetime", "name"):
        if reserved in peer_opts:
            raise InvalidArgumentError(
                f"peer_actor_options may not set {reserved!r}: launch() manages it")
    _require_ray()
    # max_task_retries: the run() in flight when the actor died is run again in the
    # restarted actor, so wait() gets the replacement's result.
    configured: Any = _actor_class(_PeerActor, "peer_actor_options",
                                   max_restarts=max_restarts,
                                   max_task_retries=max_restarts, **peer_opts)
    _actor_class(_MasterActor, "master_actor_options", num_cpus=0,
                 **_options(master_actor_options, "master_actor_options"))

    master, address = start_master(name=name, namespace=namespace, listen=listen,
                                   secret=key, master_options=master_options,
                                   actor_options=master_actor_options)
    peers: list[Any] = []
    runs: list[Any] = []
    try:
        for rank in range(num_peers):
            spec = _PeerSpec(fn=fn, rank=rank, num_peers=num_peers, master_address=address,
                             args=tuple(args),
                             communicator_options={**comm_opts, "peer_group": groups[rank],
                                                   "secret": key},
                             connect_attempts=connect_attempts,
                             connect_timeout=connect_timeout)
            peer = configured.remote(spec, master)
            peers.append(peer)
            runs.append(peer.run.remote())
    except BaseException:
        for peer in peers:
            ray.kill(peer, no_restart=True)
        _stop_master_actor(master, 10.0)
        raise
    return RayRun(master, address, peers, runs)
