"""Deterministic simulation of a whole pccl run: the real sans-IO master
(:class:`pccl.master.state.MasterState`) and N real sans-IO peers
(:class:`pccl.peer.state.PeerMachine`) in one process, a virtual clock, and a seeded
scheduler that delays and reorders messages, kills peers, drops connections and lets
joiners in, restarts the master (FoundationDB-style: the same seed replays the same run,
event for event).

    python -m pccl.testing.sim --schedules 2000            # many seeds, invariants checked
    python -m pccl.testing.sim --seed 17 --trace            # replay one, printing every event

What is simulated and what is real:

* real: every protocol decision on both sides (votes, admission, ring repair, deadlines,
  the fresh-member rule, collective and sync outcomes, withdrawals, the peer's waiters,
  registering again after a lost connection and the master-restart recovery);
* simulated: the network (each connection is FIFO, as TCP is; different connections
  reorder freely; delays are random, with a heavy tail), the data plane (a ring op
  completes when every member started it and none died or withdrew, else it fails with
  ``PeerConnectionError`` for the others; shared-state fetches succeed while a holder of
  the wanted content is alive), connections (a broken one loses what is in flight on it;
  a peer registers again with its old id once the master has forgotten it), and time
  (virtual: a 30-minute deadline costs nothing).

Every peer runs the loop of PCCL's own programs (the churn soak's step): ``if
are_peers_pending(): update_topology()``, agree on the step with a MAX all-reduce, two
concurrent SUM all-reduces, an update of its state from the results, then
``sync_shared_state`` with revision = step; any failure restores the state, votes and
retries, as :mod:`pccl.recovery` says.

Invariants checked after every run (:attr:`Report.violations`):

* *parity*: the peers that committed one sync (the master sent them its ok outcome
  together) hold the same state afterwards;
* *exact results*: each SUM equals the number of peers its collective ran with times
  the contribution; the step agreed is never below a peer's own;
* *all-or-nothing*: every peer that heard an outcome of one collective (op id) heard
  the same one;
* *no waiter left hanging*: when nothing is left to happen, every live peer's program
  has finished and its machine waits for nothing.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import heapq
import random
import sys
import time
from collections.abc import Callable, Generator
from typing import Any

from pccl.enums import DataType, ReduceOp, SharedStateSyncStrategy
from pccl.errors import ErrorKind, MasterConnectionError, PCCLError
from pccl.master import state as ms
from pccl.peer import state as ps
from pccl.protocol import messages as m
from pccl.recovery import Action, decide

# --- the programs peers run ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Pending:
    """``are_peers_pending()`` -> bool"""


@dataclasses.dataclass(frozen=True)
class Update:
    """``update_topology()`` -> None"""


@dataclasses.dataclass(frozen=True)
class Optimize:
    """``optimize_topology()`` -> None"""


@dataclasses.dataclass(frozen=True)
class Reduce:
    """``all_reduce_async`` of one int64 value; several may be yielded as a tuple (they
    run concurrently; the program gets their results, or the first error after all
    ended). -> (result, world)"""

    tag: int
    value: int
    op: ReduceOp = ReduceOp.SUM


@dataclasses.dataclass(frozen=True)
class Sync:
    """``sync_shared_state`` of the peer's state at ``revision`` -> None (the state and
    revision are the sim's ``SimPeer.state`` / ``.revision``)."""

    revision: int
    strategy: SharedStateSyncStrategy


Call = Pending | Update | Optimize | Sync | tuple[Reduce, ...]
Program = Generator[Call, Any, None]


def training_loop(peer: SimPeer, steps: int) -> Program:
    """The churn soak's step (see the module docstring), ``steps`` times."""
    done = 0
    failures = 0
    while done < steps:
        before = (peer.state, peer.revision)
        try:
            if (yield Pending()):
                yield Update()
            mine = 0 if peer.joiner else peer.revision + 1
            ((k, _),) = yield (Reduce(0, mine, ReduceOp.MAX),)
            if k < mine:
                peer.sim.violate(f"peer {peer.id}: agreed step {k} below its own {mine}")
            (g1, w1), (g2, w2) = yield (Reduce(1, 1), Reduce(2, 7))
            if g1 != w1 or g2 != 7 * w2:
                peer.sim.violate(f"peer {peer.id} step {k}: sums {g1}, {g2} over worlds "
                                 f"{w1}, {w2} (expected {w1}, {7 * w2})")
            peer.state = (peer.state * 31 + k * 1000 + g1 + g2) % (1 << 61)
            peer.revision = k
            strategy = (SharedStateSyncStrategy.ENFORCE_POPULAR if mine == k and not peer.joiner
                        else SharedStateSyncStrategy.RECEIVE_ONLY)
            yield Sync(k, strategy)
            peer.joiner = False
            peer.sim.completed(peer, k)
            done += 1
            failures = 0
            if peer.sim.optimize_every and k % peer.sim.optimize_every == 0:
                # Every peer that completed step k measures links and re-solves the ring;
                # a failure there loses nothing (the step is committed): go on.
                with contextlib.suppress(PCCLError):
                    yield Optimize()
        except PCCLError as e:
            peer.state, peer.revision = before
            failures += 1
            if failures > 40:
                raise
            if isinstance(e, MasterConnectionError):
                if not peer.reconnecting():
                    raise  # gave up registering again: the program ends
                continue  # the next call waits for the re-registration
            if decide(e, failures) is Action.GIVE_UP:
                raise
            try:
                yield Update()
            except MasterConnectionError:
                if not peer.reconnecting():
                    raise
            except PCCLError:
                pass


# --- the simulated data plane ----------------------------------------------------------


@dataclasses.dataclass
class RingOp:
    op_id: int
    world: int
    members: set[int]
    started: dict[int, int] = dataclasses.field(default_factory=dict)  # peer -> value
    op: ReduceOp = ReduceOp.SUM
    failed: str = ""
    finished: bool = False
    epoch: int = -1


# --- peers -----------------------------------------------------------------------------


class SimPeer:
    """One peer: its real :class:`PeerMachine`, its program, and the driver's part
    (what :class:`pccl.communicator.Communicator` does with the machine's commands)."""

    def __init__(self, sim: Sim, peer_id: int, joiner: bool, steps: int) -> None:
        self.sim, self.id, self.joiner = sim, peer_id, joiner
        self.machine = ps.PeerMachine(reconnect=True)
        self.alive = True
        self.state = 0
        self.revision = 0
        self.program: Program = training_loop(self, steps)
        self.finished = False
        self.error: BaseException | None = None
        self.call: Any = None  # what the program waits for
        self.results: dict[int, tuple[int, int]] = {}  # tag -> (result, world)
        self.errors: dict[int, PCCLError] = {}
        # The data plane's view of each call: the ring op started for a tag (its
        # perform), what was applied to the output, and the last outcome heard per tag.
        self.ran: dict[int, m.CollectivePerform] = {}
        self.applied: dict[int, int] = {}
        self.heard: dict[int, m.CollectiveOutcome] = {}
        self.cancelled: set[int] = set()
        self.started = False
        self.parked: Any = None  # a call made while registering again waits for that
        self.conn = 0  # master connections so far (messages of older ones are void)
        self.link_up = True  # the current one is up (False: broken, not yet replaced)
        self.rejoin_deadline = 0.0
        # Whether its tiny collectives go to the master with their tensor (a setting of
        # the peer: peers set differently make the master run the ring).
        self.via_master = sim.rng.random() < sim.via_master_rate

    # -- the driver's part --

    def feed(self, ev: ps.Event) -> None:
        if not self.alive:
            return
        self.sim.trace(f"peer {self.id} <- {ev}")
        if isinstance(ev, ps.FromMaster) and isinstance(ev.msg, m.CollectiveOutcome):
            self.heard[ev.msg.tag] = ev.msg
            self.sim.outcome_seen(self, ev.msg)
        for c in self.machine.handle(ev):
            self.execute(c)

    def execute(self, c: ps.Command) -> None:
        """Carries out one command of the machine, as the driver does (no decision of
        its own: what the machine says happens to the simulated tensors)."""
        sim = self.sim
        if isinstance(c, ps.Send):
            sim.to_master(self.id, c.msg)
        elif isinstance(c, ps.Resolve):
            self.answered(c.waiter, c.value, None)
        elif isinstance(c, ps.Fail):
            self.answered(c.waiter, None, c.kind.error(c.message))
        elif isinstance(c, ps.Establish):
            nxt = c.msg.next_id
            failed = (nxt,) if nxt >= 0 and not sim.reachable(nxt) else ()
            sim.later(sim.delay("establish", self.id, nxt), self.feed,
                      ps.PoolsEstablished(c.msg.epoch, c.generation, failed))
        elif isinstance(c, ps.InstallRing):
            sim.links_replaced(self, c.epoch)
            bad = [p for p in (c.next_id, c.prev_id) if p >= 0 and not sim.reachable(p)]
            err = f"peer {bad[0]} is gone" if bad else ""
            sim.later(sim.delay("install", self.id), self.feed,
                      ps.RingInstalled(c.epoch, c.generation, err))
        elif isinstance(c, ps.RunRing):
            if c.tag in self.ran:
                sim.violate(f"peer {self.id}: a ring op of tag {c.tag} started on the output "
                            "of the last one (neither committed nor rolled back)")
            self.ran[c.tag] = c.perform
            sim.ring_start(self, c.tag, c.perform)
        elif isinstance(c, ps.AbortRing):
            sim.ring_withdraw(self, c.tag)
        elif isinstance(c, ps.ArmRing):
            pass  # simulated ring ops never stall
        elif isinstance(c, ps.Rollback):
            self.ran.pop(c.tag, None)
            self.applied.pop(c.tag, None)
        elif isinstance(c, ps.Commit):
            self._commit(c)
        elif isinstance(c, ps.ApplyResult):
            self._check_decided(c.tag, None)
            self.applied[c.tag] = int.from_bytes(c.data, "little", signed=True)
        elif isinstance(c, ps.Fetch):
            sim.fetch(self, c.plan)
        elif isinstance(c, ps.AbortFetch):
            sim.later(sim.delay("fetch", self.id), self.feed, ps.Fetched(
                False, ErrorKind.CollectiveAbortedError, "stopped"))
        elif isinstance(c, ps.CommitSync):
            self.state = sim.committed_value(self)
            self.revision = c.revision
        elif isinstance(c, ps.Probe):
            sim.later(sim.delay("probe", self.id), self.feed, ps.Probed(
                tuple(c.msg.target_ids), tuple(1e9 for _ in c.msg.target_ids), c.generation))
        elif isinstance(c, ps.OpenRelay):
            pass  # every simulated peer is reachable: nothing is relayed
        elif isinstance(c, ps.Rejoin):
            self.rejoin_deadline = sim.now + sim.reconnect_timeout
            sim.later(sim.delay("rejoin", self.id), sim.rejoin, self)
        elif isinstance(c, ps.Log):
            sim.trace(f"peer {self.id} log: {c.message}")

    def _check_decided(self, tag: int, op_id: int | None) -> None:
        """A result goes into the output only after the master's ok outcome for it."""
        heard = self.heard.get(tag)
        if heard is None or not heard.ok or (op_id is not None and heard.op_id != op_id):
            self.sim.violate(f"peer {self.id}: applied a result of tag {tag} (op "
                             f"{op_id}) without the master's ok outcome (heard {heard})")

    def _commit(self, c: ps.Commit) -> None:
        value, _ = self.sim.contribution[(self.id, c.tag)]
        if c.local:
            self._check_decided(c.tag, None)
            self.applied[c.tag] = value
            return
        p = self.ran.pop(c.tag, None)
        if p is None:
            self.sim.violate(f"peer {self.id}: committed tag {c.tag} with no ring op")
            return
        self._check_decided(c.tag, p.op_id)
        self.applied[c.tag] = self.sim.ring_result(self, c.tag, p)

    def answered(self, w: ps.Waiter, value: Any, error: PCCLError | None) -> None:
        """A waiting call of the program got its answer."""
        call = self.call
        if isinstance(w, ps.ReduceCall):
            tag = w.tag
            applied = self.applied.pop(tag, None)
            if self.ran.pop(tag, None) is not None:
                self.sim.violate(f"peer {self.id}: reduce {tag} ended with its ring op's "
                                 "result neither committed nor rolled back")
            if error is not None:
                self.errors[tag] = error
            elif applied is None:
                self.sim.violate(f"peer {self.id}: reduce {tag} succeeded with nothing applied")
                self.errors[tag] = ErrorKind.PCCLError.error("nothing applied")
            else:
                self.results[tag] = (applied, value.world)
            self._maybe_reduced(call)
        elif isinstance(w, ps.PendingCall):
            self.machine.handle(ps.EndQuery(w.req))
            if error is None and not value.ok:
                error = ErrorKind.parse(value.kind).error(value.message)
            self.resume(None if error else value.pending, error)
        elif w == ps.UPDATE:
            self.machine.handle(ps.EndTopology())
            self.resume(None, error)
        elif w == ps.SYNC:
            self.resume(None, error)
        elif w == ps.ACCEPT and self.machine.status is ps.Status.RECONNECTING:
            if error is not None:
                # This registration attempt failed: the driver drops it and tries again.
                self.sim.attempt_failed(self)
        elif w == ps.ACCEPT:
            if error is not None:
                self.resume(None, error)
            elif not self.started:
                self.started = True
                self.resume(None, None)  # admitted: the program starts
        elif w == ps.REJOIN:
            parked, self.parked = self.parked, None
            if parked is not None:
                if error is not None:
                    self.resume(None, error)
                else:
                    self.sim.later(0.0, self.start, parked)

    def reconnecting(self) -> bool:
        return self.machine.status is ps.Status.RECONNECTING and ps.REJOIN in self.machine.waiting

    def cancel(self, tag: int) -> None:
        """The caller gives up on reduce ``tag`` (e.g. its own asyncio timeout): as the
        driver does, it says so and waits, at most the collective timeout, for the
        machine to end the call."""
        call = ps.reduce_of(tag)
        if self.alive and call in self.machine.waiting and tag not in self.cancelled:
            self.cancelled.add(tag)
            self.sim.trace(f"peer {self.id} CANCELS reduce {tag}")
            self.feed(ps.Cancelled(call))
            self.sim.later(self.sim.collective_timeout, self._expire, call)

    def _expire(self, call: ps.ReduceCall) -> None:
        if self.alive and call in self.machine.waiting and call.tag in self.cancelled:
            self.feed(ps.CallExpired(call))

    def _maybe_reduced(self, call: Any) -> None:
        if not isinstance(call, tuple):
            return
        tags = [r.tag for r in call]
        if all(t in self.results or t in self.errors for t in tags):
            errors = [self.errors[t] for t in tags if t in self.errors]
            results = [self.results.get(t) for t in tags]
            for t in tags:
                self.cancelled.discard(t)
                self.results.pop(t, None)
                self.errors.pop(t, None)
            self.resume(results, errors[0] if errors else None)

    def resume(self, value: Any, error: BaseException | None) -> None:
        """Runs the program to its next call and starts that call."""
        if not self.alive or self.finished:
            return
        self.call = None
        try:
            call = self.program.throw(error) if error is not None else self.program.send(value)
        except StopIteration:
            self.finish(None)
            return
        except PCCLError as e:
            self.finish(e)
            return
        self.call = call
        self.sim.later(self.sim.rng.random() * 0.01, self.start, call)

    def finish(self, error: BaseException | None) -> None:
        self.finished, self.error = True, error
        self.sim.trace(f"peer {self.id} program ended: {error!r}")
        # A finished peer leaves gracefully, as a program that returns closes its
        # communicator.
        self.sim.leave(self)

    def start(self, call: Any) -> None:
        if not self.alive:
            return
        if self.reconnecting():
            self.parked = call  # the driver's calls wait out a re-registration
            return
        mc = self.machine
        timeout = self.sim.collective_timeout
        try:
            if isinstance(call, Pending):
                req = mc.new_request()
                self.feed(ps.AskPending(req, True, timeout))
            elif isinstance(call, Update):
                self.feed(ps.StartTopology(timeout))
            elif isinstance(call, Optimize):
                self.feed(ps.StartTopology(timeout, optimize=True))
            elif isinstance(call, Sync):
                self.feed(ps.StartSync(m.SyncInit(
                    revision=call.revision, strategy=int(call.strategy), keys=["w"],
                    dtypes=[int(DataType.INT64)], counts=[1],
                    hashes=[self.state.to_bytes(8, "big")], unequal=[False],
                    timeout=timeout)))
            else:
                for r in call:
                    self.sim.contribution[(self.id, r.tag)] = (r.value, r.op)
                    data = r.value.to_bytes(8, "little", signed=True) if self.via_master \
                        else b""
                    self.feed(ps.StartCollective(m.CollectiveInit(
                        tag=r.tag, kind="all_reduce", dtype=int(DataType.INT64), count=1,
                        op=int(r.op), quant_algorithm=0, quant_dtype=0, timeout=timeout,
                        data=data), early=self.sim.rng.random() < self.sim.early_rate))
                    if self.sim.rng.random() < self.sim.cancel_rate:
                        self.sim.later(self.sim.rng.random() * 0.05, self.cancel, r.tag)
        except ps.ProtocolViolation as e:
            if e.kind in (ErrorKind.InvalidUsageError, ErrorKind.PendingAsyncOpsError):
                self.sim.violate(f"peer {self.id}: the machine refused a call of a correct "
                                 f"program: {e}")
            self.resume(None, e.kind.error(str(e)))


# --- the simulation --------------------------------------------------------------------


@dataclasses.dataclass
class Report:
    seed: int
    violations: list[str]
    steps: int  # steps completed, summed over peers
    kills: int
    joins: int
    drops: int
    breaks: int
    events: int
    virtual_seconds: float
    max_revision: int


class Sim:
    """One seeded run (see the module docstring)."""

    def __init__(self, seed: int, *, peers: int = 3, joiners: int = 2, steps: int = 6,
                 kills: int = 2, drops: int = 1, breaks: int = 2,
                 cancel_rate: float = 0.02, optimize_every: int = 0, restarts: int = 0,
                 early_rate: float = 0.9, via_master_rate: float = 0.7,
                 max_events: int = 200_000,
                 collective_timeout: float = 1800.0, tracer: Callable[[str], None] | None = None
                 ) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.master = ms.MasterState(repair_rings=True, token_key=bytes(32))  # reproducible
        self.peers: dict[int, SimPeer] = {}
        self.steps = steps
        self.collective_timeout = collective_timeout
        self.max_events = max_events
        self._tracer = tracer
        self.violations: list[str] = []
        self._fifo: dict[tuple[int, str], float] = collections.defaultdict(float)
        self._timed_epoch = -1
        self.rings: dict[tuple[int, int], RingOp] = {}  # (master generation, op id) ->
        self.contribution: dict[tuple[int, int], tuple[int, ReduceOp]] = {}
        self.outcomes: dict[tuple[int, int], dict[int, bool]] = collections.defaultdict(dict)
        # sync instance -> peer -> state it committed (see master_event)
        self.by_sync: dict[int, dict[int, int]] = collections.defaultdict(dict)
        self._instances: dict[int, collections.deque[int]] = collections.defaultdict(
            collections.deque)
        self._sync_instances = 0
        self.steps_done = 0
        self.max_revision = 0
        self.plans: dict[int, dict[str, int]] = {}  # peer -> fetched values
        self.kills = self.joins = self.drops = self.breaks = 0
        self._flaky = 0
        self.cancel_rate = cancel_rate
        self.early_rate = early_rate
        self.via_master_rate = via_master_rate
        self.master_gen = 0
        self.restarts = 0
        self.reconnect_timeout = 60.0
        self.optimize_every = optimize_every
        self.events = 0
        self._next_id = 1
        # Set by a subclass that ends the run early (what is left unfinished then is
        # not a hang).
        self.stopped = False
        for _ in range(peers):
            self.later(self.rng.random() * 0.1, self.spawn, False)
        horizon = 2.0 * steps
        for _ in range(joiners):
            self.later(self.rng.random() * horizon, self.spawn, True)
        for _ in range(kills):
            self.later(self.rng.random() * horizon, self.kill_one)
        for _ in range(drops):
            self.later(self.rng.random() * horizon, self.drop_one)
        for _ in range(breaks):
            self.later(self.rng.random() * horizon, self.break_links)
        for _ in range(restarts):
            self.later(self.rng.random() * horizon, self.restart_master)

    # -- scheduling --

    def later(self, dt: float, fn: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (self.now + dt, self._seq, fn, args))

    def delay(self, kind: str = "", pid: int = -1, other: int = -1,
              op: RingOp | None = None) -> float:
        """A network delay: mostly short, sometimes long (a heavy tail). What it is
        for (``kind``: "up" and "down" for messages to and from the master, "ring" for
        a ring op's duration, "establish", "fetch", ...) and between whom (``pid``,
        ``other``) is ignored here; :mod:`pccl.sim` models them."""
        r = self.rng.random()
        return self.rng.uniform(0.0005, 0.02) if r < 0.9 else self.rng.uniform(0.05, 1.5)

    def trace(self, line: str) -> None:
        if self._tracer is not None:
            self._tracer(f"{self.now:10.4f} {line}")

    def violate(self, what: str) -> None:
        self.violations.append(f"t={self.now:.3f}: {what}")

    def run(self) -> Report:
        while self._queue and self.events < self.max_events and not self.stopped:
            t, _, fn, args = heapq.heappop(self._queue)
            self.now = max(self.now, t)
            self.events += 1
            fn(*args)
        if self._queue and not self.stopped:
            self.violate(f"still busy after {self.events} events (a livelock?)")
        for p in self.peers.values():
            if p.alive and not p.finished and not self.stopped:
                self.violate(f"peer {p.id} hangs: its program waits for {p.call!r}, the "
                             f"machine for {sorted(p.machine.waiting, key=repr)}")
        for op_id, seen in self.outcomes.items():
            if len(set(seen.values())) > 1:
                self.violate(f"op {op_id}: outcomes differ across peers: {seen}")
        for k, states in self.by_sync.items():
            if len(set(states.values())) > 1:
                self.violate(f"sync {k}: parity violation (peer: state): {states}")
        return Report(self.seed, self.violations, self.steps_done, self.kills, self.joins,
                      self.drops, self.breaks, self.events, self.now, self.max_revision)

    # -- membership and chaos --

    def spawn(self, joiner: bool) -> None:
        pid = self._next_id
        self._next_id += 1
        peer = SimPeer(self, pid, joiner, self.steps)
        self.peers[pid] = peer
        if joiner:
            self.joins += 1
        self.trace(f"peer {pid} registers ({'joiner' if joiner else 'founder'})")
        peer.feed(ps.Welcomed(pid))
        self.master_event(ms.PeerRegistered(pid, self.group_of(pid), f"sim:{pid}"))

    def group_of(self, pid: int) -> int:
        """The peer group peer ``pid`` registers in (one group here)."""
        return 0

    def reachable(self, pid: int) -> bool:
        p = self.peers.get(pid)
        return p is not None and p.alive

    def _victim(self) -> SimPeer | None:
        live = [p for p in self.peers.values() if p.alive and not p.finished]
        if len(live) <= 1:
            return None
        return self.rng.choice(sorted(live, key=lambda p: p.id))

    def kill_one(self) -> None:
        """SIGKILL: the process is gone; its connections reset soon after."""
        victim = self._victim()
        if victim is None:
            return
        self.kills += 1
        self.trace(f"peer {victim.id} KILLED")
        self._gone(victim)
        self.later(self.rng.uniform(0.001, 0.2), self.master_event,
                   ms.PeerLost(victim.id, "connection closed"))

    def drop_one(self) -> None:
        """The master connection of a live peer breaks: the master drops it, the peer
        fails its calls in flight and registers again."""
        victim = self._victim()
        if victim is None:
            return
        self.drops += 1
        self.trace(f"peer {victim.id} master connection DROPPED")
        victim.link_up = False  # what is in flight on that connection is lost with it
        self.later(self.rng.uniform(0.001, 0.2), self.master_event,
                   ms.PeerLost(victim.id, "connection reset"))
        self.later(self.rng.uniform(0.001, 0.2), victim.feed,
                   ps.MasterLost("connection reset"))

    def break_links(self) -> None:
        """A ring link resets (every peer stays alive): the ring ops running now fail."""
        running = [op for op in self.rings.values() if not op.finished]
        self.trace(f"LINK RESET: ops {[op.op_id for op in running]} fail")
        self.breaks += 1
        if not running:
            self._flaky += 1  # no ring runs now: the next one to start meets the reset
        for op in running:
            self._ring_fail(op, "connection reset by peer")

    def leave(self, peer: SimPeer) -> None:
        if peer.alive:
            self.to_master(peer.id, m.Leave())
            self.later(0.5, self._gone, peer)

    def _gone(self, peer: SimPeer) -> None:
        if not peer.alive:
            return
        peer.alive = False
        for op in self.rings.values():
            if peer.id in op.members and not op.finished:
                self._ring_fail(op, f"peer {peer.id} is gone")

    # -- the network --

    def to_master(self, pid: int, msg: m.Message) -> None:
        peer = self.peers[pid]
        if not peer.alive:
            return
        if isinstance(msg, m.CollectiveDone) and not msg.ok:
            # A member that will not run its part breaks the ring for the others.
            op = self.rings.get((self.master_gen, msg.op_id))
            if op is not None and not op.finished:
                self._ring_fail(op, f"peer {pid} withdrew: {msg.message}")
        if not peer.link_up:
            return  # written into a connection that is already broken: lost
        t = max(self.now + self.delay("up", pid), self._fifo[(pid, "up")])
        self._fifo[(pid, "up")] = t
        self.later(t - self.now, self._deliver_up, pid, self.master_gen, peer.conn, msg)

    def _deliver_up(self, pid: int, gen: int, conn: int, msg: m.Message) -> None:
        peer = self.peers[pid]
        if gen == self.master_gen and conn == peer.conn and peer.link_up:
            self.master_event(ms.Received(pid, msg))  # else that connection is gone

    def to_peer(self, pid: int, msg: m.Message, instance: int = 0) -> None:
        peer = self.peers.get(pid)
        if peer is None or not peer.alive:
            return
        if isinstance(msg, m.CollectivePerform):
            self.rings.setdefault((self.master_gen, msg.op_id),
                                  RingOp(msg.op_id, msg.world, set())).members.add(pid)
        t = max(self.now + self.delay("down", pid), self._fifo[(pid, "down")])
        self._fifo[(pid, "down")] = t
        self.later(t - self.now, self._deliver_down, pid, self.master_gen, peer.conn, msg,
                   instance)

    def _deliver_down(self, pid: int, gen: int, conn: int, msg: m.Message,
                      instance: int) -> None:
        peer = self.peers[pid]
        if gen != self.master_gen or conn != peer.conn or not peer.link_up or not peer.alive:
            return  # that connection is gone
        if instance:
            self._instances[pid].append(instance)
        peer.feed(ps.FromMaster(msg))

    def master_event(self, ev: ms.Event) -> None:
        self.trace(f"master <- {ev}")
        commands = self.master.handle(ev)
        # The master commits a sync by sending every participant its ok outcome at once:
        # those outcomes are one sync instance per group, whose committers must end equal.
        instance: dict[int, int] = {}
        for c in commands:
            if isinstance(c, ms.Send) and isinstance(c.msg, m.SyncOutcome) and c.msg.ok \
                    and self.group_of(c.peer_id) not in instance:
                self._sync_instances += 1
                instance[self.group_of(c.peer_id)] = self._sync_instances
        for c in commands:
            if isinstance(c, ms.Send):
                ok_sync = isinstance(c.msg, m.SyncOutcome) and c.msg.ok
                self.to_peer(c.peer_id, c.msg,
                             instance[self.group_of(c.peer_id)] if ok_sync else 0)
            elif isinstance(c, ms.Disconnect):
                peer = self.peers.get(c.peer_id)
                if peer is not None:
                    self.later(self.delay("down", c.peer_id), self._disconnect, peer,
                               self.master_gen, peer.conn, c.reason)
            elif isinstance(c, ms.Solve):
                self.later(self.delay("solve"), self._master_timer, self.master_gen,
                           ms.Solved(c.round_id, c.group, list(c.members)))
            elif isinstance(c, ms.ArmDeadline):
                self.later(c.seconds, self._deadline, self.master_gen, c.deadline_id)
            elif isinstance(c, ms.ArmRecoveryTimer):
                self.later(5.0, self._master_timer, self.master_gen,
                           ms.RecoveryTimeout(c.recovery_id))
            elif isinstance(c, ms.CheckReach):
                self.later(self.delay("dial", c.peer_id), self._master_timer, self.master_gen,
                           ms.ReachChecked(c.epoch, c.peer_id, self.reachable(c.peer_id)))
        rnd = self.master.round
        if rnd is not None and rnd.epoch != self._timed_epoch:
            self._timed_epoch = rnd.epoch
            self.later(60.0, self._round_timeout, self.master_gen, rnd.epoch)

    def _disconnect(self, peer: SimPeer, gen: int, conn: int, reason: str) -> None:
        if gen == self.master_gen and conn == peer.conn and peer.link_up:
            peer.link_up = False
            peer.feed(ps.MasterLost(reason, may_rejoin=False))

    def _master_timer(self, gen: int, ev: ms.Event) -> None:
        if gen == self.master_gen:  # a restarted master has no such timer
            self.master_event(ev)

    def _deadline(self, gen: int, did: int) -> None:
        if gen == self.master_gen and did in self.master.deadlines:
            self.master_event(ms.DeadlineExpired(did))

    def restart_master(self) -> None:
        """The master process dies and a fresh one takes its address: every peer loses
        it and registers again, saying what it held (the master-restart recovery)."""
        self.restarts += 1
        self.trace("MASTER RESTART")
        self.master_gen += 1
        self.master = ms.MasterState(repair_rings=True, token_key=bytes(32))  # reproducible
        self._timed_epoch = -1
        for p in sorted(self.peers.values(), key=lambda p: p.id):
            p.link_up = False  # every connection to the dead master is gone
            if p.alive and not p.finished:
                self.later(self.rng.uniform(0.001, 0.3), p.feed,
                           ps.MasterLost("lost the connection to the master (reset)"))

    def rejoin(self, peer: SimPeer) -> None:
        """One registration attempt of a peer that lost its master (the driver's loop)."""
        if not peer.alive or not peer.reconnecting():
            return
        if self.now > peer.rejoin_deadline:
            peer.feed(ps.RejoinFailed(f"could not register again within "
                                      f"{self.reconnect_timeout}s"))
            return
        if peer.id in self.master.peers:
            # The master has not noticed the old connection's end yet (it would give a new
            # id; the simulation waits to keep ids stable).
            self.later(0.2, self.rejoin, peer)
            return
        resume_id, epoch, revision, ring = peer.machine.resume()
        peer.conn += 1
        peer.link_up = True
        self.trace(f"peer {peer.id} registers again (resume epoch {epoch}, revision "
                   f"{revision}, ring {ring})")
        peer.feed(ps.Welcomed(peer.id))
        self.master_event(ms.PeerRegistered(
            peer.id, self.group_of(peer.id), f"sim:{peer.id}",
            ms.Resume(epoch, revision, tuple(ring)) if resume_id else None))

    def attempt_failed(self, peer: SimPeer) -> None:
        """A registration attempt failed after the handshake: drop it, try again."""
        peer.link_up = False
        if peer.machine.connected:
            peer.feed(ps.MasterLost("a registration attempt failed"))
        if peer.id in self.master.peers:
            self.master_event(ms.PeerLost(peer.id, "connection closed"))
        self.later(0.1 + self.rng.random() * 0.2, self.rejoin, peer)

    def _round_timeout(self, gen: int, epoch: int) -> None:
        if gen != self.master_gen:
            return
        rnd = self.master.round
        if rnd is not None and rnd.epoch == epoch:
            self.master_event(ms.RoundTimeout(epoch))

    # -- the data plane --

    def ring_start(self, peer: SimPeer, tag: int, p: m.CollectivePerform) -> None:
        op = self.rings.setdefault((self.master_gen, p.op_id), RingOp(p.op_id, p.world, set()))
        op.epoch = p.epoch
        # An early start has no perform message: its members are the peer's ring.
        op.members |= set(peer.machine.ring)
        value, rop = self.contribution[(peer.id, tag)]
        op.op = rop
        if op.failed or op.finished:
            self.later(self.delay("ring_refused", peer.id), peer.feed, ps.RingDone(
                tag, False, ErrorKind.PeerConnectionError, op.failed or "ring over"))
            return
        op.started[peer.id] = value
        if self._flaky and op.world > 1:
            self._flaky -= 1
            self._ring_fail(op, "connection reset by peer")
            return
        if len(op.started) == op.world:
            op.finished = True
            for pid in sorted(op.started):
                q = self.peers[pid]
                self.later(self.delay("ring", pid, op=op), q.feed, ps.RingDone(tag, True))

    def links_replaced(self, peer: SimPeer, epoch: int) -> None:
        """A peer takes over the links of a new ring epoch: its older links close, and
        the ring ops running on them fail."""
        for op in list(self.rings.values()):
            if not op.finished and op.epoch < epoch and (
                    peer.id in op.members or peer.id in op.started):
                self._ring_fail(op, f"peer {peer.id} replaced the links of epoch {op.epoch}")

    def _ring_fail(self, op: RingOp, why: str) -> None:
        op.failed = why
        op.finished = True
        for pid in sorted(op.started):
            q = self.peers[pid]
            tags = [t for t, pf in q.ran.items() if pf.op_id == op.op_id]
            for tag in tags:
                self.later(self.rng.uniform(0.001, 0.3), q.feed, ps.RingDone(
                    tag, False, ErrorKind.PeerConnectionError, why))

    def ring_withdraw(self, peer: SimPeer, tag: int) -> None:
        p = peer.ran.get(tag)
        if p is None:
            return
        op = self.rings.get((self.master_gen, p.op_id))
        if op is not None and not op.finished:
            self._ring_fail(op, f"peer {peer.id} aborted")
        elif op is not None and peer.id in op.started:
            # Aborted after the ring completed here: the op ends failed on this peer only
            # if its RingDone has not been delivered yet; the master decides for all.
            pass

    def ring_result(self, peer: SimPeer, tag: int, p: m.CollectivePerform) -> int:
        op = self.rings.get((self.master_gen, p.op_id))
        if p.world <= 1 or op is None:
            return self.contribution[(peer.id, tag)][0]
        values = list(op.started.values())
        if op.failed:
            self.violate(f"peer {peer.id}: applied op {p.op_id}, whose ring failed "
                         f"({op.failed})")
        if len(values) != p.world:
            self.violate(f"peer {peer.id}: op {p.op_id} succeeded with {len(values)} of "
                         f"{p.world} contributions")
        return max(values, default=0) if op.op == ReduceOp.MAX else sum(values)

    def outcome_seen(self, peer: SimPeer, outcome: m.CollectiveOutcome) -> None:
        self.outcomes[(self.master_gen, outcome.op_id)][peer.id] = outcome.ok

    # -- shared state --

    def fetch(self, peer: SimPeer, plan: m.SyncPlan) -> None:
        fetched: dict[str, int] = {}
        ok, why = True, ""
        for key, want, sources in zip(plan.fetch_keys, plan.fetch_hashes, plan.fetch_sources):
            for s in sources:
                src = self.peers.get(s)
                if src is not None and src.alive and src.state.to_bytes(8, "big") == want:
                    fetched[key] = src.state
                    break
            else:
                ok, why = False, f"no holder of {key!r} answered"
        self.plans[peer.id] = fetched
        ev = ps.Fetched(True) if ok else ps.Fetched(False, ErrorKind.PeerConnectionError, why)
        self.later(self.delay("fetch", peer.id), peer.feed, ev)

    def committed_value(self, peer: SimPeer) -> int:
        value = self.plans.pop(peer.id, {}).get("w", peer.state)
        queue = self._instances[peer.id]
        if not queue:
            self.violate(f"peer {peer.id} committed a sync the master did not commit")
        else:
            self.by_sync[queue.popleft()][peer.id] = value
        return value

    def completed(self, peer: SimPeer, k: int) -> None:
        self.steps_done += 1
        self.max_revision = max(self.max_revision, k)


def run_schedules(seeds: range, **kw: Any) -> list[Report]:
    return [Sim(seed, **kw).run() for seed in seeds]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pccl.testing.sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", type=int, default=200)
    ap.add_argument("--seed", type=int, default=None, help="run this seed only")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--joiners", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--kills", type=int, default=2)
    ap.add_argument("--drops", type=int, default=1)
    ap.add_argument("--breaks", type=int, default=2)
    ap.add_argument("--restarts", type=int, default=0, help="master restarts per run")
    ap.add_argument("--optimize-every", type=int, default=0,
                    help="every peer calls optimize_topology() after every n-th step")
    ap.add_argument("--trace", action="store_true", help="print every event")
    args = ap.parse_args(argv)
    seeds = (range(args.seed, args.seed + 1) if args.seed is not None
             else range(args.first_seed, args.first_seed + args.schedules))
    started = time.perf_counter()
    bad = 0
    totals = collections.Counter[str]()
    for seed in seeds:
        r = Sim(seed, peers=args.peers, joiners=args.joiners, steps=args.steps,
                kills=args.kills, drops=args.drops, breaks=args.breaks,
                optimize_every=args.optimize_every, restarts=args.restarts,
                tracer=print if args.trace else None).run()
        totals.update(steps=r.steps, kills=r.kills, joins=r.joins, drops=r.drops,
                      breaks=r.breaks, events=r.events)
        if r.violations:
            bad += 1
            print(f"seed {seed}: {len(r.violations)} violation(s)")
            for v in r.violations[:10]:
                print(f"  {v}")
    elapsed = time.perf_counter() - started
    print(f"{len(seeds)} schedules, {bad} with violations, {dict(totals)}, "
          f"{elapsed:.1f}s ({totals['events'] / max(elapsed, 1e-9):.0f} events/s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
