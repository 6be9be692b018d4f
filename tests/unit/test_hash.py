"""Content hash (`pccl._core.content_hash`): bytes in, the same 16 bytes out whatever the
dtype, the thread count or the container; see rust/hash.rs for the format."""

from __future__ import annotations

import struct
import sys
import threading
import time

import numpy as np
import pytest

import pccl
from pccl import _core

MiB = 1 << 20
LEAF = MiB

# Known answers of the format (the same values are pinned in rust/hash.rs).
KNOWN = [
    (b"", "e6a7a223d25e5c0eeb8d9c58d2979dad"),
    (b"pccl", "b9c3b887c5fc62c15337d7c10534a9ee"),
    (bytes(i % 251 for i in range(2 * LEAF + 3)), "73f009d6557e171c486f7447718b0d7a"),
    (bytes(3 * LEAF), "211d4fd1d7886dd52bb8383b909e9437"),
]


def _data(size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


@pytest.mark.parametrize("data,hex_digest", KNOWN, ids=["empty", "pccl", "ramp", "zeros"])
def test_known_answers(data: bytes, hex_digest: str) -> None:
    assert _core.content_hash_hex(data) == hex_digest
    assert _core.content_hash(data) == bytes.fromhex(hex_digest)


def test_matches_independent_reference() -> None:
    """The format of rust/hash.rs's module doc, rebuilt from the `xxhash` package."""
    xxhash = pytest.importorskip("xxhash")
    leaf_seed = int.from_bytes(b"pcclleaf", "big")
    root_seed = int.from_bytes(b"pcclroot", "big")

    def reference(data: bytes) -> bytes:
        n = len(data)
        digests = b"".join(
            xxhash.xxh3_128_digest(data[i * LEAF : (i + 1) * LEAF], seed=(leaf_seed + i) % 2**64)
            for i in range(-(-n // LEAF))
        )
        return xxhash.xxh3_128_digest(digests + struct.pack(">QQ", n, LEAF), seed=root_seed)

    for size in (0, 1, 17, 240, LEAF - 1, LEAF, LEAF + 1, 3 * LEAF + 5):
        data = _data(size, size).tobytes()
        assert _core.content_hash(data) == reference(data), size
    for data, hex_digest in KNOWN:
        assert reference(data).hex() == hex_digest


def test_result_shape() -> None:
    h = _core.content_hash(b"abc")
    assert isinstance(h, bytes) and len(h) == 16
    hx = _core.content_hash_hex(b"abc")
    assert isinstance(hx, str) and hx == h.hex() and len(hx) == 32


@pytest.mark.parametrize(
    "dtype",
    [
        np.uint8,
        np.int8,
        np.bool_,
        np.int16,
        np.float16,
        np.int32,
        np.float32,
        np.int64,
        np.float64,
        np.complex64,
    ],
)
@pytest.mark.parametrize("shape", [(0,), (1,), (7, 3), (300_001,), (2, 3, 4, 5)])
def test_numpy_equals_its_bytes(dtype: type, shape: tuple[int, ...]) -> None:
    n = int(np.prod(shape))
    raw = _data(n * np.dtype(dtype).itemsize, n)
    if dtype is np.bool_:
        raw = raw & 1
    arr = raw.view(dtype).reshape(shape)
    want = _core.content_hash(arr.tobytes())
    # The array as the Python layer passes it, the array itself, and other containers.
    assert _core.content_hash(arr.reshape(-1).view(np.uint8)) == want
    assert _core.content_hash(arr) == want
    assert _core.content_hash(memoryview(arr)) == want
    assert _core.content_hash(bytearray(arr.tobytes())) == want
    assert _core.content_hash_hex(arr) == want.hex()


def test_same_bytes_other_dtype_same_hash() -> None:
    a = np.arange(1000, dtype=np.float32)
    assert _core.content_hash(a) == _core.content_hash(a.view(np.int32))
    assert _core.content_hash(a) == _core.content_hash(a.view(np.uint8).reshape(40, 100))


@pytest.mark.parametrize("size", [0, 1, LEAF - 1, LEAF, LEAF + 1, 10 * LEAF + 7])
def test_thread_counts_agree(size: int) -> None:
    arr = _data(size, 1)
    want = _core.content_hash(arr)
    for threads in range(1, 9):
        assert _core.content_hash(arr, threads) == want
        assert _core.content_hash(arr, threads=threads) == want
    assert _core.content_hash(arr, 10_000) == want


def test_one_byte_change_changes_it() -> None:
    arr = _data(3 * LEAF + 11, 2)
    base = _core.content_hash(arr)
    for pos in (0, LEAF - 1, LEAF, 2 * LEAF + 99, arr.size - 1):
        arr[pos] ^= 1
        assert _core.content_hash(arr) != base, pos
        arr[pos] ^= 1
    assert _core.content_hash(arr) == base
    f = np.zeros(1000, dtype=np.float32)
    g = f.copy()
    g[500] = -0.0  # one sign bit: equal as floats, different bytes
    assert _core.content_hash(f) != _core.content_hash(g)


def test_length_matters() -> None:
    assert _core.content_hash(b"") != _core.content_hash(b"\0")
    assert _core.content_hash(bytes(LEAF)) != _core.content_hash(bytes(LEAF + 1))


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(100, dtype=np.float32)[::2],
        lambda: np.arange(100, dtype=np.uint8)[::3],
        lambda: np.arange(12, dtype=np.int64).reshape(3, 4).T,
        lambda: np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4)),
        lambda: memoryview(np.arange(100, dtype=np.uint8))[::2],
        lambda: np.arange(60, dtype=np.int16).reshape(6, 10)[:, 2:5],
    ],
    ids=["f32-step", "u8-step", "transposed", "fortran", "memoryview-step", "column-slice"],
)
def test_non_contiguous_is_refused(make) -> None:
    with pytest.raises(pccl.InvalidArgumentError, match="contiguous"):
        _core.content_hash(make())
    with pytest.raises(pccl.InvalidArgumentError):
        _core.content_hash_hex(make())


def test_bad_arguments() -> None:
    with pytest.raises(pccl.InvalidArgumentError):
        _core.content_hash([1, 2, 3])
    with pytest.raises(pccl.InvalidArgumentError):
        _core.content_hash("text")
    for bad in (0, -1):
        with pytest.raises(pccl.InvalidArgumentError, match="threads"):
            _core.content_hash(b"abc", bad)


def test_read_only_buffer() -> None:
    arr = np.arange(1000, dtype=np.int32)
    arr.flags.writeable = False
    assert _core.content_hash(arr) == _core.content_hash(arr.tobytes())


def test_256_mib_releases_the_gil() -> None:
    arr = np.arange(64 * MiB, dtype=np.uint32)  # 256 MiB
    assert arr.nbytes == 256 * MiB

    count = 0
    stop = False
    started = threading.Event()

    def counter() -> None:
        nonlocal count
        started.set()
        while not stop:
            count += 1
            time.sleep(0)  # gives the GIL up on every round

    # With a long switch interval this thread is never preempted for the counter: the
    # counter can only move while this thread is blocked or has released the GIL
    # itself, i.e. inside content_hash.
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    t = threading.Thread(target=counter, daemon=True)
    try:
        t.start()
        started.wait()
        hashes = []
        moved = 0
        for _ in range(5):
            before = count
            hashes.append(_core.content_hash(arr))
            moved = count - before
            if moved > 0:
                break
        assert moved > 0, "the counter thread did not run while hashing: GIL held"
    finally:
        stop = True
        sys.setswitchinterval(old_interval)
        t.join()
    assert _core.content_hash(arr, 1) == hashes[0]
    assert len(set(hashes)) == 1
