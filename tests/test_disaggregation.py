"""Chapter 10's disaggregation simulation against timelines worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from infer_lab.measure.disaggregation import simulate, simulate_requests

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


# a chat decoding on its own, another chat, then a long prompt on the chat's server (colocated)
MIXED = dict(arrivals=[0.0, 0.05, 0.055], prefill_s=[0.01, 0.01, 0.5], out_len=[10, 3, 2],
             step_s=0.01, per_seq_s=0.0, transfer_s=0.002)


def test_a_long_prompt_stalls_the_chat_on_its_server_colocated() -> None:
    ttft, gaps = simulate_requests(split=False, **MIXED)
    assert ttft == pytest.approx([0.01, 0.01, 0.505])  # the long prompt came at 0.055, ran at 0.06
    # request 0: five steps, then one gap across the 0.5 s prefill and a step, then three more
    assert gaps[0] == pytest.approx([0.01] * 5 + [0.51] + [0.01] * 3)
    assert gaps[1] == pytest.approx([0.01, 0.01])  # alone on the other server
    assert gaps[2] == pytest.approx([0.01])


def test_split_the_long_prompt_queues_the_prefills_but_never_stalls_a_decode() -> None:
    ttft, gaps = simulate_requests(split=True, **MIXED)
    assert ttft == pytest.approx([0.01, 0.01, 0.505])  # one prefill server, in arrival order
    assert [len(g) for g in gaps] == [9, 2, 1]
    assert max(g.max() for g in gaps) == pytest.approx(0.002 + 0.01)  # transfer and a step


def test_one_shape_for_all_gives_the_events_of_simulate() -> None:
    # the same arrivals and costs: the same TTFTs and gaps, grouped by request
    kw = dict(prefill_s=0.05, step_s=0.004, per_seq_s=0.001, transfer_s=0.01)
    arrivals = np.cumsum(np.random.default_rng(3).exponential(1 / 8.0, 200))
    for split in (False, True):
        ttft, gaps = simulate(8.0, split, n=200, out_len=12, seed=3, **kw)
        mine, per_request = simulate_requests(arrivals, split, out_len=12, **kw)
        assert np.sort(mine) == pytest.approx(np.sort(ttft))
        assert np.sort(np.concatenate(per_request)) == pytest.approx(np.sort(gaps))
        assert all(len(g) == 11 for g in per_request)


def test_bad_workloads_are_refused() -> None:
    with pytest.raises(ValueError, match="arrivals"):
        simulate_requests([1.0, 0.5], True, prefill_s=0.1, out_len=4, step_s=0.01,
                          per_seq_s=0.0)
    with pytest.raises(ValueError, match="out_len"):
        simulate_requests([0.0, 0.5], False, prefill_s=0.1, out_len=[4, 1], step_s=0.01,
                          per_seq_s=0.0)
