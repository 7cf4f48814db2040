"""The wire cost of tensor parallelism: formulas by hand, and one real torchrun measurement."""

from __future__ import annotations

import pytest

from infer_lab.measure.collectives import (
    LINKS,
    allreduce_bytes_per_token,
    link_time_s,
    ring_bytes_sent,
    time_all_reduce,
)


def test_llama3_70b_all_reduces_per_token() -> None:
    # hidden 8192, 80 layers, bf16: two all-reduces per layer of 8192 * 2 bytes
    assert allreduce_bytes_per_token(8192, 80, 2) == 2 * 80 * 8192 * 2 == 2_621_440


def test_ring_all_reduce_sends_twice_the_buffer_less_one_share() -> None:
    assert ring_bytes_sent(1000, 1) == 0
    assert ring_bytes_sent(1000, 2) == 1000
    assert ring_bytes_sent(1000, 8) == pytest.approx(1750)
    with pytest.raises(ValueError):
        ring_bytes_sent(1000, 0)


def test_link_time_is_latency_plus_bytes_over_bandwidth() -> None:
    nv = LINKS["NVLink 4 (H100/H200)"]
    assert link_time_s(1 << 20, 1, nv) == 0
    expected = nv.latency_us * 1e-6 + (2 * 3 / 4 * (1 << 20)) / (nv.gbs * 1e9)
    assert link_time_s(1 << 20, 4, nv) == pytest.approx(expected)
    # the same buffer over PCIe 5 takes longer than over NVLink
    assert link_time_s(1 << 20, 4, LINKS["PCIe 5.0 x16"]) > link_time_s(1 << 20, 4, nv)


def test_torchrun_measures_real_all_reduces() -> None:
    rows = time_all_reduce(2, [16, 4096], repeats=3)
    assert [r["numel"] for r in rows] == [16, 4096]
    assert [r["bytes"] for r in rows] == [64, 16384]
    assert all(0 < r["min_s"] <= r["median_s"] for r in rows)
