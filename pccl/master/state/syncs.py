"""Shared-state syncs: per peer group, from the members' inits to the plan (popular
revision, schema and content; who fetches what from whom) and the outcome."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Collection, Iterable
from collections.abc import Set as AbstractSet

from pccl.errors import ErrorKind
from pccl.master.state.context import Context, Part
from pccl.master.state.events import Command, PeerStatus, Send, SyncDeadline
from pccl.master.state.roster import PeerRecord, covers
from pccl.protocol import messages as m

# Values of pccl.SharedStateSyncStrategy (kept numeric on the wire).
ENFORCE_POPULAR, RECEIVE_ONLY, SEND_ONLY = 0, 1, 2


@dataclasses.dataclass
class Sync:
    """One shared-state sync of a peer group, from the first init to the outcome."""

    group: int
    inits: dict[int, m.SyncInit] = dataclasses.field(default_factory=dict)
    planned: bool = False
    revision: int = 0
    participants: list[int] = dataclasses.field(default_factory=list)
    participant_set: frozenset[int] = frozenset()  # the same, for membership tests
    reported: set[int] = dataclasses.field(default_factory=set)
    error: tuple[ErrorKind, str] | None = None
    deadline: int = 0  # id of the deadline on the wait for every member's init


class Syncs(Part):
    """The sync in flight per group (at most one)."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.syncs: dict[int, Sync] = {}

    def on_init(self, peer: int, msg: m.SyncInit, out: list[Command]) -> None:
        ctx = self.ctx
        rec = ctx.peers[peer]

        def refuse(kind: ErrorKind, why: str) -> None:
            out.append(Send(peer, m.SyncOutcome(ok=False, kind=kind, message=why, revision=0)))

        if rec.status is not PeerStatus.ACCEPTED:
            refuse(ErrorKind.InvalidUsageError, "sync_shared_state() needs an accepted peer")
            return
        n = len(msg.keys)
        if not (len(msg.dtypes) == len(msg.counts) == len(msg.hashes) == len(msg.unequal) == n
                and len(set(msg.keys)) == n and msg.strategy in (0, 1, 2)):
            refuse(ErrorKind.ProtocolError, "malformed shared-state description")
            return
        sync = self.syncs.get(rec.peer_group)
        if sync is None:
            sync = self.syncs[rec.peer_group] = Sync(rec.peer_group)
            sync.deadline = ctx.arm(SyncDeadline(sync.group), msg.timeout, out)
        if sync.planned or peer in sync.inits:
            refuse(ErrorKind.InvalidUsageError,
                   "a shared-state sync is already running in this group")
            return
        sync.inits[peer] = msg
        ctx.fresh.discard(peer)
        if ctx.group_in_vote(rec.peer_group):
            self.fail(sync, ErrorKind.CollectiveAbortedError, (
                "other peers of the group are in update_topology(); call update_topology() "
                "and retry"), out)
            return
        self._maybe_plan(sync, out)
        ctx.hub.waiting_changed(out)

    def fail(self, sync: Sync, kind: ErrorKind, why: str, out: list[Command]) -> None:
        ctx = self.ctx
        del self.syncs[sync.group]
        ctx.disarm(sync.deadline)
        ctx.note("sync_failed", f"shared-state sync of group {sync.group} failed: {why}",
                 sorted(sync.participants if sync.planned else sync.inits), sync.group,
                 sync.revision)
        # Once planned, peers refused at the plan already have their outcome.
        for p in sorted(sync.participants if sync.planned else sync.inits):
            if p in ctx.peers:
                out.append(Send(p, m.SyncOutcome(ok=False, kind=kind, message=why, revision=0)))

    def _maybe_plan(self, sync: Sync, out: list[Command]) -> None:
        ctx = self.ctx
        if not ctx.all_joined(sync.group, sync.inits):
            return
        members = ctx.members(sync.group)
        ctx.disarm(sync.deadline)
        inits = {p: sync.inits[p] for p in members}
        excluded: dict[int, tuple[ErrorKind, str]] = {}
        # 1. Revisions must advance by exactly one (fresh peers and receivers excepted).
        for p, i in inits.items():
            last = ctx.last_revision.get(p)
            if i.strategy != RECEIVE_ONLY and last is not None and i.revision != last + 1:
                excluded[p] = (ErrorKind.RevisionIncrementViolationError, (
                    f"revision {i.revision} does not follow this peer's last synced revision "
                    f"{last}; increment state.revision by exactly one per sync"))
        voters = [p for p in members if p not in excluded and inits[p].strategy != RECEIVE_ONLY]
        # Peers that never completed a sync in this run (fresh joiners) do not vote while
        # a peer that did is present: they would outvote the running state with their
        # step-0 tensors and roll it back. They receive the running state instead.
        veterans = [p for p in voters if p in ctx.last_revision]
        fresh = {p for p in voters if p not in ctx.last_revision} if veterans else set()
        voters = veterans or voters
        if not voters:
            for p in members:
                excluded.setdefault(p, (ErrorKind.NoSharedStateAvailableError, (
                    "no peer of the group offers shared state (all are RECEIVE_ONLY or "
                    "were refused)")))
            self._finish_plan(sync, members, excluded, {}, 0, out)
            return
        # 2. Popular revision (ties: the higher one).
        revs = Counter(inits[p].revision for p in voters)
        revision = max(revs, key=lambda r: (revs[r], r))
        # 3. Popular schema: the key set with dtypes and counts most voters share
        #    (ties: the schema of the earliest-joined voter).
        def schema(p: int) -> tuple[tuple[str, int, int], ...]:
            i = inits[p]
            return tuple(sorted(zip(i.keys, i.dtypes, i.counts)))

        schemas = Counter(schema(p) for p in voters)
        best = max(schemas.values())
        popular_schema = next(schema(p) for p in voters if schemas[schema(p)] == best)
        shape = {k: (d, c) for k, d, c in popular_schema}
        for p in members:
            if p in excluded:
                continue
            mine = {k: (d, c) for k, d, c in schema(p)}
            if mine != shape:
                missing = sorted(set(shape) - set(mine))
                extra = sorted(set(mine) - set(shape))
                differ = sorted(k for k in set(mine) & set(shape) if mine[k] != shape[k])
                key = (missing or extra or differ)[0]
                hint = (" (optimizer state that torch creates at the first step() is a "
                        "common cause: see 'Optimizer state' in docs/training.md)"
                        if missing or extra else "")
                excluded[p] = (ErrorKind.InvalidUsageError, (
                    f"shared state key {key!r} does not match the group's: missing {missing}, "
                    f"unexpected {extra}, different dtype/size {differ}{hint}"))
        voters = [p for p in voters if p not in excluded]
        # 4. Popular content per key (ties: the content of the earliest-joined holder).
        holders: dict[str, dict[bytes, list[int]]] = {}
        for p in voters:
            i = inits[p]
            for k, h in zip(i.keys, i.hashes):
                holders.setdefault(k, {}).setdefault(h, []).append(p)
        popular: dict[str, bytes] = {}
        for k, by_hash in holders.items():
            popular[k] = max(by_hash, key=lambda h: (len(by_hash[h]), -min(by_hash[h])))
        self._finish_plan(sync, members, excluded, popular, revision, out,
                          holders=holders, inits=inits, fresh=fresh)

    def _finish_plan(self, sync: Sync, members: list[int],
                     excluded: dict[int, tuple[ErrorKind, str]],
                     popular: dict[str, bytes], revision: int, out: list[Command], *,
                     holders: dict[str, dict[bytes, list[int]]] | None = None,
                     inits: dict[int, m.SyncInit] | None = None,
                     fresh: AbstractSet[int] = frozenset()) -> None:
        ctx = self.ctx
        for p, (kind, why) in excluded.items():
            out.append(Send(p, m.SyncOutcome(ok=False, kind=kind, message=why, revision=0)))
        participants = [p for p in members if p not in excluded]
        if not participants:
            del self.syncs[sync.group]
            return
        assert holders is not None and inits is not None
        sync.planned = True
        sync.revision = revision
        sync.participants = participants
        sync.participant_set = frozenset(participants)
        ctx.note("sync_planned", f"shared-state sync of group {sync.group} to revision "
                 f"{revision}: {len(participants)} peers", participants, sync.group, revision)
        stale = set(participants)
        ctx.links.transfer_tokens = {t: fh for t, fh in ctx.links.transfer_tokens.items()
                                     if fh[0] not in stale and fh[0] in ctx.peers}
        for n, p in enumerate(participants):
            i = inits[p]
            mine = dict(zip(i.keys, i.hashes))
            unequal = dict(zip(i.keys, i.unequal))
            keys: list[str] = []
            hashes: list[bytes] = []
            sources: list[list[int]] = []
            if i.strategy != SEND_ONLY:
                for k in sorted(popular):
                    if mine[k] == popular[k]:
                        continue
                    if unequal[k] and i.strategy != RECEIVE_ONLY and p not in fresh:
                        continue  # allowed to differ; only fresh receivers take it
                    srcs = holders[k][popular[k]]
                    # Rotate per fetcher and per key so the load spreads over sources;
                    # holders the fetcher can dial come first (the rest need the relay).
                    r = (n + len(keys)) % len(srcs)
                    srcs = srcs[r:] + srcs[:r]
                    srcs.sort(key=lambda s: not ctx.peers[s].reachable)
                    keys.append(k)
                    hashes.append(popular[k])
                    sources.append(srcs)
            ids = sorted({s for srcs in sources for s in srcs})
            relays = []
            for s in ids:
                token = b""
                if not ctx.peers[s].reachable and ctx.relay:
                    token = ctx.token(f"sync:{ctx.epoch}:{revision}:{p}:{s}")
                    ctx.links.transfer_tokens[token] = (p, s)
                relays.append(token)
            out.append(Send(p, m.SyncPlan(
                revision=revision, fetch_keys=keys, fetch_hashes=hashes, fetch_sources=sources,
                source_ids=ids, source_addrs=[ctx.peers[s].p2p_addr for s in ids],
                source_relays=relays, **ctx.keys(ids))))

    def on_done(self, peer: int, msg: m.SyncDone, out: list[Command]) -> None:
        ctx = self.ctx
        sync = self.syncs.get(ctx.peers[peer].peer_group)
        if sync is None or not sync.planned or peer not in sync.participant_set:
            return
        sync.reported.add(peer)
        if not msg.ok and sync.error is None:
            sync.error = (msg.kind or ErrorKind.PeerConnectionError, f"peer {peer}: {msg.message}")
        self._maybe_finish(sync, out)

    def on_withdraw(self, peer: int, out: list[Command]) -> None:
        """The peer's caller cancelled: no one may commit what it will not. Failing the
        sync at once (not after the others report) also sends the withdrawing peer the
        one outcome it waits for; a sync already decided has its outcome on the way."""
        ctx = self.ctx
        sync = self.syncs.get(ctx.peers[peer].peer_group)
        if sync is None or peer not in (sync.participant_set if sync.planned else sync.inits):
            return
        self.fail(sync, ErrorKind.CollectiveAbortedError, (
            f"peer {peer} cancelled its sync_shared_state(); nothing was committed, retry"),
                  out)

    def _maybe_finish(self, sync: Sync, out: list[Command]) -> None:
        ctx = self.ctx
        if not covers(sync.reported, sync.participant_set):
            return
        del self.syncs[sync.group]
        kind, why = sync.error or (ErrorKind.NONE, "")
        if sync.error is None:
            ctx.note("sync_done", f"shared-state sync of group {sync.group} committed "
                     f"revision {sync.revision}", sync.participants, sync.group,
                     sync.revision)
        else:
            ctx.note("sync_failed", f"shared-state sync of group {sync.group} to revision "
                     f"{sync.revision} failed: {kind}: {why}", sync.participants,
                     sync.group, sync.revision)
        for p in sync.participants:
            if sync.error is None:
                ctx.last_revision[p] = sync.revision
            out.append(Send(p, m.SyncOutcome(ok=sync.error is None, kind=kind, message=why,
                                             revision=sync.revision)))

    def _lose(self, peer: int, group: int, out: list[Command]) -> None:
        ctx = self.ctx
        sync = self.syncs.get(group)
        if sync is None:
            return
        sync.inits.pop(peer, None)
        if not sync.planned:
            if not sync.inits:
                del self.syncs[group]
                ctx.disarm(sync.deadline)
            else:
                self._maybe_plan(sync, out)
        elif peer in sync.participant_set:
            # The plan stands: a fetcher whose source it was moves on to the next holder
            # of the same content (or reports the failure), and the others commit only
            # if every remaining participant succeeds.
            sync.participants.remove(peer)
            sync.participant_set = sync.participant_set - {peer}
            sync.reported.discard(peer)
            self._maybe_finish(sync, out)

    # --- what the other sub-machines set off ------------------------------------------

    def on_peer_dropped(self, peer: int, rec: PeerRecord, out: list[Command]) -> None:
        if rec.status is PeerStatus.ACCEPTED:
            self._lose(peer, rec.peer_group, out)

    def on_vote_started(self, peer: int, group: int, what: str, out: list[Command]) -> None:
        sync = self.syncs.get(group)
        if sync is not None and not sync.planned:
            self.fail(sync, ErrorKind.CollectiveAbortedError, (
                f"peer {peer} called {what} while this peer called sync_shared_state(); "
                f"call {what} and retry"), out)

    def waiting(self) -> Iterable[tuple[int, Collection[int]]]:
        return [(sync.group, sync.inits) for sync in self.syncs.values() if not sync.planned]

    def on_deadline(self, what: SyncDeadline, did: int, advice: str,
                    out: list[Command]) -> None:
        sync = self.syncs.get(what.group)
        if sync is not None and sync.deadline == did and not sync.planned:
            late = self.ctx.missing(self.ctx.members(sync.group), sync.inits)
            self.fail(sync, ErrorKind.OperationTimeoutError, (
                f"sync_shared_state(): peers {late} did not join it in time; {advice}"), out)
