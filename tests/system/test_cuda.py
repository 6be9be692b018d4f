"""CUDA tensors through pccl.staging on a real GPU (skipped without one): parity with the
host path, out of place, all or nothing, the content hash, pccl.blocking's view. The
pipeline's logic is tested without a GPU in tests/unit/test_staging.py and
tests/integration/test_staging_cluster.py; bench/cuda_check.sh runs these on a GPU host."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import pccl
from pccl import staging

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "PIECE_BYTES", 1 << 20)


def inputs(n: int, count: int, dtype=None) -> list:
    gen = torch.Generator().manual_seed(count)
    return [torch.randn(count, generator=gen, dtype=dtype or torch.float32) for _ in range(n)]


@pytest.mark.parametrize("dtype,op", [(torch.float32, pccl.ReduceOp.SUM),
                                      (torch.bfloat16, pccl.ReduceOp.AVG),
                                      (torch.float64, pccl.ReduceOp.MAX)])
async def test_cuda_equals_host_bit_for_bit(pccl_cluster, dtype, op) -> None:
    cluster = await pccl_cluster(2)
    xs = inputs(2, (3 << 20) // 4 + 17, dtype)
    devs = [x.cuda() for x in xs]
    infos = await asyncio.gather(*(c.all_reduce(d, op=op) for c, d in zip(cluster.comms, devs)))
    hosts = [x.clone() for x in xs]
    await asyncio.gather(*(c.all_reduce(h, op=op) for c, h in zip(cluster.comms, hosts)))
    for d, h in zip(devs, hosts):
        assert torch.equal(d.cpu().view(torch.uint8), h.view(torch.uint8))
    assert {i.algorithm for i in infos} == {"staged"}


async def test_out_of_place_and_the_caller_stream(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    xs = inputs(2, 1 << 20)
    devs, outs = [], []
    for x in xs:
        d = torch.zeros_like(x, device="cuda")
        d.add_(x.cuda())  # queued on the current stream: the staging must wait for it
        devs.append(d)
        outs.append(torch.empty_like(d))
    await asyncio.gather(*(c.all_reduce(d, o) for c, d, o in zip(cluster.comms, devs, outs)))
    assert torch.equal(outs[0].cpu(), xs[0] + xs[1])
    assert torch.equal(devs[1].cpu(), xs[1])


async def test_a_failed_piece_leaves_the_cuda_tensors_unchanged(pccl_cluster,
                                                                monkeypatch) -> None:
    cluster = await pccl_cluster(2)
    xs = inputs(2, 3 << 20)
    devs = [x.cuda() for x in xs]
    odd = cluster.comms[1]
    launch, bad = odd._launch_all_reduce, staging.piece_tag(0, 5)
    monkeypatch.setattr(odd, "_launch_all_reduce", lambda s, d, op, tag, q, w: launch(
        s, d, pccl.ReduceOp.MAX if tag == bad else op, tag, q, w))
    outcomes = await asyncio.gather(*(c.all_reduce(d) for c, d in zip(cluster.comms, devs)),
                                    return_exceptions=True)
    assert all(isinstance(e, pccl.InvalidUsageError) for e in outcomes), outcomes
    assert all(torch.equal(d.cpu(), x) for d, x in zip(devs, xs))


def test_content_hash_of_cuda_equals_host() -> None:
    x = inputs(1, (5 << 20) // 4 + 3)[0]
    assert pccl.content_hash(x.cuda()) == pccl.content_hash(x)
    assert pccl.content_hash(x.cuda()[::2]) == pccl.content_hash(x[::2].contiguous())
    assert pccl.content_hash(np.zeros(0, np.float32)) == pccl.content_hash(
        torch.zeros(0, device="cuda"))


def test_blocking_sees_cuda() -> None:
    import pccl.blocking as pb

    assert pb.cuda.is_available() and pb.cuda.is_cuda_available
    t = torch.ones(4, device="cuda")
    assert pb.DeviceType.from_torch_device_type(t.device.type) is pb.DeviceType.CUDA
