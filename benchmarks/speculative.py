"""Speculative decoding on SmolLM2-135M-Instruct: acceptance, batch-1 speedup, throughput.

Per method and k: acceptance rate, mean accepted length (tokens per verification), batch-1
decode tokens/s against the same engine without speculation (greedy output checked identical),
on a copy-heavy task (rewrite a given paragraph) and on free generation; then throughput with
and without speculation at concurrency 1, 8 and 32 (all requests added at once; generated tokens
over wall time), including ``disable_by_batch_size``. One run; ratios are what to read.

    python -m benchmarks.speculative [--threads 1] [--max-tokens 64] [--out DIR]

Drafts: prompt lookup (``ngram``); ``early_exit`` with the first 24 of 30 layers; ``draft_model``
with a truncated *copy* of the target (its first 12 layers): no smaller model with SmolLM2's
tokenizer is available offline, so the draft-model rows measure the machinery, not a good draft.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time
from typing import Any

import torch

import infer_lab as il
from benchmarks._common import print_table, provenance, write_results
from infer_lab.engine import LLMEngine, SamplingParams

PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every "
    "night its keeper climbed the spiral stairs, trimmed the wick and wound the clockwork that "
    "turned the great lens, so that ships passing the rocks below could find their way home. "
    "When the keeper grew old, the village built an electric lamp, and the stairs fell silent."
)
COPY_TASK = ("Rewrite the following paragraph exactly, word for word, with no changes:\n\n"
             + PARAGRAPH)
FREE_TASK = "Write a short story about a robot who learns to paint."


def chat(tok, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}],
                                   add_generation_prompt=True, tokenize=True)


def truncated_copy(model, num_layers: int):
    draft = copy.deepcopy(model)
    draft.layers = draft.layers[:num_layers]
    draft.config = dataclasses.replace(model.config, num_hidden_layers=num_layers)
    return draft


def run(model, tok, prompts: list[list[int]], max_tokens: int, spec: dict | None) -> dict:
    engine = LLMEngine(model, tok, speculative_config=spec, num_kv_blocks=1024,
                       max_num_seqs=64)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs: dict[str, list[int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    wall = time.perf_counter() - start
    st = engine.get_stats()
    return {"wall_s": wall, "tokens": sum(map(len, outs.values())),
            "outputs": [outs[str(i)] for i in range(len(prompts))], "steps": st.num_steps,
            "acceptance_rate": st.spec_acceptance_rate,
            "mean_accepted_length": st.spec_mean_accepted_length}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = il.load("smollm2-135m-instruct", device="cpu", dtype=torch.float32)
    specs: dict[str, dict[str, Any]] = {
        "ngram k=2": {"method": "ngram", "num_speculative_tokens": 2},
        "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4},
        "ngram k=8": {"method": "ngram", "num_speculative_tokens": 8},
        "early_exit 24/30 k=2": {"method": "early_exit", "num_layers": 24,
                                 "num_speculative_tokens": 2},
        "draft_model copy 12/30 k=2": {"method": "draft_model",
                                       "model": truncated_copy(model, 12),
                                       "num_speculative_tokens": 2},
    }
    prompts = {"copy": chat(tok, COPY_TASK), "free": chat(tok, FREE_TASK)}
    run(model, tok, [prompts["free"]], 8, None)  # warm-up
    rows = []
    for task, prompt in prompts.items():
        base = run(model, tok, [prompt], args.max_tokens, None)
        for name, spec in specs.items():
            r = run(model, tok, [prompt], args.max_tokens, spec)
            rows.append({
                "task": task, "method": name, "acceptance_rate": r["acceptance_rate"] or 0.0,
                "mean_accepted_length": r["mean_accepted_length"] or 1.0,
                "tok_s": r["tokens"] / r["wall_s"], "base_tok_s": base["tokens"] / base["wall_s"],
                "speedup": base["wall_s"] / r["wall_s"],
                "identical": r["outputs"] == base["outputs"],
            })
    print_table(rows, ["task", "method", "acceptance_rate", "mean_accepted_length", "tok_s",
                       "base_tok_s", "speedup", "identical"])
    conc_specs = {"none": None, "ngram k=4": specs["ngram k=4"],
                  "ngram k=4 disable_by_batch_size=8": {**specs["ngram k=4"],
                                                        "disable_by_batch_size": 8}}
    conc = []
    for n in (1, 8, 32):
        batch = [prompts["copy"] if i % 2 == 0 else prompts["free"] for i in range(n)]
        base = None
        for name, spec in conc_specs.items():
            r = run(model, tok, batch, args.max_tokens, spec)
            base = base or r
            conc.append({"concurrency": n, "method": name, "tok_s": r["tokens"] / r["wall_s"],
                         "ratio": base["wall_s"] / r["wall_s"],
                         "identical": r["outputs"] == base["outputs"],
                         "acceptance_rate": r["acceptance_rate"] or 0.0})
    print_table(conc, ["concurrency", "method", "tok_s", "ratio", "identical",
                       "acceptance_rate"])
    path = write_results("speculative", {
        "provenance": provenance("cpu"), "model": "smollm2-135m-instruct (fp32)",
        "max_tokens": args.max_tokens, "batch1": rows, "concurrency": conc,
        "note": "greedy, ignore_eos; speedup = baseline wall time / speculative wall time",
    }, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
