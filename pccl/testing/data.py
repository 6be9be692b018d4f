"""Deterministic tensors for tests and soak runs: the same (dtype, count, seed) gives the
same bytes in every process."""

from __future__ import annotations

import hashlib

from pccl.enums import DTYPES

try:
    import numpy as np
except ImportError as e:  # numpy is optional for pccl (torch-only programs), not here
    raise ModuleNotFoundError(
        'pccl.testing.data needs numpy, which is not installed: pip install numpy '
        '(or "pccl[numpy]")', name="numpy") from e

INT_DTYPES = tuple(i.numpy for i in DTYPES.values() if not i.is_float and i.numpy)


def deterministic_tensor(dtype: str, count: int, seed: int) -> np.ndarray:
    """Integers span their whole range (sums wrap); floats are normal(0, 100)."""
    rng = np.random.default_rng(seed)
    if dtype in INT_DTYPES:
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=count, endpoint=True, dtype=dtype)
    return (rng.standard_normal(count) * 100.0).astype(np.float32).astype(dtype)


def digest(data: object) -> str:
    """Hex SHA-256 of a tensor's bytes (numpy array or anything with the buffer protocol)."""
    return hashlib.sha256(np.ascontiguousarray(data).data.cast("B")).hexdigest()
