"""The deterministic simulation (pccl/testing/sim.py): the real sans-IO master and peers
under thousands of seeded schedules of delays, reorderings, kills, dropped connections,
broken links, cancellations and joins, with the invariants checked after each.

``PCCL_SIM_SCHEDULES`` scales the number of schedules (CI: the default below; a soak:
e.g. 100000)."""

from __future__ import annotations

import ast
import dataclasses
import os
from pathlib import Path

import pytest

from pccl.errors import ErrorKind
from pccl.peer import state as ps
from pccl.protocol import messages as m
from pccl.testing import sim
from pccl.testing.sim import Sim

SCHEDULES = int(os.environ.get("PCCL_SIM_SCHEDULES", "2000"))


def _violations(first: int, count: int, **kw: object) -> tuple[list[str], int]:
    bad: list[str] = []
    steps = 0
    for seed in range(first, first + count):
        r = Sim(seed, **kw).run()  # type: ignore[arg-type]
        steps += r.steps
        bad += [f"seed {seed}: {v}" for v in r.violations]
    return bad, steps


def test_small_groups_keep_every_invariant_under_thousands_of_schedules() -> None:
    bad, steps = _violations(0, SCHEDULES)
    assert not bad, "\n".join(bad[:20])
    assert steps > 5 * SCHEDULES  # the runs made progress, not just survived


def test_larger_groups_with_more_churn_keep_every_invariant() -> None:
    bad, steps = _violations(1_000_000, max(SCHEDULES // 8, 50), peers=6, joiners=5,
                             kills=5, drops=2, breaks=4, steps=10)
    assert not bad, "\n".join(bad[:20])
    assert steps > 0


def test_optimize_topology_between_steps_keeps_every_invariant() -> None:
    # Probes, the solver's answer and the rebuilt rings interleave with the chaos.
    bad, _ = _violations(3_000_000, max(SCHEDULES // 8, 50), peers=4, joiners=3, kills=3,
                         optimize_every=2)
    assert not bad, "\n".join(bad[:20])


def test_master_restarts_and_rejoins_keep_every_invariant() -> None:
    # The master dies and a fresh one takes over; peers whose connection broke register
    # again with what they held (the resume), and their calls wait for that.
    bad, steps = _violations(4_000_000, max(SCHEDULES // 8, 50), restarts=2, drops=3,
                             peers=4, joiners=3)
    assert not bad, "\n".join(bad[:20])
    assert steps > 0


def test_short_deadlines_end_calls_instead_of_hanging() -> None:
    # Deadlines shorter than some network delays: calls time out, programs may give up
    # (OperationTimeoutError is not retried), but nobody hangs and parity holds.
    bad, _ = _violations(2_000_000, max(SCHEDULES // 8, 50), collective_timeout=0.3)
    assert not bad, "\n".join(bad[:20])


def test_the_same_seed_replays_the_same_run() -> None:
    a, b = Sim(1234).run(), Sim(1234).run()
    assert (a.events, a.steps, a.kills, a.virtual_seconds) == (
        b.events, b.steps, b.kills, b.virtual_seconds)


def test_the_invariants_catch_a_peer_that_reports_a_failed_ring_as_done(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulation can fail: with a peer that always reports its ring part done, the
    group applies results of rings that broke, and the checks say so."""

    honest = ps.PeerMachine._ring_done

    def lying(self: ps.PeerMachine, ev: ps.RingDone, out: list[ps.Command]) -> None:
        honest(self, dataclasses.replace(ev, ok=True, kind=ErrorKind.NONE, message=""), out)

    monkeypatch.setattr(ps.PeerMachine, "_ring_done", lying)
    bad, _ = _violations(0, 100)
    assert any("whose ring failed" in v for v in bad)


def test_a_bug_planted_in_the_machines_commit_rule_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulation runs the machine's own commit rule (what the driver runs): with the
    rule's condition dropped, so that a failed outcome commits the ring's result too,
    peers apply results the group did not decide, and the checks say so."""
    rule = ps.PeerMachine._settle

    def careless(self: ps.PeerMachine, col: ps.Collective, out: list[ps.Command]) -> None:
        if isinstance(col.decided, m.CollectiveOutcome) and col.held:
            col.decided = dataclasses.replace(col.decided, ok=True)
            col.ring_ok = True
        rule(self, col, out)

    monkeypatch.setattr(ps.PeerMachine, "_settle", careless)
    bad, _ = _violations(0, 100)
    assert any("without the master's ok outcome" in v for v in bad), bad[:5]
    # And the rule as it is keeps every seed clean (the same seeds).
    monkeypatch.setattr(ps.PeerMachine, "_settle", rule)
    assert _violations(0, 100)[0] == []


def test_the_simulator_carries_out_commands_and_decides_nothing() -> None:
    """pccl/testing/sim.py holds no copy of the peer's rules: it never reads a call's
    state out of the machine (only its public queries: waiting, status, ring, resume),
    and never dispatches on a waiter's shape by hand."""
    source = (Path(sim.__file__)).read_text()
    tree = ast.parse(source)
    internals = {"collectives", "early", "redo", "aborted", "redo_aborted", "phase", "held",
                 "decided", "cancelled_calls", "installs", "proposed"}
    read = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not read & internals, read & internals
    assert "w[0]" not in source and "waiter[0]" not in source
