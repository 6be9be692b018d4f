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


@pytest.mark.multiprocess
@pytest.mark.parametrize("api", ["asyncio", "blocking"])
def test_a_torch_only_program_runs_without_numpy(tmp_path: Path, api: str) -> None:
    pytest.importorskip("torch")
    program = ASYNC_PROGRAM if api == "asyncio" else BLOCKING_PROGRAM
    done = run(tmp_path, program, ["pccl", "torch"])
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), \
        done.stdout[-3000:] + done.stderr[-5000:]
