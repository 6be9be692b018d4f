"""The peer's sans-IO state machine (pccl/peer/state.py), without sockets or clocks."""

from __future__ import annotations

import pytest

from pccl.errors import ErrorKind
from pccl.peer import state as ps
from pccl.protocol import messages as m


def cmds(machine: ps.PeerMachine, *events: ps.Event) -> list[ps.Command]:
    out: list[ps.Command] = []
    for ev in events:
        out += machine.handle(ev)
    return out


def sent(commands: list[ps.Command]) -> list[m.Message]:
    return [c.msg for c in commands if isinstance(c, ps.Send)]


def world(ring: list[int], epoch: int) -> m.WorldInfo:
    return m.WorldInfo(epoch=epoch, ring=ring, global_world_size=len(ring),
                       peer_group_world_size=len(ring), num_peer_groups=1,
                       largest_peer_group_world_size=len(ring))


def accepted(peer_id: int = 2, ring: list[int] | None = None, epoch: int = 1
             ) -> ps.PeerMachine:
    mc = ps.PeerMachine()
    ring = ring or [1, 2, 3]
    out = cmds(mc, ps.Welcomed(peer_id), ps.FromMaster(world(ring, epoch)),
               ps.FromMaster(m.TopologyUpdated(epoch=epoch)))
    install = [c for c in out if isinstance(c, ps.InstallRing)]
    assert install and install[0].epoch == epoch
    out = mc.handle(ps.RingInstalled(epoch, mc.generation))
    assert ps.Resolve(ps.ACCEPT) in out
    return mc


def init(tag: int = 0) -> m.CollectiveInit:
    return m.CollectiveInit(tag=tag, kind="all_reduce", dtype=4, count=10, op=0,
                            quant_algorithm=0, quant_dtype=0)


def perform(tag: int = 0, epoch: int = 1, op_id: int = 7, world_: int = 3
            ) -> ps.FromMaster:
    return ps.FromMaster(m.CollectivePerform(tag=tag, op_id=op_id, epoch=epoch, rank=1,
                                             world=world_))


def test_admission_installs_the_ring_between_the_neighbours() -> None:
    mc = ps.PeerMachine()
    assert mc.usable() is not None
    out = cmds(mc, ps.Welcomed(2), ps.FromMaster(world([1, 2, 3], 4)),
               ps.FromMaster(m.TopologyUpdated(epoch=4, mesh_max_bytes=4096)))
    assert mc.status is ps.Status.REGISTERED
    # The ring's order goes with the install, and the master's mesh limit of the epoch.
    assert ps.InstallRing(4, 3, 1, 1, (1, 2, 3), 4096) in out
    assert not any(isinstance(c, ps.Resolve) for c in out)  # not before the links are up
    assert cmds(mc, ps.RingInstalled(4, 1)) == [ps.Resolve(ps.ACCEPT)]
    assert mc.status is ps.Status.ACCEPTED and mc.ring_epoch == 4 and mc.usable() is None


@pytest.mark.parametrize(("sent", "order", "limit"), [
    ([3, 1, 2], (3, 1, 2), 4096),  # the master's own mesh order goes to the install
    ([1, 2, 4], (1, 2, 3), 0),  # not an order of the ring: no mesh, the ring's order
    ([1, 2], (1, 2, 3), 0),
])
def test_the_mesh_order_from_the_master_goes_to_the_install(sent, order, limit) -> None:
    mc = ps.PeerMachine()
    out = cmds(mc, ps.Welcomed(2), ps.FromMaster(world([1, 2, 3], 4)),
               ps.FromMaster(m.TopologyUpdated(epoch=4, mesh_max_bytes=4096,
                                               mesh_order=sent)))
    assert ps.InstallRing(4, 3, 1, 1, order, limit) in out
    logged = [c for c in out if isinstance(c, ps.Log)]
    assert bool(logged) == (limit == 0)
    assert all("not an order of the ring" in c.message for c in logged)


def test_a_failed_install_fails_the_admission() -> None:
    mc = ps.PeerMachine()
    cmds(mc, ps.Welcomed(2), ps.FromMaster(world([1, 2], 1)),
         ps.FromMaster(m.TopologyUpdated(epoch=1)))
    (fail,) = mc.handle(ps.RingInstalled(1, 1, "peer 1 refused"))
    assert isinstance(fail, ps.Fail) and fail.waiter == ps.ACCEPT
    assert fail.kind is ErrorKind.UpdateTopologyFailedError and "peer 1 refused" in fail.message
    assert mc.status is ps.Status.REGISTERED


def test_an_all_reduce_runs_reports_and_hears_one_outcome() -> None:
    mc = accepted()
    assert sent(mc.handle(ps.StartCollective(init()))) == [init()]
    out = mc.handle(perform())
    p = m.CollectivePerform(tag=0, op_id=7, epoch=1, rank=1, world=3)
    assert out == [ps.RunRing(0, p, armed=True)]
    assert mc.collectives[0].phase is ps.CollectivePhase.RUNNING
    assert sent(mc.handle(ps.RingDone(0, True))) == [
        m.CollectiveDone(tag=0, op_id=7, ok=True, kind=ErrorKind.NONE, message="")]
    outcome = m.CollectiveOutcome(tag=0, op_id=7, ok=True, kind=ErrorKind.NONE, message="")
    # The group's success: the ring's result is committed, then the call answered.
    assert mc.handle(ps.FromMaster(outcome)) == [
        ps.Commit(0), ps.Resolve(ps.reduce_of(0), ps.Reduced(3, "ring"))]
    # A duplicate outcome answers nothing: every call is answered once.
    assert mc.handle(ps.FromMaster(outcome)) == []
    assert not mc.collectives and not mc.waiting


def test_a_failed_outcome_rolls_the_input_back_before_failing_the_call() -> None:
    mc = accepted()
    cmds(mc, ps.StartCollective(init()), perform(), ps.RingDone(0, True))
    out = mc.handle(ps.FromMaster(m.CollectiveOutcome(
        tag=0, op_id=7, ok=False, kind=ErrorKind.PeerConnectionError, message="peer 3 died")))
    assert out == [ps.Rollback(0), ps.Fail(ps.reduce_of(0), ErrorKind.PeerConnectionError,
                                           "peer 3 died")]
    assert not mc.collectives and not mc.waiting


def test_an_outcome_while_the_ring_runs_settles_once_the_op_ended() -> None:
    """Called off while its ring op runs: the op is stopped, and only once it has ended is
    the input put back and the call failed (never while the ring still writes)."""
    mc = accepted()
    cmds(mc, ps.StartCollective(init()), perform())
    out = mc.handle(ps.FromMaster(m.CollectiveOutcome(
        tag=0, op_id=-1, ok=False, kind=ErrorKind.OperationTimeoutError, message="late")))
    assert out == [ps.AbortRing(0)]
    assert ps.reduce_of(0) in mc.waiting
    out = mc.handle(ps.RingDone(0, False, ErrorKind.CollectiveAbortedError, "aborted"))
    assert out == [ps.Rollback(0), ps.Fail(ps.reduce_of(0), ErrorKind.OperationTimeoutError,
                                           "late")]


def test_an_outcome_before_the_perform_fails_both_waiters_with_its_kind() -> None:
    mc = accepted()
    mc.handle(ps.StartCollective(init(3)))
    out = mc.handle(ps.FromMaster(m.CollectiveOutcome(
        tag=3, op_id=-1, ok=False, kind=ErrorKind.InvalidUsageError, message="mismatch")))
    assert out == [ps.Fail(ps.reduce_of(3), ErrorKind.InvalidUsageError, "mismatch")]


def test_a_perform_on_a_ring_being_installed_waits_for_the_install() -> None:
    mc = accepted()
    mc.handle(ps.StartCollective(init()))
    out = cmds(mc, ps.FromMaster(world([1, 2], 2)),
               ps.FromMaster(m.TopologyUpdated(epoch=2, repair=True)))
    assert ps.InstallRing(2, 1, 1, 1, (1, 2)) in out
    assert mc.handle(perform(epoch=2, world_=2)) == []
    assert mc.collectives[0].phase is ps.CollectivePhase.WAIT_INSTALL
    out = mc.handle(ps.RingInstalled(2, 1))
    assert [type(c) for c in out] == [ps.RunRing]


def test_a_round_of_an_epoch_being_installed_waits_for_that_install() -> None:
    """The master repaired the ring (epoch 2) and the peers' own update_topology() round
    ends on that same epoch before its install finished here: one install, and it
    answers both (a second would close the first one's links and find no pools)."""
    mc = accepted()
    out = cmds(mc, ps.FromMaster(world([1, 2], 2)),
               ps.FromMaster(m.TopologyUpdated(epoch=2, repair=True)))
    assert [c for c in out if isinstance(c, ps.InstallRing)] == [
        ps.InstallRing(2, 1, 1, 1, (1, 2))]
    mc.handle(ps.StartTopology(0.0))
    out = mc.handle(ps.FromMaster(m.TopologyUpdated(epoch=2)))
    assert not any(isinstance(c, ps.InstallRing) for c in out)
    assert ps.Resolve(ps.UPDATE) not in out  # not before the links are up
    out = mc.handle(ps.RingInstalled(2, mc.generation))
    assert ps.Resolve(ps.UPDATE) in out
    assert mc.ring_epoch == 2 and not mc.installs and not mc.installing
    # A later epoch installs again.
    out = cmds(mc, ps.FromMaster(world([1, 2], 3)),
               ps.FromMaster(m.TopologyUpdated(epoch=3, repair=True)))
    assert ps.InstallRing(3, 1, 1, 1, (1, 2)) in out


def test_a_perform_on_a_ring_that_is_not_here_fails_this_peers_part() -> None:
    mc = accepted()
    mc.handle(ps.StartCollective(init()))
    out = mc.handle(perform(epoch=9))
    (done,) = sent(out)
    assert isinstance(done, m.CollectiveDone) and not done.ok
    assert done.kind is ErrorKind.PeerConnectionError and "epoch 9" in done.message
    assert not any(isinstance(c, ps.RunRing) for c in out)


def test_a_ring_of_one_reports_done_without_a_ring() -> None:
    mc = accepted(1, [1])
    mc.handle(ps.StartCollective(init()))
    out = mc.handle(perform(world_=1))
    assert not any(isinstance(c, ps.RunRing) for c in out)
    assert sent(out)[0].ok  # type: ignore[attr-defined]
    out = mc.handle(ps.FromMaster(m.CollectiveOutcome(tag=0, op_id=7, ok=True,
                                                      kind=ErrorKind.NONE, message="")))
    assert out == [ps.Commit(0, local=True), ps.Resolve(ps.reduce_of(0), ps.Reduced(1, "local"))]


def test_the_master_calling_a_running_collective_off_aborts_its_ring() -> None:
    mc = accepted()
    mc.handle(ps.StartCollective(init()))
    mc.handle(perform())
    out = mc.handle(ps.FromMaster(m.CollectiveAbort(tag=0, op_id=7, message="peer lost")))
    assert out == [ps.AbortRing(0)]


@pytest.mark.parametrize("performed", [False, True])
def test_a_cancelled_collective_withdraws(performed: bool) -> None:
    mc = accepted()
    mc.handle(ps.StartCollective(init()))
    if performed:
        mc.handle(perform())
    out = mc.handle(ps.Cancelled(ps.reduce_of(0)))
    (done,) = sent(out)
    assert isinstance(done, m.CollectiveDone) and not done.ok
    assert done.kind is ErrorKind.CollectiveAbortedError
    assert done.op_id == (7 if performed else -1)
    assert (ps.AbortRing(0) in out) is performed
    cancelled = ps.Fail(ps.reduce_of(0), ErrorKind.CollectiveAbortedError,
                        "cancelled by the caller")
    if not performed:
        assert cancelled in out and not mc.waiting  # ended at once
        return
    # Running: it ends once its ring op stopped, with the input put back.
    assert ps.reduce_of(0) in mc.waiting
    out = mc.handle(ps.RingDone(0, False, ErrorKind.CollectiveAbortedError, "aborted"))
    assert out == [ps.Rollback(0), cancelled]


@pytest.mark.parametrize("decided_ok", [True, False])
def test_a_caller_giving_up_after_reporting_still_applies_what_the_group_decided(
        decided_ok: bool) -> None:
    """Cancelled after this peer reported its part done: the group may have decided
    already. A success decided before the withdrawal is committed here too (the group
    must not differ), yet the call still ends as cancelled."""
    mc = accepted()
    cmds(mc, ps.StartCollective(init()), perform(), ps.RingDone(0, True))
    out = mc.handle(ps.Cancelled(ps.reduce_of(0)))
    assert [type(c) for c in out] == [ps.Send] and ps.reduce_of(0) in mc.waiting
    out = mc.handle(ps.FromMaster(m.CollectiveOutcome(
        tag=0, op_id=7, ok=decided_ok, kind=ErrorKind.NONE if decided_ok
        else ErrorKind.CollectiveAbortedError, message="")))
    applied = ps.Commit(0) if decided_ok else ps.Rollback(0)
    assert out == [applied, ps.Fail(ps.reduce_of(0), ErrorKind.CollectiveAbortedError,
                                    "cancelled by the caller")]


def test_a_cancelled_call_whose_outcome_never_comes_expires_leaving_the_input() -> None:
    mc = accepted()
    cmds(mc, ps.StartCollective(init()), perform(), ps.RingDone(0, True),
         ps.Cancelled(ps.reduce_of(0)))
    out = mc.handle(ps.CallExpired(ps.reduce_of(0)))
    assert [type(c) for c in out] == [ps.Log, ps.Rollback, ps.Fail]
    assert not mc.collectives and not mc.waiting


def test_calls_the_protocol_forbids_are_refused_with_their_kind() -> None:
    mc = accepted()
    mc.handle(ps.StartCollective(init(1)))
    with pytest.raises(ps.ProtocolViolation) as e:
        mc.handle(ps.StartCollective(init(1)))
    assert e.value.kind is ErrorKind.InvalidUsageError
    with pytest.raises(ps.ProtocolViolation) as e:
        mc.handle(ps.StartTopology(0.0))
    assert e.value.kind is ErrorKind.PendingAsyncOpsError
    mc.handle(ps.Cancelled(ps.reduce_of(1)))
    mc.handle(ps.StartTopology(0.0))
    with pytest.raises(ps.ProtocolViolation) as e:
        mc.handle(ps.StartTopology(0.0, optimize=True))
    assert e.value.kind is ErrorKind.InvalidUsageError
    with pytest.raises(ps.ProtocolViolation) as e:
        mc.handle(ps.StartCollective(init(2)))
    assert e.value.kind is ErrorKind.InvalidUsageError
    mc.handle(ps.AskPending(mc.new_request(), True, 0.0))
    with pytest.raises(ps.ProtocolViolation):
        mc.handle(ps.AskPending(mc.new_request(), True, 0.0))
    # The quick look is not a collective: any number may be asked.
    mc.handle(ps.AskPending(mc.new_request(), False, 0.0))


def test_topology_failures_carry_their_kind() -> None:
    mc = accepted()
    mc.handle(ps.StartTopology(0.0, optimize=True))
    (fail,) = mc.handle(ps.FromMaster(m.OptimizeFailed(message="peer 3 lost")))
    assert isinstance(fail, ps.Fail)
    assert fail.kind is ErrorKind.TopologyOptimizationFailedError
    mc.handle(ps.EndTopology())
    mc.handle(ps.StartTopology(0.0))
    (fail,) = mc.handle(ps.FromMaster(m.ErrorReply(kind=ErrorKind.InvalidUsageError,
                                                   message="not accepted")))
    assert isinstance(fail, ps.Fail) and fail.kind is ErrorKind.InvalidUsageError


def test_losing_the_master_fails_every_waiter_and_rejoins_keeping_the_calls_waiting() -> None:
    mc = accepted()
    mc.handle(ps.StartCollective(init()))
    mc.handle(perform())
    req = mc.new_request()
    mc.handle(ps.AskPending(req, True, 0.0))
    out = mc.handle(ps.MasterLost("no word from the master for 5s"))
    fails = {c.waiter for c in out if isinstance(c, ps.Fail)}
    assert fails == {ps.query_of(req)}  # the all-reduce: once its ring op stopped
    assert all(c.kind is ErrorKind.MasterConnectionError for c in out if isinstance(c, ps.Fail))
    assert ps.AbortRing(0) in out and ps.Rejoin() in out
    assert mc.status is ps.Status.RECONNECTING and ps.REJOIN in mc.waiting
    assert mc.usable() is not None
    # Nothing is sent while the master is lost; the call ends with its input put back.
    out = mc.handle(ps.RingDone(0, True))
    assert out == [ps.Rollback(0), ps.Fail(ps.reduce_of(0), ErrorKind.MasterConnectionError,
                                           "no word from the master for 5s")]
    # Registering again: the resume says what this peer held.
    assert mc.resume() == (2, 1, -1, [1, 2, 3])
    out = cmds(mc, ps.Welcomed(2), ps.FromMaster(world([1, 2, 3], 1)),
               ps.FromMaster(m.TopologyUpdated(epoch=1)))
    assert ps.Resolve(ps.ACCEPT) in out and ps.Resolve(ps.REJOIN) in out
    assert mc.status is ps.Status.ACCEPTED and mc.reconnects == 1


def test_a_failed_registration_attempt_keeps_the_calls_waiting_for_the_rejoin() -> None:
    mc = accepted()
    mc.handle(ps.MasterLost("reset"))
    mc.handle(ps.Welcomed(2))
    out = mc.handle(ps.MasterLost("reset again"))
    assert [c.waiter for c in out if isinstance(c, ps.Fail)] == [ps.ACCEPT]
    assert ps.REJOIN in mc.waiting and ps.Rejoin() not in out
    (fail,) = mc.handle(ps.RejoinFailed("gave up after 60s"))
    assert isinstance(fail, ps.Fail) and fail.waiter == ps.REJOIN


def test_results_of_an_older_master_connection_are_void() -> None:
    mc = accepted()
    establish = m.EstablishP2P(epoch=2, ring=[1, 2, 3], next_id=3, next_addr="h:1")
    (cmd,) = mc.handle(ps.FromMaster(establish))
    assert cmd == ps.Establish(establish, 1)
    mc.handle(ps.MasterLost("reset"))
    mc.handle(ps.Welcomed(2))
    assert mc.handle(ps.PoolsEstablished(2, 1, ())) == []  # generation 1 is gone
    assert sent(mc.handle(ps.PoolsEstablished(2, 2, (3,)))) == [
        m.P2PReport(epoch=2, failed=[3])]


def test_a_reject_or_garbage_from_the_master_loses_it() -> None:
    for msg in (m.Reject(kind=ErrorKind.ProtocolError, message="bad"),
                m.Hello(version=1, peer_group=0, p2p_port=1, p2p_host="", nonce=b"",
                        mac=b"", resume_peer_id=0, resume_epoch=0, resume_revision=-1,
                        resume_peers=[])):
        mc = accepted()
        out = mc.handle(ps.FromMaster(msg))
        assert ps.Rejoin() in out and not mc.connected


def test_a_sync_plans_fetches_reports_and_commits() -> None:
    mc = accepted()
    sync_init = m.SyncInit(revision=3, strategy=0, keys=["w"], dtypes=[4], counts=[1],
                           hashes=[b"h"], unequal=[False])
    assert sent(mc.handle(ps.StartSync(sync_init))) == [sync_init]
    with pytest.raises(ps.ProtocolViolation):
        mc.handle(ps.StartSync(sync_init))
    plan = m.SyncPlan(revision=3, fetch_keys=["w"], fetch_hashes=[b"x"], fetch_sources=[[1]],
                      source_ids=[1], source_addrs=["h:1"])
    assert mc.handle(ps.FromMaster(plan)) == [ps.Fetch(plan)]
    assert sent(mc.handle(ps.Fetched(True))) == [
        m.SyncDone(ok=True, kind=ErrorKind.NONE, message="")]
    outcome = m.SyncOutcome(ok=True, kind=ErrorKind.NONE, message="", revision=3)
    assert mc.handle(ps.FromMaster(outcome)) == [ps.CommitSync(3), ps.Resolve(ps.SYNC, outcome)]
    assert mc.sync is None and not mc.waiting and mc.last_revision == 3


def test_a_sync_whose_fetch_failed_commits_nothing() -> None:
    mc = accepted()
    mc.handle(ps.StartSync(m.SyncInit(revision=3, strategy=0, keys=["w"], dtypes=[4],
                                      counts=[1], hashes=[b"h"], unequal=[False])))
    plan = m.SyncPlan(revision=3, fetch_keys=["w"], fetch_hashes=[b"x"], fetch_sources=[[1]],
                      source_ids=[1], source_addrs=["h:1"])
    mc.handle(ps.FromMaster(plan))
    assert sent(mc.handle(ps.Fetched(False, ErrorKind.PeerConnectionError, "holder died"))) == [
        m.SyncDone(ok=False, kind=ErrorKind.PeerConnectionError, message="holder died")]
    # (Even an ok outcome commits nothing this peer did not fetch.)
    out = mc.handle(ps.FromMaster(m.SyncOutcome(ok=True, kind=ErrorKind.NONE, message="",
                                                revision=3)))
    assert not any(isinstance(c, ps.CommitSync) for c in out)
    assert [type(c) for c in out] == [ps.Fail] and mc.last_revision == -1


def test_an_outcome_while_fetching_stops_the_fetch_and_settles_after_it() -> None:
    mc = accepted()
    mc.handle(ps.StartSync(m.SyncInit(revision=3, strategy=0, keys=["w"], dtypes=[4],
                                      counts=[1], hashes=[b"h"], unequal=[False])))
    mc.handle(ps.FromMaster(m.SyncPlan(revision=3, fetch_keys=["w"], fetch_hashes=[b"x"],
                                       fetch_sources=[[1]], source_ids=[1],
                                       source_addrs=["h:1"])))
    out = mc.handle(ps.FromMaster(m.SyncOutcome(
        ok=False, kind=ErrorKind.PeerConnectionError, message="peer 1 lost", revision=0)))
    assert out == [ps.AbortFetch()] and ps.SYNC in mc.waiting
    out = mc.handle(ps.Fetched(False, ErrorKind.CollectiveAbortedError, "stopped"))
    assert out == [ps.Fail(ps.SYNC, ErrorKind.PeerConnectionError, "peer 1 lost")]


@pytest.mark.parametrize("fetched", [True, False])
def test_a_withdrawn_sync_commits_only_what_the_group_decided_before(fetched: bool) -> None:
    mc = accepted()
    mc.handle(ps.StartSync(m.SyncInit(revision=3, strategy=0, keys=["w"], dtypes=[4],
                                      counts=[1], hashes=[b"h"], unequal=[False])))
    mc.handle(ps.FromMaster(m.SyncPlan(revision=3, fetch_keys=["w"], fetch_hashes=[b"x"],
                                       fetch_sources=[[1]], source_ids=[1],
                                       source_addrs=["h:1"])))
    if fetched:
        mc.handle(ps.Fetched(True))
    out = mc.handle(ps.Cancelled(ps.SYNC))
    assert sent(out) == [m.SyncWithdraw()]
    assert (ps.AbortFetch() in out) is not fetched
    if not fetched:
        mc.handle(ps.Fetched(False, ErrorKind.CollectiveAbortedError, "stopped"))
    out = mc.handle(ps.FromMaster(m.SyncOutcome(ok=True, kind=ErrorKind.NONE, message="",
                                                revision=3)))
    assert (ps.CommitSync(3) in out) is fetched
    assert out[-1] == ps.Fail(ps.SYNC, ErrorKind.CollectiveAbortedError, "cancelled by the caller")


def test_a_refused_sync_fails_the_plan_and_the_outcome() -> None:
    mc = accepted()
    mc.handle(ps.StartSync(m.SyncInit(revision=1, strategy=0, keys=[], dtypes=[], counts=[],
                                      hashes=[], unequal=[])))
    out = mc.handle(ps.FromMaster(m.SyncOutcome(
        ok=False, kind=ErrorKind.CollectiveAbortedError, message="in update", revision=0)))
    assert out == [ps.Fail(ps.SYNC, ErrorKind.CollectiveAbortedError, "in update")]
    # The call is over: a late cancellation sends nothing.
    assert mc.handle(ps.Cancelled(ps.SYNC)) == []


def test_closing_fails_everything_once() -> None:
    mc = accepted()
    mc.handle(ps.StartCollective(init()))
    out = mc.handle(ps.Closed())
    assert {c.waiter for c in out if isinstance(c, ps.Fail)} == {ps.reduce_of(0)}
    assert mc.handle(ps.Closed()) == []
    assert mc.handle(ps.MasterLost("late")) == []


def test_error_kinds_name_every_pccl_error_the_extension_defines() -> None:
    import pccl
    from pccl import _core
    core = {n for n in dir(_core) if isinstance(getattr(_core, n), type)
            and issubclass(getattr(_core, n), pccl.PCCLError)}
    kinds = {k.value for k in ErrorKind if k is not ErrorKind.NONE}
    assert core <= kinds and kinds - core == {"OperationTimeoutError"}
    for k in kinds:
        assert ErrorKind(k).exception().__name__ == k
        assert ErrorKind.of(ErrorKind(k).error("x")) is ErrorKind(k)
    assert ErrorKind.parse("nonsense") is ErrorKind.PCCLError
    assert ErrorKind.parse("", ErrorKind.MasterConnectionError) is ErrorKind.MasterConnectionError


# --- early start: the ring starts when the caller calls -------------------------------


def _ok(tag: int, op_id: int) -> ps.FromMaster:
    return ps.FromMaster(m.CollectiveOutcome(tag=tag, op_id=op_id, ok=True,
                                             kind=ErrorKind.NONE, message=""))


def test_an_early_start_runs_the_ring_at_once_and_the_perform_only_arms_it() -> None:
    mc = accepted()  # peer 2 of ring [1, 2, 3], epoch 1
    s0 = m.early_op_id(1, 5, 0)
    out = mc.handle(ps.StartCollective(init(5), early=True))
    p = m.CollectivePerform(tag=5, op_id=s0, epoch=1, rank=1, world=3)
    (sent_init,) = sent(out)
    assert (sent_init.early_op, sent_init.epoch) == (s0, 1)
    # Not armed: until the master says every member called, a silent neighbour is no stall.
    assert ps.RunRing(5, p, armed=False) in out
    assert mc.collectives[5].early
    # The master's perform under the same id: every member called; arm the stall timer.
    assert mc.handle(perform(tag=5, op_id=s0)) == [ps.ArmRing(5)]
    assert not mc.collectives[5].early
    assert sent(mc.handle(ps.RingDone(5, True)))[0].op_id == s0
    assert mc.handle(_ok(5, s0)) == [ps.Commit(5), ps.Resolve(ps.reduce_of(5),
                                                              ps.Reduced(3, "ring"))]
    # The next collective of the tag derives the next id; another tag starts at 0.
    (nxt,) = sent(mc.handle(ps.StartCollective(init(5), early=True)))
    assert nxt.early_op == m.early_op_id(1, 5, 1) != s0
    (other,) = sent(mc.handle(ps.StartCollective(init(6), early=True)))
    assert other.early_op == m.early_op_id(1, 6, 0)


def test_a_voided_early_start_runs_again_under_the_masters_op_id() -> None:
    mc = accepted()
    s0 = m.early_op_id(1, 0, 0)
    mc.handle(ps.StartCollective(init(), early=True))
    # Voided while its ring op runs: stop it; nothing is reported when it ends.
    assert mc.handle(perform(op_id=42)) == [ps.AbortRing(0)]
    out = mc.handle(ps.RingDone(0, False, ErrorKind.CollectiveAbortedError, "aborted"))
    p = m.CollectivePerform(tag=0, op_id=42, epoch=1, rank=1, world=3)
    assert sent(out) == []
    # The input goes back, and the collective runs again from it, armed.
    assert out == [ps.Rollback(0), ps.RunRing(0, p, armed=True)]
    assert sent(mc.handle(ps.RingDone(0, True)))[0].op_id == 42
    assert mc.handle(_ok(0, 42)) == [ps.Commit(0), ps.Resolve(ps.reduce_of(0),
                                                              ps.Reduced(3, "ring"))]
    assert s0 != 42


def test_a_voided_early_start_that_already_reported_runs_again_at_once() -> None:
    mc = accepted()
    s0 = m.early_op_id(1, 0, 0)
    mc.handle(ps.StartCollective(init(), early=True))
    assert sent(mc.handle(ps.RingDone(0, False, ErrorKind.PeerConnectionError, "reset"))) \
        == [m.CollectiveDone(tag=0, op_id=s0, ok=False, kind=ErrorKind.PeerConnectionError,
                             message="reset")]
    out = mc.handle(perform(op_id=43))
    assert [type(c) for c in out] == [ps.Rollback, ps.RunRing]
    assert out[1].perform.op_id == 43  # type: ignore[union-attr]


def test_no_early_start_after_a_failure_until_the_ring_is_rebuilt() -> None:
    mc = accepted()
    s0 = m.early_op_id(1, 0, 0)
    mc.handle(ps.StartCollective(init(), early=True))
    mc.handle(ps.RingDone(0, False, ErrorKind.PeerConnectionError, "reset"))
    mc.handle(ps.FromMaster(m.CollectiveOutcome(tag=0, op_id=s0, ok=False,
                                                kind=ErrorKind.PeerConnectionError,
                                                message="reset")))
    (again,) = sent(mc.handle(ps.StartCollective(init(), early=True)))
    assert again.early_op == -1  # waits for the master's perform
    mc.handle(ps.FromMaster(m.CollectiveOutcome(tag=0, op_id=-1, ok=False,
                                                kind=ErrorKind.PeerConnectionError,
                                                message="x")))
    # The repaired ring (a new epoch) allows early starts again, counted from 0.
    cmds(mc, ps.FromMaster(world([1, 2], 2)),
         ps.FromMaster(m.TopologyUpdated(epoch=2, repair=True)), ps.RingInstalled(2, 1))
    (fresh,) = sent(mc.handle(ps.StartCollective(init(), early=True)))
    assert fresh.early_op == m.early_op_id(2, 0, 0) and fresh.epoch == 2


def test_a_repaired_ring_not_taken_over_is_routine_news_not_a_warning() -> None:
    mc = accepted()
    out = cmds(mc, ps.FromMaster(world([1, 2], 2)),
               ps.FromMaster(m.TopologyUpdated(epoch=2, repair=True)),
               ps.RingInstalled(2, 1, "no pool to peer 2 for epoch 2"))
    logs = [c for c in out if isinstance(c, ps.Log)]
    assert [log.info for log in logs] == [True]
    assert "no pool to peer 2 for epoch 2" in logs[0].message
    assert "repairs again" in logs[0].message


def test_an_early_start_waits_while_a_ring_is_being_installed() -> None:
    mc = accepted()
    cmds(mc, ps.FromMaster(world([1, 2], 2)),
         ps.FromMaster(m.TopologyUpdated(epoch=2, repair=True)))
    (plain,) = sent(mc.handle(ps.StartCollective(init(), early=True)))
    assert plain.early_op == -1


def test_cancelling_an_unconfirmed_early_start_withdraws_it() -> None:
    mc = accepted()
    mc.handle(ps.StartCollective(init(), early=True))
    out = mc.handle(ps.Cancelled(ps.reduce_of(0)))
    assert ps.AbortRing(0) in out
    (done,) = sent(out)
    assert done.op_id == -1 and done.kind is ErrorKind.CollectiveAbortedError


def test_a_called_off_early_start_stops_its_ring_and_fails_the_call() -> None:
    mc = accepted()
    mc.handle(ps.StartCollective(init(), early=True))
    out = mc.handle(ps.FromMaster(m.CollectiveOutcome(
        tag=0, op_id=-1, ok=False, kind=ErrorKind.InvalidUsageError, message="disagree")))
    assert out == [ps.AbortRing(0)]
    out = mc.handle(ps.RingDone(0, False, ErrorKind.CollectiveAbortedError, "aborted"))
    assert out == [ps.Rollback(0), ps.Fail(ps.reduce_of(0), ErrorKind.InvalidUsageError,
                                           "disagree")]


def test_an_abort_of_the_run_again_that_comes_before_it_starts_is_kept() -> None:
    """Voided (perform 42) and at once called off (abort 42) while the early ring op
    still ends: the run under 42 is stopped the moment it starts."""
    mc = accepted()
    mc.handle(ps.StartCollective(init(), early=True))
    mc.handle(perform(op_id=42))
    assert mc.handle(ps.FromMaster(m.CollectiveAbort(tag=0, op_id=42, message="x"))) == []
    out = mc.handle(ps.RingDone(0, False, ErrorKind.CollectiveAbortedError, "aborted"))
    p = m.CollectivePerform(tag=0, op_id=42, epoch=1, rank=1, world=3)
    assert out[-2:] == [ps.RunRing(0, p), ps.AbortRing(0)]
