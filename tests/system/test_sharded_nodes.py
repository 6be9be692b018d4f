"""Sharded nodes (``examples/sharded_nodes.py``): FSDP-style slices inside a node
(torch.distributed, gloo), one pccl peer group per local rank across nodes.

Two nodes (4 processes) train 3 steps, a third node joins (both ranks, admitted by the
others' update_topology(), caught up by a RECEIVE_ONLY sync per group), then both
processes of the first node are SIGKILLed while the others wait for it at the start of
step 6 (in the run-wide collective are_peers_pending()). With the master repairing
rings (the default) the others' step 6 then runs on the rebuilt rings at the first
try; with ``MasterNode(repair_rings=False)`` their reduce fails with a typed pccl error,
they call update_topology() as nodes and train on. Every step of every slice is checked
bit for bit from the workers' reports: the same bytes on every node, the reduced
gradient equal to the average of the nodes' gradients computed in the ring's order
(``tests/reference.py``), and the optimizer update replayed in numpy from the seeded
initial weights.
"""

from __future__ import annotations

import importlib.util
import signal
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from reference import ring_reference

import pccl

pytestmark = pytest.mark.multiprocess

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sharded_nodes.py"


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sharded_nodes_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _f32(hex_bytes: str) -> np.ndarray:
    return np.frombuffer(bytes.fromhex(hex_bytes), dtype=np.float32)


@pytest.mark.parametrize("repair_rings", [True, False], ids=["repair", "no-repair"])
async def test_sharded_nodes_join_die_and_stay_bit_identical(tmp_path: Path,
                                                             repair_rings: bool) -> None:
    pytest.importorskip("torch")
    sn = _load_example()
    async with sn.ShardedRun(backend="gloo", log_dir=tmp_path, wait_timeout=60.0,
                             master_options={"repair_rings": repair_rings}) as run:
        a, b, c = await run.start_nodes(3)  # c's processes wait until told to join
        await run.join(a)  # an empty run admits node a
        await run.join(b)  # b's rank 0 waits; a admits it at the start of step 1
        run.allow([a, b], 3)
        await run.wait_steps([a, b], 3)

        await run.join(c)
        run.allow([a, b, c], 5)
        await run.wait_steps([a, b, c], 5)

        # Nodes b and c start step 6 and wait for node a, held before it, in the run-wide
        # are_peers_pending() that opens every step.
        run.allow([b, c], 6)
        waiting = set(b.peer_ids) | set(c.peer_ids)
        await run.master.wait_for(lambda s: waiting <= set(s.pending_votes), timeout=60)
        await run.kill(a)
        run.allow([b, c], 8)
        await run.wait_steps([b, c], 8)
        await run.finish([b, c])
        assert run.failure is None, run.failure

    # Who ended how.
    for node, code in ((a, -signal.SIGKILL), (b, 0), (c, 0)):
        assert [p.returncode for p in node.ranks] == [code] * run.local_world, node.id
    assert len({p for n in (a, b, c) for p in n.peer_ids}) == 6

    members = {1: {a, b}, 2: {a, b}, 3: {a, b}, 4: {a, b, c}, 5: {a, b, c},
               6: {b, c}, 7: {b, c}, 8: {b, c}}
    shards = sn.initial_shards(run.local_world)
    n = shards[0].size
    full_numel = sum(p.numel() for p in sn.make_model().parameters())
    assert n == -(-full_numel // run.local_world) < full_numel  # pccl moves a slice only
    lr, mu = np.float32(sn.LR), np.float32(sn.MOMENTUM)
    params = list(shards)
    momentum = [np.zeros(n, dtype=np.float32) for _ in range(run.local_world)]

    for step in range(1, 9):
        expected_nodes = sorted(node.id for node in members[step])
        for rank in range(run.local_world):
            reps = [e for e in run.reports(step) if e["rank"] == rank]
            assert sorted(e["node"] for e in reps) == expected_nodes, (step, rank)
            # Bit-identical across nodes: the slice, its content hash, momentum, result.
            for key in ("params", "params_hash", "momentum", "grad_out"):
                assert len({e[key] for e in reps}) == 1, (step, rank, key)
            # The reduce ran over this group's ring of exactly these nodes' rank-r peers.
            ring = reps[0]["ring"]
            by_peer = {e["peer_id"]: e for e in reps}
            assert all(e["ring"] == ring for e in reps)
            assert sorted(ring) == sorted(by_peer), (step, rank)
            assert all(e["world"] == len(expected_nodes) for e in reps)
            # The exact average of the nodes' gradients, in the ring's float order.
            grad_in = [_f32(by_peer[p]["grad_in"]) for p in ring]
            assert all(g.size == n for g in grad_in)
            expected = ring_reference(grad_in, pccl.ReduceOp.AVG, "float32")
            grad_out = _f32(reps[0]["grad_out"])
            assert grad_out.tobytes() == expected.tobytes(), (step, rank)
            # The optimizer on the slice, replayed from the seeded initial weights.
            momentum[rank] = momentum[rank] * mu + grad_out
            params[rank] = params[rank] - momentum[rank] * lr
            got = _f32(reps[0]["params"])
            assert got.tobytes() == params[rank].tobytes(), (step, rank)
            assert _f32(reps[0]["momentum"]).tobytes() == momentum[rank].tobytes()
            assert reps[0]["params_hash"] == pccl._core.content_hash(got.view(np.uint8)).hex()

    # The joiner caught up by fetching both slices' state, and only then; the others
    # never had to fetch anything (they stayed identical on their own).
    state_bytes = 2 * n * 4 + 8  # params + momentum (float32) + the int64 step counter
    for e in run.reports():
        if e["node"] == c.id and e["step"] == 4:
            assert e["sync"]["strategy"] == "RECEIVE_ONLY"
            assert e["sync"]["rx_bytes"] == state_bytes
        else:
            assert e["sync"]["rx_bytes"] == 0, (e["node"], e["rank"], e["step"])
    assert min(e["step"] for e in run.reports() if e["node"] == c.id) == 4

    failures = run.failures()
    if repair_rings:
        # Node a's death cost the others nothing: once the master dropped it, it rebuilt
        # both groups' rings from b and c, and step 6 ran on them at the first try.
        assert [f for f in failures if f["step"] in (6, 7, 8)] == []
        assert all(e["restarts"] == 0 for s in (6, 7, 8) for e in run.reports(s))
        return
    # Without ring repair, node a's death: every survivor rank's step 6 failed with a
    # typed pccl error at least once (the group's ring lost a member), then went through.
    assert {f["kind"] for f in failures} <= {
        "PeerConnectionError", "CollectiveAbortedError", "UpdateTopologyFailedError",
        "NoSharedStateAvailableError"}
    at_six = [f for f in failures if f["step"] == 6]
    assert {(f["node"], f["rank"]) for f in at_six} == {
        (node.id, r) for node in (b, c) for r in range(run.local_world)}
    assert "PeerConnectionError" in {f["kind"] for f in at_six}
    assert all(e["restarts"] >= 1 for e in run.reports(6))
