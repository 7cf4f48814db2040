"""Chapter 10's disaggregation simulation against timelines worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from infer_lab.measure.disaggregation import simulate

COSTS = dict(prefill_s=0.1, step_s=0.01, per_seq_s=0.0)


def test_split_counts_the_gap_across_the_kv_transfer() -> None:
    # one request: token 1 at the end of its prefill, token 2 one decode step after the KV lands
    ttft, gaps = simulate(1.0, True, n=1, out_len=4, transfer_s=0.5, **COSTS)
    assert ttft == pytest.approx([0.1])
    assert gaps == pytest.approx([0.5 + 0.01, 0.01, 0.01])


def test_colocated_single_request_decodes_at_step_cost() -> None:
    ttft, gaps = simulate(1.0, False, n=1, out_len=4, **COSTS)
    assert ttft == pytest.approx([0.1])
    assert gaps == pytest.approx([0.01] * 3)


@pytest.mark.parametrize("split", [False, True])
def test_every_token_after_the_first_has_one_gap(split: bool) -> None:
    n, out_len, transfer_s = 300, 16, 0.02
    ttft, gaps = simulate(5.0, split, n=n, out_len=out_len, transfer_s=transfer_s,
                          prefill_s=0.1, step_s=0.01, per_seq_s=0.002)
    assert len(ttft) == n and len(gaps) == n * (out_len - 1)
    # a request's gaps add up to its decode time, which in split mode includes the transfer
    floor = (out_len - 1) * 0.01 + (transfer_s if split else 0.0)
    assert gaps.sum() >= n * floor - 1e-9
    if split:
        assert np.sort(gaps)[-n:].min() >= transfer_s  # every request has one gap across it


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        simulate(0.0, True, **COSTS)
    with pytest.raises(ValueError):
        simulate(1.0, False, out_len=1, **COSTS)
