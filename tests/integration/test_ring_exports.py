"""A ring all-reduce holds the buffer exports of its tensors from ``start_all_reduce``
until it is committed or rolled back: Python cannot resize (or free) memory that the
Rust ring reads or writes meanwhile. A ``bytearray`` shows it: resizing one whose buffer
is exported raises ``BufferError``."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import pccl
from pccl import _core

N = 4096  # float32 elements
F32, SUM = int(pccl.DataType.FLOAT32), int(pccl.ReduceOp.SUM)


async def _ring_of_two() -> tuple[_core.P2PNode, _core.P2PNode]:
    """Nodes 1 and 2 with the ring links of epoch 1 installed (1 is rank 0)."""
    ia, ib = _core.Identity(), _core.Identity()
    a = await _core.P2PNode.bind(1, identity=ia)
    b = await _core.P2PNode.bind(2, identity=ib)
    keys = {1: ia.public_key, 2: ib.public_key}
    a.set_peer_keys(keys)
    b.set_peer_keys(keys)
    async with asyncio.timeout(30):
        await asyncio.gather(a.connect_pool(f"127.0.0.1:{b.port}", 2, 1, 1),
                             b.connect_pool(f"127.0.0.1:{a.port}", 1, 1, 1))
        await asyncio.gather(a.install_ring(1, 2, 2), b.install_ring(1, 1, 1))
    return a, b


def _values(first: float) -> np.ndarray:
    return np.arange(first, first + N, dtype=np.float32)


def _tensor(first: float) -> bytearray:
    return bytearray(_values(first).tobytes())


def _held(buf: bytearray) -> bool:
    """Whether ``buf``'s buffer is exported (so it cannot be resized)."""
    try:
        buf.extend(b"\0\0\0\0")
    except BufferError:
        return True
    del buf[-4:]
    return False


async def _released(buf: bytearray, node: _core.P2PNode) -> bool:
    """Whether ``buf``'s export is released, waiting (bounded) for it: a link's reader
    may hold the op's memory a moment after the run ended; the last one to let go hands
    the release to Python, which applies it at the next pccl call."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5.0
    while _held(buf):
        if loop.time() > deadline:
            return False
        node.ring_ok()
        await asyncio.sleep(0.01)
    return True


async def test_input_and_output_are_held_from_start_until_commit() -> None:
    a, b = await _ring_of_two()
    try:
        ins, outs = [_tensor(1.0), _tensor(100.0)], [bytearray(4 * N), bytearray(4 * N)]
        ops = [node.start_all_reduce(7, rank, 2, ins[rank], F32, SUM, out=outs[rank])
               for rank, node in enumerate((a, b))]
        assert all(_held(buf) for buf in ins + outs)
        async with asyncio.timeout(30):
            await asyncio.gather(*(op.run() for op in ops))
        assert all(_held(buf) for buf in ins + outs)  # until the outcome is applied
        for op, out in zip(ops, outs, strict=True):
            op.commit(out)
        for out in outs:
            np.testing.assert_array_equal(np.frombuffer(out, np.float32),
                                          _values(1.0) + _values(100.0))
        assert all([await _released(buf, a) for buf in ins + outs])
        # A spent op neither commits nor runs again.
        with pytest.raises(pccl.InvalidUsageError, match="committed or rolled back"):
            ops[0].commit(outs[0])
        with pytest.raises(pccl.InvalidUsageError, match="committed or rolled back"):
            ops[0].run()
        ops[0].rollback()  # a no-op
    finally:
        await a.close()
        await b.close()


async def test_a_scratch_op_holds_its_input_and_commit_holds_out_only_for_the_copy() -> None:
    a, b = await _ring_of_two()
    try:
        ins = [_tensor(1.0), _tensor(-5.0)]
        ops = [node.start_all_reduce(8, rank, 2, ins[rank], F32, SUM)
               for rank, node in enumerate((a, b))]
        assert all(_held(buf) for buf in ins)
        async with asyncio.timeout(30):
            await asyncio.gather(*(op.run() for op in ops))
        assert all(_held(buf) for buf in ins)
        outs = [bytearray(4 * N), bytearray(4 * N)]
        for op, out in zip(ops, outs, strict=True):
            op.commit(out)
            assert not _held(out)  # the copy is done: commit's own export is gone
        for out in outs:
            np.testing.assert_array_equal(np.frombuffer(out, np.float32),
                                          _values(1.0) + _values(-5.0))
        assert all([await _released(buf, a) for buf in ins])
    finally:
        await a.close()
        await b.close()


async def test_an_in_place_tensor_is_held_until_rollback_and_an_unrun_op_until_dropped(
) -> None:
    a, b = await _ring_of_two()
    try:
        tensor = _tensor(3.0)
        op = a.start_all_reduce(9, 0, 2, tensor, F32, SUM, in_place=True)
        assert _held(tensor)
        op.rollback()  # never ran: no task ever held the op's memory
        assert not _held(tensor)
        assert bytes(tensor) == bytes(_tensor(3.0))
        with pytest.raises(pccl.InvalidUsageError, match="committed or rolled back"):
            op.run()
        other = _tensor(4.0)
        op = a.start_all_reduce(10, 0, 2, other, F32, SUM)
        assert _held(other)
        del op
        assert not _held(other)
    finally:
        await a.close()
        await b.close()
