"""Chapter 3's waste measurement: reserved vs used KV slots, checked against a replay of the
BlockManager and against hand-counted cases."""

from __future__ import annotations

import pytest

from infer_lab.cache import BlockManager
from infer_lab.cache.waste import KVUsage, kv_usage, next_pow2, reserved_slots
from infer_lab.measure import RequestSpec, long_tail_mix


def test_one_request_by_hand():
    # prompt 3, output 4: holds 3, 4, 5, 6 tokens over its 4 steps -> 18 slot-steps used.
    r = [RequestSpec(3, 4)]
    assert kv_usage(r, "oracle") == KVUsage("oracle", 4 * 6, 18)
    assert kv_usage(r, "max", max_len=10) == KVUsage("max", 40, 18)
    assert kv_usage(r, "pow2").reserved == 4 * 8
    # blocks of 4: 3 -> 1 block, 4 -> 1, 5 -> 2, 6 -> 2 = 6 blocks = 24 slot-steps
    assert kv_usage(r, "paged", block_size=4) == KVUsage("paged/4", 24, 18)
    assert kv_usage(r, "paged", block_size=1).utilization == 1.0


def test_max_len_defaults_to_the_longest_sequence():
    r = [RequestSpec(3, 4), RequestSpec(10, 1)]
    assert kv_usage(r, "max") == kv_usage(r, "max", max_len=10)


def test_paged_usage_matches_a_block_manager_replay():
    reqs = long_tail_mix(32, seed=3)
    for bs in (4, 16):
        mgr = BlockManager(10_000, bs)
        reserved = used = 0
        for i, r in enumerate(reqs):
            mgr.allocate_slots(i, r.prompt_len)
        for step in range(max(r.output_len for r in reqs)):
            for i, r in enumerate(reqs):
                if step < r.output_len:
                    if step > 0:
                        mgr.allocate_slots(i, 1)
                    reserved += len(mgr.block_table(i)) * bs
                    used += mgr.num_tokens(i)
                if step == r.output_len - 1:
                    mgr.free(i)
        assert kv_usage(reqs, "paged", block_size=bs) == KVUsage(f"paged/{bs}", reserved, used)
        assert mgr.num_free_blocks == 10_000


def test_schemes_rank_as_expected_on_the_long_tail_mix():
    reqs = long_tail_mix()
    u = {s: kv_usage(reqs, s).utilization for s in ("max", "pow2", "oracle")}
    paged = [kv_usage(reqs, "paged", block_size=b).utilization for b in (8, 16, 32)]
    assert u["max"] < u["pow2"] < u["oracle"] < paged[2] < paged[1] < paged[0] < 1


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("max", 5, 6), {}),  # no max_len
        (("max", 5, 6, 4), {}),  # max_len below the final length
        (("paged", 0, 6), {}),  # holds nothing
        (("paged", 7, 6), {}),  # holds more than its final length
        (("paged", 3, 6), {"block_size": 0}),
        (("lifo", 3, 6, 8), {}),
    ],
)
def test_reserved_slots_rejects_bad_input(args, kwargs):
    with pytest.raises(ValueError):
        reserved_slots(*args, **kwargs)


def test_kv_usage_rejects_bad_input():
    with pytest.raises(ValueError):
        kv_usage([], "oracle")
    with pytest.raises(ValueError):
        kv_usage([RequestSpec(0, 3)], "oracle")


def test_next_pow2():
    assert [next_pow2(n) for n in (1, 2, 3, 4, 5, 1000, 1024, 1025)] == [
        1, 2, 4, 4, 8, 1024, 1024, 2048
    ]
