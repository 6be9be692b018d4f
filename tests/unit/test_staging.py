"""pccl.staging without a network or a GPU: the pipeline on a FakeDevice whose copies
complete later on worker threads, with a fake collective (each piece doubled, as a sum
over two equal peers). What overlaps, what is started after a failure, all or nothing,
the drain after a cancellation, the content hash."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from pccl import _core, content_hash, staging
from pccl.enums import DataType
from pccl.errors import (
    CollectiveAbortedError,
    InvalidArgumentError,
    PeerConnectionError,
)
from pccl.peer.options import ReduceInfo
from pccl.testing.fake_device import FakeDevice, FakeDeviceError

PIECE = 4096  # bytes: 1024 float32 per piece
N = 6 * 1024 + 100  # floats: 7 pieces, the last one short


@pytest.fixture
def dev() -> Iterator[FakeDevice]:
    with FakeDevice(delay=0.0005) as d:
        yield d


async def until(cond: Callable[[], bool], what: str, deadline: float = 10.0) -> None:
    """Polls ``cond`` until it holds, at most ``deadline`` seconds."""
    end = time.monotonic() + deadline
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.001)


class FakeGroup:
    """The collectives: each piece's floats doubled; the vote answers ``vote_answer``
    (at least this peer's flag). Records starts and ends in the device's trace."""

    def __init__(self, dev: FakeDevice, *, world: Callable[[int], int] = lambda i: 2,
                 fail: dict[int, BaseException] | None = None,
                 before: Callable[[int], Any] | None = None, vote_answer: int = 0) -> None:
        self.dev, self.world, self.fail, self.before = dev, world, fail or {}, before
        self.vote_answer = vote_answer
        self.started: list[int] = []
        self.votes: list[int] = []

    async def __call__(self, index: int, data: Any, dtype: DataType, count: int, *,
                       vote: bool, late: bool) -> ReduceInfo:
        if vote:
            self.votes.append(int(data[0]))
            data[0] = max(int(data[0]), self.vote_answer)
            return ReduceInfo(tx_bytes=1, rx_bytes=1, world_size=self.world(index))
        assert late == (index >= staging.DEPTH)
        self.started.append(index)
        self.dev.note("reduce", "start", index)
        try:
            if self.before is not None:
                await self.before(index)
            if index in self.fail:
                raise self.fail[index]
            floats = data.view(np.float32)
            assert dtype is DataType.FLOAT32 and floats.size == count
            # (After a device fault the buffer holds whatever it held, NaN patterns
            # included: a ring would reduce them without a word, so numpy must too.)
            with np.errstate(all="ignore"):
                floats *= 2
            return ReduceInfo(tx_bytes=data.nbytes, rx_bytes=data.nbytes,
                              world_size=self.world(index))
        finally:
            self.dev.note("reduce", "end", index)


def source() -> np.ndarray:
    return np.random.default_rng(1).standard_normal(N).astype(np.float32)


async def run(dev: FakeDevice, x: Any, group: FakeGroup, out: Any = None) -> ReduceInfo:
    src = dev.tensor(x, "tensor")
    dst = None if out is None else dev.tensor(out, "out")
    return await staging.staged_all_reduce(dev, src, dst, group, piece_bytes=PIECE)


def seen(dev: FakeDevice, what: str, phase: str, key: int) -> bool:
    return (what, phase, key) in list(dev.trace)


def all_copies_done(dev: FakeDevice) -> bool:
    starts = sum(1 for w, p, _ in list(dev.trace) if w != "reduce" and p == "start")
    ends = sum(1 for w, p, _ in list(dev.trace) if w != "reduce" and p == "end")
    return starts == ends


def test_piece_tags_stay_apart_from_user_tags() -> None:
    assert staging.piece_tag(0, 0) == staging.STAGED_TAG_BASE
    tags = {staging.piece_tag(t, i) for t in (0, 1, staging.MAX_STAGED_TAG)
            for i in (0, 1, 7, -1)}
    assert len(tags) == 12
    assert all(staging.STAGED_TAG_BASE <= t < 1 << 64 for t in tags)
    assert staging.check_user_tag(staging.STAGED_TAG_BASE - 1) == staging.STAGED_TAG_BASE - 1
    for bad in (staging.STAGED_TAG_BASE, -1, True, 1.0):
        with pytest.raises(InvalidArgumentError):
            staging.check_user_tag(bad)
    with pytest.raises(InvalidArgumentError, match="too large"):
        staging.piece_tag(staging.MAX_STAGED_TAG + 1, 0)


def test_pieces_are_element_aligned_and_cover_the_tensor() -> None:
    assert staging._geometry(10, 4, 8) == [(0, 8), (8, 2)]
    assert staging._geometry(24, 8, 20) == [(0, 16), (16, 8)]  # 20 rounded down to 16
    assert staging._geometry(0, 4, 8) == [(0, 0)]


async def test_copies_and_collectives_overlap(dev: FakeDevice) -> None:
    n = len(staging._geometry(N * 4, 4, PIECE))

    async def before(i: int) -> None:
        # A serial pipeline would never get past these: the next piece's copy to the
        # host runs during this piece's collective, and the previous piece's copy back
        # to the device during this one's.
        if i + 1 < n:
            await until(lambda: seen(dev, "d2h", "start", (i + 1) * PIECE),
                        f"copy of piece {i + 1} to the host during collective {i}")
        if i >= 1:
            await until(lambda: seen(dev, "h2d", "start", (i - 1) * PIECE),
                        f"copy of piece {i - 1} to the device during collective {i}")

    x = source()
    t = dev.put(x)
    group = FakeGroup(dev, before=before)
    info = await run(dev, t, group)
    assert np.array_equal(t.numpy(), x * 2)
    assert group.started == list(range(n)) and group.votes == [0]
    assert info.algorithm == "staged" and info.world_size == 2
    assert info.tx_bytes == N * 4 + 1
    # The tensor is written once, after the vote, from the scratch.
    d2d = dev.trace.index(("d2d", "start", 0))
    assert all(dev.trace.index(("h2d", "end", j * PIECE)) < d2d for j in range(n))
    assert dev.pinned == staging.DEPTH + 1


async def test_out_of_place_writes_out_only(dev: FakeDevice) -> None:
    x = source()
    t, out = dev.put(x), dev.put(np.zeros_like(x))
    await run(dev, t, FakeGroup(dev), out=out)
    assert np.array_equal(out.numpy(), x * 2) and np.array_equal(t.numpy(), x)
    assert not any(w == "d2d" for w, _, _ in dev.trace)


@pytest.mark.parametrize("failed", [0, 2, 6])
async def test_a_failed_piece_fails_the_call_and_writes_nothing(dev: FakeDevice,
                                                                failed: int) -> None:
    x = source()
    t = dev.put(x)
    group = FakeGroup(dev, fail={failed: PeerConnectionError("peer 7 died"),
                                 failed + 1: CollectiveAbortedError("later")})
    with pytest.raises(PeerConnectionError, match="peer 7 died"):
        await run(dev, t, group)
    assert np.array_equal(t.numpy(), x)
    # Piece i starts only once piece i - DEPTH succeeded: the same pieces on every peer.
    assert group.started == list(range(min(7, failed + staging.DEPTH)))
    assert group.votes == []  # (no vote after a failed piece: every peer knows)
    assert all_copies_done(dev)
    assert ("reduce", "end", group.started[-1]) in dev.trace


async def test_pieces_on_different_worlds_fail_alike(dev: FakeDevice) -> None:
    x = source()
    t = dev.put(x)
    with pytest.raises(PeerConnectionError, match="ran on 2 and 3 peers"):
        await run(dev, t, FakeGroup(dev, world=lambda i: 3 if i == 4 else 2))
    assert np.array_equal(t.numpy(), x)


@pytest.mark.parametrize("direction,piece", [("d2h", 1), ("h2d", 6), ("d2d", 0)])
async def test_a_device_fault_still_joins_every_piece_and_votes_no(
        direction: str, piece: int) -> None:
    with FakeDevice(fail=[(direction, piece * PIECE)]) as dev:
        x = source()
        t = dev.put(x)
        group = FakeGroup(dev)
        with pytest.raises(FakeDeviceError):
            await run(dev, t, group)
        assert group.started == list(range(7))
        # (The commit copy comes after the vote: the group has decided; this device is
        # broken and its tensor lost, as when a host peer's process dies mid-call.)
        assert group.votes == ([0] if direction == "d2d" else [1])
        if direction != "d2d":
            assert np.array_equal(t.numpy(), x)
        assert all_copies_done(dev)


async def test_another_peers_no_vote_fails_the_call(dev: FakeDevice) -> None:
    x = source()
    t = dev.put(x)
    with pytest.raises(CollectiveAbortedError, match="another peer"):
        await run(dev, t, FakeGroup(dev, vote_answer=1))
    assert np.array_equal(t.numpy(), x)


async def test_cancel_withdraws_the_pieces_and_drains_the_copies(dev: FakeDevice) -> None:
    release = asyncio.Event()

    async def before(i: int) -> None:
        if i == 2:
            await release.wait()  # never set: the call is cancelled meanwhile

    x = source()
    t = dev.put(x)
    group = FakeGroup(dev, before=before)
    call = asyncio.ensure_future(run(dev, t, group))
    await until(lambda: 2 in group.started and seen(dev, "h2d", "start", 0),
                "piece 2's collective started, piece 0 copied back")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    # Every collective started has ended, and every copy queued completed.
    assert all(("reduce", "end", i) in dev.trace for i in group.started)
    assert all_copies_done(dev)
    assert np.array_equal(t.numpy(), x)


async def test_empty_tensor(dev: FakeDevice) -> None:
    t = dev.put(np.zeros(0, np.float32))
    info = await run(dev, t, FakeGroup(dev))
    assert info.world_size == 2 and t.numpy().size == 0


@pytest.mark.parametrize("nbytes", [0, 1, (1 << 20) - 1, 3 * (1 << 20) + 5])
def test_content_hash_of_a_device_tensor_is_the_host_hash(nbytes: int) -> None:
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    with FakeDevice() as dev:
        t = dev.put(data)
        assert staging.staged_content_hash(dev, dev.tensor(t, "t"), piece_bytes=1 << 20) \
            == _core.content_hash(data)
        assert content_hash(t) == content_hash(data)
