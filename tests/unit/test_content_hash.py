"""pccl.content_hash hashes any tensor by its logical contents, as the sync does (the sync
itself: tests/system/test_logging_and_hash.py)."""

from __future__ import annotations

import numpy as np
import pytest

import pccl
from pccl import _core


def _sample(shape=(64, 33), dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(7).standard_normal(shape).astype(dtype)


def test_content_hash_is_the_core_hash_of_the_bytes() -> None:
    x = _sample()
    h = pccl.content_hash(x)
    assert isinstance(h, str) and len(h) == 32 and int(h, 16) >= 0
    assert h == _core.content_hash(x.tobytes()).hex()
    assert "content_hash" in pccl.__all__


def test_one_flipped_bit_changes_the_hash() -> None:
    x = _sample()
    h = pccl.content_hash(x)
    raw = x.reshape(-1).view(np.uint8)
    for i in (0, raw.size // 2, raw.size - 1):
        raw[i] ^= 1 << (i % 8)
        assert pccl.content_hash(x) != h
        raw[i] ^= 1 << (i % 8)
    assert pccl.content_hash(x) == h


def test_non_contiguous_views_hash_their_logical_contents() -> None:
    x = _sample((40, 50))
    for view in (x.T, x[:, ::3], x[::-1], x[5:9, 7]):
        assert not view.flags.c_contiguous
        assert pccl.content_hash(view) == pccl.content_hash(np.ascontiguousarray(view))
    assert pccl.content_hash(x.T) != pccl.content_hash(x)


def test_other_inputs() -> None:
    assert pccl.content_hash(b"abc") == _core.content_hash_hex(b"abc")
    assert pccl.content_hash(np.zeros(0, np.float32)) == _core.content_hash_hex(b"")
    assert pccl.content_hash(np.float64(1.5)) == _core.content_hash_hex(np.float64(1.5).tobytes())
    with pytest.raises(pccl.InvalidArgumentError):
        pccl.content_hash(np.array([object()]))
    with pytest.raises(pccl.InvalidArgumentError):
        pccl.content_hash([1, 2, 3])


def test_numpy_and_torch_agree() -> None:
    torch = pytest.importorskip("torch")
    x = _sample((30, 20))
    t = torch.from_numpy(x.copy())
    assert pccl.content_hash(t) == pccl.content_hash(x)
    assert pccl.content_hash(t.T) == pccl.content_hash(x.T)  # non-contiguous
    assert pccl.content_hash(t[:, 1::2]) == pccl.content_hash(x[:, 1::2])
    assert pccl.content_hash(t.requires_grad_()) == pccl.content_hash(x)
    b = torch.arange(10, dtype=torch.bfloat16)
    assert pccl.content_hash(b) == _core.content_hash_hex(b.view(torch.uint8).numpy())
    t2 = torch.from_numpy(x.copy())
    t2.view(torch.int32).view(-1)[3] ^= 1
    assert pccl.content_hash(t2) != pccl.content_hash(x)
