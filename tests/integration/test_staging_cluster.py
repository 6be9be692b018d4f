"""Device tensors on in-process clusters, staged through host buffers: a FakeDevice
stands in for the GPU (tests/system/test_cuda.py runs the same on CUDA). Results equal
the host path's bytes, all or nothing across peers, typed errors, misuse refused."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

import pccl
from pccl import staging
from pccl.testing.fake_device import FakeDevice, FakeDeviceError

PIECE = 16 << 10


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "PIECE_BYTES", PIECE)


@pytest.fixture
def devs() -> Iterator[list[FakeDevice]]:
    ds = [FakeDevice(delay=0.0002) for _ in range(3)]
    yield ds
    for d in ds:
        d.close()


def inputs(n: int, count: int, dtype: str = "float32") -> list[np.ndarray]:
    rng = np.random.default_rng(count)
    if dtype.startswith("float"):
        return [rng.standard_normal(count).astype(dtype) for _ in range(n)]
    return [rng.integers(-1000, 1000, count).astype(dtype) for _ in range(n)]


@pytest.mark.parametrize("comm_kwargs", [{}, {"via_master_max_bytes": 0}],
                         ids=["default", "ring_only"])
@pytest.mark.parametrize("op,dtype", [(pccl.ReduceOp.SUM, "float32"),
                                      (pccl.ReduceOp.AVG, "float64"),
                                      (pccl.ReduceOp.MAX, "int32")])
async def test_equals_the_host_path_bit_for_bit(pccl_cluster, devs, comm_kwargs, op,
                                                dtype) -> None:
    cluster = await pccl_cluster(2, comm_kwargs=comm_kwargs)
    xs = inputs(2, 10_000 + 3, dtype)
    ts = [d.put(x) for d, x in zip(devs, xs)]
    infos = await asyncio.gather(*(c.all_reduce(t, op=op, tag=5)
                                   for c, t in zip(cluster.comms, ts)))
    hosts = [x.copy() for x in xs]
    await asyncio.gather(*(c.all_reduce(h, op=op, tag=5) for c, h in zip(cluster.comms, hosts)))
    for t, h in zip(ts, hosts):
        assert t.numpy().tobytes() == h.tobytes()
    assert {i.algorithm for i in infos} == {"staged"} and {i.world_size for i in infos} == {2}
    assert infos[0].tx_bytes >= xs[0].nbytes // 2


async def test_three_peers_agree_and_out_of_place(pccl_cluster, devs) -> None:
    cluster = await pccl_cluster(3)
    xs = inputs(3, 20_000)
    ts = [d.put(x) for d, x in zip(devs, xs)]
    outs = [d.put(np.zeros_like(x)) for d, x in zip(devs, xs)]
    await asyncio.gather(*(c.all_reduce(t, o, op=pccl.ReduceOp.SUM)
                           for c, t, o in zip(cluster.comms, ts, outs)))
    results = [o.numpy() for o in outs]
    assert all(r.tobytes() == results[0].tobytes() for r in results)
    np.testing.assert_allclose(results[0], sum(x.astype(np.float64) for x in xs), rtol=1e-5,
                               atol=1e-5)
    assert all(np.array_equal(t.numpy(), x) for t, x in zip(ts, xs))


async def test_a_failed_middle_piece_leaves_every_tensor_unchanged(pccl_cluster, devs,
                                                                   monkeypatch) -> None:
    cluster = await pccl_cluster(2)
    xs = inputs(2, 20_000)
    ts = [d.put(x) for d, x in zip(devs, xs)]
    odd = cluster.comms[1]
    launch = odd._launch_all_reduce
    bad_tag = staging.piece_tag(0, 2)

    def disagreeing(src, dst, op, tag, q, wire):
        # Peer 1 asks for MAX on piece 2: the master refuses that piece to both peers.
        return launch(src, dst, pccl.ReduceOp.MAX if tag == bad_tag else op, tag, q, wire)

    monkeypatch.setattr(odd, "_launch_all_reduce", disagreeing)
    outcomes = await asyncio.gather(*(c.all_reduce(t, op=pccl.ReduceOp.SUM)
                                      for c, t in zip(cluster.comms, ts)),
                                    return_exceptions=True)
    assert all(isinstance(e, pccl.InvalidUsageError) for e in outcomes), outcomes
    assert all("disagree" in str(e) for e in outcomes)
    assert all(np.array_equal(t.numpy(), x) for t, x in zip(ts, xs))
    # The group is in step: the next call works.
    monkeypatch.setattr(odd, "_launch_all_reduce", launch)
    await asyncio.gather(*(c.all_reduce(t, op=pccl.ReduceOp.SUM)
                           for c, t in zip(cluster.comms, ts)))
    assert np.array_equal(ts[0].numpy(), xs[0] + xs[1])


async def test_a_device_fault_on_one_peer_fails_every_peer(pccl_cluster, devs) -> None:
    cluster = await pccl_cluster(2)
    xs = inputs(2, 20_000)
    with FakeDevice(fail=[("d2h", 3 * PIECE)]) as broken:
        ts = [devs[0].put(xs[0]), broken.put(xs[1])]
        outcomes = await asyncio.gather(*(c.all_reduce(t, op=pccl.ReduceOp.SUM)
                                          for c, t in zip(cluster.comms, ts)),
                                        return_exceptions=True)
        assert isinstance(outcomes[0], pccl.CollectiveAbortedError), outcomes
        assert isinstance(outcomes[1], FakeDeviceError), outcomes
        assert all(np.array_equal(t.numpy(), x) for t, x in zip(ts, xs))


async def test_retry_helper_and_mixed_tensors(pccl_cluster, devs) -> None:
    cluster = await pccl_cluster(2)
    xs = inputs(2, 5_000)
    ts = [d.put(x) for d, x in zip(devs, xs)]
    hosts = [x.copy() for x in xs]
    await asyncio.gather(*(c.all_reduce_multiple_with_retry([
        pccl.ReduceDescriptor(t, tag=1), pccl.ReduceDescriptor(h, tag=2)])
        for c, t, h in zip(cluster.comms, ts, hosts)))
    assert np.array_equal(ts[1].numpy(), xs[0] + xs[1])
    assert np.array_equal(hosts[0], xs[0] + xs[1])


async def test_misuse_is_refused(pccl_cluster, devs) -> None:
    cluster = await pccl_cluster(2)
    comm = cluster.comms[0]
    t = devs[0].put(np.ones(100, np.float32))
    with pytest.raises(pccl.InvalidArgumentError, match="must both be in host memory"):
        comm.all_reduce_async(t, np.zeros(100, np.float32))
    with pytest.raises(pccl.InvalidArgumentError, match="must both be in host memory"):
        comm.all_reduce_async(np.ones(100, np.float32), t)
    with pytest.raises(pccl.InvalidArgumentError, match="out has"):
        comm.all_reduce_async(t, devs[0].put(np.ones(99, np.float32)))
    with pytest.raises(pccl.InvalidArgumentError, match="range pccl keeps"):
        comm.all_reduce_async(np.ones(4, np.float32), tag=staging.STAGED_TAG_BASE)
    with pytest.raises(pccl.InvalidArgumentError, match="too large"):
        comm.all_reduce_async(t, tag=staging.MAX_STAGED_TAG + 1)
    handle = comm.all_reduce_async(t, tag=9)
    with pytest.raises(pccl.InvalidUsageError, match="in flight"):
        comm.all_reduce_async(np.ones(4, np.float32), tag=9)
    handle.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert np.array_equal(t.numpy(), np.ones(100, np.float32))
