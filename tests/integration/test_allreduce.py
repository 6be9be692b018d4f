"""In-process ring all-reduce: every dtype x op, bit-identical across peers, exact
against a reference computed in the ring's order; odd sizes; concurrency; misuse."""

from __future__ import annotations

import array
import asyncio

import numpy as np
import pytest
from reference import (
    FLOAT_DTYPES,
    INT_DTYPES,
    OPS,
    in_ring_order,
    random_input,
    reference,
    ring_reference,
)

import pccl
from pccl.protocol import messages as m
from pccl.testing import HeldMessage

try:  # imported up front: a first import inside a test would stall the event loop
    import torch
except ImportError:  # torch is optional
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


def as_bf16_tensor(bits: np.ndarray):
    """bfloat16 input for pccl: a torch tensor if torch is there, else ml_dtypes."""
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)


def tensor_for(dtype: str, data: np.ndarray):
    return as_bf16_tensor(data) if dtype == "bfloat16" else data.copy()


def bytes_of(t) -> bytes:
    if type(t).__module__.startswith("torch"):
        return t.view(torch.int16).numpy().tobytes()
    return t.tobytes()


async def reduce_all(cluster, tensors, op, tag=0, **kw):
    return await asyncio.gather(*(c.all_reduce(t, op=op, tag=tag, **kw)
                                  for c, t in zip(cluster.comms, tensors)))


# The paths of a small all-reduce: reduced by the master (the default below 64 KiB),
# the ring started early (one master round trip), the ring after the master's perform
# (two), each of those on the mesh instead (recursive doubling). Each must give the
# very bytes of its algorithm's reduction order (the master replays the ring's).
NO_MESH, MESH = {"mesh_max_bytes": 0}, {"mesh_max_bytes": 1 << 20}
PATHS = {"via_master": ({}, NO_MESH, "master"),
         "early_ring": ({"via_master_max_bytes": 0}, NO_MESH, "ring"),
         "performed_ring": ({"via_master_max_bytes": 0, "early_start_max_bytes": 0}, NO_MESH,
                            "ring"),
         "early_mesh": ({"via_master_max_bytes": 0}, MESH, "mesh"),
         "performed_mesh": ({"via_master_max_bytes": 0, "early_start_max_bytes": 0}, MESH,
                            "mesh")}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("world", [2, 3, 4, 5])
async def test_every_dtype_and_op_is_exact_and_bit_identical(pccl_cluster, world,
                                                               path) -> None:
    comm_kwargs, master_kwargs, algorithm = PATHS[path]
    cluster = await pccl_cluster(world, pool_size=2, comm_kwargs=comm_kwargs,
                                 master_kwargs=master_kwargs)
    count = 37  # not a multiple of any world size
    for dtype in INT_DTYPES + FLOAT_DTYPES:
        if dtype == "bfloat16" and torch is None:
            continue  # bfloat16 tensors come from torch here
        for op in OPS:
            inputs = [random_input(dtype, count, seed=100 * world + r, op=op)
                      for r in range(world)]
            tensors = [tensor_for(dtype, x) for x in inputs]
            infos = await reduce_all(cluster, tensors, op)
            assert all(i.world_size == world for i in infos)
            assert {i.algorithm for i in infos} == {algorithm}
            expected = reference(algorithm, in_ring_order(cluster.comms, inputs), op,
                                 dtype).tobytes()
            got = [bytes_of(t) for t in tensors]
            assert got[0] == expected, (dtype, op)
            assert all(g == got[0] for g in got), (dtype, op)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
async def test_float_results_are_close_to_the_exact_sum(pccl_cluster, dtype) -> None:
    """Documented tolerance: the ring's order differs from a float64 sum only by
    rounding; relative error stays within world * eps."""
    cluster = await pccl_cluster(4)
    inputs = [random_input(dtype, 10_000, seed=r, op=pccl.ReduceOp.SUM) for r in range(4)]
    tensors = [x.copy() for x in inputs]
    await reduce_all(cluster, tensors, pccl.ReduceOp.SUM)
    exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)
    eps = np.finfo(dtype).eps
    scale = np.sum([np.abs(x.astype(np.float64)) for x in inputs], axis=0)
    assert np.all(np.abs(tensors[0] - exact) <= 4 * eps * scale)


@pytest.mark.parametrize("count", [0, 1, 2, 3, 5, 101, 16_385, 65_537])
async def test_odd_sizes(pccl_cluster, count) -> None:
    cluster = await pccl_cluster(3)
    inputs = [np.arange(count, dtype=np.int64) * (r + 1) for r in range(3)]
    tensors = [x.copy() for x in inputs]
    await reduce_all(cluster, tensors, pccl.ReduceOp.SUM)
    for t in tensors:
        np.testing.assert_array_equal(t, np.arange(count, dtype=np.int64) * 6)


async def test_large_buffer_spans_many_pieces(pccl_cluster) -> None:
    cluster = await pccl_cluster(3, pool_size=3, comm_kwargs={"piece_bytes": 64 << 10},
                                 master_kwargs=NO_MESH)
    n = (4 << 20) // 4 + 7
    inputs = [random_input("float32", n, seed=r, op=pccl.ReduceOp.AVG) for r in range(3)]
    tensors = [x.copy() for x in inputs]
    infos = await reduce_all(cluster, tensors, pccl.ReduceOp.AVG)
    expected = ring_reference(in_ring_order(cluster.comms, inputs), pccl.ReduceOp.AVG, "float32")
    for t in tensors:
        assert t.tobytes() == expected.tobytes()
    # Each peer sends 2(k-1)/k of the buffer plus headers.
    payload = 2 * 2 * n * 4 // 3
    assert payload <= infos[0].tx_bytes <= payload * 1.01 + 64 * 1024


async def test_out_leaves_the_input_alone(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    xs = [np.full(10, r + 1, dtype=np.float32) for r in range(2)]
    ys = [np.zeros(10, dtype=np.float32) for _ in range(2)]
    await asyncio.gather(*(c.all_reduce(x, out=y, op=pccl.ReduceOp.MAX)
                           for c, x, y in zip(cluster.comms, xs, ys)))
    for r, (x, y) in enumerate(zip(xs, ys)):
        np.testing.assert_array_equal(x, np.full(10, r + 1, dtype=np.float32))
        np.testing.assert_array_equal(y, np.full(10, 2, dtype=np.float32))


async def test_read_only_input_is_fine_with_out(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    xs = [np.ones(8, dtype=np.int32) for _ in range(2)]
    for x in xs:
        x.flags.writeable = False
    ys = [np.empty(8, dtype=np.int32) for _ in range(2)]
    await asyncio.gather(*(c.all_reduce(x, out=y) for c, x, y in zip(cluster.comms, xs, ys)))
    assert all((y == 2).all() for y in ys)


async def test_concurrent_async_reduces_with_distinct_tags(pccl_cluster) -> None:
    cluster = await pccl_cluster(3)
    shapes = {1: ("float32", 1000), 2: ("int64", 77), 3: ("float64", 5000), 4: ("uint8", 3)}
    inputs = {tag: [random_input(dt, n, seed=tag * 10 + r, op=pccl.ReduceOp.SUM)
                    for r in range(3)] for tag, (dt, n) in shapes.items()}
    tensors = {tag: [x.copy() for x in xs] for tag, xs in inputs.items()}
    handles = []
    for r, c in enumerate(cluster.comms):
        # Each peer starts the reduces in a different order.
        order = list(shapes) if r % 2 == 0 else list(reversed(shapes))
        for tag in order:
            handles.append(c.all_reduce_async(tensors[tag][r], op=pccl.ReduceOp.SUM, tag=tag))
    infos = await asyncio.gather(*handles)
    algorithms: dict[int, set[str]] = {}
    for r in range(len(cluster.comms)):
        order = list(shapes) if r % 2 == 0 else list(reversed(shapes))
        for tag in order:
            algorithms.setdefault(tag, set()).add(infos.pop(0).algorithm)
    for tag, (dt, _) in shapes.items():
        assert len(algorithms[tag]) == 1, algorithms  # every peer ran the same one
        expected = reference(algorithms[tag].pop(), in_ring_order(cluster.comms, inputs[tag]),
                             pccl.ReduceOp.SUM, dt).tobytes()
        assert all(t.tobytes() == expected for t in tensors[tag]), tag


async def test_world_size_one_returns_the_input(pccl_cluster) -> None:
    cluster = await pccl_cluster(1)
    x = np.arange(5, dtype=np.float32)
    info = await cluster.comms[0].all_reduce(x, op=pccl.ReduceOp.AVG)
    np.testing.assert_array_equal(x, np.arange(5, dtype=np.float32))
    # Alone, the master reduces it: 20 bytes there and back, no ring.
    assert info == pccl.ReduceInfo(tx_bytes=20, rx_bytes=20, world_size=1)
    y = np.zeros(5, dtype=np.float32)
    await cluster.comms[0].all_reduce(x, out=y, op=pccl.ReduceOp.SUM)
    np.testing.assert_array_equal(y, x)


async def test_buffer_protocol_and_dlpack_inputs(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    bufs = [array.array("i", [1, 2, 3]) for _ in range(2)]
    await reduce_all(cluster, bufs, pccl.ReduceOp.SUM)
    assert [list(b) for b in bufs] == [[2, 4, 6]] * 2
    raw = [bytearray(b"\x01\x02") for _ in range(2)]
    await reduce_all(cluster, raw, pccl.ReduceOp.SUM)
    assert raw == [bytearray(b"\x02\x04")] * 2


@needs_torch
async def test_torch_tensors_in_place(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.float16):
        ts = [torch.full((3, 4), float(r + 1), dtype=dtype) for r in range(2)]
        await reduce_all(cluster, ts, pccl.ReduceOp.SUM)
        for t in ts:
            assert torch.equal(t, torch.full((3, 4), 3.0, dtype=dtype))


@pytest.mark.parametrize("make_bad", [
    lambda: np.arange(20, dtype=np.float32)[::2],          # non-contiguous
    lambda: np.ones((4, 4), dtype=np.float32).T,           # Fortran order
    lambda: np.ones(3, dtype=np.complex64),                # unsupported dtype
    lambda: np.ones(3, dtype=bool),
    lambda: "not a tensor",
], ids=["strided", "transposed", "complex", "bool", "str"])
async def test_bad_tensors_are_invalid_argument(pccl_cluster, make_bad) -> None:
    cluster = await pccl_cluster(1)
    with pytest.raises(pccl.InvalidArgumentError):
        await cluster.comms[0].all_reduce(make_bad())


async def test_read_only_in_place_and_mismatched_out_are_invalid(pccl_cluster) -> None:
    cluster = await pccl_cluster(1)
    (c,) = cluster.comms
    ro = np.ones(4, dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises(pccl.InvalidArgumentError, match="read-only"):
        await c.all_reduce(ro)
    with pytest.raises(pccl.InvalidArgumentError):
        await c.all_reduce(np.ones(4, dtype=np.float32), out=np.ones(5, dtype=np.float32))
    with pytest.raises(pccl.InvalidArgumentError):
        await c.all_reduce(np.ones(4, dtype=np.float32), out=np.ones(4, dtype=np.float64))
    with pytest.raises(pccl.InvalidArgumentError):
        await c.all_reduce(np.ones(4, dtype=np.float32), op=17)


async def test_reused_in_flight_tag_is_invalid_usage(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    a, b = cluster.comms
    x, y, z = (np.ones(4, dtype=np.float32) for _ in range(3))
    first = a.all_reduce_async(x, tag=5)
    with pytest.raises(pccl.InvalidUsageError, match="tag 5"):
        a.all_reduce_async(y, tag=5)
    await asyncio.gather(first, b.all_reduce(z, tag=5))
    assert (x == 2).all()


@pytest.mark.parametrize(("field", "words"), [
    ("count", ["10 x FLOAT32 (shape 10)", "11 x FLOAT32 (shape 11)"]),
    ("dtype", ["10 x FLOAT32", "10 x FLOAT64"]),
    ("op", ["op SUM", "op MAX"]),
    ("shape", ["10 x FLOAT32 (shape 2x5)", "10 x FLOAT32 (shape 5x2)"]),
])
async def test_peers_disagreeing_all_get_invalid_usage(pccl_cluster, field, words) -> None:
    cluster = await pccl_cluster(3)
    xs = [np.ones(10, dtype=np.float32) for _ in range(3)]
    ops = [pccl.ReduceOp.SUM] * 3
    if field == "count":
        xs[2] = np.ones(11, dtype=np.float32)
    elif field == "dtype":
        xs[2] = np.ones(10, dtype=np.float64)
    elif field == "shape":  # equal counts, different shapes: a transposed tensor
        xs = [np.ones((2, 5), dtype=np.float32) for _ in range(2)] + [
            np.ones((5, 2), dtype=np.float32)]
    else:
        ops[2] = pccl.ReduceOp.MAX
    before = [x.copy() for x in xs]
    results = await asyncio.gather(*(c.all_reduce(x, op=o) for c, x, o in
                                     zip(cluster.comms, xs, ops)), return_exceptions=True)
    assert all(isinstance(r, pccl.InvalidUsageError) for r in results), results
    assert "disagree" in str(results[0])
    for w in words:  # enum names and shapes, in the API's words
        assert w in str(results[0]), str(results[0])
    for x, b in zip(xs, before):
        np.testing.assert_array_equal(x, b)
    # The group is still usable.
    xs = [np.ones(10, dtype=np.float32) for _ in range(3)]
    await reduce_all(cluster, xs, pccl.ReduceOp.SUM)
    assert all((x == 3).all() for x in xs)


async def test_update_topology_with_reduces_in_flight_is_refused(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    a, b = cluster.comms
    xa, xb = np.ones(4, dtype=np.float32), np.ones(4, dtype=np.float32)
    h = a.all_reduce_async(xa, tag=1)
    with pytest.raises(pccl.PendingAsyncOpsError):
        await a.update_topology()
    await asyncio.gather(h, b.all_reduce(xb, tag=1))


async def test_reduce_against_a_voting_peer_is_called_off(pccl_cluster) -> None:
    """One peer thinks joiners are pending and votes, the other reduces: the reduce is
    called off (retryable) instead of both waiting for each other forever."""
    cluster = await pccl_cluster(2)
    a, b = cluster.comms
    vote = asyncio.create_task(a.update_topology())
    await cluster.master.wait_for(lambda s: len(s.votes) == 1)
    x = np.ones(4, dtype=np.float32)
    with pytest.raises(pccl.CollectiveAbortedError):
        await b.all_reduce(x)
    np.testing.assert_array_equal(x, np.ones(4, dtype=np.float32))
    await b.update_topology()
    await vote


async def test_peer_leaving_before_the_reduce_runs_it_on_the_repaired_ring(pccl_cluster) -> None:
    """Two of three peers started a reduce when the third leaves: the master rebuilds the
    ring without it, and the held reduce runs on the two survivors."""
    cluster = await pccl_cluster(3)
    a, b, c = cluster.comms
    xa, xb = np.ones(100, dtype=np.float32), np.full(100, 2, dtype=np.float32)
    ha, hb = a.all_reduce_async(xa), b.all_reduce_async(xb)
    await cluster.master.wait_for(lambda s: len(s.collectives) == 1
                                  and len(next(iter(s.collectives.values())).inits) == 2)
    await c.close()
    infos = await asyncio.gather(ha, hb)
    assert [i.world_size for i in infos] == [2, 2]
    assert (xa == 3).all() and (xb == 3).all()
    assert a.ring == b.ring == sorted([a.peer_id, b.peer_id])
    assert a.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) == 2


async def test_peer_leaving_before_the_reduce_fails_it_without_ring_repair(pccl_cluster) -> None:
    """With ``MasterNode(repair_rings=False)`` the held reduce fails for the survivors
    (nothing written) until they call update_topology()."""
    cluster = await pccl_cluster(3, master_kwargs={"repair_rings": False})
    a, b, c = cluster.comms
    xa, xb = np.ones(100, dtype=np.float32), np.ones(100, dtype=np.float32)
    ha, hb = a.all_reduce_async(xa), b.all_reduce_async(xb)
    await cluster.master.wait_for(lambda s: len(s.collectives) == 1
                                  and len(next(iter(s.collectives.values())).inits) == 2)
    await c.close()
    for h in (ha, hb):
        with pytest.raises(pccl.PeerConnectionError):
            await h
    assert (xa == 1).all() and (xb == 1).all()
    await asyncio.gather(a.update_topology(), b.update_topology())
    infos = await asyncio.gather(a.all_reduce(xa), b.all_reduce(xb))
    assert infos[0].world_size == 2 and (xa == 2).all()


async def test_multiple_with_retry(pccl_cluster) -> None:
    cluster = await pccl_cluster(3)
    data = [[np.full(50 + i, r + 1, dtype=np.float32) for i in range(6)] for r in range(3)]
    results = await asyncio.gather(*(
        c.all_reduce_multiple_with_retry(
            [pccl.ReduceDescriptor(t, op=pccl.ReduceOp.SUM, tag=i) for i, t in enumerate(ts)],
            max_in_flight=2)
        for c, ts in zip(cluster.comms, data)))
    assert all(len(r) == 6 and r[0].world_size == 3 for r in results)
    assert all((t == 6).all() for ts in data for t in ts)


async def test_cancel_after_the_group_decided_still_applies_the_result(pccl_cluster) -> None:
    """The success outcome is on its way when the caller cancels: the output is written
    anyway (the other peers applied it too), then CancelledError propagates."""
    cluster = await pccl_cluster(2)
    a, b = cluster.comms
    held = HeldMessage(a, m.CollectiveOutcome)
    x, y = np.ones(1000, dtype=np.float32), np.full(1000, 2, dtype=np.float32)
    h = a.all_reduce_async(x, tag=5)
    await b.all_reduce(y, tag=5)
    async with asyncio.timeout(10):
        await held.arrived.wait()
    assert held.message.ok and (x == 1).all()  # type: ignore[union-attr]
    h.cancel()  # the task sees it before the outcome that follows
    held.release()
    with pytest.raises(asyncio.CancelledError):
        await h
    assert (x == 3).all() and (y == 3).all()


async def test_cancel_before_the_others_arrive_withdraws_cleanly(pccl_cluster) -> None:
    cluster = await pccl_cluster(2)
    a, b = cluster.comms
    x = np.ones(1000, dtype=np.float32)
    h = a.all_reduce_async(x, tag=3)
    await cluster.master.wait_for(lambda s: len(s.collectives) == 1)
    h.cancel()
    with pytest.raises(asyncio.CancelledError):
        await h
    await cluster.master.wait_for(lambda s: not s.collectives)
    assert (x == 1).all()
    # The tag is free again and the group works.
    y = np.ones(1000, dtype=np.float32)
    await asyncio.gather(a.all_reduce(x, tag=3), b.all_reduce(y, tag=3))
    assert (x == 2).all() and (y == 2).all()
