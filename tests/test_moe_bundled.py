"""The bundled mixture of experts, ``tiny-moe``: loadable by name, equal to transformers on its own
files, the same through the engine as naive decode, and served by ``infer-lab serve``; and the
routing counts of Chapter 12 (``infer_lab.measure.moe``)."""

from __future__ import annotations

import pytest
import torch

import infer_lab as il
from infer_lab.measure import moe as mm
from infer_lab.model.loader import resolve_model_path
from infer_lab.model.moe import moe_blocks, route
from tests.engine_fixtures import logits_after
from tests.helpers import assert_greedy_equal

PROMPTS = ["And God said,", "In the beginning", "Blessed are the", "And the LORD spake"]


@pytest.fixture(scope="module")
def tiny_moe():
    return il.load("tiny-moe", device="cpu", dtype="float32")


def test_shipped_small_and_loadable_by_name(tiny_moe):
    path = resolve_model_path("tiny-moe")
    assert sum(f.stat().st_size for f in path.iterdir()) <= 5 * 10**6
    assert (path / "heldout.txt").read_text().count("\n\n") >= 20  # held-out chapters
    model, _ = tiny_moe
    cfg = model.config
    assert cfg.model_type == "mixtral" and (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)
    assert len(moe_blocks(model)) == cfg.num_hidden_layers


def test_equals_transformers_on_its_own_files(tiny_moe):
    from transformers import AutoModelForCausalLM

    model, tok = tiny_moe
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-moe"),
                                              dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode("And the LORD said unto Moses, Speak unto the children")])
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() <= 1e-4


def test_engine_equals_naive_decode(tiny_moe):
    model, tok = tiny_moe
    llm = il.LLM(model, tokenizer=tok, num_kv_blocks=32, block_size=8)
    params = il.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok.encode(prompt)
        ref = il.generate_naive(model, tok, ids, 16, ignore_eos=True).token_ids
        assert_greedy_equal(out.token_ids, ref, logits_after(model, ids))


def test_served_by_infer_lab_serve(tiny_moe):
    import openai

    from infer_lab.serve.server import make_app
    from tests.live_server import running

    model, tok = tiny_moe
    app = make_app("tiny-moe", device="cpu", dtype="float32", num_kv_blocks=64)
    with running(app) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-moe"]
        resp = client.completions.create(model="tiny-moe", prompt=PROMPTS[0], max_tokens=12,
                                         temperature=0, extra_body={"ignore_eos": True})
    ids = tok.encode(PROMPTS[0])
    ref = il.generate_naive(model, tok, ids, 12, ignore_eos=True)
    assert resp.choices[0].text == ref.text


# ----------------------------------------------------------------------------- the counts
def test_distinct_experts_formula_matches_simulated_uniform_routing():
    gen = torch.Generator().manual_seed(0)
    e, k = 16, 4
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(4000)])
    for batch in (1, 3, 8, 32):
        got = mm.sampled_distinct_experts(ids, batch, samples=400)
        assert got == pytest.approx(float(mm.expected_distinct_experts(e, k, batch)), rel=0.03)


def test_decode_bytes_and_intensity():
    mixtral = mm.PUBLISHED_MOE["Mixtral-8x7B"]
    embed = mixtral.vocab_size * mixtral.hidden_size
    # reading every expert is reading the whole model but the embedding table (untied head read)
    assert mm.decode_weight_bytes(mixtral, 8, 1) == mixtral.num_parameters() - embed
    # reading k experts is reading the active parameters, less the embedding table
    assert mm.decode_weight_bytes(mixtral, 2, 1) == mixtral.num_active_parameters() - embed
    # batch 1 in bf16: one FLOP per weight byte; with every expert read, active/total of it
    assert mm.decode_intensity(mixtral, 1) == pytest.approx(1.0)
    big = mm.decode_intensity(mixtral, 10_000)
    ratio = (mixtral.num_active_parameters() - embed) / (mixtral.num_parameters() - embed)
    assert big == pytest.approx(10_000 * ratio, rel=1e-3)


def test_capacity_and_dropped_pairs():
    assert mm.expert_capacity(64, 8, 2, 1.0) == 16
    assert mm.expert_capacity(64, 8, 2, 1.25) == 20
    counts = torch.tensor([30, 16, 10, 0, 20, 16, 12, 24])
    assert mm.dropped_pairs(counts, 16) == 14 + 4 + 8
    assert mm.imbalance(counts) == pytest.approx(30 / 16)


def test_routing_hooks_record_what_the_router_chose(tiny_moe):
    model, tok = tiny_moe
    ids = tok.encode("In the beginning God created the heaven and the earth.")
    routing = mm.routing_on(model, [ids, ids[:5]])
    assert sorted(routing) == list(model.config.moe_layers)
    assert all(r.shape == (len(ids) + 5, 2) for r in routing.values())
    block = moe_blocks(model)[0]
    assert block.router_hook is None  # removed afterwards
    captured = {}
    handle = block.register_forward_pre_hook(lambda m, a: captured.update(x=a[0]))
    with torch.inference_mode():
        model(torch.tensor([ids]))
    handle.remove()
    _, want = route(block, captured["x"][0])
    assert torch.equal(routing[block.layer][: len(ids)], want)
