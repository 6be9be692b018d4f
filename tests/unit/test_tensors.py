"""pccl.enums.DTYPES, the one dtype table, and what pccl.tensors derives from it."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import pccl
from pccl import tensors
from pccl.enums import DTYPES, DataType


def test_the_table_covers_every_datatype_and_agrees_with_numpy() -> None:
    assert set(DTYPES) == set(DataType)
    for dt, info in DTYPES.items():
        assert (info.numpy is None) == (info.torch is None) == (not info.is_tensor_type), dt
        if info.numpy is not None and info.numpy != "bfloat16":  # bfloat16: ml_dtypes
            assert np.dtype(info.numpy).itemsize == info.size, dt
            assert (np.dtype(info.numpy).kind == "f") == info.is_float, dt
    wire_only = {dt for dt, info in DTYPES.items() if not info.is_tensor_type}
    assert wire_only == {DataType.FLOAT8_E4M3, DataType.FLOAT8_E5M2}


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_the_table_agrees_with_torch() -> None:
    import torch

    for dt, info in DTYPES.items():
        if info.torch is not None:
            t = torch.zeros(3, dtype=getattr(torch, info.torch))
            assert t.element_size() == info.size, dt
            assert t.is_floating_point() == info.is_float, dt
            assert tensors.as_raw(t, writable=True).dtype is dt


def test_tensors_derive_from_the_table() -> None:
    assert tensors.ELEMENT_SIZE == {dt: info.size for dt, info in DTYPES.items()}
    for dt, info in DTYPES.items():
        if info.numpy is not None and info.numpy != "bfloat16":
            raw = tensors.as_raw(np.zeros(5, dtype=info.numpy), writable=True)
            assert (raw.dtype, raw.count, raw.nbytes) == (dt, 5, 5 * info.size)
    with pytest.raises(pccl.InvalidArgumentError, match="unsupported dtype"):
        tensors.as_raw(np.zeros(2, dtype=np.complex64), writable=False)
