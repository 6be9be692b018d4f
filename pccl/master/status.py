"""The master's read-only window on a run: a live status page, ``/api/status`` (JSON),
``/api/events`` (the same JSON as server-sent events) and ``/metrics`` (Prometheus).

:class:`RunMonitor` is the model: the server feeds it what it sees (connections,
heartbeats, the state machine's :class:`~pccl.master.state.Note` s) and it keeps the
timeline, counters and latency histogram.
:class:`pccl.master.status_server.StatusServer` serves it over HTTP with aiohttp, on its
own port (imported only when a status server runs: aiohttp takes a while to import).
Nothing here changes the run: every route is a GET.

Access: a status server bound to a loopback address is open to this machine's users; any
other address needs a token (``MasterNode(status_token=...)``), sent as
``Authorization: Bearer TOKEN`` or, by a browser (EventSource cannot set headers), as
``?token=TOKEN`` in the page's URL once, exchanged for a cookie at once (see
:mod:`pccl.observe.server`). ``/healthz`` is open (for load balancers and
Kubernetes probes) and says only ``ok``. Connections have budgets and deadlines whoever
opens them (see :mod:`pccl.observe.server`).

The ``/api/status`` schema (version 1) is documented in ``docs/operations.md``.

What peers send ends up here (error texts, probe reports), so the model keeps it small
and the documents well-formed: a timeline entry's text is cut to TIMELINE_TEXT_CHARS,
the timeline as a whole to TIMELINE_MAX_BYTES of JSON, and every document goes out
through :func:`to_json`, which writes a number that is not finite (NaN, infinity) as
``null``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import io
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pccl import _core
from pccl._core import __version__
from pccl.errors import InvalidArgumentError
from pccl.master import state as st
from pccl.master.stragglers import PeerLag, StragglerTracker
from pccl.observe.collector import ScrapeTimeCollector
from pccl.protocol import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION
from pccl.protocol import messages as msgs
from pccl.protocol.auth import is_loopback_host, split_host_port

log = logging.getLogger(__name__)


class Master(Protocol):
    """What the status model reads of the master (it depends on no server class: the
    server composes it, not the other way round)."""

    @property
    def address(self) -> str: ...
    @property
    def state(self) -> st.MasterState: ...
    @property
    def secret(self) -> bytes | None: ...
    @property
    def identity(self) -> _core.Identity: ...
    @property
    def insecure(self) -> bool: ...
    @property
    def relayed_streams(self) -> int: ...
    @property
    def relayed_bytes(self) -> int: ...
    @property
    def refused_handshakes(self) -> collections.Counter[str]: ...

SCHEMA_VERSION = 1
#: Timeline entries kept (the oldest are forgotten first).
TIMELINE_LENGTH = 500
#: Characters of an entry's text kept (the text may carry what a peer sent); a longer
#: one is cut there and says how much was cut.
TIMELINE_TEXT_CHARS = 300
#: Characters of a note's text logged (the log line of a timeline entry).
LOG_TEXT_CHARS = 2000
#: Peer ids an entry lists at most.
TIMELINE_PEERS = 256
#: Bytes of JSON the whole timeline may take (the oldest entries are forgotten first);
#: the documents carry at most this much of it.
TIMELINE_MAX_BYTES = 128 * 1024
#: The timeline's file in a master's ``state_dir`` (one JSON entry a line), and the
#: size at which it is rotated to ``timeline.jsonl.1`` (replacing the previous one).
TIMELINE_FILE = "timeline.jsonl"
TIMELINE_FILE_MAX_BYTES = 64 << 20
#: Seconds of collective completions the rate is computed over.
RATE_WINDOW = 30.0
#: Server-sent events: at most this many snapshots a second per client, and one at
#: least every KEEPALIVE seconds (heartbeat ages move even when nothing happens).
MAX_EVENTS_PER_SECOND = 4.0
KEEPALIVE = 2.0
#: Open event streams at once (each holds a task and a socket).
MAX_EVENT_STREAMS = 64
# Latency buckets of collectives, in seconds: from loopback microseconds to WAN minutes.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# Why a peer was dropped, by the start of the reason the state machine gives.
_DROP_CAUSES = (("left", "left"),
                ("connection closed", "connection_closed"),
                ("heartbeat timeout", "heartbeat_timeout"),
                ("protocol error", "protocol_error"),
                ("unreachable", "unreachable"),
                ("removed by the operator", "removed"))


def finite(value: Any) -> Any:
    """``value`` (made of dicts, lists, tuples and scalars) with every float that is not
    finite replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def cut(text: str, chars: int) -> str:
    """``text``, or its first ``chars`` characters and how many more there were."""
    if len(text) <= chars:
        return text
    return f"{text[:chars]}... ({len(text) - chars} more characters)"


def to_json(doc: Any) -> str:
    """The JSON every route and event sends: compact, ASCII, NaN and infinities as null
    (strict JSON: a browser's ``JSON.parse`` refuses ``NaN``)."""
    return json.dumps(finite(doc), separators=(",", ":"), allow_nan=False)


def _append_only(path: Path) -> io.TextIOWrapper:
    """``path`` opened to append text, created 0600 (closed by ``RunMonitor.close``)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    return open(fd, "a", encoding="utf-8")  # noqa: SIM115


def _timeline_entry(line: bytes) -> dict[str, Any] | None:
    """One line of a timeline file as an entry, or None when it is not one."""
    try:
        e = json.loads(line)
    except ValueError:
        return None
    if not isinstance(e, dict) or set(e) != {"seq", "time", "kind", "text", "peers", "group"}:
        return None
    if not (isinstance(e["seq"], int) and isinstance(e["time"], (int, float))
            and isinstance(e["kind"], str) and isinstance(e["text"], str)
            and isinstance(e["peers"], list) and isinstance(e["group"], int)):
        return None
    e["kind"], e["text"] = cut(e["kind"], 40), cut(e["text"], TIMELINE_TEXT_CHARS)
    e["peers"] = [p for p in e["peers"][:TIMELINE_PEERS] if isinstance(p, int)]
    return e


def _drop_cause(reason: str) -> str:
    for prefix, cause in _DROP_CAUSES:
        if reason.startswith(prefix):
            return cause
    return "other"


@dataclasses.dataclass
class PeerView:
    """What the server knows of one connected peer beyond the state machine's record."""

    remote: str  # where its control connection comes from
    encrypted: bool
    connected_at: float  # wall clock
    last_seen: float  # monotonic: its last message of any kind
    # Reported with every heartbeat answer (pong): p2p bytes so far, and the running
    # sync's fetched / total bytes (0 / 0: none running).
    tx_bytes: int = 0
    rx_bytes: int = 0
    sync_rx_bytes: int = 0
    sync_rx_total: int = 0
    # The static key it proved (fingerprint), and its certificate's name and expiry
    # (unix seconds) when the master checks certificates.
    fingerprint: str | None = None
    # What the operator calls it: its certificate's name, else what it said (name=).
    name: str | None = None
    cert_name: str | None = None
    cert_not_after: int | None = None
    # The control-plane protocol version it speaks (a rolling upgrade shows here).
    version: int | None = None


class RunMonitor:
    """Keeps what the status page shows and the metrics count. Event-loop only."""

    def __init__(self, master: Master) -> None:
        self.master = master
        self.started_at = time.time()
        self.peers: dict[int, PeerView] = {}
        self.timeline: collections.deque[dict[str, Any]] = collections.deque()
        self._sizes: collections.deque[int] = collections.deque()  # each entry's JSON bytes
        self.timeline_bytes = 0  # their sum
        self._seq = 0
        # Running collectives: op id -> when it began (monotonic), its tensor bytes.
        self._started: dict[int, float] = {}
        self._bytes: dict[int, int] = {}
        self._completions: collections.deque[tuple[float, float]] = collections.deque()
        self.collectives = {"ok": 0, "failed": 0}
        self.syncs = {"ok": 0, "failed": 0}
        self.latency_sum = 0.0
        self.changed = asyncio.Event()
        self.registry = CollectorRegistry(auto_describe=True)
        self._m_collectives = Counter(
            "pccl_collectives", "Collectives that ended, by outcome", ["outcome"],
            registry=self.registry)
        self._m_bytes = Counter(
            "pccl_collective_bytes", "Tensor bytes of the collectives that succeeded "
            "(elements x element size, once per collective)", registry=self.registry)
        self._m_latency = Histogram(
            "pccl_collective_seconds", "Time from a collective's start (every member "
            "called it) to its outcome", buckets=_LATENCY_BUCKETS, registry=self.registry)
        self._m_syncs = Counter("pccl_syncs", "Shared-state syncs that ended, by outcome",
                                ["outcome"], registry=self.registry)
        self._m_drops = Counter("pccl_peers_dropped", "Peers dropped, by cause", ["cause"],
                                registry=self.registry)
        self._m_admitted = Counter("pccl_peers_admitted", "Peers admitted into a ring",
                                   registry=self.registry)
        self._m_rounds = Counter("pccl_topology_rounds", "Rounds of ring building, by outcome",
                                 ["outcome"], registry=self.registry)
        self._m_resumed = Counter("pccl_peers_resumed", "Peers that came back after a "
                                  "master restart", registry=self.registry)
        self._m_restarts = Counter("pccl_master_restarts", "Master restarts this master "
                                   "recovered a run from (peers resuming after one)",
                                   registry=self.registry)
        self.registry.register(ScrapeTimeCollector(lambda: _live_gauges(self)))
        for outcome in ("ok", "failed"):
            self._m_collectives.labels(outcome)
            self._m_syncs.labels(outcome)
        self._recovering = False
        # The timeline's file (MasterNode(state_dir=)): every entry appended as it comes.
        self._journal: io.TextIOWrapper | None = None
        self._journal_path: Path | None = None
        # Who holds collectives back (fed with the monotonic clock; see stragglers.py).
        self.stragglers = StragglerTracker()

    def started(self) -> None:
        """The master started listening (again): the uptime counts from now."""
        self.started_at = time.time()
        self.add("master", f"master started on {self.master.address}")

    # --- what the server reports ------------------------------------------------------

    def add(self, kind: str, text: str, peers: tuple[int, ...] = (), group: int = -1) -> None:
        """A timeline entry: its text cut to TIMELINE_TEXT_CHARS, its peers to
        TIMELINE_PEERS; the oldest entries go while there are more than TIMELINE_LENGTH
        or they take more than TIMELINE_MAX_BYTES."""
        self._seq += 1
        entry = {"seq": self._seq, "time": time.time(), "kind": kind,
                 "text": cut(text, TIMELINE_TEXT_CHARS),
                 "peers": list(peers[:TIMELINE_PEERS]), "group": group}
        self._keep(entry)
        self._write(entry)
        self.changed.set()

    def _keep(self, entry: dict[str, Any]) -> None:
        size = len(to_json(entry)) + 1  # (and its comma in the list)
        self.timeline.append(entry)
        self._sizes.append(size)
        self.timeline_bytes += size
        while len(self.timeline) > TIMELINE_LENGTH or self.timeline_bytes > TIMELINE_MAX_BYTES:
            self.timeline.popleft()
            self.timeline_bytes -= self._sizes.popleft()

    # --- the timeline's file (MasterNode(state_dir=)) -----------------------------------

    def keep_in(self, state_dir: Path) -> None:
        """Keeps the timeline in ``state_dir/timeline.jsonl`` across restarts: takes
        back the newest entries of the masters that ran before (a line that does not
        parse as one, e.g. cut by a crash, is skipped), numbers on after them, and
        appends every new entry. The file is this master's own (0600 in a 0700
        directory), not input from the network; it is still read with limits."""
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = state_dir / TIMELINE_FILE
        old: list[dict[str, Any]] = []
        cut = False  # the file ends inside a line (a crash mid-write)
        if path.exists():
            with path.open("rb") as f:
                f.seek(0, io.SEEK_END)
                start = max(0, f.tell() - 4 * TIMELINE_MAX_BYTES)
                f.seek(start)
                data = f.read()
            cut = bool(data) and not data.endswith(b"\n")
            lines = data.split(b"\n")
            for line in lines[1 if start else 0:]:
                entry = _timeline_entry(line)
                if entry is not None:
                    old.append(entry)
        for entry in old[-TIMELINE_LENGTH:]:
            self._keep(entry)
        self._seq = max([self._seq, *(e["seq"] for e in old)])
        self._journal, self._journal_path = _append_only(path), path
        if cut:  # ours start on a new line
            self._journal.write("\n")
        if old:
            log.info("timeline: %d entries taken back from %s", len(old[-TIMELINE_LENGTH:]), path)

    def _write(self, entry: dict[str, Any]) -> None:
        """Appends ``entry`` to the timeline's file, if there is one; a failed write
        (a full disk) stops the file with one warning, never the master."""
        if self._journal is None or self._journal_path is None:
            return
        try:
            self._journal.write(to_json(entry) + "\n")
            self._journal.flush()
            if self._journal.tell() > TIMELINE_FILE_MAX_BYTES:
                self._journal.close()
                os.replace(self._journal_path, str(self._journal_path) + ".1")
                self._journal = _append_only(self._journal_path)
        except OSError as e:
            log.warning("timeline: writing %s failed (%s); the timeline is kept in memory "
                        "only from now on", self._journal_path, e)
            self.close()

    def close(self) -> None:
        """Closes the timeline's file (the master stopped)."""
        journal, self._journal = self._journal, None
        if journal is not None:
            with contextlib.suppress(OSError):
                journal.close()

    def connected(self, peer_id: int, remote: str, encrypted: bool, text: str,
                  name: str | None = None, version: int | None = None) -> None:
        now = time.monotonic()
        self.peers[peer_id] = PeerView(remote, encrypted, time.time(), now, name=name,
                                       version=version)
        self.add("joined", text, (peer_id,))

    def identified(self, peer_id: int, fingerprint: str, name: str | None,
                   not_after: int | None) -> None:
        view = self.peers.get(peer_id)
        if view is not None:
            view.fingerprint, view.cert_name, view.cert_not_after = fingerprint, name, not_after

    def seen(self, peer_id: int) -> None:
        view = self.peers.get(peer_id)
        if view is not None:
            view.last_seen = time.monotonic()

    def heartbeat(self, peer_id: int, tx: int, rx: int, sync_rx: int, sync_total: int) -> None:
        view = self.peers.get(peer_id)
        if view is not None:
            view.tx_bytes, view.rx_bytes = tx, rx
            view.sync_rx_bytes, view.sync_rx_total = sync_rx, sync_total
        rec = self.master.state.peers.get(peer_id)
        if rec is not None:
            self.stragglers.heartbeat(time.monotonic(), peer_id, rec.peer_group, tx)

    def collective_message(self, peer_id: int, msg: msgs.CollectiveInit | msgs.CollectiveDone
                           ) -> None:
        """An accepted peer called a collective or reported its part ended (seen before
        the state machine handles it)."""
        rec = self.master.state.peers.get(peer_id)
        if rec is None or rec.status is not st.PeerStatus.ACCEPTED:
            return
        if isinstance(msg, msgs.CollectiveInit):
            self.stragglers.called(time.monotonic(), peer_id, rec.peer_group, msg.tag)
        elif msg.op_id >= 0:
            self.stragglers.done(time.monotonic(), peer_id, rec.peer_group, msg.tag)

    def notes(self, notes: list[st.Note]) -> None:
        """The state machine's notes: logged at INFO (what an operator reads), counted."""
        now = time.monotonic()
        for note in notes:
            if note.kind == "collective_started":
                self._started[note.value] = now
                self._bytes[note.value] = note.nbytes
                self.stragglers.performed(now, note.group, note.tag)
                continue
            if note.kind == "collective_failed" and note.value < 0:
                self.stragglers.ended(now, note.group, note.tag, note.peers, False)
            if note.kind == "collective_done" or (note.kind == "collective_failed"
                                                  and note.value >= 0):
                began = self._started.pop(note.value, None)
                ok = note.kind == "collective_done"
                # Small enough for the mesh: its bytes are not in the ring counters.
                ring = self._bytes.get(note.value, 0) > \
                    self.master.state.mesh_limits.get(note.group, 0)
                self.stragglers.ended(now, note.group, note.tag, note.peers, ok, ring)
                self.collectives["ok" if ok else "failed"] += 1
                self._m_collectives.labels("ok" if ok else "failed").inc()
                if began is not None:
                    took = now - began
                    self._m_latency.observe(took)
                    if ok:
                        self.latency_sum += took
                        self._completions.append((now, took))
                nbytes = self._bytes.pop(note.value, 0)
                if ok:
                    self._m_bytes.inc(nbytes)
                    continue
            if note.kind == "collective_failed" and note.value < 0:
                self.collectives["failed"] += 1
                self._m_collectives.labels("failed").inc()
            if note.kind in ("sync_planned", "sync_done"):
                # A run may sync every step: counted and shown as progress, logged at
                # DEBUG, kept off the timeline (failures are on it).
                if note.kind == "sync_done":
                    self.syncs["ok"] += 1
                    self._m_syncs.labels("ok").inc()
                log.debug("%s", note.text)
                continue
            if note.kind == "sync_failed":
                self.syncs["failed"] += 1
                self._m_syncs.labels("failed").inc()
            elif note.kind == "dropped":
                reason = note.text.split("dropped: ", 1)[-1]
                self._m_drops.labels(_drop_cause(reason)).inc()
                for p in note.peers:
                    self.peers.pop(p, None)
                    self.stragglers.forget(p)
            elif note.kind == "admitted":
                self._m_admitted.inc(len(note.peers))
            elif note.kind in ("ring", "repair"):
                self._m_rounds.labels("ok").inc()
                self._recovering = False
            elif note.kind == "round_failed":
                self._m_rounds.labels("failed").inc()
            elif note.kind == "resume":
                self._m_resumed.inc()
                if not self._recovering:
                    self._recovering = True
                    self._m_restarts.inc()
            log.info("%s", cut(note.text, LOG_TEXT_CHARS))
            self.add(note.kind, note.text, note.peers, note.group)
        self.changed.set()

    # --- what the page and the API show -----------------------------------------------

    def lag_table(self) -> list[PeerLag]:
        """The accepted peers' straggler rows, slowest first (see stragglers.py)."""
        s = self.master.state
        return self.stragglers.table({p: s.peers[p].peer_group for p in s.accepted()})

    def rate(self) -> tuple[float, float | None, float | None]:
        """Collectives per second over the last RATE_WINDOW seconds, and their median and
        95th-percentile latency in seconds (None: none ended in the window)."""
        now = time.monotonic()
        while self._completions and self._completions[0][0] < now - RATE_WINDOW:
            self._completions.popleft()
        took = sorted(t for _, t in self._completions)
        if not took:
            return 0.0, None, None
        span = min(RATE_WINDOW, max(now - self._completions[0][0], 1.0))
        return (len(took) / span, took[len(took) // 2],
                took[min(len(took) - 1, int(len(took) * 0.95))])

    def snapshot(self) -> dict[str, Any]:
        """The ``/api/status`` document (see docs/operations.md for the schema)."""
        m = self.master
        s = m.state
        now = time.monotonic()
        paths = s.links_now()
        ring_of: dict[int, list[int]] = {g: list(r) for g, r in sorted(s.rings.items())}
        nxt: dict[int, int] = {}
        prv: dict[int, int] = {}
        for ring in ring_of.values():
            for i, p in enumerate(ring):
                if len(ring) > 1:
                    nxt[p] = ring[(i + 1) % len(ring)]
                    prv[p] = ring[i - 1]
        syncing = {p: sync for sync in s.syncs.values() for p in sync.participants}
        slowest = self.lag_table()
        lags = {row.peer: row for row in slowest}
        peers = []
        for pid, rec in s.peers.items():
            view = self.peers.get(pid)
            out_path = paths.get((pid, nxt[pid])) if pid in nxt else None
            in_path = paths.get((prv[pid], pid)) if pid in prv else None
            peers.append({
                "id": pid,
                "group": rec.peer_group,
                # "pending": registered, waiting for the accepted peers to admit it
                "state": "accepted" if rec.status is st.PeerStatus.ACCEPTED else "pending",
                "p2p_address": rec.p2p_addr,
                "control_address": view.remote if view else None,
                "reachable": rec.reachable,
                "encrypted": view.encrypted if view else None,
                "name": view.name if view else None,
                "protocol": view.version if view else None,
                "key_fingerprint": view.fingerprint if view else None,
                "cert_name": view.cert_name if view else None,
                "cert_not_after": view.cert_not_after if view else None,
                "path_out": out_path or ("direct" if pid in nxt else None),
                "path_in": in_path or ("direct" if pid in prv else None),
                "next": nxt.get(pid),
                "heartbeat_age_s": round(now - view.last_seen, 3) if view else None,
                "connected_at": view.connected_at if view else None,
                "revision": s.last_revision.get(pid),
                "tx_bytes": view.tx_bytes if view else 0,
                "rx_bytes": view.rx_bytes if view else 0,
                "syncing": pid in syncing,
                "sync_rx_bytes": view.sync_rx_bytes if view else 0,
                "sync_rx_total": view.sync_rx_total if view else 0,
                "lag": _lag_doc(lags[pid]) if pid in lags else None,
            })
        groups = []
        for g, members in sorted(s._groups().items()):
            ring = ring_of.get(g, [])
            groups.append({
                "group": g,
                "members": sorted(members),
                "ring": ring,
                "epoch": s.ring_epochs.get(g),
                "broken": s._ring_broken(g) if ring else None,
                "links": [{"from": a, "to": ring[(i + 1) % len(ring)],
                           "path": paths.get((a, ring[(i + 1) % len(ring)]), "direct")}
                          for i, a in enumerate(ring) if len(ring) > 1],
            })
        syncs = []
        for sync in sorted(s.syncs.values(), key=lambda x: x.group):
            fetched = sum(self.peers[p].sync_rx_bytes for p in sync.participants
                          if p in self.peers)
            total = sum(self.peers[p].sync_rx_total for p in sync.participants
                        if p in self.peers)
            syncs.append({"group": sync.group, "planned": sync.planned,
                          "revision": sync.revision if sync.planned else None,
                          "participants": list(sync.participants) or sorted(sync.inits),
                          "done": sorted(sync.reported), "rx_bytes": fetched,
                          "rx_total": total})
        per_second, p50, p95 = self.rate()
        return {
            "schema": SCHEMA_VERSION,
            "time": time.time(),
            "master": {
                "address": m.address,
                "version": __version__,
                "protocol": PROTOCOL_VERSION,
                "min_protocol": MIN_PROTOCOL_VERSION,
                "started_at": self.started_at,
                "uptime_s": round(time.time() - self.started_at, 3),
                "authenticated": m.secret is not None,
                "certificates": m.identity.checks_certs,
                "key_fingerprint": m.identity.fingerprint,
                "denylist_version": m.identity.denylist_version,
                "accepts_clear_text": m.insecure,
                "phase": s.phase.name.lower(),
                "epoch": s.epoch,
                "relay": {"enabled": s.relay, "streams": m.relayed_streams,
                          "bytes": m.relayed_bytes},
            },
            "peers": peers,
            "groups": groups,
            # Peers by how much their group waited for them, slowest first.
            "slowest": [row.peer for row in slowest],
            "bandwidth": [{"from": a, "to": b, "bytes_per_s": bw, "round": r}
                          for (a, b), (bw, r) in sorted(s.bandwidth.items())
                          if a in s.peers and b in s.peers],
            "collectives": {
                "ok": self.collectives["ok"], "failed": self.collectives["failed"],
                "running": sum(1 for c in s.collectives.values() if c.op_id >= 0),
                "waiting": sum(1 for c in s.collectives.values() if c.op_id < 0),
                "per_second": round(per_second, 3),
                "latency_p50_s": p50, "latency_p95_s": p95,
            },
            "syncs": {"ok": self.syncs["ok"], "failed": self.syncs["failed"],
                      "running": syncs},
            "timeline": list(self.timeline)[-100:],
        }


def _lag_doc(row: PeerLag) -> dict[str, Any]:
    """``peers[].lag`` of ``/api/status`` (see docs/operations.md, "Who is slow?")."""
    return {"collectives": row.collectives,
            "call_p50_s": row.call_p50, "call_p95_s": row.call_p95,
            "done_p50_s": row.done_p50, "done_p95_s": row.done_p95,
            "held_s": row.held, "wait_share": row.wait_share,
            "ring_bytes_per_s": row.ring_bytes_per_s, "straggler": row.straggler}


def _live_gauges(mon: RunMonitor) -> Iterator[Metric]:
    """The master's metrics read from its state at scrape time."""
    s = mon.master.state
    peers = GaugeMetricFamily("pccl_peers", "Peers known to the master, by state",
                              labels=["state"])
    peers.add_metric(["accepted"], len(s.accepted()))
    peers.add_metric(["pending"], len(s.pending()))
    yield peers
    yield GaugeMetricFamily("pccl_peer_groups", "Peer groups with accepted peers",
                            value=len(s.group_sizes()))
    yield GaugeMetricFamily("pccl_ring_epoch", "Newest ring epoch", value=s.ring_epoch)
    yield GaugeMetricFamily("pccl_collectives_running", "Collectives in progress",
                            value=sum(1 for c in s.collectives.values() if c.op_id >= 0))
    yield GaugeMetricFamily("pccl_syncs_running", "Shared-state syncs in progress",
                            value=len(s.syncs))
    yield GaugeMetricFamily("pccl_relayed_streams", "Ring-link streams relayed now",
                            value=mon.master.relayed_streams)
    refused = CounterMetricFamily("pccl_handshakes_refused", "Connections refused or dropped "
                                  "in the handshake, by reason (secret, identity, timeout, "
                                  "garbage)", labels=["reason"])
    for reason in ("secret", "identity", "timeout", "garbage"):
        refused.add_metric([reason], mon.master.refused_handshakes.get(reason, 0))
    yield refused
    relayed = CounterMetricFamily("pccl_relayed_bytes", "Bytes relayed so far (both "
                                  "directions)")
    relayed.add_metric([], mon.master.relayed_bytes)
    yield relayed
    yield GaugeMetricFamily("pccl_master_uptime_seconds", "Seconds since this master "
                            "started", value=time.time() - mon.started_at)
    # (Counters: they only grow while the peer lives; a peer's restart is a new series
    # start, which rate() handles as a counter reset.)
    tx = CounterMetricFamily("pccl_peer_p2p_tx_bytes", "p2p bytes each peer sent (its "
                             "last heartbeat report)", labels=["peer", "group"])
    rx = CounterMetricFamily("pccl_peer_p2p_rx_bytes", "p2p bytes each peer received (its "
                             "last heartbeat report)", labels=["peer", "group"])
    for pid, view in mon.peers.items():
        rec = s.peers.get(pid)
        if rec is not None:
            tx.add_metric([str(pid), str(rec.peer_group)], view.tx_bytes)
            rx.add_metric([str(pid), str(rec.peer_group)], view.rx_bytes)
    yield tx
    yield rx
    lag = GaugeMetricFamily("pccl_peer_lag_seconds", "How far behind the first member each "
                            "peer called (phase=call) and finished (phase=done) its "
                            "group's collectives, over the last 64", labels=[
                                "peer", "name", "group", "phase", "quantile"])
    share = GaugeMetricFamily("pccl_peer_wait_share", "Fraction of its group's collective "
                              "time spent waiting for this peer alone (last 64 collectives)",
                              labels=["peer", "name", "group"])
    rate = GaugeMetricFamily("pccl_peer_ring_bytes_per_second", "Bytes each peer sent per "
                             "second of its group's ring time, from its heartbeats",
                             labels=["peer", "name", "group"])
    for row in mon.lag_table():
        seen = mon.peers.get(row.peer)
        who = [str(row.peer), (seen.name if seen else None) or "", str(row.group)]
        for phase, p50, p95 in (("call", row.call_p50, row.call_p95),
                                ("done", row.done_p50, row.done_p95)):
            if p50 is not None and p95 is not None:
                lag.add_metric([*who, phase, "0.5"], p50)
                lag.add_metric([*who, phase, "0.95"], p95)
        share.add_metric(who, row.wait_share)
        if row.ring_bytes_per_s is not None:
            rate.add_metric(who, row.ring_bytes_per_s)
    yield lag
    yield share
    yield rate


def check_listen(listen: str, token: str | None) -> None:
    """``MasterNode(status_listen=..., status_token=...)``: a malformed address or an
    address other machines can reach without a token fails at construction."""
    host, _ = split_host_port(listen)
    if not is_loopback_host(host) and not token:
        raise InvalidArgumentError(
            f"MasterNode(status_listen={listen!r}) is reachable from other machines: give "
            f"status_token=... (clients send 'Authorization: Bearer TOKEN'), or listen on "
            f"127.0.0.1")
