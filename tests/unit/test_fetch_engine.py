"""The shared-state fetch engine's pure parts (pccl._core): exact copies, prefaulting, the
ranges a large tensor is fetched in, and leaf digests combining into the content hash.
(Syncs between peers: tests/system/test_shared_state.py.)"""

from __future__ import annotations

import numpy as np
import pytest

import pccl
from pccl import _core

try:
    import torch
except ImportError:  # optional
    torch = None



def test_copy_into_copies_exactly_and_checks_lengths() -> None:
    for n in (0, 1, 4097, (64 << 20) + 3):  # inline and multi-threaded paths
        src = np.frombuffer(np.random.default_rng(n).bytes(n), dtype=np.uint8)
        dst = np.zeros(n, dtype=np.uint8)
        _core.copy_into(dst, src)
        assert np.array_equal(dst, src)
    with pytest.raises(pccl.InvalidArgumentError, match="destination has 3 bytes"):
        _core.copy_into(np.zeros(3, np.uint8), np.zeros(4, np.uint8))
    with pytest.raises(pccl.InvalidArgumentError, match="read-only"):
        _core.copy_into(np.frombuffer(b"abcd", np.uint8), np.zeros(4, np.uint8))


def test_prefault_keeps_contents() -> None:
    for n in (0, 5, (8 << 20) + 3):  # empty, inside one page, across huge pages
        a = np.frombuffer(np.random.default_rng(n).bytes(n), dtype=np.uint8).copy()
        before = a.copy()
        _core.prefault(a)
        assert np.array_equal(a, before)
    fresh = np.zeros(16 << 20, dtype=np.uint8)  # untouched pages read back as zeros
    _core.prefault(fresh)
    assert not fresh.any()
    with pytest.raises(pccl.InvalidArgumentError, match="read-only"):
        _core.prefault(np.frombuffer(b"abcd", np.uint8))


def test_fetch_ranges_cover_the_tensor_on_hash_leaves() -> None:
    """The fetch engine's range policy (Rust; more cases in rust/net/fetch.rs)."""
    from pccl.peer.fetch import RANGE_BYTES

    _fetch_ranges, leaf = _core.fetch_ranges, _core.HASH_LEAF_BYTES
    assert RANGE_BYTES == _core.FETCH_RANGE_BYTES and leaf == 1 << 20
    assert _fetch_ranges(0, 3) == [(0, 0)]
    assert _fetch_ranges(2 * RANGE_BYTES - 1, 3) == [(0, 2 * RANGE_BYTES - 1)]
    for nbytes in (2 * RANGE_BYTES, 3 * RANGE_BYTES + 12345, (256 << 20) + 7, 1 << 30):
        for holders in (1, 2, 3, 5):
            for streams in (1, 4):
                rs = _fetch_ranges(nbytes, holders, streams)
                # As many as the holders and streams ask for, rounded up to a multiple
                # of the holders, as long as ranges stay about RANGE_BYTES or more.
                want = min(nbytes // RANGE_BYTES, holders * -(-streams // holders))
                assert len(rs) == want
                assert [a for a, _ in rs] == [sum(n for _, n in rs[:i])
                                              for i in range(len(rs))]
                assert sum(n for _, n in rs) == nbytes and all(a % leaf == 0 for a, _ in rs)
                assert all(n >= RANGE_BYTES - want * leaf for _, n in rs)
    assert len(_fetch_ranges(1 << 30, 3, 4)) == 6  # two per holder
    assert len(_fetch_ranges(1 << 30, 1, 4)) == 4


def test_leaf_digests_of_runs_combine_into_the_content_hash() -> None:
    leaf = 1 << 20
    data = np.frombuffer(np.random.default_rng(3).bytes(5 * leaf + 777), dtype=np.uint8)
    for cut in (0, 1, 3, 5):
        parts = (_core.leaf_digests(data[:cut * leaf], 0)
                 + _core.leaf_digests(data[cut * leaf:], cut))
        assert _core.hash_root(parts, data.nbytes) == _core.content_hash(data)
    wrong_start = _core.leaf_digests(data[:leaf], 0) + _core.leaf_digests(data[leaf:], 0)
    assert _core.hash_root(wrong_start, data.nbytes) != _core.content_hash(data)
    with pytest.raises(pccl.InvalidArgumentError, match="do not fit"):
        _core.hash_root(b"\0" * 16, data.nbytes)
