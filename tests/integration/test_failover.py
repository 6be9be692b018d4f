"""Several masters: the quorum rule that keeps two masters from both moving a group on
(pccl/master/state/quorum.py, quorum_filter), checked on the sans-IO master and
on a randomized model of two masters and peers moving between them; the peers' side
(which master they register with) is tested with real masters in
tests/system/test_failover_run.py."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from pccl.master.state import (
    ArmRecoveryTimer,
    Command,
    Disconnect,
    MasterState,
    PeerLost,
    PeerRegistered,
    PeerStatus,
    Received,
    RecoveryTimeout,
    Resume,
    RoundTimeout,
    Send,
)
from pccl.peer.state import FromMaster, PeerMachine, known_rings, without_leavers
from pccl.protocol import messages as m


def addr(pid: int) -> str:
    return f"10.1.0.{pid}:{7000 + pid}"


def join(st: MasterState, pid: int, masters: int = 2) -> list[Command]:
    return st.handle(PeerRegistered(pid, 0, addr(pid), masters=masters))


def resume(st: MasterState, pid: int, epoch: int, ring: Sequence[int],
           masters: int = 2) -> list[Command]:
    return st.handle(PeerRegistered(pid, 0, addr(pid), Resume(epoch, -1, tuple(ring)),
                                    masters=masters))


def report_all(st: MasterState) -> list[Command]:
    rnd = st.round
    assert rnd is not None
    out: list[Command] = []
    for p in list(rnd.members):
        out += st.handle(Received(p, m.P2PReport(epoch=rnd.epoch, failed=[])))
    return out


def run_of(n: int, **kwargs: object) -> MasterState:
    """Peers 1..n accepted in one group (peer 1 alone at epoch 1, the rest at 2), each
    saying it has two masters (quorums on unless ``quorum=False``)."""
    kwargs.setdefault("quorum", True)
    st = MasterState(mesh_max_bytes=0, token_key=bytes(32), **kwargs)  # type: ignore[arg-type]
    join(st, 1)
    report_all(st)
    for p in range(2, n + 1):
        join(st, p)
    if n > 1:
        st.handle(Received(1, m.UpdateTopology()))
        report_all(st)
    assert st.accepted() == list(range(1, n + 1))
    return st


def sent_away(out: list[Command]) -> list[int]:
    return sorted(c.peer_id for c in out if isinstance(c, Disconnect) and c.elsewhere)


def established(out: list[Command]) -> dict[int, list[int]]:
    return {c.peer_id: c.msg.ring for c in out
            if isinstance(c, Send) and isinstance(c.msg, m.EstablishP2P)}


def test_quorums_come_from_the_masters_configuration_never_from_a_hello() -> None:
    # Issue 36 (7): one hello saying "masters=2" used to turn quorums on for good, and a
    # single-master run then stopped when half its ring died, waiting for other masters.
    st = MasterState(mesh_max_bytes=0)
    join(st, 1, masters=1)
    assert not st.quorum_on
    join(st, 2, masters=3)
    assert not st.quorum_on
    assert MasterState(quorum=True).quorum_on
    assert MasterState(standby=True).quorum_on
    off = MasterState(quorum=False)
    off.handle(PeerRegistered(1, 0, addr(1), masters=2))
    assert not off.quorum_on


def test_repairs_go_on_while_a_majority_of_the_previous_ring_is_left() -> None:
    st = run_of(5)
    for dead, left in ((5, [1, 2, 3, 4]), (4, [1, 2, 3]), (3, [1, 2])):
        st.handle(PeerLost(dead, "heartbeat timeout"))
        assert st.round is not None and st.round.members == left
        report_all(st)
        assert st.rings[0] == left and st.lineage[0][1] == frozenset(left)
    # {1, 2} lose 2: 1 of 2 is no majority. Peer 1 is sent to its other masters (a
    # master there may hold peer 2 and, with it, the group).
    out = st.handle(PeerLost(2, "heartbeat timeout"))
    assert sent_away(out) == [1] and st.round is None and st.accepted() == []
    assert [n.kind for n in st.take_notes()].count("no_quorum") == 1


def test_losing_half_the_ring_at_once_stops_the_group_here() -> None:
    st = run_of(4)
    st.handle(PeerLost(4, "heartbeat timeout"))  # a repair of {1, 2, 3} starts
    out = st.handle(PeerLost(3, "heartbeat timeout"))  # {1, 2}: 2 of 4, not a majority
    assert sent_away(out) == [1, 2] and st.accepted() == [] and st.round is None
    assert st.lineage[0] == (2, frozenset({1, 2, 3, 4}))  # counted against later too
    # One of them comes back here alone: still no majority of that ring.
    resume(st, 1, 4, [1, 2, 3])
    assert st.round is None and st.recovery_awaiting == {2, 3}


def test_the_same_losses_with_one_master_repair_down_to_one_peer() -> None:
    st = run_of(4, quorum=False)
    st.handle(PeerLost(4, "heartbeat timeout"))
    out = st.handle(PeerLost(3, "heartbeat timeout"))
    assert sorted(established(out)) == [1, 2] and sent_away(out) == []


def test_peers_that_leave_gracefully_are_not_counted() -> None:
    st = run_of(5)
    for p in (5, 4, 3):
        st.handle(Received(p, m.Leave()))
    assert st.lineage[0][1] == frozenset({1, 2})
    assert st.round is not None and st.round.members == [1, 2]
    report_all(st)
    assert st.rings[0] == [1, 2]


def test_a_standby_takes_over_only_with_a_majority_of_the_old_ring() -> None:
    st = MasterState(mesh_max_bytes=0, token_key=bytes(32), quorum=True)
    # Two of the five peers of ring epoch 7 come here; the other three do not.
    assert resume(st, 2, 7, [1, 2, 3, 4, 5]) == [ArmRecoveryTimer(1)]
    assert st.held_groups() == [0]  # gathering: other peers of the group come here
    resume(st, 4, 7, [1, 2, 3, 4, 5])
    out = st.handle(RecoveryTimeout(1))
    assert sent_away(out) == [2, 4] and established(out) == {}
    assert st.held_groups() == []

    st = MasterState(mesh_max_bytes=0, token_key=bytes(32), quorum=True)
    resume(st, 2, 7, [1, 2, 3, 4, 5])
    resume(st, 4, 7, [1, 2, 3, 4, 5])
    resume(st, 5, 6, [1, 2, 3, 4, 5])  # (saw an older epoch: still of that ring)
    out = st.handle(RecoveryTimeout(1))
    assert established(out) == {p: [2, 4, 5] for p in (2, 4, 5)}
    assert st.round is not None and st.round.epoch == 8  # after every epoch reported
    report_all(st)
    assert st.lineage[0] == (8, frozenset({2, 4, 5}))


def test_graceful_leaves_do_not_count_against_the_quorum_of_a_take_over() -> None:
    # docs/semantics.md's plan (issue 36): three of six peers leave gracefully, then the
    # master dies before installing a ring without them. The survivors learnt who left
    # (WorldInfo.left) and report the ring without the leavers, so the standby takes
    # the group over with 3 of the 3 peers still in it (3 of 6 is no majority).
    a = run_of(6, repair_rings=False)
    epoch = a.ring_epochs[0]
    worlds: list[m.WorldInfo] = []
    for leaver in (4, 5, 6):
        out = a.handle(Received(leaver, m.Leave()))
        worlds += [c.msg for c in out if isinstance(c, Send) and c.peer_id == 1
                   and isinstance(c.msg, m.WorldInfo)]
    assert worlds[-1].left == [4, 5, 6] and worlds[-1].left_epoch == epoch
    survivor = PeerMachine()
    survivor.installed = (epoch, [1, 2, 3, 4, 5, 6])
    for w in worlds:
        survivor.handle(FromMaster(w))
    (base_epoch, base), more = survivor.resume_base()
    assert (base_epoch, base, more) == (epoch, [1, 2, 3], [])

    b = MasterState(mesh_max_bytes=0, token_key=bytes(32), standby=True)
    out = []
    for p in (1, 2, 3):  # (all of that ring came back: no need to wait for the rest)
        out += b.handle(PeerRegistered(p, 0, addr(p), Resume(epoch, -1, tuple(base), p,
                                                             epoch, tuple(base)), masters=2))
    assert established(out) == {p: [1, 2, 3] for p in (1, 2, 3)} and not sent_away(out)

    # Without the leavers' names the same survivors are no majority of the ring.
    c = MasterState(mesh_max_bytes=0, token_key=bytes(32), standby=True)
    for p in (1, 2, 3):
        c.handle(PeerRegistered(p, 0, addr(p), Resume(epoch, -1, (1, 2, 3, 4, 5, 6), p,
                                                      epoch, (1, 2, 3, 4, 5, 6)), masters=2))
    assert sent_away(c.handle(RecoveryTimeout(1))) == [1, 2, 3]


def test_a_proposal_counted_against_the_installed_epoch_gives_the_ring_without_leavers() -> None:
    proposal = m.EstablishP2P(epoch=9, ring=[1, 2, 3], next_id=2, next_addr="x:1",
                              quorum_epochs=[8], quorum_rings=[[1, 2, 3]])
    assert known_rings((8, [1, 2, 3, 4, 5, 6]), proposal) == ((8, [1, 2, 3]), [(9, [1, 2, 3])])


def test_quorum_counts_the_ids_peers_had_at_their_old_master() -> None:
    # Peer 9 here was peer 3 there (its old id was taken): it counts as 3.
    st = MasterState(mesh_max_bytes=0, token_key=bytes(32), quorum=True)
    st.handle(PeerRegistered(9, 0, addr(9), Resume(7, -1, (1, 2, 3), peer_id=3), masters=2))
    out = st.handle(PeerRegistered(1, 0, addr(1), Resume(7, -1, (1, 2, 3)), masters=2))
    st.handle(RecoveryTimeout(1))
    assert sent_away(out) == []
    assert st.round is not None and st.round.members == [1, 9]


def test_a_peer_bringing_a_newer_proposal_waits_until_the_epochs_pass_it() -> None:
    # This master took the group over at epoch 8 from {3, 4, 5}. Peer 1 comes from the
    # old master, which had proposed (never installed) {1, 2, 3} up to epoch 12.
    st = MasterState(mesh_max_bytes=0, token_key=bytes(32), quorum=True)
    for p in (3, 4, 5):
        resume(st, p, 7, [1, 2, 3, 4, 5])
    st.handle(RecoveryTimeout(1))
    report_all(st)
    assert st.lineage[0] == (8, frozenset({3, 4, 5}))
    resume(st, 1, 12, [1, 2, 3])
    out: list[Command] = []
    for p in (3, 4, 5):
        out += st.handle(Received(p, m.UpdateTopology()))
    # Its ring may have been installed for all this master knows, and 1 of 3 is here:
    # peer 1 goes; the group goes on, past epoch 12.
    assert sent_away(out) == [1]
    assert st.round is not None and st.round.epoch == 13 and st.round.members == [3, 4, 5]
    report_all(st)
    # Now its proposal is older than this master's ring: it joins as anyone would.
    resume(st, 1, 12, [1, 2, 3])
    for p in (3, 4, 5):
        st.handle(Received(p, m.UpdateTopology()))
    report_all(st)
    assert st.peers[1].status is PeerStatus.ACCEPTED and st.rings[0] == [1, 3, 4, 5]


# --- two masters, peers moving between them at random -------------------------------


class _Peer:
    def __init__(self, name: int) -> None:
        self.name = name
        self.at: int | None = None  # the master it is connected to
        self.gen = 0  # its connections so far (messages of older ones are lost)
        self.proposed: m.EstablishP2P | None = None
        self.installed: tuple[int, tuple[int, ...]] = (0, ())


class TwoMasters:
    """Masters 0 and 1 and ``n`` peers. Peers register with either master (a partition
    decides which one they reach), lose their connection at random, and answer every
    ring proposal after a random delay; the masters' commits (installed rings) are
    recorded. Peer ids are the peers' names (the server gives an old id back)."""

    def __init__(self, n: int, seed: int) -> None:
        self.rng = random.Random(seed)
        # Master 1 is a standby: it starts no group of its own.
        self.masters = [MasterState(mesh_max_bytes=0, token_key=bytes(32), quorum=True,
                                    standby=bool(i)) for i in range(2)]
        self.peers = {p: _Peer(p) for p in range(1, n + 1)}
        # (master, peer name, peer connection generation, event) still to be delivered
        self.inflight: list[tuple[int, int, int, object]] = []
        self.timers: list[tuple[int, object]] = []
        self.to_peers: list[tuple[int, int, int, int]] = []  # topology_updated in flight
        self.commits: list[tuple[int, int, frozenset[int]]] = []  # (epoch, master, ring)
        self.sent_away = 0

    def feed(self, mi: int, event: object) -> None:
        st = self.masters[mi]
        before = st.ring_epochs.get(0)
        out = st.handle(event)  # type: ignore[arg-type]
        if st.ring_epochs.get(0) != before and 0 in st.rings:
            self.commits.append((st.ring_epochs[0], mi, frozenset(st.rings[0])))
        for c in out:
            if isinstance(c, Send) and isinstance(c.msg, m.EstablishP2P):
                peer = self.peers[c.peer_id]
                if peer.at == mi and (peer.proposed is None
                                      or c.msg.epoch > peer.proposed.epoch):
                    peer.proposed = c.msg  # recorded before answering
                self.inflight.append((mi, c.peer_id, peer.gen, Received(
                    c.peer_id, m.P2PReport(epoch=c.msg.epoch, failed=[]))))
            elif isinstance(c, Send) and isinstance(c.msg, m.TopologyUpdated):
                # Reaches the peer later, or never (a loss first): it may have answered a
                # proposal that was installed without ever hearing so.
                peer = self.peers[c.peer_id]
                self.to_peers.append((mi, c.peer_id, peer.gen, c.msg.epoch))
            elif isinstance(c, Disconnect):
                peer = self.peers[c.peer_id]
                if peer.at == mi:
                    self.sent_away += c.elsewhere
                    peer.at = None
                    peer.gen += 1
            elif isinstance(c, ArmRecoveryTimer):
                self.timers.append((mi, RecoveryTimeout(c.recovery_id)))

    def register(self, p: int, mi: int) -> None:
        peer = self.peers[p]
        peer.at, peer.gen = mi, peer.gen + 1
        res = None
        prop = peer.proposed
        if prop is not None:  # what a real peer reports (PeerMachine.resume_base)
            (base_epoch, base), more = known_rings(
                (peer.installed[0], list(peer.installed[1])), prop)
            res = Resume(prop.epoch, -1, tuple(prop.ring), p, base_epoch, tuple(base),
                         tuple((e, tuple(r)) for e, r in more))
        self.feed(mi, PeerRegistered(p, 0, addr(p), res, masters=2))

    def lose(self, p: int) -> None:
        peer = self.peers[p]
        assert peer.at is not None
        mi, peer.at, peer.gen = peer.at, None, peer.gen + 1
        self.feed(mi, PeerLost(p, "connection lost"))

    def step(self) -> None:
        rng = self.rng
        roll = rng.random()
        idle = [p for p in self.peers.values() if p.at is None]
        if idle and roll < 0.25:
            self.register(rng.choice(idle).name, rng.randrange(2))
        elif roll < 0.37:
            busy = [p for p in self.peers.values() if p.at is not None]
            if busy:
                self.lose(rng.choice(busy).name)
        elif roll < 0.47:
            mi = rng.randrange(2)
            st = self.masters[mi]
            if st.pending():
                for p in st.accepted():
                    self.inflight.append((mi, p, self.peers[p].gen,
                                          Received(p, m.UpdateTopology())))
        elif roll < 0.52:
            mi = rng.randrange(2)
            rnd = self.masters[mi].round
            if rnd is not None:
                self.feed(mi, RoundTimeout(rnd.epoch))
        elif roll < 0.57 and self.timers:
            self.feed(*self.timers.pop(rng.randrange(len(self.timers))))
        elif roll < 0.67 and self.to_peers:
            mi, p, gen, epoch = self.to_peers.pop(rng.randrange(len(self.to_peers)))
            peer, prop = self.peers[p], self.peers[p].proposed
            if peer.at == mi and peer.gen == gen and prop is not None and prop.epoch == epoch:
                peer.installed = max(peer.installed, (prop.epoch, tuple(prop.ring)))
        elif self.inflight:
            mi, p, gen, ev = self.inflight.pop(rng.randrange(len(self.inflight)))
            peer = self.peers[p]
            if peer.at == mi and peer.gen == gen and p in self.masters[mi].peers:
                self.feed(mi, ev)

    def check(self) -> None:
        """Installed rings form one chain: epochs never repeat across the masters, and
        each ring keeps a majority of the one installed before it."""
        epochs = [e for e, _, _ in self.commits]
        assert len(set(epochs)) == len(epochs), self.commits
        chain = sorted(self.commits, key=lambda c: c[0])
        for (e0, m0, r0), (e1, m1, r1) in zip(chain, chain[1:]):
            assert 2 * len(r0 & r1) > len(r0), (
                f"ring {sorted(r1)} (epoch {e1}, master {m1}) keeps no majority of ring "
                f"{sorted(r0)} (epoch {e0}, master {m0})")


@pytest.mark.parametrize("seed", range(40))
def test_two_masters_never_fork_a_group(seed: int) -> None:
    model = TwoMasters(5, seed)
    for p in model.peers:
        model.register(p, 0)
    for _ in range(3000):
        model.step()
        model.check()
    assert model.commits  # (the schedule did something)


def test_the_random_schedules_take_groups_over_and_send_peers_away() -> None:
    """The property above is not vacuous: across the seeds, both masters install
    rings and quorums turn peers away."""
    by_master = [0, 0]
    away = 0
    for seed in range(40):
        model = TwoMasters(5, seed)
        for p in model.peers:
            model.register(p, 0)
        for _ in range(3000):
            model.step()
        for _, mi, _ in model.commits:
            by_master[mi] += 1
        away += model.sent_away
    assert by_master[0] > 0 and by_master[1] > 0 and away > 0


def test_without_quorums_the_same_model_forks() -> None:
    """The check catches a fork: with quorum counting off, some schedule installs two
    rings that share no majority."""
    for seed in range(40):
        model = TwoMasters(5, seed)
        for st in model.masters:
            st.quorum, st.standby = False, False
        for p in model.peers:
            model.register(p, 0)
        try:
            for _ in range(3000):
                model.step()
                model.check()
        except AssertionError:
            return
    pytest.fail("no schedule forked the group without quorums")


# --- the peer's side ------------------------------------------------------------------


def test_master_lists() -> None:
    from pccl import InvalidArgumentError
    from pccl.peer.options import master_addresses

    assert master_addresses("10.0.0.1:48148") == ("10.0.0.1:48148",)
    assert master_addresses("a:1, b:2") == ("a:1", "b:2")  # as PCCL_MASTER carries them
    assert master_addresses(["a:1", "[::1]:2"]) == ("a:1", "[::1]:2")
    for bad, why in (("a:1,a:1", "twice"), ("a:1,b", "no valid port"), ([], "give 1 to"),
                     ([f"h:{p}" for p in range(1, 18)], "give 1 to"), (5, "string or")):
        with pytest.raises(InvalidArgumentError, match=why):
            master_addresses(bad)
    import pccl
    # (Masters on other machines and no secret: allow_anonymous=True says so.)
    comm = pccl.Communicator(master="a:1,b:2", allow_anonymous=True)
    assert comm.masters == ("a:1", "b:2") and comm.master == "a:1,b:2"


def test_a_peer_reports_the_rings_that_may_have_been_installed() -> None:
    from pccl.peer import state as ps

    mach = ps.PeerMachine()
    mach.handle(ps.Welcomed(4))
    proposal = m.EstablishP2P(epoch=9, ring=[2, 4, 6], next_id=6, next_addr="x:1",
                              quorum_epochs=[7, 8], quorum_rings=[[2, 4, 5], [2, 4, 5, 6]])
    mach.handle(ps.FromMaster(proposal))
    # Counted against ring 7 (installed) and 8 (maybe): 8 and the proposal may be.
    assert mach.resume_base() == ((7, [2, 4, 5]), [(8, [2, 4, 5, 6]), (9, [2, 4, 6])])
    mach.handle(ps.FromMaster(m.WorldInfo(epoch=9, ring=[2, 4, 6], global_world_size=3,
                                          peer_group_world_size=3, num_peer_groups=1,
                                          largest_peer_group_world_size=3)))
    mach.handle(ps.FromMaster(m.TopologyUpdated(epoch=9)))
    assert mach.resume_base() == ((9, [2, 4, 6]), [])  # heard it was installed
    # An older proposal (a late message) changes nothing.
    mach.handle(ps.FromMaster(m.EstablishP2P(epoch=8, ring=[1], next_id=-1, next_addr="")))
    assert mach.resume_base() == ((9, [2, 4, 6]), [])


def test_leavers_are_taken_out_of_their_own_ring_only() -> None:
    # A later ring was made without them; an id there belongs to someone else (a
    # restarted master hands ids out again): it must still count.
    left = (8, frozenset({4, 5}))
    assert without_leavers((8, [1, 2, 3, 4, 5]), left) == (8, [1, 2, 3])
    assert without_leavers((9, [1, 2, 4]), left) == (9, [1, 2, 4])
    assert without_leavers((7, [1, 4]), left) == (7, [1, 4])
