"""Structured output: what constraining costs and what it buys (issue 19).

- validity: how often SmolLM2-135M-Instruct's answer parses and validates against a schema
  when only asked nicely (the schema in the prompt), against constrained decoding;
- compile time per schema (a fresh compiler: the cache miss a new schema pays once);
- mask time per constrained token (filling and applying the bitmask, from the engine's stats);
- throughput at concurrency 1, 8 and 32 on the bundled model, every request constrained vs none
  (generated tokens per second of wall time; the median of interleaved rounds, with a
  distribution-free 95% interval for the median overhead from the rounds: read the ratios).

    python -m benchmarks.structured [--samples 4] [--max-tokens 96] [--rounds 7]
        [--threads 1] [--only validity|throughput]

writes ``benchmarks/results/structured.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from typing import Any

import jsonschema
import torch

import infer_lab as il
from benchmarks._common import RESULTS, print_table, provenance, write_results
from infer_lab.engine import LLMEngine, SamplingParams
from infer_lab.engine.structured import StructuredOutputs, StructuredOutputsParams
from infer_lab.measure.stats import median_ci

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False},
    "city": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0}},
        "required": ["city", "country", "population"], "additionalProperties": False},
    "answer": {"type": "object", "properties": {
        "answer": {"enum": ["yes", "no"]},
        "reasons": {"type": "array", "items": {"type": "string", "maxLength": 40},
                    "minItems": 1, "maxItems": 3}},
        "required": ["answer", "reasons"], "additionalProperties": False},
}
RESULT = RESULTS / "structured.json"
QUESTIONS = {"person": "Describe a famous scientist.", "city": "Tell me about Paris.",
             "answer": "Is the Earth round?"}


def run(engine: LLMEngine, requests: list[tuple[Any, SamplingParams]]) -> tuple[list, float]:
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    done: dict[str, Any] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [done[f"r{i}"] for i in range(len(requests))], time.perf_counter() - start


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def validity(samples: int, max_tokens: int) -> list[dict[str, Any]]:
    model, tok = il.load("smollm2-135m-instruct", device="cpu", dtype=torch.float32)
    rows = []
    for name, schema in SCHEMAS.items():
        ask = (f"{QUESTIONS[name]} Reply with only a JSON object that follows this JSON "
               f"Schema: {json.dumps(schema)}")
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": ask}],
                                                 add_generation_prompt=True),
                         add_special_tokens=False)
        for constrained in (False, True):
            so = StructuredOutputsParams(json=schema) if constrained else None
            reqs = [(ids, SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=s,
                                         structured_outputs=so)) for s in range(samples)]
            outs, _ = run(LLMEngine(model, tok, il.EngineConfig(num_kv_blocks=256)), reqs)
            ok = sum(valid(o.text, schema) for o in outs)
            rows.append({"schema": name, "constrained": constrained, "valid": ok,
                         "samples": samples, "rate": ok / samples,
                         "length_finishes": sum(o.finish_reason == "length" for o in outs)})
    return rows


def compile_and_throughput(max_tokens: int, rounds: int) -> tuple[list[dict], list[dict], float]:
    """Compile times, then throughput with and without constraints.

    Each concurrency runs ``rounds`` times, the two arms alternating within a round, and the
    overhead is the median of the per-round ratios: on a shared machine a neighbour's burst
    then lands on both arms of a round instead of on one arm of the whole run.
    """
    model, tok = il.load(device="cpu")
    compiles = []
    for name, schema in SCHEMAS.items():
        so = StructuredOutputs(tok, model.config.vocab_size, {0})
        so.compile(StructuredOutputsParams(json={"type": "object"}))  # tokenizer set-up
        start = time.perf_counter()
        so.compile(StructuredOutputsParams(json=schema))
        compiles.append({"schema": name, "compile_ms": (time.perf_counter() - start) * 1e3})
    rows, mask_s, mask_rows = [], 0.0, 0
    prompts = ["And God said,", "In the beginning", "Blessed are the", "Thou shalt"]
    warm = LLMEngine(model, tok, il.EngineConfig(num_kv_blocks=64))  # first-call costs
    answer = StructuredOutputsParams(json=SCHEMAS["answer"])
    run(warm, [(p, SamplingParams(max_tokens=8, seed=0, structured_outputs=so))
               for p in prompts[:2] for so in (None, answer)])
    for concurrency in (1, 8, 32):
        rates: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
        for _ in range(rounds):
            for constrained in (False, True):
                engine = LLMEngine(model, tok, il.EngineConfig(num_kv_blocks=1024,
                                                               max_num_seqs=32))
                so = StructuredOutputsParams(json=SCHEMAS["answer"]) if constrained else None
                engine.structured.compile(so) if so else None  # compile outside the timing
                reqs = [(prompts[i % 4], SamplingParams(max_tokens=max_tokens,
                                                        temperature=0.8, seed=i,
                                                        structured_outputs=so))
                        for i in range(concurrency)]
                outs, wall = run(engine, reqs)
                tokens = sum(len(o.token_ids) for o in outs)
                rates["constrained" if constrained else "unconstrained"].append(tokens / wall)
                if constrained:
                    mask_s += engine.structured.stats.mask_seconds
                    mask_rows += engine.structured.stats.mask_rows
        ratios = [c / u for u, c in zip(rates["unconstrained"], rates["constrained"])]
        per_round = [1 - r for r in ratios]
        rows.append({"concurrency": concurrency, "rounds": rounds,
                     "unconstrained_tok_s": statistics.median(rates["unconstrained"]),
                     "constrained_tok_s": statistics.median(rates["constrained"]),
                     "overhead": 1 - statistics.median(ratios),
                     # the rounds are independent repeats: an interval for their median
                     "overhead_ci95": [None if math.isnan(x) else x
                                       for x in median_ci(per_round)],  # >= 6 rounds
                     "overhead_per_round": per_round})
    return compiles, rows, mask_s / max(1, mask_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=7,
                        help="throughput rounds per level (6 or more give a 95%% interval)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (on a shared 2-core machine a second thread "
                             "makes every step wait for a free core)")
    parser.add_argument("--only", choices=("validity", "throughput"),
                        help="measure one part and keep the other from the existing JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    old = json.loads(RESULT.read_text()) if args.only and RESULT.exists() else {}
    settings = {"temperature": 0.7, "throughput_max_tokens": 64,
                "validity_model": "smollm2-135m-instruct", "throughput_model": "tiny-kjv",
                "grammar_engine": "xgrammar 0.2.9", "threads": args.threads}
    settings = {**old.get("settings", {}), **settings}
    part: dict[str, Any] = {}
    if args.only != "throughput":
        part["validity"] = validity(args.samples, args.max_tokens)
        settings.update(samples=args.samples, max_tokens=args.max_tokens)
        print_table(part["validity"], ["schema", "constrained", "valid", "samples",
                                       "length_finishes"])
    if args.only != "validity":
        compiles, throughput, mask_per_token = compile_and_throughput(64, args.rounds)
        part.update(compile=compiles, throughput=throughput,
                    mask_seconds_per_token=mask_per_token)
        settings.update(rounds=args.rounds)
        print_table(compiles, ["schema", "compile_ms"])
        print_table(throughput, ["concurrency", "unconstrained_tok_s", "constrained_tok_s",
                                 "overhead", "overhead_ci95"])
        print(f"mask time per constrained token: {mask_per_token * 1e6:.0f} us")
    stamp = {**provenance("cpu"), "load_average": [round(x, 2) for x in os.getloadavg()]}
    runs = {**old.get("runs", {}), **{k: stamp for k in part}}  # which run measured each part
    path = write_results("structured", {**old, **stamp, **part, "settings": settings,
                                        "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
