"""Structured output (issue 19): constrained decoding in the engine, with ``jsonschema`` as the
referee. Every constrained output that finishes with ``stop`` must validate; one cut off by
``max_tokens`` must say ``length``; unconstrained neighbours in the batch must be unchanged."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import infer_lab as il
from infer_lab.engine import LLMEngine, SamplingParams
from infer_lab.engine.structured import StructuredOutputError
from infer_lab.engine.structured import StructuredOutputsParams as S

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"], "additionalProperties": False}},
        "required": ["person"], "additionalProperties": False},
    "bounded_array": {"type": "object", "properties": {
        "verses": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 99},
                   "minItems": 2, "maxItems": 4}},
        "required": ["verses"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {
        "book": {"enum": ["Genesis", "Exodus", "Psalms"]},
        "testament": {"type": "string", "enum": ["old", "new"]}},
        "required": ["book", "testament"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {
        "ref": {"type": "string", "pattern": "^[A-Z][a-z]{2,8} [0-9]{1,3}:[0-9]{1,3}$"},
        "ok": {"type": "boolean"}},
        "required": ["ref", "ok"], "additionalProperties": False},
}
PROMPTS = ["And God said,", "In the beginning", "Blessed are the", "Thou shalt"]


@pytest.fixture(scope="module")
def bundled():
    return il.load(device="cpu")


def run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    for _ in range(10_000):  # bounded
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return done


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_every_output_validates_greedy_and_sampled(bundled, temperature):
    model, tok = bundled
    engine = LLMEngine(model, tok, il.EngineConfig(num_kv_blocks=512))
    requests = {f"{name}-{i}": (p, SamplingParams(max_tokens=200, temperature=temperature,
                                                  seed=i, structured_outputs=S(json=schema)))
                for name, schema in SCHEMAS.items() for i, p in enumerate(PROMPTS[:2])}
    done = run(engine, requests)
    for rid, c in done.items():
        assert c.finish_reason == "stop", (rid, c.text)
        jsonschema.validate(json.loads(c.text), SCHEMAS[rid.rsplit("-", 1)[0]])
    assert engine.structured.stats.compiles == len(SCHEMAS)  # one compile per schema


def test_regex_choice_and_json_object(bundled):
    model, tok = bundled
    engine = LLMEngine(model, tok, il.EngineConfig(num_kv_blocks=256))
    done = run(engine, {
        "re": ("Call", SamplingParams(max_tokens=20, temperature=0.7, seed=1,
                                      structured_outputs=S(regex=r"\d{3}-\d{4}"))),
        "ch": ("Amen", SamplingParams(max_tokens=20, structured_outputs=S(
            choice=["yea", "nay", "selah"]))),
        "obj": ("And", SamplingParams(max_tokens=200, temperature=0,
                                      structured_outputs=S(json_object=True))),
    })
    assert re.fullmatch(r"\d{3}-\d{4}", done["re"].text) and done["re"].finish_reason == "stop"
    assert done["ch"].text in ("yea", "nay", "selah")
    if done["obj"].finish_reason == "stop":
        assert isinstance(json.loads(done["obj"].text), dict)
    else:  # the tiny model may ramble inside a string; then it must say so
        assert done["obj"].finish_reason == "length"


def test_unconstrained_neighbours_are_unchanged(bundled):
    model, tok = bundled
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = [o.text for o in il.LLM(device="cpu").generate(PROMPTS, params, use_tqdm=False)]
    engine = LLMEngine(model, tok, il.EngineConfig(num_kv_blocks=512))
    mixed: dict = {f"u{i}": (p, params) for i, p in enumerate(PROMPTS)}
    mixed |= {f"c{i}": (p, SamplingParams(max_tokens=120, temperature=0.8, seed=i,
                                          structured_outputs=S(json=SCHEMAS["enum"])))
              for i, p in enumerate(PROMPTS)}
    done = run(engine, mixed)
    assert [done[f"u{i}"].text for i in range(len(PROMPTS))] == alone
    for i in range(len(PROMPTS)):
        jsonschema.validate(json.loads(done[f"c{i}"].text), SCHEMAS["enum"])
    stats = engine.structured.stats
    assert stats.constrained_requests == len(PROMPTS) and stats.mask_rows > 0


def test_out_of_tokens_is_length_never_stop(bundled):
    model, tok = bundled
    engine = LLMEngine(model, tok, il.EngineConfig(num_kv_blocks=64))
    done = run(engine, {"short": ("And", SamplingParams(
        max_tokens=4, temperature=0, structured_outputs=S(json=SCHEMAS["nested"])))})
    assert done["short"].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(done["short"].text)


def test_constraints_survive_preemption(bundled):
    model, tok = bundled
    engine = LLMEngine(model, tok, il.EngineConfig(num_kv_blocks=12, max_num_seqs=8))
    requests = {f"p{i}": (p, SamplingParams(max_tokens=150, temperature=0.5, seed=i,
                                            structured_outputs=S(json=SCHEMAS["nested"])))
                for i, p in enumerate(PROMPTS * 2)}
    done = run(engine, requests)
    assert engine.get_stats().num_preemptions > 0  # the pool was too small for all at once
    for c in done.values():
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMAS["nested"])


@pytest.mark.parametrize("bad", [
    S(json={"type": "object", "properties": {"a": {"type": "strin"}}}),
    S(regex="(unclosed"),
    S(grammar="root ::= undefined_rule"),
])
def test_uncompilable_constraints_are_refused_at_add_request(bundled, bad):
    model, tok = bundled
    engine = LLMEngine(model, tok, il.EngineConfig(num_kv_blocks=16))
    with pytest.raises(StructuredOutputError) as e:
        engine.add_request("bad", "And", SamplingParams(structured_outputs=bad))
    assert "cannot be compiled" in str(e.value) and ".cc:" not in str(e.value)
    assert not engine.has_unfinished_requests()


def test_params_shapes_are_checked():
    with pytest.raises(StructuredOutputError):
        S()
    with pytest.raises(StructuredOutputError):
        S(json={"type": "object"}, regex="a")
    with pytest.raises(StructuredOutputError):
        S(choice=[])
    with pytest.raises(TypeError):
        SamplingParams(structured_outputs={"json": {}})


def test_allowed_token_ids_is_the_vocabulary_scan_and_ends_in_eos(bundled):
    """The helper's set for a state equals a scan of every token's text (the definition of the
    mask), at the start, midway and at the end, where only the stop token is left."""
    from infer_lab.engine.structured import StructuredOutputs

    model, tok = bundled
    so = StructuredOutputs(tok, model.config.vocab_size, tok.eos_token_ids)
    spec = S(regex="(yes|no)")
    texts = [tok.decode([i]) for i in range(model.config.vocab_size)]  # special ones: ""

    def scan(done: str) -> list[int]:
        return [i for i, t in enumerate(texts)
                if t and any(w.startswith(done + t) for w in ("yes", "no"))]

    matcher = so.matcher(spec)
    assert so.allowed_token_ids(matcher) == scan("") and scan("")
    assert matcher.accept_token(tok.token_to_id("y"))
    assert so.allowed_token_ids(matcher) == scan("y")
    for piece in tok.encode("es", add_special_tokens=False):
        assert matcher.accept_token(piece)
    assert so.allowed_token_ids(matcher) == sorted(tok.eos_token_ids)
    assert matcher.accept_token(sorted(tok.eos_token_ids)[0])
    assert so.allowed_token_ids(matcher) == []


def test_mask_cache_counts_split_the_vocabulary(bundled):
    from infer_lab.engine.structured import StructuredOutputs, mask_cache_counts

    model, tok = bundled
    vocab = model.config.vocab_size
    so = StructuredOutputs(tok, vocab, tok.eos_token_ids)
    regular = mask_cache_counts(so.compile(S(regex="(yes|no)")))
    nested = mask_cache_counts(so.compile(S(json=SCHEMAS["nested"])))
    recursive = mask_cache_counts(so.compile(S(json_object=True)))
    for rows in (regular, nested, recursive):
        assert rows and all(sum(r.values()) == vocab and min(r.values()) >= 0 for r in rows)
    assert all(r["uncertain"] == 0 for r in regular)  # one rule, no stack: all decided ahead
    # any JSON value nests: what may follow a closing quote or bracket depends on the stack
    assert any(r["uncertain"] > 0 for r in recursive)
    assert max(r["accepted"] for r in recursive) > vocab // 2  # inside a string: most tokens
