"""The engine with quantized weights and an 8-bit KV cache: batched equals each request alone
*under the same quantization* (near-tie rule), and the options are checked."""

from __future__ import annotations

import pytest
import torch

import infer_lab as il
from infer_lab.cache import build_paged_batch
from infer_lab.cache.kv_quant import Int8PagedKVCache, attention_backend_for, make_paged_kv_cache
from infer_lab.cache.paged import PagedAttentionContext
from infer_lab.model.generate import stream_naive
from infer_lab.model.quantize import QuantizationError, quantize_model
from tests.engine_fixtures import assert_no_leak, tiny_model, varied_prompts
from tests.helpers import assert_greedy_equal

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def int8_model(tmp_path_factory):
    model, tok = tiny_model(tmp_path_factory)
    return quantize_model(model, "int8"), tok


def logits_with_kv(model, kv_cache_dtype, prompt):
    """Next-token logits after ``prompt + prefix``, prefilled through an 8-bit paged cache: the
    same quantization the engine applies, so the near-tie rule compares like with like."""
    def at(prefix):
        ids = list(prompt) + list(prefix)
        blocks = -(-len(ids) // 16)
        cache = make_paged_kv_cache(model.config, blocks, 16, "cpu", model.dtype, kv_cache_dtype)
        batch = build_paged_batch([(ids, 0, list(range(blocks)))], 16, blocks)
        ctx = PagedAttentionContext(cache, batch, backend=attention_backend_for(cache, None))
        with torch.inference_mode():
            return model(batch.input_ids, batch.positions, ctx)[-1]
    return at


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_batched_equals_alone_with_int8_weights_and_8bit_kv(int8_model, kv):
    model, tok = int8_model
    prompts = varied_prompts(24, seed=5)
    params = [il.SamplingParams(max_tokens=m, **GREEDY) for _, m in prompts]
    llm = il.LLM(model, tokenizer=tok, kv_cache_dtype=kv, max_num_seqs=32, log_steps=True)
    assert llm.engine.runner.cache.kv_cache_dtype == kv
    outs = llm.generate([p for p, _ in prompts], params, use_tqdm=False)
    assert max(len(r.work) for r in llm.engine.step_log) > 8  # really batched
    assert_no_leak(llm.engine)
    alone = il.LLM(model, tokenizer=tok, kv_cache_dtype=kv, max_num_seqs=1)
    for (prompt, budget), out, p in zip(prompts, outs, params, strict=True):
        ref = alone.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids
        assert len(ref) == budget
        assert_greedy_equal(out.outputs[0].token_ids, ref, logits_with_kv(model, kv, prompt))


def test_int8_weights_engine_equals_naive_decode_of_the_same_model(int8_model):
    model, tok = int8_model
    prompts = varied_prompts(12, seed=9)
    llm = il.LLM(model, tokenizer=tok, max_num_seqs=16)
    outs = llm.generate([p for p, _ in prompts],
                        [il.SamplingParams(max_tokens=m, **GREEDY) for _, m in prompts],
                        use_tqdm=False)
    for (prompt, budget), out in zip(prompts, outs, strict=True):
        ref = list(stream_naive(model, prompt, budget, set()))

        def at(prefix, prompt=prompt):
            with torch.inference_mode():
                return model(torch.tensor([prompt + prefix]), last_only=True)[0, -1]
        assert_greedy_equal(out.outputs[0].token_ids, ref, at)


def test_int8_kv_engine_cache_is_smaller_for_the_same_blocks(int8_model):
    model, tok = int8_model
    full = il.LLM(model, tokenizer=tok, num_kv_blocks=64).engine.runner.cache
    small = il.LLM(model, tokenizer=tok, num_kv_blocks=64, kv_cache_dtype="int8")
    cache = small.engine.runner.cache
    assert isinstance(cache, Int8PagedKVCache)
    assert cache.nbytes * 3.5 < full.nbytes  # fp32 model: 4 bytes -> 1 byte + 2 per 32 values


def test_llm_quantization_option_and_errors(int8_model):
    llm = il.LLM(quantization="int8")  # the bundled model, loaded and quantized
    assert llm.model.quantization == "int8"
    assert llm.generate("And God said", il.SamplingParams(max_tokens=4, temperature=0.0),
                        use_tqdm=False)[0].outputs[0].token_ids
    model, tok = int8_model
    with pytest.raises(QuantizationError, match="quantized as int8"):
        il.LLM(model, tokenizer=tok, quantization="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        il.LLM(model, tokenizer=tok, kv_cache_dtype="int4")


def test_server_serves_a_quantized_model_with_an_int8_cache():
    import httpx

    from infer_lab.serve.server import make_app
    from tests.live_server import running

    app = make_app(None, device="cpu", num_kv_blocks=64, max_num_seqs=8, quantization="int8",
                   kv_cache_dtype="int8")
    llm = il.LLM(quantization="int8", kv_cache_dtype="int8", num_kv_blocks=64)
    want = llm.generate("And God said,", il.SamplingParams(max_tokens=12, temperature=0.0,
                                                          ignore_eos=True), use_tqdm=False)
    with running(app) as base:
        r = httpx.post(f"{base}/v1/completions", json={
            "prompt": "And God said,", "max_tokens": 12, "temperature": 0, "ignore_eos": True},
            timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want[0].outputs[0].text


def test_serve_command_line_takes_the_quantization_options():
    from infer_lab.cli import build_parser

    args = build_parser().parse_args(["serve", "--quantization", "int4", "--kv-cache-dtype",
                                      "fp8_e4m3", "--num-kv-blocks", "8"])
    assert (args.quantization, args.kv_cache_dtype, args.num_kv_blocks) == ("int4", "fp8_e4m3", 8)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "int3"])
