"""The summary of bench/allreduce_rounds.py: per (k, size), every round's ratio to gloo."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "allreduce_rounds.py"
_spec = importlib.util.spec_from_file_location("allreduce_rounds", _PATH)
assert _spec is not None and _spec.loader is not None
rounds_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rounds_mod)


def _row(k: int, mib: int, busbw: float) -> dict[str, Any]:
    return {"peers": k, "size_bytes": mib << 20, "busbw_GBps_median": busbw}


def test_ratios_per_round_and_their_median() -> None:
    rounds = [
        {"gloo": [_row(4, 64, 1.0)], "pccl": [_row(4, 64, 1.2)],
         "pccl_out_of_place": [_row(4, 64, 1.5)],
         "loopback": [{"streams": 4, "busbw_bound_GBps_median": 2.0}]},
        {"gloo": [_row(4, 64, 2.0)], "pccl": [_row(4, 64, 1.0)],
         "pccl_out_of_place": [_row(4, 64, 2.0)], "loopback": []},
        {"gloo": [_row(4, 64, 0.5)], "pccl": [_row(4, 64, 1.0)],
         "pccl_out_of_place": [_row(4, 64, 0.5)],
         "loopback": [{"streams": 4, "busbw_bound_GBps_median": 3.0}]},
    ]
    (row,) = rounds_mod.summarize(rounds)
    assert (row["peers"], row["size_bytes"]) == (4, 64 << 20)
    assert row["gloo"] == [1.0, 2.0, 0.5]
    assert row["bound_per_k"] == [2.0, None, 3.0]
    assert row["in_place_over_gloo"] == pytest.approx([1.2, 0.5, 2.0])
    assert row["in_place_over_gloo_median"] == pytest.approx(1.2)
    assert row["out_of_place_over_gloo"] == pytest.approx([1.5, 1.0, 1.0])
    assert row["out_of_place_over_gloo_median"] == pytest.approx(1.0)


def test_a_round_without_pccl_for_a_size_is_left_out_of_its_ratios() -> None:
    rounds = [
        {"gloo": [_row(2, 1, 1.0), _row(2, 64, 1.0)], "pccl": [_row(2, 1, 2.0)]},
        {"gloo": [_row(2, 1, 1.0), _row(2, 64, 1.0)], "pccl": [_row(2, 1, 4.0),
                                                               _row(2, 64, 3.0)]},
    ]
    one, big = rounds_mod.summarize(rounds)
    assert one["in_place_over_gloo"] == pytest.approx([2.0, 4.0])
    assert big["in_place"] == [None, 3.0]
    assert big["in_place_over_gloo"] == pytest.approx([3.0])
    assert "out_of_place" not in one  # never run out of place
