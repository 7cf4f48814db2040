"""KL divergence of a candidate's next-token distribution from a reference's (Chapter 8b):
constructed models whose answer is known in closed form, then real models (the same model -> 0).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import infer_lab as il
from infer_lab.measure import stats
from infer_lab.measure.kl import (
    CachedReference,
    KLResult,
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
    # and the per-token values, by window in text order, are the per-position divergences
    assert [len(w) for w in res.window_kls] == [n for _, n in res.window_sums]
    flat = torch.tensor([k for w in res.window_kls for k in w], dtype=torch.float64)
    assert torch.allclose(flat, per_pos, rtol=1e-12, atol=0)
    assert "window_kls" not in res.as_dict() and res.as_dict()["kl_p99"] == res.kl_p99


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


class BigramModel(TableModel):
    """``table[ids]`` plus ``shift[previous token]``: logits that depend on two tokens."""

    def __init__(self, table: torch.Tensor, shift: torch.Tensor) -> None:
        super().__init__(table)
        self.shift = shift

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        prev = torch.cat([ids[:, :1], ids[:, :-1]], 1)
        return self.table[ids] + self.shift[prev]


def _table_run(n_tokens: int = 400, window: int = 32, stride: int = 16):
    """A candidate off by a different amount at almost every position: a continuous tail."""
    gen = torch.Generator().manual_seed(2)
    vocab = 31
    ref_table = torch.randn(vocab, vocab, generator=gen) * 2
    shift = torch.randn(vocab, vocab, generator=gen)
    ids = torch.randint(0, vocab, (n_tokens,), generator=gen)
    return kl_divergence(TableModel(ref_table), BigramModel(ref_table, shift), ids, window,
                         stride)


def test_kl_p99_interval_resamples_windows():
    res = _table_run()
    lo, hi = res.kl_p99_ci()
    assert lo <= res.kl_p99 <= hi and lo < hi
    assert res.kl_p99_ci() == (lo, hi)
    few = res.kl_p99_ci(n_boot=50)  # few resamples: the seed shows (2000 land on the same
    assert res.kl_p99_ci(n_boot=50) == few != res.kl_p99_ci(n_boot=50, seed=1)  # few values)
    narrow = res.kl_p99_ci(level=0.5)
    assert lo <= narrow[0] <= narrow[1] <= hi  # a lower level, a narrower interval
    # Chapter 7's interval with the windows as groups, and its count of samples past the p99
    assert (lo, hi) == stats.bootstrap_ci(res.window_kls, ps=(99,), n_boot=2000)["p99"]
    assert res.beyond_p99 == stats.beyond(res.tokens, 99) == 4  # 399 tokens: too few for a tail
    one = _table_run(40, 64, 32)
    assert len(one.window_kls) == 1 and all(math.isnan(x) for x in one.kl_p99_ci())
    stored = dataclasses.replace(res, window_kls=())  # e.g. read back from a result file
    assert all(math.isnan(x) for x in stored.kl_p99_ci())


def test_kl_p99_interval_width_follows_the_windows():
    res = _table_run()
    w = res.window_kls
    # every window the same: every resample pools copies of one window, so one value
    same = dataclasses.replace(res, window_kls=(w[3],) * len(w))
    lo, hi = same.kl_p99_ci()
    pooled = torch.tensor(w[3] * len(w), dtype=torch.float64)
    assert lo == hi == pytest.approx(float(torch.quantile(pooled, 0.99)), rel=1e-12)
    # one window with a run of huge outliers (one bad passage, more tokens than lie past the
    # p99): resamples that draw it and those that miss it disagree on the tail
    spiked = list(w)
    spiked[5] = tuple(k + (1000.0 if i < 8 else 0.0) for i, k in enumerate(w[5]))
    base = res.kl_p99_ci()
    out = dataclasses.replace(res, window_kls=tuple(spiked)).kl_p99_ci()
    assert out[1] - out[0] > 10 * (base[1] - base[0])
    assert out[1] > 100  # the outlier itself reaches the top of the interval


# --- does the window bootstrap's p99 interval cover the truth? -----------------------------

LEVEL_SIGMA = 0.5  # a window's level: lognormal(0, 0.5), its hardest windows ~3x the median


def clustered_kls(rng: np.random.Generator, n_windows: int = 50) -> list[np.ndarray]:
    """Per-token KLs of one text whose hard passages raise a whole window together.

    Each window (50-150 scored tokens) draws a level, lognormal(0, ``LEVEL_SIGMA``), and each
    of its tokens that level times an exponential(1): tokens of one window are correlated,
    windows independent, and every token's value has the same distribution, ``L·E``.
    """
    sizes = rng.integers(50, 151, n_windows)
    levels = np.exp(LEVEL_SIGMA * rng.standard_normal(n_windows))
    return [level * rng.exponential(1.0, int(size)) for level, size in zip(levels, sizes)]


def population_p99() -> float:
    """The p99 of ``L·E``, by quadrature instead of sampling: P(L·E > q) = E[exp(-q / L)].

    ``L = exp(σZ)``, Z standard normal: the expectation over Z by 200-node Gauss-Hermite
    (probabilists'), then bisection for the q whose tail is 1%.
    """
    z, w = np.polynomial.hermite_e.hermegauss(200)
    w = w / math.sqrt(2 * math.pi)
    lo, hi = 0.0, 1000.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if (w * np.exp(-mid * np.exp(-LEVEL_SIGMA * z))).sum() > 0.01 \
            else (lo, mid)
    return (lo + hi) / 2


def kl_result(window_kls: list[np.ndarray]) -> KLResult:
    """A :class:`KLResult` of given per-token values (the text's metadata nominal)."""
    flat = np.concatenate(window_kls)
    return KLResult(kl_mean=float(flat.mean()), kl_p99=float(np.percentile(flat, 99)),
                    kl_max=float(flat.max()), top1_agreement=math.nan, ppl=math.nan,
                    ppl_ref=math.nan, tokens=flat.size, window=300, stride=150,
                    window_sums=tuple((float(w.sum()), w.size) for w in window_kls),
                    window_kls=tuple(tuple(w.tolist()) for w in window_kls))


def test_kl_p99_interval_covers_clustered_tails_and_a_token_bootstrap_does_not():
    """Seeded: 150 texts of 50 windows (~5,000 tokens) whose tails come in runs.

    The truth is the population p99 of one token's KL, by quadrature (checked against a million
    tokens). Each text's p99 rests on ~50 tokens beyond it (>= ``stats.MIN_BEYOND``) from a
    median of ~15 windows (the independent events). The interval that resamples windows should
    cover the truth at about its 95%; resampling tokens reads each run as independent draws and
    covers it in about half of the texts.

    The bounds are measured, on 1,000 texts drawn from another seed: the window bootstrap covers
    88.4%, the token one 52.6% (with 2,000 resamples 88.8% and 52.9%: 400 move the coverage by
    less than a point, inside the binomial noise of 150 texts, ±2.6 points, and cost a fifth).
    The window bootstrap falls short of 95% here without a fault: a percentile-bootstrap interval
    of a p99 that rests on ~15 independent events is too narrow (measured the same way, it
    rises to ~93% at ~40 events, 200 windows of 50 tokens, and ~95% at ~60, 400 of 25). So each
    bound is the measured rate three binomial standard deviations of 150 texts out (a correct
    method misses it with probability ~0.1%): >= 80.6% by windows, <= 64.8% by tokens. The
    token bootstrap's 52.6% lies ~7 of its standard deviations below the window bound. This
    seed's 150 texts give 81.3% (122) and 50.7% (76): the window figure low in its noise (three
    other seeds' 150 give 85-88%), one text above its bound, and left so, not re-seeded.
    """
    true = population_p99()
    rng = np.random.default_rng(2026)
    levels = np.exp(LEVEL_SIGMA * rng.standard_normal(100_000))
    million = (levels[:, None] * rng.exponential(1.0, (100_000, 10))).ravel()
    assert np.percentile(million, 99) == pytest.approx(true, rel=0.01)
    trials, n_boot = 150, 400
    hits, events = {"windows": 0, "tokens": 0}, []
    for i in range(trials):
        res = kl_result(clustered_kls(rng))
        assert res.beyond_p99 >= stats.MIN_BEYOND
        events.append(res.windows_beyond_p99)
        for name, (lo, hi) in (
                ("windows", res.kl_p99_ci(n_boot=n_boot, seed=i)),
                ("tokens", stats.bootstrap_ci(np.concatenate(res.window_kls), ps=(99,),
                                              n_boot=n_boot, seed=i)["p99"])):
            hits[name] += lo <= true <= hi
    grouped, tokens = hits["windows"] / trials, hits["tokens"] / trials

    def sd(p: float) -> float:
        return math.sqrt(p * (1 - p) / trials)

    assert grouped >= 0.884 - 3 * sd(0.884), hits  # 0.806
    assert tokens <= 0.526 + 3 * sd(0.526), hits  # 0.648
    assert 10 <= np.median(events) <= 20  # ~50 tokens beyond each p99, from ~15 windows


def test_windows_beyond_p99_counts_the_passages_the_tail_comes_from():
    base = [np.full(100, 0.01 * (w + 1)) for w in range(10)]  # 1,000 tokens: 10 past the p99
    one = [w.copy() for w in base]
    one[3][20:30] = 5.0  # one hard passage: ten bad tokens in a row
    res = kl_result(one)
    assert res.beyond_p99 == 10 and res.windows_beyond_p99 == 1
    spread = [w.copy() for w in base]
    for w in (0, 2, 4, 6, 8):
        spread[w][:2] = 5.0 + w  # five passages, two bad tokens each
    assert kl_result(spread).windows_beyond_p99 == 5
    more = [w.copy() for w in spread]
    more[9][-1] = 100.0  # one more bad token: one of window 0's two (tied) ranks eleventh
    assert kl_result(more).windows_beyond_p99 == 6  # and drops out; its other stays
    ties = [np.ones(100) for _ in range(10)]  # all equal: the last ten in text order
    assert kl_result(ties).windows_beyond_p99 == 1
    assert dataclasses.replace(res, window_kls=()).windows_beyond_p99 is None  # not kept


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


def test_real_model_p99_interval_holds_the_estimate():
    model, tok = il.load()
    heldout = Path(il.__file__).parent / "assets" / "tiny-moe" / "heldout.txt"
    ids = tok.encode(heldout.read_text())[:1025]
    res = kl_divergence(model, quantize_model(copy.deepcopy(model), "int4", 32), ids,
                        window=128, stride=64)
    assert res.tokens == 1024 and len(res.window_kls) >= 15
    lo, hi = res.kl_p99_ci()
    assert 0 < lo <= res.kl_p99 <= hi
    m_lo, m_hi = res.kl_mean_ci()
    assert m_hi < lo  # the tail sits well above the mean, both resampled by window
    assert res.beyond_p99 == 11  # 1024 tokens: just enough past the p99 for a tail (>= 10)
    assert res.windows_beyond_p99 == 7  # but from 7 of the 16 windows: by events, too few


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
