"""pccl.blocking: PCCL's blocking API on pccl.

The end-to-end test runs ``examples/pccl_style.py`` (a PCCL-style synchronous script)
as a master and four peer processes: join, every kind of reduce with exact values, a
late joiner synced to bit-identical state, and two peers SIGKILLed mid-run while the
others recover. The rest runs in-process: error mapping, recovery semantics, the
background loop's lifecycle.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pccl
import pccl.blocking as pb

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "pccl_style.py"
WAIT = 60.0  # bound on any single wait for another process


def _has_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


# --- the PCCL-style script, master + peers in processes ------------------------------


class Script:
    """``examples/pccl_style.py`` in a child process; JSON events on its stdout."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name = name
        self.args = args
        self.stderr_path = log_dir / f"{name}.stderr"
        self.events: list[dict[str, Any]] = []
        self.proc: asyncio.subprocess.Process | None = None

    def _open_stderr(self) -> Any:
        return self.stderr_path.open("wb")

    async def start(self) -> None:
        with self._open_stderr() as err:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, str(SCRIPT), *self.args, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=err,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})

    async def release(self) -> None:
        """Lets a ``--hold`` peer go on and connect."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        await self.proc.stdin.drain()

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-4000:]

    async def next_event(self, name: str) -> dict[str, Any]:
        """Reads events until one called ``name`` (bounded)."""
        assert self.proc is not None and self.proc.stdout is not None
        async with asyncio.timeout(WAIT):
            while line := await self.proc.stdout.readline():
                event = json.loads(line)
                event.pop("t")
                self.events.append(event)
                if event["event"] == name:
                    return event
        raise AssertionError(f"{self.name} exited without {name!r}:\n{self.stderr()}")

    async def finish(self) -> int:
        """Reads the remaining events and returns the exit code (bounded)."""
        assert self.proc is not None and self.proc.stdout is not None
        async with asyncio.timeout(WAIT):
            while line := await self.proc.stdout.readline():
                event = json.loads(line)
                event.pop("t")
                self.events.append(event)
            return await self.proc.wait()

    def of(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == name]

    async def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc._transport.close()  # type: ignore[attr-defined]


@pytest.mark.multiprocess
async def test_pccl_style_script_runs_on_pccl(tmp_path: Path) -> None:
    # Peers a and d hold torch tensors where b and c hold numpy arrays (when torch is
    # installed): the reduces and the shared state mix them.
    torch_args = ["--torch"] if _has_torch() else []
    master = Script("master", ["master", "--listen", "127.0.0.1:0"], tmp_path)
    scripts = [master]
    try:
        await master.start()
        address = (await master.next_event("listening"))["address"]

        def peer(name: str, weight: int, *extra: str) -> Script:
            s = Script(name, ["peer", "--master", address, "--weight", str(weight),
                              "--world", "3", "--steps", "3", *extra], tmp_path)
            scripts.append(s)
            return s

        a, b, c = peer("a", 1, *torch_args), peer("b", 2, "--die-at", "3:async"), \
            peer("c", 4, "--die-at", "2:multiple")
        d = peer("d", 8, "--late", "--hold", *torch_args)  # joins once a, b, c run as 3
        for s in (a, b, c, d):
            await s.start()
        for s in (a, b, c):
            joined = await s.next_event("joined")
            assert joined["world"] == joined["local"] == 3
        await d.release()

        codes = {s.name: await s.finish() for s in (a, b, c, d)}
        logs = {s.name: s.stderr() for s in (a, b, c, d)}
        assert codes == {"a": 0, "b": -signal.SIGKILL, "c": -signal.SIGKILL, "d": 0}, logs

        # Three peers: every kind of reduce gives exactly the sum 1 + 2 + 4.
        for s in (a, b, c):
            (r,) = s.of("reduced")
            assert r["world"] == 3
            assert r["numpy_sum"] == {"sum": 7.0, "exact": True}
            assert r["numpy_avg"] == {"sum": 7.0, "exact": True, "send_untouched": True}
            assert r["async"] == {"ok": [True, True], "status": [0, 0], "world": 3,
                                  "sum": {"sum": 7.0, "exact": True}, "max": 4,
                                  "max_exact": True}
            assert r["multiple"] == {"a": {"sum": 7.0, "exact": True},
                                     "b": {"sum": 7.0, "exact": True},
                                     "world": 3, "tx_positive": True}
            assert r["tensors"] == {
                "kind": "torch" if s is a and torch_args else "numpy", "f16_sum": 7.0,
                "f16_exact": True, "f64": {"sum": 7.0, "exact": True}, "async_ok": True,
                "min": 1, "min_exact": True}

        # Shared state: the late joiner ends bit-identical, at the run's revision.
        first = [s.of("synced")[0] for s in (a, b, c)]
        assert {e["revision"] for e in first} == {0}
        assert len({e["digest"] for e in first}) == 1
        second = [s.of("synced")[-1] for s in (a, b, c, d)]
        assert {e["revision"] for e in second} == {1}
        assert len({e["digest"] for e in second}) == 1
        assert len({e["momentum"] for e in second}) == 1
        assert second[3]["rx_bytes"] > 0 and second[0]["rx_bytes"] == 0

        # Steps: 4 peers (15), c killed before step 2's reduces (11: the master rebuilt
        # the ring without c and ran them on a, b, d), b killed in step 3 between the
        # multi-reduce (11) and the stats reduce (9: it waited for b, then ran on the
        # ring the master rebuilt without b, at the first try).
        def step(s: Script, n: int) -> dict[str, Any]:
            return next(e for e in s.of("step") if e["step"] == n)

        for s in (a, b, c, d):
            e = step(s, 1)
            assert (e["multiple"]["world"], e["stats_world"], e["world"]) == (4, 4, 4)
            assert e["multiple"]["grad"] == e["multiple"]["grad_step"] == \
                {"sum": 15.0, "exact": True}
            assert (e["multiple"]["quantized"], e["multiple"]["quantized_exact"]) == \
                (15.0, True)
            assert e["multiple"]["own"] == {"sum": 15.0, "exact": True}
            assert (e["stats_sum"], e["stats_count"], e["attempts"]) == (15, 4, 1)
        assert c.events[-1] == {"event": "dying"} and not [e for e in c.of("step")
                                                          if e["step"] == 2]
        for s in (a, b, d):
            e = step(s, 2)
            assert (e["multiple"]["world"], e["stats_world"], e["world"]) == (3, 3, 3)
            assert e["multiple"]["grad"] == {"sum": 11.0, "exact": True}
            assert e["multiple"]["quantized"] == 11.0
            assert e["multiple"]["own"] == {"sum": 11.0, "exact": True}
            assert (e["stats_sum"], e["attempts"]) == (11, 1)
        assert b.events[-1] == {"event": "dying"}
        for s in (a, d):
            e = step(s, 3)
            assert e["multiple"]["world"] == 3
            assert e["multiple"]["grad"] == {"sum": 11.0, "exact": True}
            assert (e["stats_sum"], e["stats_count"], e["stats_world"]) == (9, 2, 2)
            assert (e["attempts"], e["world"]) == (1, 2)
        for n in (1, 2, 3):
            assert len({step(s, n)["digest"] for s in (a, d)}) == 1
            assert {step(s, n)["revision"] for s in (a, d)} == {n + 1}
        (done_a,), (done_d,) = a.of("done"), d.of("done")
        assert done_a == done_d

        # The master outlived its script's main() and stops cleanly on SIGTERM.
        assert master.proc is not None and master.proc.returncode is None
        master.proc.send_signal(signal.SIGTERM)
        assert await master.finish() == 0, master.stderr()
    finally:
        for s in scripts:
            await s.close()


# --- in-process -------------------------------------------------------------------------


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "pccl-blocking-loop"]


@pytest.fixture(autouse=True)
def loop_thread_stops() -> Iterator[None]:
    yield
    # Every test closes what it opened, so the loop thread must be gone (joined).
    assert not pb.loop_thread_running()
    assert not _loop_threads()


@pytest.fixture
def master() -> Iterator[pb.MasterNode]:
    with pb.MasterNode("127.0.0.1:0", heartbeat_interval=0.25, heartbeat_timeout=3.0) as m:
        yield m


def _admit(master: pb.MasterNode, first: pb.Communicator, *joiners: pb.Communicator) -> None:
    """Connects ``first`` alone, then the joiners, admitted by ``first``."""
    first.connect()
    with concurrent.futures.ThreadPoolExecutor(len(joiners)) as pool:
        joins = [pool.submit(j.connect) for j in joiners]
        master.wait_for(lambda s: len(s.pending()) == len(joiners))
        assert first.are_peers_pending()
        first.update_topology()
        for j in joins:
            j.result(timeout=WAIT)


def _pending_inits(n: int) -> Any:
    return lambda s: sum(len(c.inits) for c in s.collectives.values()) >= n


def test_pccl_names_and_enums() -> None:
    for name in ("Communicator", "MasterNode", "ReduceOp", "Attribute", "DataType",
                 "SharedStateSyncStrategy", "DistributionHint", "QuantizationAlgorithm",
                 "ReduceOperandDescriptor", "QuantizationOptions", "ReduceDescriptor",
                 "TensorInfo", "SharedState", "SharedStateSyncInfo", "ReduceInfo",
                 "ReduceOpDescriptor", "AsyncReduceHandle", "PCCLError", "cuda"):
        assert name in pb.__all__, name
    assert pb.PCCLError is pccl.PCCLError and pb.ReduceOp is pccl.ReduceOp
    assert [op.name for op in pb.ReduceOp] == ["SUM", "AVG", "PROD", "MAX", "MIN"]
    assert [s.name for s in pb.SharedStateSyncStrategy] == \
        ["ENFORCE_POPULAR", "RECEIVE_ONLY", "SEND_ONLY"]
    assert pb.Attribute.LOCAL_WORLD_SIZE.value == 2
    assert pb.Attribute.PEER_GROUP_WORLD_SIZE is pb.Attribute.LOCAL_WORLD_SIZE
    assert pb.DataType.FLOAT.value == 10 and pb.DataType.FLOAT32 is pb.DataType.FLOAT
    assert pb.DataType.from_numpy_dtype(np.dtype(np.float64)) is pb.DataType.DOUBLE
    assert pb.DataType.INT32.to_numpy_dtype() == np.int32
    assert pb.Result(8) is pb.Result.RANK_CONNECTION_LOST
    q = pb.QuantizationOptions()
    assert (q.quantized_datatype, q.algorithm) == \
        (pb.DataType.UINT8, pb.QuantizationAlgorithm.MIN_MAX)
    info = pb.ReduceInfo(3, 10, 20)
    assert (info.local_world_size, info.world_size, info.tx_bytes, info.rx_bytes) == \
        (3, 3, 10, 20)
    assert pb.SharedStateSyncInfo(1, 2).rx_bytes == 2
    try:
        import torch
    except ImportError:
        torch = None
    cuda = torch is not None and torch.cuda.is_available()
    assert pb.cuda.is_available() is cuda and pb.cuda.is_cuda_available is cuda


def test_pccl_datatypes_map_member_by_member_onto_the_one_dtype_table() -> None:
    from pccl.blocking import compat
    from pccl.enums import DTYPES

    # PCCL's C values and pccl's differ (FLOAT is 10 here, FLOAT32 is 2 in pccl): the
    # map is explicit, one to one, and covers both enums.
    assert pb.DataType.FLOAT.value != pccl.DataType.FLOAT32.value
    assert set(compat._CORE_DTYPE) == set(pb.DataType)
    assert sorted(compat._CORE_DTYPE.values()) == sorted(pccl.DataType)
    assert compat._CORE_DTYPE[pb.DataType.DOUBLE] is pccl.DataType.FLOAT64
    for dt in pb.DataType:
        info = DTYPES[compat._CORE_DTYPE[dt]]
        assert compat.element_info(dt) is info
        assert compat._as_datatype(compat._CORE_DTYPE[dt]) is dt  # pccl's enum accepted
        if info.numpy is None:  # wire-only
            with pytest.raises(pb.ArgumentValueError, match="has no numpy dtype"):
                dt.to_numpy_dtype()
            with pytest.raises(pb.ArgumentValueError, match="has no torch dtype"):
                dt.to_torch_dtype()
        elif info.numpy != "bfloat16":  # numpy's bfloat16 needs ml_dtypes
            assert dt.to_numpy_dtype() == np.dtype(info.numpy)
            assert dt.to_numpy_dtype().itemsize == info.size
            assert pb.DataType.from_numpy_dtype(np.dtype(info.numpy)) is dt
    with pytest.raises(pb.ArgumentAssertionError, match="Unsupported dtype"):
        pb.DataType.from_numpy_dtype(np.complex64)


def test_to_torch_dtype_without_torch_is_a_typed_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # sys.modules[name] = None makes `import torch` raise ImportError, as on a machine
    # without torch; the numpy-only install must get pccl's typed error, not a bare one.
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(pb.ArgumentValueError, match=r"needs torch.*pccl\[torch\]"):
        pb.DataType.FLOAT.to_torch_dtype()
    with pytest.raises(pb.ArgumentValueError, match="has no torch dtype"):
        pb.DataType.FLOAT8_E4M3.to_torch_dtype()  # wire-only, whether torch is there or not


def test_result_codes_of_every_error_class() -> None:
    expected = {
        pb.InvalidArgumentError: pb.Result.INVALID_ARGUMENT,
        pb.ArgumentValueError: pb.Result.INVALID_ARGUMENT,
        pb.ArgumentAssertionError: pb.Result.INVALID_ARGUMENT,
        pb.InvalidUsageError: pb.Result.INVALID_USAGE,
        pb.RevisionIncrementViolationError: pb.Result.INVALID_USAGE,
        pb.TooFewPeersError: pb.Result.TOO_FEW_PEERS,
        pb.MasterConnectionError: pb.Result.MASTER_CONNECTION_FAILED,
        pb.AuthenticationError: pb.Result.MASTER_CONNECTION_FAILED,
        pb.PeerConnectionError: pb.Result.RANK_CONNECTION_LOST,
        pb.CollectiveAbortedError: pb.Result.RANK_CONNECTION_LOST,
        pb.NoSharedStateAvailableError: pb.Result.NO_SHARED_STATE_AVAILABLE,
        pb.PendingAsyncOpsError: pb.Result.PENDING_ASYNC_OPS,
        pb.UpdateTopologyFailedError: pb.Result.UPDATE_TOPOLOGY_FAILED,
        pb.TopologyOptimizationFailedError: pb.Result.TOPOLOGY_OPTIMIZATION_FAILED,
        pb.ProtocolError: pb.Result.INTERNAL_ERROR,
        pb.PCCLError: pb.Result.INTERNAL_ERROR,
    }
    for cls, result in expected.items():
        assert pb.result_of(cls("x")) is result, cls
    assert issubclass(pb.ArgumentValueError, ValueError)
    assert issubclass(pb.ArgumentAssertionError, AssertionError)


def test_argument_errors_have_pccls_types() -> None:
    x = np.zeros(8, np.float32)
    with pytest.raises(AssertionError):
        pb.Communicator("no-port")
    with pytest.raises(AssertionError):
        pb.MasterNode("no-port")
    comm = pb.Communicator("127.0.0.1:1", 0)
    with pytest.raises(pb.InvalidUsageError) as e:
        comm.update_topology()  # before connect(), as PCCL's unit test does
    assert e.value.result is pb.Result.INVALID_USAGE
    with pytest.raises(ValueError) as ve:
        comm.all_reduce(x, [0.0] * 8, op=pb.ReduceOp.SUM)
    assert isinstance(ve.value, pb.InvalidArgumentError)
    assert ve.value.result is pb.Result.INVALID_ARGUMENT
    bad = [
        (np.zeros((4, 4), np.float32)[:, ::2], np.zeros(8, np.float32)),  # not contiguous
        (x, np.zeros(8, np.float64)),  # dtypes differ
        (x, np.zeros(9, np.float32)),  # sizes differ
        (np.zeros(8, bool), np.zeros(8, bool)),  # no such DataType
    ]
    for send, recv in bad:
        with pytest.raises(AssertionError) as ae:
            comm.all_reduce(send, recv, op=pb.ReduceOp.SUM)
        assert ae.value.result is pb.Result.INVALID_ARGUMENT
    with pytest.raises(pb.InvalidArgumentError):
        comm.all_reduce(x, x, op=pb.ReduceOp.SUM,
                        operand_descriptor=pb.ReduceOperandDescriptor(pb.DataType.DOUBLE))
    with pytest.raises(AssertionError):
        pb.SharedState([])
    with pytest.raises(ValueError):
        pb.TensorInfo("t", 0, numel=1, dtype=pb.DataType.FLOAT, device_type=pb.DeviceType.CPU,
                      allow_content_inequality=False)
    with pytest.raises(pb.MasterConnectionError) as me:
        comm.connect(n_attempts=1)  # nothing listens on port 1
    assert isinstance(me.value, Exception)
    assert me.value.result is pb.Result.MASTER_CONNECTION_FAILED
    comm.close()


def test_torch_argument_errors() -> None:
    torch = pytest.importorskip("torch")
    comm = pb.Communicator("127.0.0.1:1", 0)
    t = torch.zeros(8)
    with pytest.raises(ValueError):
        comm.all_reduce(t, np.zeros(8, np.float32), op=pb.ReduceOp.SUM)  # mixed kinds
    with pytest.raises(ValueError):
        comm.all_reduce(torch.zeros(8, dtype=torch.bool), torch.zeros(8, dtype=torch.bool),
                        op=pb.ReduceOp.SUM)
    with pytest.raises(AssertionError):
        comm.all_reduce(torch.zeros(4, 4).t(), torch.zeros(16), op=pb.ReduceOp.SUM)
    with pytest.raises(AssertionError):
        pb.TensorInfo.from_torch(torch.zeros(4, 4).t(), "w")
    assert pb.DataType.from_torch_dtype(torch.bfloat16) is pb.DataType.BFLOAT16
    assert pb.DataType.BFLOAT16.to_torch_dtype() is torch.bfloat16
    comm.close()


def test_torch_tensors_between_two_peers(master: pb.MasterNode) -> None:
    torch = pytest.importorskip("torch")
    a, b = pb.Communicator(master.address, 0), pb.Communicator(master.address, 0)
    try:
        _admit(master, a, b)
        xa = torch.full((300,), 1.5, dtype=torch.bfloat16)
        xb = torch.full((300,), 2.0, dtype=torch.bfloat16)
        ia, oa = torch.arange(10, dtype=torch.int64), torch.zeros(10, dtype=torch.int64)
        wa = torch.linspace(0, 1, 100, dtype=torch.float64)
        wb = torch.zeros(100, dtype=torch.float64)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            other = pool.submit(b.all_reduce, xb, xb, op=pb.ReduceOp.SUM)
            assert a.all_reduce(xa, xa, op=pb.ReduceOp.SUM).local_world_size == 2
            other.result(timeout=WAIT)
            other = pool.submit(b.all_reduce_async(
                ia * 3, torch.zeros(10, dtype=torch.int64), op=pb.ReduceOp.PROD, tag=2).wait)
            ok, status, _ = a.all_reduce_async(ia, oa, op=pb.ReduceOp.PROD, tag=2).wait()
            assert other.result(timeout=WAIT)[0] and (ok, status) == (True, 0)
            sb = pb.SharedState([pb.TensorInfo.from_torch(wb, "w")])
            other = pool.submit(b.sync_shared_state, sb)
            a.sync_shared_state(pb.SharedState([pb.TensorInfo.from_torch(wa, "w")]))
            assert other.result(timeout=WAIT).rx_bytes == wb.numel() * 8
        assert (xa == 3.5).all() and (xb == xa).all()  # exact in bfloat16
        assert (oa == torch.arange(10) ** 2 * 3).all() and (ia == torch.arange(10)).all()
        assert torch.equal(wa, wb)
    finally:
        a.close()
        b.close()


def test_world_of_one_behaves_like_pccl(master: pb.MasterNode) -> None:
    with pb.Communicator(master.address, 0) as comm:
        comm.connect()
        with pytest.raises(pb.InvalidUsageError):
            comm.connect()
        assert comm.get_attribute(pb.Attribute.GLOBAL_WORLD_SIZE) == 1
        assert comm.get_attribute(pccl.Attribute.PEER_GROUP_WORLD_SIZE) == 1  # async enum
        assert comm.are_peers_pending() is False
        x = np.ones(4, np.float32)
        with pytest.raises(pb.TooFewPeersError) as e:
            comm.all_reduce(x, x, op=pb.ReduceOp.SUM)
        assert e.value.result is pb.Result.TOO_FEW_PEERS
        with pytest.raises(pb.PCCLError):
            comm.all_reduce_async(x, x, op=pb.ReduceOp.SUM)  # raised at the call
        with pytest.raises(pb.TooFewPeersError):
            comm.all_reduce_multiple_with_retry([pb.ReduceOpDescriptor.from_numpy(
                x, x, pb.ReduceDescriptor(4, pb.ReduceOp.SUM, 0,
                                          pb.ReduceOperandDescriptor(pb.DataType.FLOAT),
                                          pb.QuantizationOptions()))])
        with pytest.raises(pb.InvalidUsageError):
            comm.optimize_topology()
        comm.update_topology()
        state = pb.SharedState([pb.TensorInfo.from_numpy(x, "x")])
        assert comm.sync_shared_state(state).rx_bytes == 0
        assert (x == 1).all()


def test_two_peers_reduce_from_two_threads(master: pb.MasterNode) -> None:
    a, b = pb.Communicator(master.address, 0, 2), pb.Communicator(master.address, 0, 2)
    try:
        _admit(master, a, b)
        assert a.get_attribute(pb.Attribute.LOCAL_WORLD_SIZE) == 2
        x = np.arange(1000, dtype=np.int64)
        y = np.arange(1000, dtype=np.int64) * 10
        recv = np.zeros(1000, dtype=np.int64)
        # Both peers block in Python threads at once: waiting must release the GIL.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            other = pool.submit(b.all_reduce, y, y, op=pb.ReduceOp.SUM, tag=4)
            info = a.all_reduce(x, recv, op=pb.ReduceOp.SUM, tag=4)
            assert other.result(timeout=WAIT).local_world_size == 2
        assert info.local_world_size == 2 and info.tx_bytes > 0
        assert (recv == np.arange(1000) * 11).all() and (y == recv).all()
        assert (x == np.arange(1000)).all()  # send untouched

        # Async handles: PendingAsyncOps while in flight; wait() is idempotent.
        h = a.all_reduce_async(x, x, op=pb.ReduceOp.MAX, tag=5)
        with pytest.raises(pb.PendingAsyncOpsError) as e:
            a.update_topology()
        assert e.value.result is pb.Result.PENDING_ASYNC_OPS
        assert not h.done()
        hb = b.all_reduce_async(y, y, op=pb.ReduceOp.MAX, tag=5)
        assert hb.wait()[0] and h.wait() == (True, 0, h.wait()[2])
        assert h.done() and h.error is None and (x == y).all()
    finally:
        a.close()
        b.close()


def test_handles_held_when_a_peer_leaves_run_on_the_repaired_ring(master: pb.MasterNode) -> None:
    """Like PCCL: a peer leaving while the others wait for it in a collective costs them
    nothing; the master rebuilds the ring and their handles complete on the survivors."""
    comms = [pb.Communicator(master.address, 0, 2) for _ in range(3)]
    a, b, c = comms
    try:
        _admit(master, a, b, c)
        xs = [np.arange(64, dtype=np.float32) * (i + 1) for i in range(2)]
        handles = [p.all_reduce_async(x, x, op=pb.ReduceOp.SUM, tag=1) for p, x in
                   zip((a, b), xs)]
        master.wait_for(_pending_inits(2))
        c.close()  # leaves while a and b wait for it in the collective
        results = [h.wait() for h in handles]
        assert [(ok, status, info.local_world_size) for ok, status, info in results] == \
            [(True, 0, 2)] * 2
        assert all(h.error is None for h in handles)
        assert all((x == np.arange(64) * 3).all() for x in xs)
        assert a.get_attribute(pb.Attribute.GLOBAL_WORLD_SIZE) == 2
    finally:
        for p in comms:
            p.close()


@pytest.mark.parametrize("auto", [True, False])
def test_without_ring_repair_failed_handles_report_until_update_topology(auto: bool) -> None:
    """``MasterNode(repair_rings=False)``: the held handles fail (nothing written), and so
    does a relaunch, whatever ``auto_update_topology`` says (it is ignored), until every
    surviving peer called update_topology()."""
    with pb.MasterNode("127.0.0.1:0", heartbeat_interval=0.25, heartbeat_timeout=3.0,
                       repair_rings=False) as master:
        comms = [pb.Communicator(master.address, 0, 2, auto_update_topology=auto)
                 for _ in range(3)]
        a, b, c = comms
        try:
            _admit(master, a, b, c)
            xs = [np.arange(64, dtype=np.float32) * (i + 1) for i in range(2)]

            def launch() -> list[pb.AsyncReduceHandle]:
                return [p.all_reduce_async(x, x, op=pb.ReduceOp.SUM, tag=1) for p, x in
                        zip((a, b), xs)]

            handles = launch()
            master.wait_for(_pending_inits(2))
            c.close()  # leaves while a and b wait for it in the collective
            for h, x, i in zip(handles, xs, (1, 2)):
                ok, status, info = h.wait()
                assert (ok, status) == (False, pb.Result.RANK_CONNECTION_LOST.value)
                assert info == pb.ReduceInfo(0, 0, 0)
                assert isinstance(h.error, pb.PeerConnectionError)
                assert (x == np.arange(64) * i).all()  # nothing written on failure
            assert a.get_attribute(pb.Attribute.GLOBAL_WORLD_SIZE) == 2
            # The old ring is still in place: update_topology() on every survivor first.
            assert [h.wait()[1] for h in launch()] == [pb.Result.RANK_CONNECTION_LOST.value] * 2
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                other = pool.submit(b.update_topology)
                a.update_topology()
                other.result(timeout=WAIT)
            results = [h.wait() for h in launch()]
            assert [(ok, status, info.local_world_size) for ok, status, info in results] == \
                [(True, 0, 2)] * 2
            assert all((x == np.arange(64) * 3).all() for x in xs)
        finally:
            for p in comms:
                p.close()


def test_multiple_with_retry_survives_a_peer_leaving(master: pb.MasterNode) -> None:
    comms = [pb.Communicator(master.address, 0, 2) for _ in range(3)]
    try:
        _admit(master, *comms)
        tensors = {i: [np.full(1000, 10.0 ** i, np.float64) for _ in range(4)]
                   for i in range(2)}

        def reduce_all(i: int) -> pb.ReduceInfo:
            descriptors = [pb.ReduceOpDescriptor.from_numpy(t, t, pb.ReduceDescriptor(
                count=t.size, op=pb.ReduceOp.SUM, tag=k,
                operand_descriptor=pb.ReduceOperandDescriptor(pb.DataType.DOUBLE),
                quantization_options=pb.QuantizationOptions(pb.DataType.DOUBLE,
                                                            pb.QuantizationAlgorithm.NONE)))
                for k, t in enumerate(tensors[i])]
            return comms[i].all_reduce_multiple_with_retry(descriptors, max_in_flight=3)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(reduce_all, i) for i in range(2)]
            master.wait_for(_pending_inits(2))  # the first reduces wait for peer 3
            comms[2].close()
            infos = [r.result(timeout=WAIT) for r in runs]
        assert [i.local_world_size for i in infos] == [2, 2]
        assert all(i.tx_bytes > 0 for i in infos)
        for i in range(2):
            for t in tensors[i]:
                assert (t == 11.0).all()
    finally:
        for c in comms:
            c.close()


def test_shared_state_late_joiner_and_raw_pointers(master: pb.MasterNode) -> None:
    a, b = pb.Communicator(master.address, 0), pb.Communicator(master.address, 0)
    try:
        _admit(master, a, b)
        wa = np.linspace(0, 1, 5000, dtype=np.float32)
        wb = np.zeros(5000, dtype=np.float32)
        sa = pb.SharedState([pb.TensorInfo.from_numpy(wa, "w")])
        # PCCL's raw-pointer constructor: the memory stays the caller's.
        sb = pb.SharedState([pb.TensorInfo("w", wb.ctypes.data, numel=wb.size,
                                           dtype=pb.DataType.FLOAT,
                                           device_type=pb.DeviceType.CPU,
                                           allow_content_inequality=False)])
        sa.revision = 7
        with pytest.raises(ValueError):
            sa.revision = -1
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reports: list = []
            other = pool.submit(b.sync_shared_state, sb, pb.SharedStateSyncStrategy.RECEIVE_ONLY,
                                progress=reports.append)
            info_a = a.sync_shared_state(sa)
            info_b = other.result(timeout=WAIT)
        assert (wb == wa).all() and sb.revision == sa.revision == 7
        assert reports[-1].final and reports[-1].rx_bytes == reports[-1].rx_total == wa.nbytes
        assert (info_a.tx_bytes, info_b.rx_bytes) == (wa.nbytes, wa.nbytes)
        for s in (sa, sb):
            s.push_revision()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            other = pool.submit(b.sync_shared_state, sb)
            assert a.sync_shared_state(sa).tx_bytes == 0
            assert other.result(timeout=WAIT).rx_bytes == 0
        assert sa.revision == sb.revision == 8
    finally:
        a.close()
        b.close()


def test_blocking_call_on_the_loop_thread_is_refused(master: pb.MasterNode) -> None:
    with pb.Communicator(master.address, 0) as comm:
        comm.connect()
        loop = comm._loop
        assert loop is not None
        result: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def on_loop() -> None:
            try:
                result.set_result(comm.get_attribute(pb.Attribute.GLOBAL_WORLD_SIZE))
            except BaseException as e:
                result.set_exception(e)

        loop.loop.call_soon_threadsafe(on_loop)
        with pytest.raises(pb.InvalidUsageError):
            result.result(timeout=WAIT)


def test_loop_thread_starts_lazily_and_stops_with_the_last_object() -> None:
    assert not pb.loop_thread_running()
    comm = pb.Communicator("127.0.0.1:1", 0)
    assert not pb.loop_thread_running()  # nothing to run yet
    m1 = pb.MasterNode("127.0.0.1:0")
    m1.run()
    assert pb.loop_thread_running() and len(_loop_threads()) == 1
    comm = pb.Communicator(m1.address, 0)
    comm.connect()
    m1.interrupt()
    assert pb.loop_thread_running()  # the communicator still holds it
    comm.close()
    assert not pb.loop_thread_running() and not _loop_threads()
    m1.interrupt()  # idempotent
    with pytest.raises(pb.InvalidUsageError):
        m1.run()  # an interrupted master does not come back
    with pb.MasterNode("127.0.0.1:0") as m2:  # a fresh loop for a fresh object
        assert pb.loop_thread_running()
        with pytest.raises(pb.InvalidArgumentError):
            m2.run()  # already running (PCCL: INVALID_ARGUMENT)
    assert not pb.loop_thread_running()


def _run_python(code: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=WAIT, cwd=ROOT, **kwargs)


def test_interpreter_exit_closes_what_is_left_open() -> None:
    # PCCL's own unit tests drop connected communicators without destroying them.
    code = """if True:
        import threading, numpy as np
        import pccl.blocking as pccl
        m = pccl.MasterNode("127.0.0.1:0")
        m.run()
        def connect():
            c = pccl.Communicator(m.address, 0)
            c.connect()
        connect()          # dropped: closed in the background
        kept = pccl.Communicator(m.address, 0)
        kept.connect()     # never closed: closed at exit
        m.interrupt()
        print("ok", flush=True)
    """
    done = _run_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert "Traceback" not in done.stderr and "never awaited" not in done.stderr, done.stderr


def test_ctrl_c_calls_a_blocked_reduce_off(master: pb.MasterNode) -> None:
    a, b = pb.Communicator(master.address, 0), pb.Communicator(master.address, 0)
    try:
        _admit(master, a, b)
        x = np.arange(100, dtype=np.float32)

        def interrupt_once_a_waits() -> None:
            try:
                master.wait_for(_pending_inits(1))
            finally:
                # Always interrupt, so the main thread cannot wait forever for a reduce
                # b never joins; a failed wait_for still fails the test below.
                os.kill(os.getpid(), signal.SIGINT)

        # A process started in the background by a non-interactive shell (as CI may
        # be) inherits SIGINT ignored; Ctrl-C is what this test is about, so restore it.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                sender = pool.submit(interrupt_once_a_waits)
                with pytest.raises(KeyboardInterrupt):
                    a.all_reduce(x, x, op=pb.ReduceOp.SUM)  # b never joins this one
                sender.result(timeout=WAIT)
        finally:
            signal.signal(signal.SIGINT, previous)
        # The reduce was called off at the master, not left waiting for b.
        master.wait_for(lambda s: not s.collectives)
        assert (x == np.arange(100)).all()
        # The tag is free again and both peers reduce normally.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            other = pool.submit(b.all_reduce, x.copy(), np.zeros(100, np.float32),
                                op=pb.ReduceOp.SUM)
            assert a.all_reduce(x, x, op=pb.ReduceOp.SUM).local_world_size == 2
            assert other.result(timeout=WAIT).local_world_size == 2
        assert (x == np.arange(100) * 2).all()
    finally:
        a.close()
        b.close()


def test_blocking_rank_world_size_and_last_synced_revision(master: pb.MasterNode) -> None:
    a, b = pb.Communicator(master.address, 0), pb.Communicator(master.address, 0)
    try:
        _admit(master, a, b)
        assert (a.rank, b.rank) == (0, 1) and a.world_size == b.world_size == 2
        assert a.last_synced_revision is None
        wa, wb = np.ones(8, np.float32), np.ones(8, np.float32)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            other = pool.submit(b.sync_shared_state,
                                pb.SharedState([pb.TensorInfo.from_numpy(wb, "w")]))
            a.sync_shared_state(pb.SharedState([pb.TensorInfo.from_numpy(wa, "w")]))
            other.result(timeout=WAIT)
        assert a.last_synced_revision == b.last_synced_revision == 0
    finally:
        a.close()
        b.close()
