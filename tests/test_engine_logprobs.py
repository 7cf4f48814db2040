"""Log-probabilities and penalties through the engine, against an independent forward pass."""

from __future__ import annotations

import pytest
import torch

import infer_lab as il
from infer_lab.engine import LLMEngine, TokenLogprobs
from tests.engine_fixtures import assert_no_leak, tiny_model, varied_prompts
from tests.helpers import assert_greedy_equal


@pytest.fixture(scope="module")
def model_tok(tmp_path_factory):
    return tiny_model(tmp_path_factory)


def raw_logprobs(model, prompt: list[int], out: list[int], t: int) -> torch.Tensor:
    """log_softmax of the plain forward's last logits after ``prompt + out[:t]``."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out[:t]]))[0, -1]
    return torch.log_softmax(logits.double(), -1)


def stream(engine: LLMEngine) -> tuple[dict[str, il.RequestOutput], dict[str, list]]:
    done, deltas = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.setdefault(out.request_id, []).extend(out.outputs[0].delta_logprobs)
            if out.finished:
                done[out.request_id] = out
    return done, deltas


def test_logprobs_are_the_raw_distribution_of_an_independent_forward(model_tok):
    model, tok = model_tok
    (p1, _), (p2, _), (p3, _) = varied_prompts(3, seed=5)
    engine = LLMEngine(model, tok, max_num_batched_tokens=32)  # chunked prompts, too
    asks = {
        "greedy": (p1, il.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                         logprobs=5)),
        # sampled, with penalties: the logprobs stay those of the raw logits
        "sampled": (p2, il.SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=3,
                                          repetition_penalty=1.3, presence_penalty=0.5,
                                          ignore_eos=True, logprobs=3)),
        "only": (p3, il.SamplingParams(max_tokens=6, temperature=1.0, seed=1,
                                       ignore_eos=True, logprobs=0)),
        "none": (p1, il.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)),
    }
    for rid, (prompt, params) in asks.items():
        engine.add_request(rid, prompt, params)
    done, deltas = stream(engine)
    for rid, (prompt, params) in asks.items():
        c = done[rid].outputs[0]
        if params.logprobs is None:
            assert c.logprobs is None and deltas[rid] == []
            continue
        assert len(c.logprobs) == len(c.token_ids) and deltas[rid] == c.logprobs
        for t, lp in enumerate(c.logprobs):
            assert isinstance(lp, TokenLogprobs) and lp.token_id == c.token_ids[t]
            ref = raw_logprobs(model, prompt, c.token_ids, t)
            assert abs(lp.logprob - float(ref[lp.token_id])) < 1e-4
            assert len(lp.top) == params.logprobs
            values, ids = ref.topk(params.logprobs)
            assert [i for i, _ in lp.top] == ids.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in lp.top], dtype=torch.double),
                                       values, atol=1e-4, rtol=0)
    assert_no_leak(engine)


def penalised_greedy(model, prompt: list[int], n: int, rep: float, freq: float, pres: float):
    """Greedy decode with the penalties applied by hand, token by token, in plain Python."""
    out: list[int] = []

    def logits_at(prefix: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + prefix]))[0, -1].double().tolist()
        for v in range(len(logits)):
            if v in prompt or v in prefix:
                logits[v] = logits[v] / rep if logits[v] > 0 else logits[v] * rep
            count = prefix.count(v)
            logits[v] -= freq * count + (pres if count else 0.0)
        return torch.tensor(logits)

    for _ in range(n):
        out.append(int(logits_at(out).argmax()))
    return out, logits_at


def test_penalised_greedy_decode_matches_a_hand_written_loop(model_tok):
    model, tok = model_tok
    prompts = [p for p, _ in varied_prompts(4, seed=8)]
    settings = [(1.0, 0.0, 0.0), (1.5, 0.0, 0.0), (1.0, 1.2, 0.0), (0.8, 0.4, 0.9)]
    llm = il.LLM(model, tokenizer=tok)
    params = [il.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
              for r, f, p in settings]
    outs = llm.generate(prompts, params, use_tqdm=False)
    plain = llm.generate(prompts, il.SamplingParams(max_tokens=16, temperature=0,
                                                    ignore_eos=True), use_tqdm=False)
    for prompt, (r, f, p), out in zip(prompts, settings, outs, strict=True):
        ref, logits_at = penalised_greedy(model, prompt, 16, r, f, p)
        assert_greedy_equal(out.token_ids, ref, logits_at)
    assert outs[0].token_ids == plain[0].token_ids  # neutral values change nothing
    assert any(o.token_ids != q.token_ids for o, q in zip(outs[1:], plain[1:], strict=True))
    assert_no_leak(llm.engine)
