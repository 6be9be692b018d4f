"""Who is slow: per peer, how far behind its group it calls and finishes collectives, how
much of the group's collective time went to waiting for it alone, and what its ring link
carried per second of ring time. Passive: it reads only what the master sees anyway
(members' CollectiveInit and CollectiveDone, the outcome, heartbeat byte counters).

Sans-IO like :mod:`pccl.master.state`: every method takes ``now``, the caller's monotonic
clock in seconds, and nothing here reads a clock, so tests feed exact times and get exact
values. The server's :class:`pccl.master.status.RunMonitor` drives it.

Per successful collective of a group (first call at ``t0``, outcome at ``end``):

- call lag of a member: its CollectiveInit's arrival minus the first member's;
- done lag: its CollectiveDone's arrival minus the first member's (ring collectives only:
  one reduced by the master has no per-member end);
- held: the time during which the collective waited for this member *alone*: the last
  caller holds it from the second-to-last call to its own; the last to finish holds it
  from the second-to-last finish (or the last call, if later) to its own;
- wall: ``end - t0``.

A member's **wait share** is its held time over the wall time of the collectives it took
part in (the last :data:`WINDOW` of its group): 0.25 means that a quarter of the group's
collective time was spent with everyone else done and waiting for it. A ring runs at its
slowest link's pace and every member waits for the peer behind it, so a slow link shows as
its receiving end finishing last, collective after collective.

**Ring rate**: the growth of the peer's reported tx counter (ring-link bytes and
shared-state bytes it served) between its oldest and newest kept heartbeat, over the ring
time (perform to outcome of the collectives that are not small enough for the mesh) its
group accumulated in between. Every member of a ring sends about as much and the ring
moves at its slowest link's pace, so all members of one ring show about the same rate: it
says how fast the ring goes, the wait share says who holds it back.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses

#: Collectives kept per group (the lags and shares are over these).
WINDOW = 64
#: Heartbeat samples kept per peer (the ring rate spans RATE_SAMPLES - 1 intervals).
RATE_SAMPLES = 9
#: A straggler's wait share is at least this many times the median of the others' ...
OUTLIER_FACTOR = 3.0
#: ... and at least this fraction of the collective time ...
OUTLIER_SHARE = 0.10
#: ... and it held each collective this long on average (seconds): a peer 1 ms behind
#: on loopback is not worth a red row.
OUTLIER_FLOOR_S = 0.02
#: Open collectives kept in all (beyond, the oldest is forgotten: calls whose collective
#: never ended must not pile up).
MAX_OPEN = 4096


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``values`` (not empty): the value below which
    lies the fraction ``q`` of them, as the status page's latency quantiles."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


@dataclasses.dataclass
class _Open:
    """A collective between its first call and its outcome."""

    calls: dict[int, float] = dataclasses.field(default_factory=dict)
    dones: dict[int, float] = dataclasses.field(default_factory=dict)
    performed: float | None = None


@dataclasses.dataclass(frozen=True)
class _Record:
    """One successful collective: per member (call lag, done lag or None, held)."""

    wall: float
    members: dict[int, tuple[float, float | None, float]]


@dataclasses.dataclass(frozen=True)
class PeerLag:
    """What :meth:`StragglerTracker.table` says of one peer (seconds, bytes/s)."""

    peer: int
    group: int
    collectives: int  # in the window
    call_p50: float
    call_p95: float
    done_p50: float | None  # None: no ring collective in the window
    done_p95: float | None
    held: float  # seconds the window's collectives waited for it alone
    wait_share: float  # held / the wall time of those collectives
    ring_bytes_per_s: float | None  # None: no ring time between its kept heartbeats
    straggler: bool = False

    @property
    def lag_p95(self) -> float:
        """The larger of its call and done lag p95."""
        return max(self.call_p95, self.done_p95 or 0.0)


class StragglerTracker:
    """Per-group collectives and per-peer heartbeats in, :class:`PeerLag` rows out."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self._open: dict[tuple[int, int], _Open] = {}
        self._records: dict[int, collections.deque[_Record]] = {}
        # Per group: ring seconds of every collective that ended (a running total).
        self._ring_seconds: dict[int, float] = {}
        # Per peer: (group, [(now, tx bytes, the group's ring seconds then)]).
        self._samples: dict[int, tuple[int, collections.deque[tuple[float, int, float]]]] = {}

    # --- what happened ----------------------------------------------------------------

    def called(self, now: float, peer: int, group: int, tag: int) -> None:
        """``peer`` sent CollectiveInit for ``tag`` (a repeated one keeps the first)."""
        key = (group, tag)
        col = self._open.get(key)
        if col is None:
            if len(self._open) >= MAX_OPEN:
                del self._open[next(iter(self._open))]
            col = self._open[key] = _Open()
        col.calls.setdefault(peer, now)

    def done(self, now: float, peer: int, group: int, tag: int) -> None:
        """``peer`` reported its part of ``tag`` ended (CollectiveDone)."""
        col = self._open.get((group, tag))
        if col is not None:
            col.dones.setdefault(peer, now)

    def performed(self, now: float, group: int, tag: int) -> None:
        """Every member called: the ring runs (or the master reduced it) from now."""
        col = self._open.get((group, tag))
        if col is not None and col.performed is None:
            col.performed = now

    def ended(self, now: float, group: int, tag: int, members: tuple[int, ...], ok: bool,
              ring: bool = True) -> None:
        """The outcome of ``tag`` went out. Only a successful one whose every member's
        call was seen is recorded; ``ring``: its time counts towards the ring rate (not
        reduced by the master, not small enough for the mesh)."""
        col = self._open.pop((group, tag), None)
        if col is None or not ok or not members:
            return
        if ring and col.performed is not None:
            self._ring_seconds[group] = self._ring_seconds.get(group, 0.0) + max(
                0.0, now - col.performed)
        if any(p not in col.calls for p in members):
            return
        calls = {p: col.calls[p] for p in members}
        t0 = min(calls.values())
        held = dict.fromkeys(members, 0.0)
        by_call = sorted(members, key=lambda p: calls[p])
        last_call = calls[by_call[-1]]
        if len(members) > 1:
            held[by_call[-1]] += last_call - calls[by_call[-2]]
        dones = {p: col.dones[p] for p in members if p in col.dones}
        first_done: float | None = None
        if len(dones) == len(members):
            first_done = min(dones.values())
            by_done = sorted(members, key=lambda p: dones[p])
            if len(members) > 1:
                held[by_done[-1]] += max(
                    0.0, dones[by_done[-1]] - max(dones[by_done[-2]], last_call))
        record = _Record(now - t0, {
            p: (calls[p] - t0, None if first_done is None else dones[p] - first_done,
                held[p]) for p in members})
        self._records.setdefault(group, collections.deque(maxlen=self.window)).append(record)

    def heartbeat(self, now: float, peer: int, group: int, tx_bytes: int) -> None:
        """``peer``'s heartbeat answer reported ``tx_bytes`` sent so far."""
        got = self._samples.get(peer)
        if got is None or got[0] != group or (got[1] and tx_bytes < got[1][-1][1]):
            got = self._samples[peer] = (group, collections.deque(maxlen=RATE_SAMPLES))
        got[1].append((now, tx_bytes, self._ring_seconds.get(group, 0.0)))

    def forget(self, peer: int) -> None:
        """``peer`` left: its heartbeats go (its part of the group's records ages out)."""
        self._samples.pop(peer, None)
        for col in self._open.values():
            col.calls.pop(peer, None)
            col.dones.pop(peer, None)

    # --- what it says -----------------------------------------------------------------

    def ring_rate(self, peer: int) -> float | None:
        """Bytes/s (see the module docstring); None: no ring time in its samples."""
        got = self._samples.get(peer)
        if got is None or len(got[1]) < 2:
            return None
        (_, tx0, ring0), (_, tx1, ring1) = got[1][0], got[1][-1]
        return (tx1 - tx0) / (ring1 - ring0) if ring1 > ring0 else None

    def table(self, peers: dict[int, int]) -> list[PeerLag]:
        """Rows for ``peers`` (id -> group) that took part in a recorded collective,
        slowest first: by wait share, then lag p95, then id. Stragglers are flagged
        (see :data:`OUTLIER_FACTOR` and the next constants)."""
        rows: list[PeerLag] = []
        for peer, group in peers.items():
            mine = [(r.wall, r.members[peer]) for r in self._records.get(group, ())
                    if peer in r.members]
            if not mine:
                continue
            calls = [c for _, (c, _, _) in mine]
            dones = [d for _, (_, d, _) in mine if d is not None]
            held = sum(h for _, (_, _, h) in mine)
            wall = sum(w for w, _ in mine)
            rows.append(PeerLag(
                peer, group, len(mine), quantile(calls, 0.5), quantile(calls, 0.95),
                quantile(dones, 0.5) if dones else None,
                quantile(dones, 0.95) if dones else None,
                held, held / wall if wall > 0 else 0.0, self.ring_rate(peer)))
        shares: dict[int, list[float]] = {}
        for row in rows:
            shares.setdefault(row.group, []).append(row.wait_share)
        for got in shares.values():
            got.sort()
        flagged = []
        for row in rows:
            # The median of the others' shares: the group's sorted shares without one
            # occurrence of this row's (index arithmetic, not a copy per row).
            ordered = shares[row.group]
            k = (len(ordered) - 1) // 2  # quantile(others, 0.5) of len(ordered) - 1 values
            i = bisect.bisect_left(ordered, row.wait_share)
            median = 0.0 if len(ordered) < 2 else ordered[k if k < i else k + 1]
            flagged.append(dataclasses.replace(row, straggler=(
                row.wait_share >= OUTLIER_SHARE
                and row.wait_share >= OUTLIER_FACTOR * median
                and row.held / row.collectives >= OUTLIER_FLOOR_S)))
        return sorted(flagged, key=lambda r: (-r.wait_share, -r.lag_p95, r.peer))
