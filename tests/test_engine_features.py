"""Sampling reproducibility, parallel samples, stop strings, abort, timings and the API's edges."""

from __future__ import annotations

import pytest

import infer_lab as il
from infer_lab.engine import LLMEngine
from tests.engine_fixtures import assert_no_leak, tiny_model, varied_prompts


@pytest.fixture(scope="module")
def model_tok(tmp_path_factory):
    return tiny_model(tmp_path_factory)


def engine_for(model_tok, **kw) -> LLMEngine:
    model, tok = model_tok
    return LLMEngine(model, tok, **kw)


def drain(engine: LLMEngine) -> dict[str, il.RequestOutput]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def seeded(seed: int, **kw) -> il.SamplingParams:
    return il.SamplingParams(max_tokens=12, temperature=1.5, top_k=50, top_p=0.95, seed=seed,
                             ignore_eos=True, **kw)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(model_tok):
    prompt = varied_prompts(1, seed=3)[0][0]
    alone = engine_for(model_tok)
    alone.add_request("r", prompt, seeded(7))
    first = drain(alone)["r"].token_ids
    assert_no_leak(alone)

    again = engine_for(model_tok)
    again.add_request("r", prompt, seeded(7))
    assert drain(again)["r"].token_ids == first

    crowded = engine_for(model_tok, max_num_batched_tokens=40)
    for i, (p, m) in enumerate(varied_prompts(12, seed=4)):
        other = il.SamplingParams(max_tokens=m, temperature=0.7 * (i % 3), top_p=0.5 + i / 30,
                                  seed=i if i % 2 else None, ignore_eos=True)
        crowded.add_request(f"o{i}", p, other)
        if i == 6:
            crowded.step()  # arrive mid-stream, next to running requests
            crowded.add_request("r", prompt, seeded(7))
    assert drain(crowded)["r"].token_ids == first
    assert_no_leak(crowded)

    other_seed = engine_for(model_tok)
    other_seed.add_request("r", prompt, seeded(8))
    assert drain(other_seed)["r"].token_ids != first


def test_n_samples_share_one_prefill(model_tok):
    prompt = varied_prompts(1, seed=9)[0][0] * 3  # 15 tokens
    engine = engine_for(model_tok, log_steps=True, block_size=4)
    engine.add_request("r", prompt, il.SamplingParams(n=6, max_tokens=10, temperature=2.0,
                                                      seed=1, ignore_eos=True))
    out = drain(engine)["r"]
    assert len(out.outputs) == 6 and [c.index for c in out.outputs] == list(range(6))
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(samples)) == 6 and all(len(s) == 10 for s in samples)
    prefill = sum(n for r in engine.step_log for _, _, n, kind in r.work if kind == "prefill")
    assert prefill == len(prompt)  # the prompt was computed once, not six times
    assert out.text == out.outputs[0].text and out.token_ids == out.outputs[0].token_ids
    assert_no_leak(engine)


def test_n_samples_survive_preemption(model_tok):
    engine = engine_for(model_tok, num_kv_blocks=12, block_size=4)
    for i, (p, _) in enumerate(varied_prompts(6, seed=11)):
        engine.add_request(f"r{i}", p[:12], il.SamplingParams(n=3, max_tokens=14, seed=i,
                                                              temperature=1.0, ignore_eos=True))
    done = drain(engine)
    assert engine.get_stats().num_preemptions > 0
    assert all(len(o.outputs) == 3 and all(len(c.token_ids) == 14 for c in o.outputs)
               for o in done.values())
    assert_no_leak(engine)


def test_stop_strings_across_token_boundaries_are_trimmed(model_tok):
    model, tok = model_tok
    llm = il.LLM(model, tokenizer=tok)
    prompt = "The quick brown fox"
    full = llm.generate(prompt, il.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0]
    pieces = [tok.decode([t]) for t in full.token_ids]
    # a stop string that starts inside one token and ends inside a later one
    k = next(i for i in range(3, len(pieces) - 2) if len(pieces[i]) >= 2)
    start = sum(len(p) for p in pieces[:k]) + 1
    stop = full.text[start : start + len(pieces[k]) + 1]
    assert stop and stop not in full.text[:start]
    engine = LLMEngine(model, tok)
    engine.add_request("s", prompt, il.SamplingParams(max_tokens=40, temperature=0,
                                                      ignore_eos=True, stop=["@@@", stop]))
    streamed, last = "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.outputs[0].delta_text
            assert stop not in streamed  # never even briefly shown to a streaming client
            last = out
    assert last.text == full.text[:start] == streamed
    assert last.finish_reason == "stop" and last.outputs[0].stop_reason == stop
    assert len(last.token_ids) < len(full.token_ids)
    assert_no_leak(engine)


def test_abort_frees_blocks_at_once(model_tok):
    engine = engine_for(model_tok, max_num_seqs=4, block_size=4)
    for i, (p, _) in enumerate(varied_prompts(8, seed=2)):
        engine.add_request(f"r{i}", p, il.SamplingParams(n=2 if i == 1 else 1, max_tokens=20,
                                                         temperature=0.5, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv.num_used_blocks > 0 and engine.scheduler.num_waiting > 0
    used = engine.kv.num_used_blocks
    assert engine.abort("r1") and engine.kv.num_used_blocks < used  # a running one
    assert engine.abort("r7")  # a waiting one
    assert not engine.abort("r7") and not engine.abort("nope")
    for i in (0, 2, 3, 4, 5, 6):
        engine.abort(f"r{i}")
    assert_no_leak(engine)
    assert engine.step() == []


def test_timings_and_output_fields(model_tok):
    model, tok = model_tok
    llm = il.LLM(model, tokenizer=tok, max_num_seqs=4)
    prompts = ["In the beginning", [5, 6, 7, 8], "café"]
    params = [il.SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (3, 5, 7)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [3, 5, 7]
    assert outs[0].prompt == "In the beginning" and outs[1].prompt_token_ids == [5, 6, 7, 8]
    for o in outs:
        m, times = o.metrics, o.outputs[0].token_times
        assert len(times) == len(o.token_ids)
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time == times[0]
        assert times == sorted(times) and m.finish_time == times[-1]
        assert o.text == tok.decode(o.token_ids) and o.finished
    assert_no_leak(llm.engine)


def test_top_k_1_and_tiny_top_p_are_greedy(model_tok):
    model, tok = model_tok
    llm = il.LLM(model, tokenizer=tok)
    prompts = [p for p, _ in varied_prompts(6, seed=12)]
    greedy = llm.generate(prompts, il.SamplingParams(max_tokens=8, temperature=0,
                                                     ignore_eos=True), use_tqdm=False)
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        outs = llm.generate(prompts, il.SamplingParams(max_tokens=8, temperature=1.3,
                                                       ignore_eos=True, **kw), use_tqdm=False)
        assert [o.token_ids for o in outs] == [g.token_ids for g in greedy]


@pytest.mark.parametrize("kw", [
    dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(max_tokens=0), dict(n=0),
    dict(top_k=-2), dict(stop=[""]), dict(stop_token_ids=[-1]), dict(max_tokens=2.5),
    dict(temperature=float("nan")),
])
def test_invalid_sampling_params_fail_at_construction(kw):
    with pytest.raises((ValueError, TypeError)):
        il.SamplingParams(**kw)


def test_requests_that_cannot_run_are_rejected_when_added(model_tok):
    engine = engine_for(model_tok, num_kv_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="context"):
        engine.add_request("a", [5] * 250, il.SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("b", [], il.SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("c", [10**6], il.SamplingParams())
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("d", [5] * 30, il.SamplingParams(max_tokens=10))
    # more parallel samples than running slots would wait forever (found by the server's fuzzing)
    narrow = engine_for(model_tok, num_kv_blocks=8, block_size=4, max_num_seqs=4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        narrow.add_request("n", [5, 6], il.SamplingParams(n=5, max_tokens=2))
    narrow.add_request("n4", [5, 6], il.SamplingParams(n=4, max_tokens=2))
    drain(narrow)
    assert_no_leak(narrow)
    engine.add_request("e", [5, 6], il.SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="in use"):
        engine.add_request("e", [5, 6], il.SamplingParams(max_tokens=2))
    drain(engine)
    assert_no_leak(engine)


def test_generate_accepts_one_prompt_and_checks_params_length(model_tok):
    model, tok = model_tok
    llm = il.LLM(model, tokenizer=tok)
    one = llm.generate([5, 6, 7], il.SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(one) == 1 and len(one[0].token_ids) == 2
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate(["a", "b"], [il.SamplingParams()], use_tqdm=False)
    assert_no_leak(llm.engine)


def test_one_config_is_built_resolved_and_read_by_every_part(model_tok):
    model, tok = model_tok
    engine = LLMEngine(model, tok, il.EngineConfig(max_num_seqs=4, block_size=8),
                       num_kv_blocks=40)
    cfg = engine.config
    assert (cfg.max_num_seqs, cfg.block_size, cfg.num_kv_blocks) == (4, 8, 40)
    assert cfg.max_model_len == model.config.max_position_embeddings  # resolved
    assert all(part.config is cfg for part in (engine.scheduler, engine.kv, engine.runner))
    assert engine.kv.pool.num_blocks == 40 and engine.runner.cache.num_blocks == 41  # + scratch
    assert engine.runner.block_table.shape == (5, cfg.max_model_len // 8)
    assert il.engine.StaticScheduler is type(LLMEngine(model, tok, policy="static").scheduler)
    assert LLMEngine(model, tok, max_model_len=10**6).config.max_model_len == cfg.max_model_len
    llm = il.LLM(model, tokenizer=tok, config=il.EngineConfig(max_num_seqs=3), block_size=4)
    assert (llm.engine.config.max_num_seqs, llm.engine.config.block_size) == (3, 4)
    with pytest.raises(TypeError, match="unknown engine option"):
        LLMEngine(model, tok, max_num_seq=4)
    with pytest.raises(TypeError, match="EngineConfig"):
        LLMEngine(model, tok, {"max_num_seqs": 4})


def test_parallel_samples_equal_their_solo_runs_through_copy_on_write(model_tok):
    """n samples share the prompt's blocks and copy the partial last block on their first write;
    each must then read back only its own K/V, so sample k equals a solo run with its seed."""
    from infer_lab.engine.engine import sample_seed

    prompt = varied_prompts(1, seed=9)[0][0] * 3  # 15 tokens: the last block of 4 is partial

    def params(n: int, seed: int) -> il.SamplingParams:
        return il.SamplingParams(n=n, max_tokens=12, temperature=1.5, seed=seed,
                                 ignore_eos=True)

    engine = engine_for(model_tok, block_size=4, num_kv_blocks=24)
    engine.add_request("r", prompt, params(3, 7))
    together = [c.token_ids for c in drain(engine)["r"].outputs]
    assert len(set(map(tuple, together))) == 3  # they diverge, so a shared write would show
    assert_no_leak(engine)
    for k in range(3):
        solo = engine_for(model_tok, block_size=4, num_kv_blocks=24)
        solo.add_request("s", prompt, params(1, sample_seed(7, k)))
        assert drain(solo)["s"].token_ids == together[k]
