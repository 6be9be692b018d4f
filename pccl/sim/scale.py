"""A whole run at scale: the real sans-IO master and peers of
:mod:`pccl.testing.sim`, with the network of :mod:`pccl.sim.network` instead of random
delays, the master as one busy process, churn at given rates, and the data plane's
time from :mod:`pccl.sim.collectives`.

What is real and what is modelled:

* **real**: every protocol decision (the master's :class:`~pccl.master.state.MasterState`
  and every peer's :class:`~pccl.peer.state.PeerMachine`, the programs of PCCL's
  examples), and the **master's CPU**: each event's ``handle()`` is timed on this
  machine, together with decoding the message it carries and encoding every message
  it sends (msgpack, as the server does). The master is one process: an event waits
  until the ones before it were handled, and what it sends leaves after its own CPU
  time. Virtual time therefore includes the master's queueing, which is what limits
  it at scale.
* **modelled**: message transit (one-way latency peer <-> master from the network
  model), ring and mesh all-reduces (their modelled time for ``reduce_bytes``), pool
  dials (``DIAL_ROUND_TRIPS`` round trips to the ring neighbour), shared-state fetches
  (``sync_bytes`` from the first holder at the link's rate), peers' own CPU (none: each
  peer is its own process, microseconds per event against milliseconds of latency).

Churn: kills (SIGKILL: connections reset at once), hangs (SIGSTOP: the peer stops
answering; its ring neighbours fail after ``stall_s``, the master drops it after
``heartbeat_timeout``), graceful leaves and joins, each a Poisson process.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import time
from typing import Any

import numpy as np

from pccl import algorithms
from pccl.communicator import Communicator
from pccl.master import state as ms
from pccl.peer import state as ps
from pccl.protocol import codec
from pccl.protocol import messages as m
from pccl.sim import collectives
from pccl.sim.network import NetworkModel
from pccl.testing import sim as base

#: pccl's default: all-reduces up to this size go to the master with their tensor
#: (``Communicator(via_master_max_bytes=)``, read from its signature) unless the group's
#: tensors would pass ``VIA_MASTER_MAX_TOTAL`` there.
VIA_MASTER_MAX_BYTES: int = inspect.signature(Communicator).parameters[
    "via_master_max_bytes"].default


class TimedMaster:
    """A :class:`MasterState` whose ``handle()`` is timed, message codec included.
    ``tensor_bytes`` is what each collective's tensor would weigh (the simulated ones
    carry 8 bytes): tensors reduced by the master cost its link that much each way."""

    def __init__(self, state: ms.MasterState, tensor_bytes: int) -> None:
        self.state = state
        self.tensor_bytes = tensor_bytes
        self.last_cpu = 0.0
        self.last_wire = 0.0
        self.cpu = 0.0
        self.events = 0
        self.by_kind: collections.Counter[str] = collections.Counter()
        self.cpu_by_kind: dict[str, float] = collections.defaultdict(float)
        self.bytes_out = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.state, name)

    def handle(self, ev: ms.Event) -> list[ms.Command]:
        wire = codec.encode(ev.msg) if isinstance(ev, ms.Received) else None
        t0 = time.perf_counter()
        if wire is not None:
            codec.decode(wire)
        out = self.state.handle(ev)
        link_s = 0.0
        if isinstance(ev, ms.Received) and isinstance(ev.msg, m.CollectiveInit) \
                and ev.msg.data:
            link_s += self.tensor_bytes / collectives.MASTER_BANDWIDTH
        frames = codec.FrameCache()  # as the server does
        for c in out:
            if isinstance(c, ms.Send):
                # Every message crosses the master's link (a round's world: k of them).
                nbytes = len(frames.frame(c.msg))
                self.bytes_out += nbytes
                link_s += nbytes / collectives.MASTER_BANDWIDTH
                if isinstance(c.msg, m.CollectiveOutcome) and c.msg.data:
                    link_s += self.tensor_bytes / collectives.MASTER_BANDWIDTH
        dt = time.perf_counter() - t0
        self.last_wire = link_s
        kind = type(ev.msg).__name__ if isinstance(ev, ms.Received) else type(ev).__name__
        self.last_cpu = dt
        self.cpu += dt
        self.events += 1
        self.by_kind[kind] += 1
        self.cpu_by_kind[kind] += dt
        return out


class ScalePeer(base.SimPeer):
    """A simulated peer that records how long its calls take."""

    def __init__(self, sim: ScaleSim, peer_id: int, joiner: bool, steps: int) -> None:
        super().__init__(sim, peer_id, joiner, steps)
        self.spawned_at = sim.now
        self.call_at = sim.now
        self.admitted = False

    def resume(self, value: Any, error: BaseException | None) -> None:
        sim = self.sim
        assert isinstance(sim, ScaleSim)
        call = self.call
        if call is not None and self.alive:
            sim.record_call(call, sim.now - self.call_at, error)
            if isinstance(call, tuple):
                sim.record_collective((sim.group_of(self.id), len(call), self.revision),
                                      self.call_at,
                                      None if error is not None else sim.now)
        elif not self.admitted and self.started and error is None:
            self.admitted = True
            sim.admissions.append(sim.now - self.spawned_at)
        super().resume(value, error)
        if self.call is not None and self.call is not call:
            self.call_at = sim.now

    def finish(self, error: BaseException | None) -> None:
        """The first program to end ends the run (the others are within a step of it;
        letting every peer leave would measure k repair rounds at the end)."""
        sim = self.sim
        assert isinstance(sim, ScaleSim)
        sim.last_finish = max(sim.last_finish, sim.now)
        self.finished, self.error = True, error
        if error is None:
            sim.stopped = True

    def start(self, call: Any) -> None:
        if isinstance(call, tuple):
            sim = self.sim
            assert isinstance(sim, ScaleSim)
            self.via_master = sim.goes_via_master(len(self.machine.ring))
        super().start(call)


@dataclasses.dataclass
class Churn:
    """Events per second of virtual time, from ``start`` to ``stop`` seconds."""

    kills: float = 0.0
    hangs: float = 0.0
    leaves: float = 0.0
    joins: float = 0.0
    start: float = 10.0
    stop: float = 60.0


class ScaleSim(base.Sim):
    def __init__(self, peers: int, *, seed: int = 0, steps: int = 3,
                 net: NetworkModel | None = None, churn: Churn | None = None,
                 reduce_bytes: int = 4 << 20, sync_bytes: int = 64 << 20,
                 founders_within: float = 5.0, heartbeat_timeout: float = 10.0,
                 stall_s: float = 30.0, via_master_rate: float = 0.0,
                 loopback_bandwidth: float | None = None, algorithm: str = "auto",
                 measure_cpu: bool = True, duration: float | None = None,
                 max_events: int = 50_000_000, group_size: int | None = None) -> None:
        if duration is not None:
            steps = 1 << 40  # the run ends at ``duration`` (virtual seconds)
        super().__init__(seed, peers=0, joiners=0, steps=steps, kills=0, drops=0, breaks=0,
                         cancel_rate=0.0, early_rate=1.0, via_master_rate=via_master_rate,
                         max_events=max_events)
        # Peer groups of about ``group_size`` (None: everyone in one): peer i in group
        # i mod n, joiners too, so the groups stay about as large as each other.
        self.groups = max(1, -(-peers // group_size)) if group_size else 1
        self.master = TimedMaster(ms.MasterState(  # type: ignore[assignment]
            repair_rings=True, token_key=bytes(32)), reduce_bytes)
        self.timed: TimedMaster = self.master  # type: ignore[assignment]
        self.net = net if net is not None else NetworkModel()
        self.nrng = np.random.default_rng(seed)
        self.churn = churn if churn is not None else Churn()
        self.reduce_bytes = reduce_bytes
        # The master's measured CPU enters virtual time (it queues events); without it
        # a seed replays exactly (the CPU is still measured and reported).
        self.measure_cpu = measure_cpu
        # "auto": pccl's defaults pick (via the master, else the cost model: mesh or
        # ring); "ring", "mesh": that one (and via the master at via_master_rate).
        self.algorithm = algorithm
        self._extra_up = 0.0
        self._extra_down = 0.0
        self.sync_bytes = sync_bytes
        self.heartbeat_timeout = heartbeat_timeout
        self.stall_s = stall_s
        self.master_free = 0.0
        self._inbox: collections.deque[tuple[float, ms.Event]] = collections.deque()
        self._master_scheduled = False
        self.last_finish = 0.0
        self._op_seconds: dict[int, float] = {}
        self.admissions: list[float] = []
        self.calls: dict[str, list[float]] = collections.defaultdict(list)
        self.failed_calls: collections.Counter[str] = collections.Counter()
        self.hangs = self.leaves = 0
        self.queue_wait: list[float] = []
        self.algorithm_used: collections.Counter[str] = collections.Counter()
        # (call, step) -> the latest call of any member, the ends of the successful ones
        self._collective_calls: dict[tuple[int, int, int], list[float]] = {}
        self._collective_ends: dict[tuple[int, int, int], list[float]] = \
            collections.defaultdict(list)
        self.net.sample(peers, self.nrng)
        if duration is not None:
            self.later(duration, self._end)
        if loopback_bandwidth is not None:  # every link this fast (calibration runs)
            self.net.up[:] = self.net.down[:] = loopback_bandwidth
        for _ in range(peers):
            self.later(float(self.nrng.random()) * founders_within, self.spawn, False)
        c = self.churn
        for rate, fn in ((c.kills, self.kill_one), (c.hangs, self.hang_one),
                         (c.leaves, self.leave_one), (c.joins, self.join_one)):
            t = c.start
            while rate > 0:
                t += float(self.nrng.exponential(1 / rate))
                if t >= c.stop:
                    break
                self.later(t, fn)

    def _end(self) -> None:
        self.stopped = True
        self.last_finish = self.now

    # --- peers ---

    def spawn(self, joiner: bool) -> None:
        pid = self._next_id
        if pid > len(self.net):
            self.net.sample(max(16, len(self.net) // 10), self.nrng)
        self._next_id += 1
        peer = ScalePeer(self, pid, joiner, self.steps)
        self.peers[pid] = peer
        if joiner:
            self.joins += 1
        peer.feed(ps.Welcomed(pid))
        self.master_event(ms.PeerRegistered(pid, self.group_of(pid), f"sim:{pid}"))

    def group_of(self, pid: int) -> int:
        return (pid - 1) % self.groups

    def slot(self, pid: int) -> int:
        return pid - 1

    def join_one(self) -> None:
        self.spawn(True)

    def leave_one(self) -> None:
        victim = self._victim()
        if victim is None:
            return
        self.leaves += 1
        victim.finished = True  # its program stops and the peer leaves gracefully
        self.leave(victim)

    def hang_one(self) -> None:
        """SIGSTOP: nothing in or out from now on; the neighbours' stall timers and the
        master's heartbeat timeout find out."""
        victim = self._victim()
        if victim is None:
            return
        self.hangs += 1
        victim.alive = False
        self.later(self.stall_s, self._fail_rings_of, victim.id)
        self.later(self.heartbeat_timeout, self.master_event,
                   ms.PeerLost(victim.id, "heartbeat timeout"))

    def _fail_rings_of(self, pid: int) -> None:
        for op in self.rings.values():
            if pid in op.members and not op.finished:
                self._ring_fail(op, f"peer {pid} stalled")

    # --- the master: one process ---

    def goes_via_master(self, world: int) -> bool:
        if self.algorithm != "auto":
            return self.rng.random() < self.via_master_rate
        return self.reduce_bytes <= VIA_MASTER_MAX_BYTES \
            and world * self.reduce_bytes <= ms.VIA_MASTER_MAX_TOTAL

    def master_event(self, ev: ms.Event) -> None:
        """An event reaches the master: handled now if it is idle, else queued behind
        the others (one process, first come first served)."""
        self._inbox.append((self.now, ev))
        if not self._master_scheduled:
            self._master_scheduled = True
            self.later(max(0.0, self.master_free - self.now), self._master_next)

    def _master_next(self) -> None:
        arrived, ev = self._inbox.popleft()
        self.queue_wait.append(self.now - arrived)
        super().master_event(ev)
        self.master_free = self.now + self._master_cpu() + self.timed.last_wire
        if self._inbox:
            self.later(self.master_free - self.now, self._master_next)
        else:
            self._master_scheduled = False

    def _master_cpu(self) -> float:
        return self.timed.last_cpu if self.measure_cpu else 0.0

    def to_master(self, pid: int, msg: m.Message) -> None:
        if isinstance(msg, m.CollectiveInit) and msg.data:
            # The tensor goes up the peer's own link first.
            self._extra_up = self.reduce_bytes / float(self.net.up[self.slot(pid)])
        try:
            super().to_master(pid, msg)
        finally:
            self._extra_up = 0.0

    def to_peer(self, pid: int, msg: m.Message, instance: int = 0) -> None:
        if isinstance(msg, m.CollectiveOutcome) and msg.data and pid in self.peers:
            self._extra_down = self.reduce_bytes / float(self.net.down[self.slot(pid)])
        try:
            super().to_peer(pid, msg, instance)
        finally:
            self._extra_down = 0.0

    # --- the network ---

    def delay(self, kind: str = "", pid: int = -1, other: int = -1,
              op: base.RingOp | None = None) -> float:
        net = self.net
        if kind == "up":
            return self._extra_up + float(net.master_latency(self.slot(pid)))
        if kind == "rejoin":
            return float(net.master_latency(self.slot(pid)))
        if kind == "down":
            return self._master_cpu() + self._extra_down + \
                float(net.master_latency(self.slot(pid)))
        if kind == "establish":
            if other < 0:
                return 1e-3
            rtt = 2 * float(net.latency(self.slot(pid), self.slot(other)))
            return algorithms.DIAL_ROUND_TRIPS * rtt
        if kind == "ring" and op is not None:
            return self._ring_seconds(op)
        if kind == "fetch":
            return self._fetch_seconds(pid)
        if kind == "probe":
            return 0.25 + 2 * float(net.master_latency(self.slot(pid)))
        return 1e-3  # local: installing links, a refused ring op, the solver's answer

    def _ring_seconds(self, op: base.RingOp) -> float:
        got = self._op_seconds.get(op.op_id)
        if got is None:
            members = sorted(op.started)
            ring = next((p.machine.ring for p in (self.peers[q] for q in members)
                         if p.machine.ring), members)
            order = [self.slot(q) for q in ring if q in op.started] or \
                [self.slot(q) for q in members]
            k = len(order)
            one_way = float(np.median(self.net.latency(np.asarray(order),
                                                       np.roll(order, -1))))
            limit = algorithms.mesh_max_bytes(k, one_way)
            if self.algorithm == "mesh" or (self.algorithm == "auto"
                                            and self.reduce_bytes <= limit):
                got = collectives.mesh_seconds(self.net, order, self.reduce_bytes)
                self.algorithm_used["mesh"] += 1
            else:
                got = collectives.ring_seconds(self.net, order, self.reduce_bytes)
                self.algorithm_used["ring"] += 1
            self._op_seconds[op.op_id] = got
        return got

    def _fetch_seconds(self, pid: int) -> float:
        plan = self.plans.get(pid)
        if not plan:
            return 1e-3
        src = next((q.id for q in self.peers.values()
                    if q.alive and q.id != pid and q.machine.ring), pid)
        i, j = self.slot(src), self.slot(pid)
        return float(self.net.latency(i, j) + self.sync_bytes / self.net.bandwidth(i, j))

    # --- figures ---

    def record_call(self, call: Any, seconds: float, error: BaseException | None) -> None:
        kind = (f"reduce{len(call)}" if isinstance(call, tuple)
                else type(call).__name__.lower())
        if error is not None:
            self.failed_calls[kind] += 1
        else:
            self.calls[kind].append(seconds)

    def record_collective(self, key: tuple[int, int, int], called: float,
                          ended: float | None) -> None:
        self._collective_calls.setdefault(key, []).append(called)
        if ended is not None:
            self._collective_ends[key].append(ended)

    def collective_latency(self) -> dict[str, list[float]]:
        """Per call shape ("reduce1", "reduce2"): from the last member's call to each
        member's result, as a benchmark that starts every peer at once measures it."""
        out: dict[str, list[float]] = collections.defaultdict(list)
        for key, ends in self._collective_ends.items():
            last = max(self._collective_calls[key])
            out[f"reduce{key[1]}"] += [e - last for e in ends if e >= last]
        return out

    def figures(self, wall: float) -> dict[str, Any]:
        t = self.timed
        lost = sum(v for k, v in self.failed_calls.items() if k.startswith("reduce")) \
            + self.failed_calls["sync"]

        def dist(xs: list[float]) -> dict[str, float]:
            if not xs:
                return {}
            a = np.asarray(xs)
            return {"n": len(xs), "median_s": float(np.median(a)),
                    "p90_s": float(np.percentile(a, 90)), "max_s": float(a.max())}

        return {
            "events": self.events,
            "virtual_s": self.last_finish,
            "wall_s": wall,
            "master_events": t.events,
            "master_cpu_s": t.cpu,
            "master_cpu_per_event_us": 1e6 * t.cpu / max(t.events, 1),
            "master_events_per_cpu_s": t.events / max(t.cpu, 1e-9),
            "master_busy_fraction": t.cpu / max(self.last_finish, 1e-9),
            "master_bytes_out": t.bytes_out,
            "master_cpu_by_kind_us": {k: 1e6 * v / t.by_kind[k]
                                      for k, v in sorted(t.cpu_by_kind.items(),
                                                         key=lambda kv: -kv[1])},
            "master_events_by_kind": dict(t.by_kind.most_common()),
            "master_queue_wait": dist(self.queue_wait),
            "admission": dist(self.admissions),
            "calls": {k: dist(v) for k, v in sorted(self.calls.items())},
            "collective_from_last_call": {k: dist(v) for k, v in
                                          sorted(self.collective_latency().items())},
            "failed_calls": dict(self.failed_calls),
            "steps_done": self.steps_done,
            "step_attempts_lost": lost,
            "lost_fraction": lost / max(lost + self.steps_done, 1),
            "kills": self.kills, "hangs": self.hangs, "leaves": self.leaves,
            "joins": self.joins,
            "algorithm_used": dict(self.algorithm_used),
            "violations": self.violations[:20],
        }


def run(peers: int, **kw: Any) -> dict[str, Any]:
    """One simulated run; its figures (see :meth:`ScaleSim.figures`)."""
    t0 = time.perf_counter()
    sim = ScaleSim(peers, **kw)
    sim.run()
    fig = sim.figures(time.perf_counter() - t0)
    fig["peers"] = peers
    return fig
