"""pccl.launch.ray on a real local Ray cluster: a detached master actor, three peer
actors training, one of them killed with ``ray.kill`` and brought back by Ray as a
joiner; the run goes on and every peer ends with bit-identical state.

The Ray driver runs in a child process (this file run as a script) that the test waits
for: Ray leaves a socket open in its driver process after ``ray.shutdown()``, and the
child's exit also shows that Ray's own processes (GCS, raylet, workers) are gone, which
the test then checks by their session directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pccl

N = 1 << 18  # elements of the model and of each gradient
STEPS = 20  # training steps the run takes at least
KILL_AT = 3  # the driver kills a peer once every peer has done this many steps
VICTIM = 1  # the rank it kills
NUM_PEERS = 3
SECRET = "5f0c1a9e7d3b42c8a6e1f0b97c2d4e3a"  # a key of 128 random bits, not a password
RESULT_MARK = "PCCL-RAY-RESULT "


# --- the training function, run by every peer actor ------------------------------------


def _base() -> np.ndarray:
    """Every gradient is ``weight x base``: small integers, exact in float32 sums."""
    return (np.arange(N) % 5 + 1).astype(np.float32)


def _weight(rank: int, incarnation: int, num_peers: int) -> int:
    """A power of two per rank, another one for a restarted rank: the reduced sum says
    exactly which peers (and which incarnations) contributed."""
    return 1 << (rank if incarnation == 0 else num_peers + rank)


async def _admit_or_wait(ctx: Any, wait: bool, deadline: float) -> None:
    """Admits pending joiners; with ``wait``, first polls (bounded) until one knocks."""
    while wait and not await ctx.admit_joiners():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {ctx.rank}: no replacement peer knocked in time")
        await asyncio.sleep(0.05)  # poll: a restarted actor takes a few seconds to start
    if not wait:
        await ctx.admit_joiners()


async def _sync(comm: pccl.Communicator, state: pccl.SharedState) -> pccl.SyncInfo:
    for attempt in range(4):
        try:
            return await comm.sync_shared_state(state)
        except pccl.PeerConnectionError:  # a holder died mid-transfer: nothing written
            if attempt == 3:
                raise
    raise AssertionError("unreachable")


async def train(comm: pccl.Communicator, ctx: Any) -> dict[str, Any]:
    """Each step: admit joiners, all-reduce (SUM, the retry policy) this peer's gradient,
    add the sum to the model, sync the shared state (model + step counter).

    A replacement's first collective is the step's reduce, which it joins with zeros:
    that is what the running peers call next whether they admitted it between steps or
    inside the reduce's own retry (``update_topology()`` of the retry policy). Its sync
    right after that hands it the model and the step. The run ends at a step >= steps
    whose reduce every rank took part in, a restarted one included (all peers decide on
    the same reduced bytes, so they stop together)."""
    steps, expect_restart = ctx.args
    n = ctx.num_peers
    base = _base()
    model = np.arange(N, dtype=np.float32)
    step = np.zeros(1, dtype=np.int64)
    state = pccl.SharedState([pccl.TensorInfo.from_numpy(model, "model"),
                              pccl.TensorInfo.from_numpy(step, "step")])
    everyone = [(1 << r) | (1 << (n + r)) for r in range(n)]
    trace: list[list[int]] = []  # [step, contributors' mask, reduce world size]
    exact = True
    fresh = ctx.restarted
    if not fresh:
        await ctx.wait_for_peers(timeout=60.0)
        await comm.sync_shared_state(state)  # the founders start from the same model
    joined = False  # has a replacement been admitted (seen in a reduce)?
    deadline = time.monotonic() + 90.0
    for _ in range(10 * steps):  # the run ends long before: this only bounds the loop
        at = int(step[0])
        if not fresh:
            # Past the last step with no replacement yet: hold here until it knocks.
            await _admit_or_wait(ctx, wait=at >= steps and expect_restart and not joined,
                                 deadline=deadline)
        grad = base * np.float32(0 if fresh else _weight(ctx.rank, ctx.incarnation, n))
        (info,) = await comm.all_reduce_multiple_with_retry(
            [pccl.ReduceDescriptor(grad, op=pccl.ReduceOp.SUM, tag=0)])
        world = comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE)  # one view after a reduce
        mask = int(grad[0] / base[0])
        exact = exact and bool(np.array_equal(grad, base * np.float32(mask)))
        model += grad
        step[0] += 1
        state.revision += 1
        await _sync(comm, state)  # a fresh replacement adopts model, step, revision here
        trace.append([int(step[0]), mask, info.world_size])
        # A member that added zeros (a replacement's first reduce) or a replacement's bit.
        joined = joined or info.world_size > bin(mask).count("1") or mask >> n != 0
        fresh = False
        ctx.report(step=int(step[0]), world=info.world_size)
        all_ranks = all(mask & bits for bits in everyone)
        if int(step[0]) >= steps and all_ranks and (mask >> n or not expect_restart):
            break
    else:
        raise RuntimeError(f"rank {ctx.rank}: the run did not end within {10 * steps} steps")
    return {"rank": ctx.rank, "incarnation": ctx.incarnation, "trace": trace,
            "exact": exact, "revision": state.revision,
            "world": world,
            "hashes": [pccl.content_hash(model), pccl.content_hash(step)],
            "model_head": model[:8].tolist()}


async def _fail(comm: pccl.Communicator, ctx: Any) -> None:
    raise pccl.InvalidUsageError(f"rank {ctx.rank} gives up on purpose")


# --- the driver (a child process of the test) --------------------------------------------


def _poll(what: str, check: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)  # poll the actors' progress: a bounded wait for a condition
    raise TimeoutError(f"{what} within {timeout} s")


def driver(temp_dir: str) -> dict[str, Any]:
    import ray

    from pccl.launch.ray import launch, start_master, stop_master

    t0 = time.monotonic()
    ray.init(num_cpus=NUM_PEERS + 1, include_dashboard=False, _node_ip_address="127.0.0.1",
             _temp_dir=temp_dir, log_to_driver=False, configure_logging=False)
    t_init = time.monotonic() - t0
    out: dict[str, Any] = {"ray_init_s": round(t_init, 2)}
    try:
        run = launch(train, NUM_PEERS, args=(STEPS, True), name="pccl-test-master",
                     namespace="pccl-test", listen="127.0.0.1:0", secret=SECRET,
                     master_options={"heartbeat_interval": 0.25, "heartbeat_timeout": 2.0},
                     communicator_options={"p2p_listen_host": "127.0.0.1",
                                           "p2p_connection_pool_size": 1,
                                           "peer_timeout": 5.0, "collective_timeout": 30.0},
                     max_restarts=1, peer_actor_options={"num_cpus": 1},
                     connect_timeout=60.0)
        with run:
            out["master_address"] = run.master_address
            try:  # the detached master's name is taken while it runs
                start_master(name="pccl-test-master", namespace="pccl-test")
                out["name_taken_refused"] = False
            except pccl.InvalidUsageError:
                out["name_taken_refused"] = True
            found = ray.get_actor("pccl-test-master", namespace="pccl-test")
            out["master_named"] = ray.get(found.address.remote()) == run.master_address
            progress = _poll(
                f"every peer at step {KILL_AT}",
                lambda: (p := run.progress(timeout=5.0)) and len(p) == NUM_PEERS and all(
                    v.get("step", 0) >= KILL_AT for v in p.values()) and p, timeout=60.0)
            out["ready_s"] = round(time.monotonic() - t0, 2)
            out["steps_at_kill"] = {r: v["step"] for r, v in progress.items()}
            ray.kill(run.peers[VICTIM], no_restart=False)
            out["results"] = run.wait(timeout=90.0)
            out["finished_s"] = round(time.monotonic() - t0, 2)
            out["incarnations"] = run.incarnations()
            out["master_status"] = run.master_status()
        try:
            ray.get_actor("pccl-test-master", namespace="pccl-test")
            out["master_gone"] = False
        except ValueError:
            out["master_gone"] = True
        # An exception raised by the peer function reaches wait() with its own class.
        with launch(_fail, 1, name="pccl-test-master-2", namespace="pccl-test",
                    listen="127.0.0.1:0", communicator_options={
                        "p2p_listen_host": "127.0.0.1", "p2p_connection_pool_size": 1}) as run:
            try:
                run.wait(timeout=60.0)
                out["failure"] = None
            except pccl.InvalidUsageError as e:
                out["failure"] = str(e)
        out["stop_master_after_stop"] = stop_master("pccl-test-master-2", "pccl-test")
        out["second_run_done_s"] = round(time.monotonic() - t0, 2)
    finally:
        ray.shutdown()
    out["total_s"] = round(time.monotonic() - t0, 2)
    return out


# --- the tests ---------------------------------------------------------------------------


def _session_processes(sid: int) -> list[int]:
    """Live processes of session ``sid``: the driver started it (``start_new_session``),
    and Ray's processes (GCS, raylet, workers) inherit it, even once reparented."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(pid))
    return found


@pytest.mark.multiprocess
@pytest.mark.alone  # a Ray cluster: a dozen processes
def test_killed_peer_actor_is_restarted_and_admitted_with_parity() -> None:
    pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'pccl[ray]'")
    # A short directory: Ray puts unix sockets under it (a 107-byte path limit).
    temp_dir = tempfile.mkdtemp(prefix="pccl-ray-", dir="/tmp")
    env = {**os.environ, "HOME": temp_dir,  # Ray writes its auth token under ~/.ray
           "RAY_USAGE_STATS_ENABLED": "0"}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, __file__, temp_dir], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=80)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver's group: Ray's processes too
        stdout, stderr = proc.communicate()
        pytest.fail(f"the Ray driver did not finish in 80 s\n{stderr[-4000:]}")
    finally:
        try:
            _poll("Ray's processes gone", lambda: not _session_processes(proc.pid),
                  timeout=15.0)
            left: list[int] = []
        except TimeoutError:
            left = _session_processes(proc.pid)
            for pid in left:  # started by this test (its driver's session): end them
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, stderr[-4000:]
    assert not left, f"Ray processes left running: {left}"
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT_MARK)]
    assert lines, stderr[-4000:]
    out = json.loads(lines[-1][len(RESULT_MARK):])
    print(f"ray.init {out['ray_init_s']} s; peers training at {out['ready_s']} s; run done "
          f"at {out['finished_s']} s; failing run done at {out['second_run_done_s']} s; "
          f"driver {out['total_s']} s; test {elapsed:.1f} s")

    assert out["master_named"] and out["master_gone"] and out["name_taken_refused"]
    assert out["failure"] and "rank 0 gives up on purpose" in out["failure"]
    assert out["stop_master_after_stop"] is False
    assert out["master_address"].startswith("127.0.0.1:")
    # Ray restarted the killed actor once; the others never.
    assert out["incarnations"] == {str(r): int(r == VICTIM) for r in range(NUM_PEERS)}
    results = out["results"]
    assert [r["rank"] for r in results] == list(range(NUM_PEERS))
    assert [r["incarnation"] for r in results] == [int(r == VICTIM) for r in range(NUM_PEERS)]
    # Bit-identical state on every peer, the replacement included, at one revision.
    assert len({tuple(r["hashes"]) for r in results}) == 1
    assert len({r["revision"] for r in results}) == 1
    # The replacement was admitted: the world is whole again, and it trained.
    assert all(r["world"] == NUM_PEERS for r in results)
    founders = [r for r in results if r["incarnation"] == 0]
    trace = founders[0]["trace"]
    assert all(r["trace"] == trace for r in founders)
    replacement = results[VICTIM]["trace"]
    assert replacement == trace[-len(replacement):]  # the same reduces, from its join on
    full_old, victim_new = (1 << NUM_PEERS) - 1, 1 << (NUM_PEERS + VICTIM)
    masks = [m for _, m, _ in trace]
    assert masks[:KILL_AT] == [full_old] * KILL_AT  # all founders trained the first steps
    assert masks[-1] == full_old & ~(1 << VICTIM) | victim_new  # the replacement trained
    assert any(m & (1 << VICTIM) == 0 for m in masks)  # steps the victim missed
    assert all(r["exact"] for r in results)  # every reduce was exactly sum(weights) x base
    assert [s for s, _, _ in trace] == list(range(1, len(trace) + 1))
    assert len(trace) >= STEPS
    # The model is the initial one plus every step's reduced sum, exactly.
    expect = np.arange(N, dtype=np.float32) + _base() * np.float32(sum(masks))
    assert pccl.content_hash(expect) == results[0]["hashes"][0]
    assert results[0]["model_head"] == expect[:8].tolist()
    # All three peers were accepted at the end; nobody was left pending.
    assert out["master_status"]["pending"] == 0


def test_bad_input_fails_with_typed_errors() -> None:
    pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'pccl[ray]'")
    import ray

    from pccl.launch.ray import launch, start_master

    def not_async(comm: pccl.Communicator, ctx: Any) -> None:
        return None

    with pytest.raises(pccl.InvalidArgumentError, match="async"):
        launch(not_async, 2)  # type: ignore[arg-type]
    with pytest.raises(pccl.InvalidArgumentError, match="num_peers"):
        launch(train, 0)
    with pytest.raises(pccl.InvalidArgumentError, match="max_restarts"):
        launch(train, 2, max_restarts=-2)
    with pytest.raises(pccl.InvalidArgumentError, match="peer_group"):
        launch(train, 2, peer_group=[0, 1, 2])
    with pytest.raises(pccl.InvalidArgumentError, match="communicator_options"):
        launch(train, 2, communicator_options={"no_such_option": 1})
    with pytest.raises(pccl.InvalidArgumentError, match="p2p_connection_pool_size"):
        launch(train, 2, communicator_options={"p2p_connection_pool_size": 0})
    with pytest.raises(pccl.InvalidArgumentError, match="not in communicator_options"):
        launch(train, 2, communicator_options={"secret": SECRET})
    with pytest.raises(pccl.InvalidArgumentError, match="max_restarts"):
        launch(train, 2, peer_actor_options={"max_restarts": 5})
    assert not ray.is_initialized()  # checked before any use of Ray ...
    with pytest.raises(pccl.InvalidUsageError, match="ray.init"):
        launch(train, 2)  # ... which needs ray.init() first
    with pytest.raises(pccl.InvalidUsageError, match="ray.init"):
        start_master()


def test_import_pccl_does_not_import_ray() -> None:
    code = "import sys, pccl, pccl.launch; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


if __name__ == "__main__":  # the driver process of the first test
    print(RESULT_MARK + json.dumps(driver(sys.argv[1])), flush=True)
