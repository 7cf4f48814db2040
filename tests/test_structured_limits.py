"""What one constraint may cost (issue 24), on the engine's side: the compile cache bounded in
bytes, schemas bounded in size, depth and enum values, grammars that accept nothing or slow down
as the output grows refused before they run, and a matcher over its CPU budget per token failing
its own request alone."""

from __future__ import annotations

import json

import pytest

import infer_lab as il
from infer_lab.engine import LLMEngine, SamplingParams
from infer_lab.engine.structured import (
    GrammarLimitError,
    GrammarLimits,
    GrammarTooSlowError,
    StructuredOutputError,
    StructuredOutputs,
)
from infer_lab.engine.structured import StructuredOutputsParams as S

AMBIGUOUS = 'root ::= s\ns ::= s s | "a"'


@pytest.fixture(scope="module")
def bundled():
    return il.load(device="cpu")


@pytest.fixture(scope="module")
def structured(bundled):
    model, tok = bundled
    return StructuredOutputs(tok, model.config.vocab_size, tok.eos_token_ids)


def enum_schema(i: int, n: int = 40) -> dict:
    return {"enum": [f"value {i} number {k}" for k in range(n)]}


def test_the_compile_cache_is_bounded_in_bytes_least_recently_used_first(bundled):
    model, tok = bundled
    so = StructuredOutputs(tok, model.config.vocab_size, tok.eos_token_ids)
    one = so.compile(S(json=enum_schema(0)))
    size = one.memory_size_bytes
    so.limits = GrammarLimits(cache_bytes=3 * size + 3 * 2000)  # room for about three
    for i in range(1, 8):
        so.compile(S(json=enum_schema(i)))
        assert so.cache_bytes <= so.limits.cache_bytes
    compiles = so.stats.compiles
    so.compile(S(json=enum_schema(7)))  # the most recent: still cached
    assert so.stats.compiles == compiles
    so.compile(S(json=enum_schema(1)))  # long evicted: compiled again
    assert so.stats.compiles == compiles + 1
    so.limits = GrammarLimits(cache_bytes=10)  # a grammar larger than the cache: used, not kept
    so.compile(S(json=enum_schema(99)))
    assert so.cache_bytes <= so.limits.cache_bytes + 3 * size + 3 * 2000


@pytest.mark.parametrize(("spec", "reason"), [
    (S(json={"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(500)}}),
     "grammar_size"),
    (S(regex="a" * 5000), "grammar_size"),
    (S(grammar='root ::= "' + "b" * 5000 + '"'), "grammar_size"),
    (S(json={"enum": list(range(101))}), "enum_values"),
    (S(json={"anyOf": [{"enum": list(range(60))}, {"enum": list(range(60))}]}), "enum_values"),
    (S(choice=[str(i) for i in range(101)]), "enum_values"),
    (S(json=json.loads('{"type":"object","properties":{"a":' * 9 + "{}" + "}}" * 9)),
     "schema_depth"),
    (S(json=json.loads('{"a":' + "[" * 16 + "]" * 16 + "}")), "schema_depth"),
])
def test_constraints_over_a_limit_are_refused_before_compiling(structured, spec, reason):
    structured.limits = GrammarLimits(max_bytes=4096, max_depth=16, max_enum_values=100)
    compiles = structured.stats.compiles
    with pytest.raises(GrammarLimitError) as e:
        structured.prepare(spec)
    assert e.value.reason == reason and "limit" in str(e.value)
    assert structured.stats.compiles == compiles


@pytest.mark.parametrize("spec", [
    S(grammar="root ::= root"),  # accepts nothing: every token masked
    S(grammar="root ::= a\na ::= b\nb ::= a"),
])
def test_a_constraint_that_accepts_nothing_is_refused(structured, spec):
    structured.limits = GrammarLimits()
    with pytest.raises(StructuredOutputError, match="accepts no output"):
        structured.prepare(spec)


@pytest.mark.parametrize("spec", [
    S(grammar=AMBIGUOUS),
    S(grammar='root ::= s\ns ::= "a" | s s | "b" s'),
    S(regex="(a*)*b"),
])
def test_grammars_that_slow_down_as_the_output_grows_are_refused(structured, spec):
    structured.limits = GrammarLimits()
    with pytest.raises(GrammarTooSlowError, match="slows down|ms"):
        structured.prepare(spec)


@pytest.mark.parametrize("spec", [
    S(grammar='root ::= expr\nexpr ::= expr "+" term | term\nterm ::= [0-9]+'),  # left-recursive
    S(grammar='root ::= "yes" | "no"'),
    S(regex="[a-z]+(,[a-z]+)*"),
    S(regex=r"\d{3}-\d{4}"),
    S(json={"type": "object", "properties": {"a": {"type": "string"}}}),
    S(json_object=True),
    S(choice=["left", "right"]),
])
def test_ordinary_constraints_pass_and_are_kept_on_the_params(structured, spec):
    structured.limits = GrammarLimits()
    compiled = structured.prepare(spec)
    assert spec.compiled is compiled and structured.is_prepared(spec)


def test_nesting_too_deep_for_python_is_a_structured_output_error():
    deep = "[" * 5000 + "]" * 5000
    with pytest.raises(StructuredOutputError, match="nested too deeply"):
        S(json=deep)


def test_a_matcher_over_its_cpu_budget_fails_its_request_alone(bundled):
    """An ambiguous grammar added offline (no prepare): matching slows with every token; once
    one token's fill takes more than the budget of CPU time the request fails with
    GrammarTooSlowError and its blocks go back, while a neighbour decodes exactly as alone."""
    model, tok = bundled
    engine = LLMEngine(model, tok, il.EngineConfig(num_kv_blocks=128, max_num_seqs=4))
    engine.structured.limits = GrammarLimits(token_seconds=0.002)
    engine.add_request("slow", "And", SamplingParams(
        max_tokens=400, temperature=0, ignore_eos=True, structured_outputs=S(grammar=AMBIGUOUS)))
    engine.add_request("plain", "In the beginning", SamplingParams(
        max_tokens=24, temperature=0, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["slow"].finish_reason == "error"
    assert "GrammarTooSlowError" in done["slow"].error
    assert 0 < len(done["slow"].token_ids) < 400
    ref = il.generate_naive(model, tok, "In the beginning", max_tokens=24, ignore_eos=True)
    assert done["plain"].token_ids == ref.token_ids
    assert engine.get_stats().num_kv_blocks_used == 0
