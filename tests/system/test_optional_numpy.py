"""numpy is optional, as in PCCL: a torch-only program imports pccl, runs a master and
peers, reduces, syncs shared state and optimizes the topology without numpy installed.

The programs run in a child interpreter whose import path holds pccl, torch and what
they require, and not numpy (see bare_env)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import bare_env
import pytest

ASYNC_PROGRAM = """
import asyncio, sys, warnings
warnings.simplefilter("ignore")  # torch says once that numpy is missing
import torch
import pccl

async def main():
    async with pccl.MasterNode("127.0.0.1:0") as master:
        a, b = (pccl.Communicator(master.address, p2p_listen_host="127.0.0.1")
                for _ in range(2))
        await a.connect()
        joining = asyncio.create_task(b.connect())
        await master.wait_for(lambda s: len(s.pending()) == 1)
        assert await a.are_peers_pending()
        await a.update_topology()
        await joining
        try:
            xs = [torch.full((1000,), float(i + 1)) for i in range(2)]
            await asyncio.gather(a.all_reduce(xs[0]), b.all_reduce(xs[1]))
            assert all(torch.equal(x, torch.full((1000,), 3.0)) for x in xs)
            bf = [torch.full((64,), 1.5, dtype=torch.bfloat16) for _ in range(2)]
            out = [torch.empty(64, dtype=torch.bfloat16) for _ in range(2)]
            await asyncio.gather(*(c.all_reduce(x, out=o) for c, x, o in zip((a, b), bf, out)))
            assert all(torch.equal(o, torch.full((64,), 3.0, dtype=torch.bfloat16)) for o in out)
            assert torch.equal(bf[0], torch.full((64,), 1.5, dtype=torch.bfloat16))
            ys = [torch.full((99,), i + 1, dtype=torch.int64) for i in range(2)]
            await asyncio.gather(*(c.all_reduce_async(y, tag=7) for c, y in zip((a, b), ys)))
            assert all(torch.equal(y, torch.full((99,), 3, dtype=torch.int64)) for y in ys)
            ds = [[pccl.ReduceDescriptor(torch.full((77,), float(k + i)), tag=10 + k)
                   for k in range(3)] for i in range(2)]
            await asyncio.gather(*(c.all_reduce_multiple_with_retry(d, 2)
                                   for c, d in zip((a, b), ds)))
            assert all(torch.equal(ds[0][k].tensor, torch.full((77,), 2.0 * k + 1))
                       for k in range(3))
            q = pccl.QuantizationOptions(pccl.QuantizationAlgorithm.MIN_MAX, pccl.DataType.UINT8)
            qs = [torch.linspace(0, 1, 256) for _ in range(2)]
            await asyncio.gather(*(c.all_reduce(x, quantization=q, tag=3)
                                   for c, x in zip((a, b), qs)))
            assert torch.equal(qs[0], qs[1])
            ws = [torch.arange(4096, dtype=torch.float32) * (i + 1) for i in range(2)]
            states = [pccl.SharedState([pccl.TensorInfo.from_torch(w, "w")]) for w in ws]
            await asyncio.gather(*(c.sync_shared_state(s, strategy=st) for c, s, st in zip(
                (a, b), states, (pccl.SharedStateSyncStrategy.SEND_ONLY,
                                 pccl.SharedStateSyncStrategy.RECEIVE_ONLY))))
            assert torch.equal(ws[0], ws[1])
            assert pccl.content_hash(ws[0]) == pccl.content_hash(ws[1])
            await asyncio.gather(a.optimize_topology(), b.optimize_topology())
        finally:
            await asyncio.gather(a.close(), b.close())

asyncio.run(main())
assert "numpy" not in sys.modules, "numpy was imported"
print("OK")
"""

BLOCKING_PROGRAM = """
import sys, threading, warnings
warnings.simplefilter("ignore")
import torch
import pccl.blocking as pccl

with pccl.MasterNode("127.0.0.1:0") as master:
    a, b = pccl.Communicator(master.address, 0), pccl.Communicator(master.address, 0)
    a.connect()
    joiner = threading.Thread(target=b.connect)
    joiner.start()
    master.wait_for(lambda s: len(s.pending()) == 1)
    assert a.are_peers_pending()
    a.update_topology()
    joiner.join(60)
    xa, xb = torch.full((300,), 1.0), torch.full((300,), 2.0)
    other = threading.Thread(target=b.all_reduce, args=(xb, xb),
                             kwargs={"op": pccl.ReduceOp.SUM})
    other.start()
    a.all_reduce(xa, xa, op=pccl.ReduceOp.SUM)
    other.join(60)
    assert torch.equal(xa, torch.full((300,), 3.0)) and torch.equal(xa, xb)

    def both(fa, fb):
        other = threading.Thread(target=fb)
        other.start()
        fa()
        other.join(60)
        assert not other.is_alive()

    # bfloat16 and float32 by raw pointer (PCCL's constructor), then quantized
    ts = [[torch.full((50,), float(i + 1), dtype=dt) for dt in (torch.bfloat16, torch.float32)]
          for i in range(2)]
    ds = [[pccl.ReduceOpDescriptor(t.data_ptr(), t.data_ptr(), pccl.ReduceDescriptor(
        50, pccl.ReduceOp.SUM, 20 + k,
        pccl.ReduceOperandDescriptor(pccl.DataType.from_torch_dtype(t.dtype)),
        pccl.QuantizationOptions(pccl.DataType.UINT8, pccl.QuantizationAlgorithm.NONE)))
        for k, t in enumerate(tt)] for tt in ts]
    both(lambda: a.all_reduce_multiple_with_retry(ds[0]),
         lambda: b.all_reduce_multiple_with_retry(ds[1]))
    assert all(torch.equal(t, torch.full((50,), 3.0, dtype=t.dtype)) for t in ts[0] + ts[1])
    qs = [torch.linspace(0, 1, 256) for _ in range(2)]
    handles = []
    both(lambda: handles.append(a.all_reduce_async(qs[0], qs[0], op=pccl.ReduceOp.SUM, tag=3,
                                                   quantization_options=pccl.QuantizationOptions())),
         lambda: b.all_reduce(qs[1], qs[1], op=pccl.ReduceOp.SUM, tag=3,
                              quantization_options=pccl.QuantizationOptions()))
    assert handles[0].wait()[0] and torch.equal(qs[0], qs[1])
    ws = [torch.arange(4096, dtype=torch.bfloat16) * (i + 1) for i in range(2)]
    states = [pccl.SharedState([pccl.TensorInfo.from_torch(w, "w")]) for w in ws]
    both(lambda: a.sync_shared_state(states[0], pccl.SharedStateSyncStrategy.SEND_ONLY),
         lambda: b.sync_shared_state(states[1], pccl.SharedStateSyncStrategy.RECEIVE_ONLY))
    assert torch.equal(ws[0], ws[1])
    a.close()
    b.close()
assert "numpy" not in sys.modules, "numpy was imported"
print("OK")
"""


def run(tmp: Path, program: str, names: list[str]) -> subprocess.CompletedProcess[str]:
    env = bare_env.environment(tmp, names, without={"numpy"})
    assert not (tmp / "site" / "numpy").exists()
    return subprocess.run([sys.executable, "-S", "-c", textwrap.dedent(program)], env=env,
                          capture_output=True, text=True, timeout=240, check=False)


def test_pccl_imports_with_neither_numpy_nor_torch(tmp_path: Path) -> None:
    done = run(tmp_path, """
        import sys
        import pccl, pccl.blocking
        pccl.SharedState([pccl.TensorInfo.from_numpy(bytearray(8), "w")])
        assert "numpy" not in sys.modules and "torch" not in sys.modules
        try:
            pccl.content_hash(bytearray(8))
        except pccl.InvalidArgumentError as e:
            assert "needs numpy" in str(e), e
        else:
            raise SystemExit("content_hash of a buffer worked without numpy?")
        print("OK")
        """, ["pccl"])
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stdout + done.stderr


def test_a_master_without_numpy_keeps_the_ring_on_optimize_topology(tmp_path: Path) -> None:
    # Rings of 3 or more are solved on the master (pccl.topology, numpy): without numpy
    # optimize_topology() succeeds on every peer, the ring stays, the master says why.
    done = run(tmp_path, """
        import asyncio, logging, sys
        import pccl
        from pccl.testing import Cluster

        said = []
        handler = logging.Handler()
        handler.emit = lambda record: said.append(record.getMessage())
        logging.getLogger("pccl.master").addHandler(handler)

        async def main():
            async with Cluster(3, comm_kwargs={"p2p_listen_host": "127.0.0.1"}) as cluster:
                await asyncio.gather(*(c.optimize_topology() for c in cluster.comms))
                await asyncio.gather(*(c.update_topology() for c in cluster.comms))

        asyncio.run(main())
        assert any("no numpy" in s and "pip install numpy" in s for s in said), said
        assert "numpy" not in sys.modules and "torch" not in sys.modules
        try:
            import pccl.topology
        except ModuleNotFoundError as e:
            assert e.name == "numpy" and "pip install numpy" in str(e), e
        else:
            raise SystemExit("pccl.topology imported without numpy?")
        print("OK")
        """, ["pccl"])
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stdout + done.stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize("api", ["asyncio", "blocking"])
def test_a_torch_only_program_runs_without_numpy(tmp_path: Path, api: str) -> None:
    pytest.importorskip("torch")
    program = ASYNC_PROGRAM if api == "asyncio" else BLOCKING_PROGRAM
    done = run(tmp_path, program, ["pccl", "torch"])
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), \
        done.stdout[-3000:] + done.stderr[-5000:]
