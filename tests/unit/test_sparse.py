"""pccl.sparse: the sparse error-feedback codec (rust/sparse; more cases there)."""

from __future__ import annotations

import numpy as np
import pytest

import pccl
from pccl.sparse import ErrorFeedback, SparseCodec


def _sample(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_the_residual_is_exactly_what_the_payload_does_not_carry() -> None:
    codec = SparseCodec(density=2 / 64, bits=2, chunk=64)
    x = _sample(64 * 150)
    acc = x.copy()
    payload = codec.compress(acc)
    assert len(payload) == codec.payload_bytes(x.size)
    decoded = np.zeros_like(x)
    codec.decode_add(payload, decoded)
    assert np.array_equal(acc, x - decoded)  # bit for bit
    # Two elements of every chunk travel, the largest magnitudes.
    sent = (decoded != 0).reshape(-1, 64)
    assert (sent.sum(axis=1) == 2).all()
    mags = np.abs(x).reshape(-1, 64)
    kept_min = np.where(sent, mags, np.inf).min(axis=1)
    assert (np.where(sent, 0, mags).max(axis=1) <= kept_min).all()


def test_bytes_are_a_small_fraction_of_dense_and_int8() -> None:
    codec = SparseCodec(density=1 / 64, bits=2, chunk=64)
    n = 1 << 20
    size = codec.payload_bytes(n)
    assert size == 16 + n // 64  # one entry of 6 + 2 bits per chunk
    assert 4 * n / size > 250 and n / size > 63  # against fp32 and int8


def test_payloads_summed_in_rank_order_are_the_same_on_every_peer() -> None:
    codec = SparseCodec(density=4 / 64, bits=4, chunk=64)
    payloads = [codec.compress(_sample(4096, seed=r)) for r in range(4)]
    sums = []
    for _peer in range(3):
        total = np.zeros(4096, np.float32)
        for p in payloads:
            codec.decode_add(p, total)
        sums.append(total.tobytes())
    assert sums[0] == sums[1] == sums[2]
    assert codec.compress(_sample(4096, seed=0)) == payloads[0]  # deterministic


def test_a_hostile_payload_raises_protocol_error_and_changes_nothing() -> None:
    codec = SparseCodec(density=2 / 64, bits=2, chunk=64)
    good = codec.compress(_sample(1000))
    out = _sample(1000, seed=9)
    before = out.copy()
    for bad in (good[:-1], good + b"\0", b"XXXX" + good[4:],
                good[:12] + np.float32(np.nan).tobytes() + good[16:]):
        with pytest.raises(pccl.ProtocolError):
            codec.decode_add(bad, out)
        assert np.array_equal(out, before)
    other = SparseCodec(density=2 / 64, bits=4, chunk=64)
    with pytest.raises(pccl.ProtocolError):
        other.decode_add(good, out)


def test_bad_arguments_are_refused() -> None:
    for kw in ({"chunk": 1}, {"bits": 3}, {"density": 0.0}, {"density": float("nan")},
               {"density": 1.0, "chunk": 1024}):
        with pytest.raises(pccl.InvalidArgumentError):
            SparseCodec(**kw)  # type: ignore[arg-type]
    codec = SparseCodec()
    with pytest.raises(pccl.InvalidArgumentError, match="float32"):
        codec.compress(np.zeros(64, np.float64))
    with pytest.raises(pccl.InvalidArgumentError, match="non-finite"):
        codec.compress(np.array([np.inf] + [0.0] * 63, np.float32))


def test_error_feedback_loses_nothing_over_steps() -> None:
    """What is not sent stays in the accumulator: after T pushes (beta 1), everything
    sent plus what is still owed equals everything pushed (up to float32 rounding)."""
    codec = SparseCodec(density=1 / 64, bits=2, chunk=64)
    fb = ErrorFeedback(codec, size=8192, beta=1.0)
    assert not fb.accumulator.any()  # a joiner owes nothing
    pushed = np.zeros(8192, np.float64)
    sent = np.zeros(8192, np.float64)
    for t in range(20):
        g = _sample(8192, seed=100 + t)
        pushed += g
        decoded = np.zeros(8192, np.float32)
        codec.decode_add(fb.push(g), decoded)
        sent += decoded
    assert np.allclose(sent + fb.accumulator, pushed, atol=1e-4)
    assert sent.any() and fb.accumulator.any()
