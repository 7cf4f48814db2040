"""KL divergence of a candidate's next-token distribution from a reference's (Chapter 8b):
constructed models whose answer is known in closed form, then real models (the same model -> 0).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import infer_lab as il
from infer_lab.measure.kl import (
    CachedReference,
    kl_divergence,
    kl_divergence_many,
    kl_per_token,
)
from infer_lab.measure.quality import perplexity
from infer_lab.model.quantize import quantize_model


class TableModel:
    """Logits at each position depend on that position's token only: ``table[ids]``."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]


def test_kl_of_two_known_distributions():
    p, q = torch.tensor([[0.5, 0.5]]), torch.tensor([[0.9, 0.1]])
    want = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    got = kl_per_token(p.log(), q.log())
    assert got.item() == pytest.approx(want, rel=1e-6)
    # softmax ignores a constant added to every logit: no divergence
    assert kl_per_token(p.log(), p.log() + 3.0).item() == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="shapes differ"):
        kl_per_token(torch.zeros(2, 3), torch.zeros(2, 4))


@pytest.mark.parametrize("window,stride", [(16, 8), (7, 6), (200, None)])
def test_mean_p99_agreement_and_perplexity_match_closed_form(window, stride):
    gen = torch.Generator().manual_seed(1)
    vocab = 11
    ref_table = torch.randn(vocab, vocab, generator=gen) * 2
    cand_table = ref_table.clone()
    cand_table[3] = torch.randn(vocab, generator=gen) * 2  # only after token 3 does it differ
    ids = torch.randint(0, vocab, (120,), generator=gen)
    res = kl_divergence(TableModel(ref_table), TableModel(cand_table), ids, window, stride)
    # position t is predicted from token t-1: every position 1..119 is scored once
    per_pos = kl_per_token(ref_table[ids[:-1]], cand_table[ids[:-1]])
    assert res.tokens == 119
    assert res.kl_mean == pytest.approx(float(per_pos.mean()), rel=1e-9)
    assert res.kl_p99 == pytest.approx(float(torch.quantile(per_pos, 0.99)), rel=1e-9)
    assert res.kl_max == pytest.approx(float(per_pos.max()), rel=1e-9)
    assert res.kl_mean > 0
    ref_top, cand_top = ref_table[ids[:-1]].argmax(-1), cand_table[ids[:-1]].argmax(-1)
    assert res.top1_agreement == pytest.approx(float((ref_top == cand_top).float().mean()))
    nll = -torch.log_softmax(cand_table[ids[:-1]].double(), -1)[torch.arange(119), ids[1:]]
    assert res.ppl == pytest.approx(math.exp(float(nll.mean())), rel=1e-9)
    # the windows' sums are the per-position divergences cut where the windows score
    assert sum(n for _, n in res.window_sums) == 119
    assert sum(s for s, _ in res.window_sums) == pytest.approx(float(per_pos.sum()), rel=1e-9)


def test_kl_mean_interval_resamples_windows():
    gen = torch.Generator().manual_seed(2)
    vocab = 11
    ref_table = torch.randn(vocab, vocab, generator=gen) * 2
    cand_table = ref_table.clone()
    cand_table[3] = torch.randn(vocab, generator=gen) * 2
    ids = torch.randint(0, vocab, (400,), generator=gen)
    res = kl_divergence(TableModel(ref_table), TableModel(cand_table), ids, 32, 16)
    lo, hi = res.kl_mean_ci()
    assert lo < res.kl_mean < hi
    assert res.kl_mean_ci(seed=1) != (lo, hi) and res.kl_mean_ci() == (lo, hi)  # seeded
    one = kl_divergence(TableModel(ref_table), TableModel(cand_table), ids[:40], 64, 32)
    assert len(one.window_sums) == 1 and math.isnan(one.kl_mean_ci()[0])  # one window: none


def test_identical_models_and_many_candidates():
    gen = torch.Generator().manual_seed(2)
    table = torch.randn(7, 7, generator=gen)
    ids = torch.randint(0, 7, (50,), generator=gen)
    res = kl_divergence_many(TableModel(table), {"same": TableModel(table.clone()),
                                                 "flat": TableModel(torch.zeros(7, 7))}, ids, 20)
    assert res["same"].kl_mean == 0.0 and res["same"].kl_p99 == 0.0
    assert res["same"].top1_agreement == 1.0 and res["same"].ppl == res["same"].ppl_ref
    # a uniform candidate: KL(p || uniform) = log V - H(p)
    lp = torch.log_softmax(table[ids[:-1]].double(), -1)
    want = float((math.log(7) + (lp.exp() * lp).sum(-1)).mean())
    assert res["flat"].kl_mean == pytest.approx(want, rel=1e-9)
    assert res["flat"].ppl == pytest.approx(7.0, rel=1e-9)


def test_bad_arguments():
    m = TableModel(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="window"):
        kl_divergence(m, m, [0, 1, 2], window=1)
    with pytest.raises(ValueError, match="stride"):
        kl_divergence(m, m, [0, 1, 2], window=4, stride=4)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        kl_divergence(m, m, [0])
    with pytest.raises(ValueError, match="candidate"):
        kl_divergence_many(m, {}, [0, 1])


@pytest.fixture(scope="module")
def tiny():
    model, tok = il.load()
    ids = tok.encode(il.measure.quality.KJV_PASSAGE)[:160]
    return model, ids


def test_real_model_against_itself_is_zero_and_perplexity_agrees(tiny):
    model, ids = tiny
    res = kl_divergence(model, copy.deepcopy(model), ids, window=64)
    assert res.kl_mean == 0.0 and res.top1_agreement == 1.0
    # the same windows as quality.perplexity: the same perplexity
    assert res.ppl_ref == pytest.approx(perplexity(model, ids, window=64).perplexity, rel=1e-5)


def test_real_model_int8_diverges_less_than_int4(tiny):
    model, ids = tiny
    res = kl_divergence_many(model, {
        "int8": quantize_model(copy.deepcopy(model), "int8"),
        "int4": quantize_model(copy.deepcopy(model), "int4", 32)}, ids, window=64)
    assert 0 < res["int8"].kl_mean < res["int4"].kl_mean
    assert res["int8"].kl_p99 >= res["int8"].kl_mean
    assert res["int8"].top1_agreement > 0.9


def test_cached_reference_replays_the_same_logits():
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(9, 9, generator=gen)
    calls = []

    def model(ids):
        calls.append(ids.numel())
        return table[ids]

    ids = torch.randint(0, 9, (60,), generator=gen)
    ref = CachedReference(model)
    cand = TableModel(table + 0.1 * torch.randn(9, 9, generator=gen))
    first = kl_divergence(ref, cand, ids, window=16)
    n = len(calls)
    again = kl_divergence(ref, cand, ids, window=16)
    assert len(calls) == n and again == first  # replayed, not recomputed
    assert first == kl_divergence(model, cand, ids, window=16)
