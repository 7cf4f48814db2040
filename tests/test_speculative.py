"""Speculative decoding (issue 17): lossless output, exact rollback, clear errors.

Drafts used: prompt lookup (``ngram``); ``early_exit`` with the bundled model's first layer; and
``draft_model`` with a *truncated copy of the target* (its first 2 of 4 layers, own weights
object, own paged cache). The bundled model (4 layers, 3072 tokens, trained) runs most tests;
SmolLM2-135M-Instruct a few (marked slow). The sampled-draft tests use a random-weight tiny
Llama with a 12-token vocabulary as the target, and as drafts both a *different* random model
of the same vocabulary (``draft_model``) and the target's own first layers (``early_exit``).
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

import infer_lab as il
from infer_lab.engine import LLMEngine, SamplingParams, speculative
from infer_lab.engine.speculative import (
    SpeculativeConfig,
    accepted_prefix,
    ngram_propose,
    rejection_sample,
    verify_sampled,
)
from infer_lab.model.config import ModelConfig
from infer_lab.model.transformer import Transformer
from infer_lab.utils import cdiv
from tests.engine_fixtures import assert_no_leak, logits_after
from tests.helpers import assert_greedy_equal, make_checkpoint

COPY = ("Copy this list exactly: red apple, green pear, blue plum, red apple, green pear, "
        "blue plum, red apple, green pear,")
PROMPTS = [COPY, "Once upon a time there was a little", "the cat sat on the mat. the cat sat on",
           "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,", "Hello"]


@pytest.fixture(scope="module")
def bundled():
    return il.load(device="cpu", dtype=torch.float32)


def truncated_copy(model, num_layers: int):
    """A separate model object holding copies of the target's first layers (the test draft)."""
    draft = copy.deepcopy(model)
    draft.layers = draft.layers[:num_layers]
    draft.config = dataclasses.replace(model.config, num_hidden_layers=num_layers)
    return draft


def methods(model):
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
        "early_exit": {"method": "early_exit", "num_layers": 1, "num_speculative_tokens": 3},
        "draft_model": {"method": "draft_model", "model": truncated_copy(model, 2),
                        "num_speculative_tokens": 3},
    }


def run(model, tok, prompts, params, spec=None, **kw):
    """Every prompt through one engine; outputs in prompt order, and the engine."""
    kw.setdefault("num_kv_blocks", 256)
    engine = LLMEngine(model, tok, speculative_config=spec, **kw)
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert_no_leak(engine)
    return [done[str(i)] for i in range(len(prompts))], engine


@pytest.mark.parametrize("method", ["ngram", "early_exit", "draft_model"])
def test_greedy_output_unchanged_in_a_mixed_batch_with_preemption(bundled, method):
    model, tok = bundled
    params = [SamplingParams(max_tokens=m, temperature=0) for m in (40, 25, 33, 30, 12)]
    small = dict(num_kv_blocks=12, block_size=8, max_num_batched_tokens=24, max_num_seqs=4)
    base, _ = run(model, tok, PROMPTS, params, **small)
    outs, engine = run(model, tok, PROMPTS, params, methods(model)[method], **small)
    stats_ = engine.get_stats()
    assert stats_.num_preemptions > 0  # the small pool forced preemption; the budget, chunks
    assert stats_.spec_num_draft_tokens > 0 and stats_.spec_num_accepted_tokens > 0
    for prompt, a, b in zip(PROMPTS, outs, base):
        ids = tok.encode(prompt)
        assert_greedy_equal(a.outputs[0].token_ids, b.outputs[0].token_ids,
                            logits_after(model, ids))
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason


@pytest.mark.parametrize("method", ["ngram", "early_exit", "draft_model"])
def test_greedy_alone_equals_naive(bundled, method):
    model, tok = bundled
    ids = tok.encode(COPY)
    outs, engine = run(model, tok, [ids], SamplingParams(max_tokens=30, temperature=0),
                       methods(model)[method])
    ref = il.generate_naive(model, tok, ids, 30).token_ids
    assert_greedy_equal(outs[0].outputs[0].token_ids, ref, logits_after(model, ids))
    m = outs[0].metrics
    assert m.spec_num_draft_tokens > 0
    assert m.spec_acceptance_rate == m.spec_num_accepted_tokens / m.spec_num_draft_tokens
    assert engine.get_stats().spec_num_drafts == m.spec_num_drafts


def test_ngram_speeds_up_the_copy_task(bundled):
    """Acceptance on a repeating output is high: far fewer target forwards than tokens."""
    model, tok = bundled
    outs, engine = run(model, tok, [PROMPTS[3]], SamplingParams(max_tokens=40, temperature=0),
                       methods(model)["ngram"])
    assert engine.num_steps < 0.7 * (1 + 40)  # prefill + one step per token without it
    assert outs[0].metrics.spec_mean_accepted_length > 1.5


@pytest.mark.parametrize("method", ["ngram", "early_exit", "draft_model"])
def test_seeded_sampling_identical_with_and_without_speculation(bundled, method):
    model, tok = bundled
    params = [SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, seed=s,
                             presence_penalty=0.3 if s % 2 else 0.0, logprobs=2)
              for s in range(len(PROMPTS))]
    base, _ = run(model, tok, PROMPTS, params)
    outs, engine = run(model, tok, PROMPTS, params, methods(model)[method])
    assert engine.get_stats().spec_num_accepted_tokens > 0
    for a, b in zip(outs, base):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert [x.token_id for x in la] == [x.token_id for x in lb]
        np.testing.assert_allclose([x.logprob for x in la], [x.logprob for x in lb], atol=1e-4)


def test_output_independent_of_the_batch(bundled):
    """A seeded request alone and among others: the same tokens, with speculation on."""
    model, tok = bundled
    spec = methods(model)["ngram"]
    p = SamplingParams(max_tokens=30, temperature=1.0, seed=11)
    alone, _ = run(model, tok, [COPY], p, spec)
    mixed, _ = run(model, tok, PROMPTS, p, spec)
    assert alone[0].outputs[0].token_ids == mixed[0].outputs[0].token_ids


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 6},
    {"method": "early_exit", "num_layers": 1, "num_speculative_tokens": 4,
     "draft_sampling": "sampled"},
], ids=["ngram", "early_exit_sampled"])
def test_rollback_leaves_table_and_free_queue_as_if_never_written(bundled, spec):
    model, tok = bundled
    engine = LLMEngine(model, tok, num_kv_blocks=40, block_size=4, enable_prefix_caching=False,
                       speculative_config=spec)
    engine.add_request("a", "Once upon a time there was", SamplingParams(max_tokens=60))
    seq = engine.requests["a"].seqs[0]
    rejected = 0
    while engine.has_unfinished_requests():
        before = engine.get_stats().spec_num_draft_tokens - engine.get_stats(
        ).spec_num_accepted_tokens
        engine.step()
        st = engine.get_stats()
        rejected += (st.spec_num_draft_tokens - st.spec_num_accepted_tokens) > before
        if seq.is_finished:
            break
        # exactly the blocks its computed tokens need, taken from the front of the queue
        assert len(seq.block_table) == cdiv(seq.num_computed, 4)
        assert seq.block_table == list(range(len(seq.block_table)))
        assert engine.kv.pool.free_block_ids() == list(range(len(seq.block_table), 40))
    assert rejected > 0  # some proposals were rejected, so something was rolled back
    assert_no_leak(engine)


def test_stops_inside_an_accepted_run(bundled):
    """EOS, stop strings and max_tokens end the output where they would without speculation."""
    model, tok = bundled
    spec = methods(model)["ngram"]
    base, _ = run(model, tok, [COPY], SamplingParams(max_tokens=40, temperature=0))
    text = base[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    stop_ids = base[0].outputs[0].token_ids[17]
    cases = [SamplingParams(max_tokens=40, temperature=0, stop=[stop]),
             SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop_ids]),
             SamplingParams(max_tokens=13, temperature=0)]
    for params in cases:
        (a,), engine = run(model, tok, [COPY], params, spec)
        (b,), _ = run(model, tok, [COPY], params)
        assert engine.get_stats().spec_num_accepted_tokens > 0
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        assert (a.outputs[0].finish_reason, a.outputs[0].stop_reason) == (
            b.outputs[0].finish_reason, b.outputs[0].stop_reason)
    assert len(a.outputs[0].token_ids) == 13


def test_prefix_caching_with_a_draft_model(bundled):
    """A later request reuses the target's cached prefix; the draft's cache, addressed by the
    same blocks, still holds that prefix, so the output stays the model's own."""
    model, tok = bundled
    params = SamplingParams(max_tokens=24, temperature=0)
    (base,), _ = run(model, tok, [COPY + " red"], params, enable_prefix_caching=False)
    engine = LLMEngine(model, tok, speculative_config=methods(model)["draft_model"],
                       block_size=8, num_kv_blocks=64)
    for rid, prompt in (("first", COPY), ("second", COPY + " red")):
        engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                last = out
    assert engine.get_stats().prefix_cache_hits > 0
    assert last.outputs[0].token_ids == base.outputs[0].token_ids
    assert last.metrics.spec_num_accepted_tokens > 0
    assert_no_leak(engine)


def test_disable_by_batch_size_turns_it_off_without_changing_output(bundled):
    """Off at or above the batch size (here: from 3 running or waiting); the output is the same."""
    model, tok = bundled
    params = [SamplingParams(max_tokens=m, temperature=0) for m in (30, 30, 8, 8, 8)]
    base, _ = run(model, tok, PROMPTS, params)
    for limit, speculates in ((1, False), (3, True), (100, True)):
        spec = {**methods(model)["ngram"], "disable_by_batch_size": limit}
        outs, engine = run(model, tok, PROMPTS, params, spec)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
        assert (engine.get_stats().spec_num_drafts > 0) == speculates
    engine = LLMEngine(model, tok, num_kv_blocks=256,
                       speculative_config={**methods(model)["ngram"], "disable_by_batch_size": 3})
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        engine.add_request(str(i), p, sp)
    engine.step()
    engine.step()  # 5 requests running: no proposals
    assert engine.get_stats().spec_num_drafts == 0


def test_structured_or_parallel_samples_do_not_speculate(bundled):
    model, tok = bundled
    (out,), engine = run(model, tok, [COPY], SamplingParams(max_tokens=10, n=2, seed=1,
                                                             temperature=1.0),
                         methods(model)["ngram"])
    assert engine.get_stats().spec_num_drafts == 0
    assert len(out.outputs) == 2


def test_bad_configs_raise_clear_errors(bundled, tmp_path):
    model, tok = bundled
    bad = [({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
           ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
           ({"method": "ngram"}, "num_speculative_tokens"),
           ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "unknown"),
           ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
             "prompt_lookup_max": 2}, "prompt_lookup_max"),
           ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
           ({"method": "early_exit", "num_speculative_tokens": 2}, "num_layers"),
           ({"method": "early_exit", "num_layers": 1, "num_speculative_tokens": 2,
             "draft_sampling": "random"}, "draft_sampling"),
           ({"method": "ngram", "num_speculative_tokens": 2, "draft_sampling": "sampled"},
            "unknown"),
           ("ngram", "dict")]
    for spec, word in bad:
        with pytest.raises((ValueError, TypeError), match=word):
            il.EngineConfig(speculative_config=spec)
    with pytest.raises(ValueError, match="num_layers"):
        LLMEngine(model, tok, speculative_config={"method": "early_exit", "num_layers": 4,
                                                  "num_speculative_tokens": 2})
    make_checkpoint(tmp_path, "llama3", vocab_size=500)
    other = il.load(tmp_path, device="cpu", dtype=torch.float32)[0]
    with pytest.raises(ValueError, match="vocabulary"):
        LLMEngine(model, tok, speculative_config={"method": "draft_model", "model": other,
                                                  "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="continuous"):
        il.EngineConfig(policy="static", speculative_config=methods(model)["ngram"])
    assert SpeculativeConfig.parse(methods(model)["ngram"]).prompt_lookup_max == 3


def test_llm_and_cli_take_the_config(bundled):
    from infer_lab.cli import build_parser

    args = build_parser().parse_args(
        ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", "[1, 2]"])
    llm = il.LLM(speculative_config=args.speculative_config, num_kv_blocks=64)
    (out,) = llm.generate([COPY], SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
    assert out.metrics.spec_num_draft_tokens > 0


def test_ngram_proposal_and_acceptance_rules():
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 3, 1) == [7, 1]  # latest one
    assert ngram_propose([5, 6, 7, 8], 3, 3, 1) == []
    assert ngram_propose([4, 1, 5, 2, 1], 3, 2, 1) == [5, 2, 1]  # falls back to n = 1
    assert accepted_prefix([1, 2, 3], [1, 2, 4, 5]) == [1, 2, 4]
    assert accepted_prefix([1, 2, 3], [1, 2, 3, 5]) == [1, 2, 3, 5]
    assert accepted_prefix([1, 2], [9, 2, 3]) == [9]


def _chi2_pvalue(rule, p, q, n=20000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros(len(p))
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).tolist()
    for d in drafts:
        counts[rule(p, q, d, gen)[0]] += 1
    expected = p.numpy() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    dof = len(p) - 1  # the chi-square survival function: Q(dof / 2, chi2 / 2)
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(chi2 / 2)))


def test_rejection_sampling_preserves_the_distribution_and_a_broken_rule_does_not():
    """The draft's token drawn from q, then the rule: the result must be distributed as p
    (chi-square at significance 0.001); accepting every draft (a broken rule) yields q."""
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64)
    q = torch.tensor([0.1, 0.3, 0.3, 0.2, 0.1], dtype=torch.float64)
    assert _chi2_pvalue(rejection_sample, p, q) > 1e-3

    def always_accept(p, q, d, gen):
        return d, True
    assert _chi2_pvalue(always_accept, p, q) < 1e-3


# ---------------------------------------------------------------------- 16-bit
# bf16 keeps 8 bits of mantissa: logits of magnitude 8-16 are spaced 1/16 apart, and a forward
# of k + 1 tokens sums in another order than a forward of one. Two such steps are a near tie.
BF16_TIE = 0.125


@pytest.fixture(scope="module")
def bundled_bf16():
    return il.load(device="cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("method", ["ngram", "early_exit", "draft_model"])
def test_bf16_greedy_unchanged_under_the_near_tie_rule(bundled_bf16, method):
    """In bf16, greedy output with speculation equals the output without it, token for token
    but at a near tie (top-2 logits within BF16_TIE where they first differ)."""
    model, tok = bundled_bf16
    params = SamplingParams(max_tokens=40, temperature=0)
    base, _ = run(model, tok, PROMPTS, params)
    outs, engine = run(model, tok, PROMPTS, params, methods(model)[method])
    assert engine.get_stats().spec_num_accepted_tokens > 0
    for prompt, a, b in zip(PROMPTS, outs, base):
        assert_greedy_equal(a.outputs[0].token_ids, b.outputs[0].token_ids,
                            logits_after(model, tok.encode(prompt)), tol=BF16_TIE)


# ---------------------------------------------------------------------- a sampled draft
TINY_VOCAB = 12
TINY_PROMPT = [3, 7, 1, 5, 9]


def tiny_llama(seed: int, num_layers: int = 2) -> Transformer:
    """A random-weight Llama of 12 tokens, weights spread wide enough for varied p and q."""
    cfg = ModelConfig.from_dict(dict(
        model_type="llama", vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64))
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def tiny_target():
    return tiny_llama(0, num_layers=3)


def sample_many(target, tok, spec, n: int, first_seed: int = 0, **params):
    """``n`` requests seeded ``first_seed``.. (one engine, batched): outputs ``[n, max_tokens]``."""
    sp = [SamplingParams(max_tokens=4, seed=s, ignore_eos=True, detokenize=False, **params)
          for s in range(first_seed, first_seed + n)]
    outs, engine = run(target, tok, [TINY_PROMPT] * n, sp, spec, num_kv_blocks=2048,
                       max_num_seqs=256, max_num_batched_tokens=4096)
    return np.array([o.outputs[0].token_ids for o in outs]), engine.get_stats()


def homogeneity_pvalue(a: np.ndarray, b: np.ndarray) -> float:
    """Chi-square test that two samples of tokens come from one distribution (2 x V table;
    tokens seen fewer than 10 times in both together pooled into one cell)."""
    ca, cb = (np.bincount(x, minlength=TINY_VOCAB).astype(float) for x in (a, b))
    rare = ca + cb < 10
    ca, cb = np.append(ca[~rare], ca[rare].sum()), np.append(cb[~rare], cb[rare].sum())
    if ca[-1] + cb[-1] == 0:
        ca, cb = ca[:-1], cb[:-1]
    total = ca + cb
    ea, eb = total * ca.sum() / total.sum(), total * cb.sum() / total.sum()
    chi2 = float(((ca - ea) ** 2 / ea).sum() + ((cb - eb) ** 2 / eb).sum())
    dof = len(total) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(chi2 / 2)))


SAMPLED_DRAFTS = {
    # a different random model, same vocabulary: rarely agrees (about 13% accepted)
    "draft_model": (lambda: {"method": "draft_model", "model": tiny_llama(1),
                             "num_speculative_tokens": 3, "draft_sampling": "sampled"},
                    dict(temperature=1.0)),
    # the target's first 2 of 3 layers; top-k, top-p and a penalty, which p must count
    "early_exit": (lambda: {"method": "early_exit", "num_layers": 2,
                            "num_speculative_tokens": 3, "draft_sampling": "sampled"},
                   dict(temperature=0.8, top_k=8, top_p=0.95, presence_penalty=0.7)),
}
N_SAMPLES = 3000
SIGNIFICANCE = 1e-3


@pytest.mark.parametrize("method", list(SAMPLED_DRAFTS))
def test_sampled_draft_preserves_the_distribution(bundled, tiny_target, method, monkeypatch):
    """Tokens 2-4 (the first comes from prefill and is never drafted) over 3000 seeded samples
    with speculation on and off: a chi-square homogeneity test per position passes at
    significance 1e-3; with acceptance broken (every guess kept) the same test fails. The two
    samples take disjoint seeds: the test assumes independent samples, and a shared seed would
    draw the first token (so every later token's prefix) alike in both."""
    _, tok = bundled
    make_spec, params = SAMPLED_DRAFTS[method]
    spec = make_spec()
    off, _ = sample_many(tiny_target, tok, None, N_SAMPLES, **params)
    on, stats_ = sample_many(tiny_target, tok, spec, N_SAMPLES, first_seed=N_SAMPLES, **params)
    paired, _ = sample_many(tiny_target, tok, None, 100, first_seed=N_SAMPLES, **params)
    assert stats_.spec_num_draft_tokens > N_SAMPLES  # proposals were made...
    assert 0 < stats_.spec_num_accepted_tokens < stats_.spec_num_draft_tokens  # ...some rejected
    assert on.shape == off.shape == (N_SAMPLES, 4)  # max_tokens held inside accepted runs
    for j in (1, 2, 3):
        assert homogeneity_pvalue(off[:, j], on[:, j]) > SIGNIFICANCE, f"token {j + 1}"
    assert (on[:100] != paired).any()  # the same distribution, not the same seeded stream
    again, _ = sample_many(tiny_target, tok, spec, N_SAMPLES, first_seed=N_SAMPLES, **params)
    assert (again == on).all()  # reproducible: same seeds, same batch

    monkeypatch.setattr(speculative, "rejection_sample", lambda p, q, x, gen=None: (x, True))
    broken, stats_ = sample_many(tiny_target, tok, spec, N_SAMPLES, first_seed=N_SAMPLES,
                                 **params)
    assert stats_.spec_num_accepted_tokens == stats_.spec_num_draft_tokens
    assert min(homogeneity_pvalue(off[:, j], broken[:, j]) for j in (1, 2, 3)) < SIGNIFICANCE


def test_sampled_draft_keeps_greedy_requests_and_stop_tokens(bundled, tiny_target):
    """In sampled-draft mode a greedy request still gets the greedy draft and its output is
    the model's own; a stop token inside a kept run ends the output there; each kept token
    comes with its log-probability."""
    _, tok = bundled
    spec = SAMPLED_DRAFTS["draft_model"][0]()
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, detokenize=False)
    stop = [SamplingParams(max_tokens=12, seed=s, stop_token_ids=[6], ignore_eos=True,
                           detokenize=False, logprobs=1)
            for s in range(40)]
    prompts = [TINY_PROMPT] * 41
    base, _ = run(tiny_target, tok, prompts, [greedy] + stop)
    outs, engine = run(tiny_target, tok, prompts, [greedy] + stop, spec)
    assert engine.get_stats().spec_num_draft_tokens > 0
    assert outs[0].outputs[0].token_ids == base[0].outputs[0].token_ids
    ended = 0
    for o in outs[1:]:
        ids = o.outputs[0].token_ids
        assert 6 not in ids[:-1] and len(ids) <= 12
        assert [lp.token_id for lp in o.outputs[0].logprobs] == ids
        assert all(-30 < lp.logprob <= 0 for lp in o.outputs[0].logprobs)
        if ids[-1] == 6:
            assert o.outputs[0].finish_reason == "stop"
            ended += 1
        else:
            assert len(ids) == 12 and o.outputs[0].finish_reason == "length"
    assert ended > 0


def test_verify_sampled_runs():
    """The kept run: guesses while accepted, the correction at the first rejection, and a
    bonus token from p after k accepted guesses."""
    q = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    p_agrees = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert verify_sampled(p_agrees, q, [1, 2]) == [1, 2, 0]
    p_rejects = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert verify_sampled(p_rejects, q, [1, 2]) == [2]  # p(1) = 0: rejected, drawn from p - q


# ---------------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="module")
def smollm2():
    return il.load("smollm2-135m-instruct", device="cpu", dtype=torch.float32)


SMOL_PROMPTS = [
    "Repeat the sentence: The quick brown fox jumps over the lazy dog near the river bank. "
    "Answer: The quick brown fox",
    "The capital of France is",
    "Copy this list: apples, pears, plums, apples, pears, plums, apples,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return",
]


def smollm2_spec(model, method: str) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4}
    if method == "early_exit":
        return {"method": "early_exit", "num_layers": 24, "num_speculative_tokens": 2}
    return {"method": "draft_model", "model": truncated_copy(model, 8),
            "num_speculative_tokens": 2}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "early_exit", "draft_model"])
def test_smollm2_mixed_batch_with_preemption_and_chunks(smollm2, method):
    """SmolLM2, four requests in a pool too small for all of them and a 24-token budget:
    preemption and chunked prefill happen, and greedy output equals no speculation's."""
    model, tok = smollm2
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
              for m in (16, 12, 16, 10)]
    small = dict(num_kv_blocks=10, block_size=8, max_num_batched_tokens=24, max_num_seqs=4,
                 enable_prefix_caching=False, log_steps=True)
    base, _ = run(model, tok, SMOL_PROMPTS, params, **small)
    outs, engine = run(model, tok, SMOL_PROMPTS, params, smollm2_spec(model, method), **small)
    st = engine.get_stats()
    assert st.num_preemptions > 0
    first: dict[str, int] = {}  # tokens of each request's first step: its first prompt chunk
    for rec in engine.step_log:
        for _, rid, n, _ in rec.work:
            first.setdefault(rid, n)
    assert any(first[str(i)] < len(tok.encode(p)) for i, p in enumerate(SMOL_PROMPTS))
    assert st.spec_num_draft_tokens > 0
    for prompt, a, b in zip(SMOL_PROMPTS, outs, base):
        assert_greedy_equal(a.outputs[0].token_ids, b.outputs[0].token_ids,
                            logits_after(model, tok.encode(prompt)))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "early_exit"])
def test_smollm2_greedy_unchanged(smollm2, method):
    model, tok = smollm2
    text = ("Repeat the sentence: The quick brown fox jumps over the lazy dog near the river "
            "bank. Answer: The quick brown fox")
    spec = ({"method": "ngram", "num_speculative_tokens": 4} if method == "ngram" else
            {"method": "early_exit", "num_layers": 24, "num_speculative_tokens": 2})
    params = SamplingParams(max_tokens=16, temperature=0)
    prompts = [text, "The capital of France is"]
    base, _ = run(model, tok, prompts, params)
    outs, engine = run(model, tok, prompts, params, spec)
    assert engine.get_stats().spec_num_draft_tokens > 0
    for prompt, a, b in zip(prompts, outs, base):
        assert_greedy_equal(a.outputs[0].token_ids, b.outputs[0].token_ids,
                            logits_after(model, tok.encode(prompt)))
