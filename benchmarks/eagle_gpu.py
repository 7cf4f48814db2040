"""EAGLE on a GPU (device_check.sh's ``eagle`` step): greedy output unchanged, tokens/s both ways.

Two targets, fp32 (greedy equality is the fp32 claim), batch 1, greedy, ``ignore_eos``:

- the bundled 4-layer model with a head self-distilled here in seconds (trained on the CPU, as
  the tests train it, then loaded onto the device): its drafts are often right, so accepted
  paths are long and the chain's rollback and the tree's compaction run on the device;
- SmolLM2-135M-Instruct with the shipped head, when the model is in the local cache; otherwise
  the random-weight stand-in of SmolLM2's shape (``INFER_LAB_SMOLLM2=random``'s; a GPU machine
  cannot fetch the real one), on which the shipped head loads (same hidden size and vocabulary)
  but is almost never right: its rows are step costs, not acceptance.

Per target: no speculation, EAGLE chains of k = 2 and 4, and a tree; each its own engine, a
warm-up request first (CUDA graphs are captured before timing), then the prompts one at a time.
A row: decode tokens/s (generated tokens after the first over the wall time after each
prefill, device synchronised), its ratio to no speculation's, tokens per verification, and
whether every prompt's tokens equal no speculation's. Rows go to ``eagle_gpu.json`` as
measured; the exit status is 1 if any output differs.

    python -m benchmarks.eagle_gpu [--device cuda|cpu] [--max-tokens 64] [--prompts 4]
        [--out DIR]

``--device cpu --max-tokens 8 --prompts 1`` runs the same code on the CPU in about a minute.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import infer_lab as il
from benchmarks._common import RESULTS, print_table, provenance, write_results
from benchmarks.eagle import HEAD, TREE
from benchmarks.eagle_prompts import HELD_OUT
from benchmarks.speculative import chat
from infer_lab.engine import LLMEngine, SamplingParams
from infer_lab.engine.eagle_train import collect_features, new_head, train_eagle_head
from infer_lab.model import registry
from infer_lab.model.eagle_head import save_eagle_head
from infer_lab.model.loader import random_named_model

SMOLLM2 = "smollm2-135m-instruct"
WORDS = ["And", "the", "LORD", "said", "unto", "Moses", "In", "the", "beginning", "God",
         "created", "heaven", "earth", "and", "there", "was", "light", "Blessed", "are", "they",
         "that", "mourn", "for", "they", "shall", "be", "comforted"]  # the tests' words


def specs(head: str | Path) -> dict[str, dict[str, Any] | None]:
    chain = {"method": "eagle", "model": str(head)}
    return {"none": None,
            "eagle k=2": {**chain, "num_speculative_tokens": 2},
            "eagle k=4": {**chain, "num_speculative_tokens": 4},
            "eagle tree (6 nodes, depth 4)": {**chain, "num_speculative_tokens": 4,
                                              "speculative_token_tree": TREE}}


def tiny_head(path: Path) -> Path:
    """A head for the bundled model, self-distilled on the CPU in seconds (the tests' recipe)."""
    model, tok = il.load(device="cpu", dtype=torch.float32)
    rng = np.random.default_rng(0)
    prompts = [tok.encode(" ".join(rng.choice(WORDS, rng.integers(3, 12)))) for _ in range(64)]
    samples = collect_features(model, tok, prompts, 32)
    head = new_head(model, samples, 1024, trained_depth=6)
    train_eagle_head(head, model, samples, steps=40, lr=3e-3, tokens_per_batch=2048)
    return save_eagle_head(head, path, dtype=torch.float32)


def smollm2(device: str) -> tuple[Any, Any, str]:
    """SmolLM2 from the cache if it is there, else its random stand-in (never a download)."""
    spec = registry.NAMED_MODELS[SMOLLM2]
    cached = registry.cache_dir() / SMOLLM2 / (spec.filename + ".sha256-verified")
    if cached.is_file() and not registry.random_requested(SMOLLM2):
        model, tok = il.load(SMOLLM2, device=device, dtype=torch.float32)
        return model, tok, f"{SMOLLM2} (fp32)"
    model, tok = random_named_model(SMOLLM2, device, torch.float32)
    return model, tok, f"{SMOLLM2} RANDOM WEIGHTS stand-in (fp32; step costs only)"


def timed(model, tok, prompts: list[list[int]], spec: dict | None,
          max_tokens: int) -> dict[str, Any]:
    """The prompts one at a time through one engine: tokens, decode seconds, acceptance."""
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    engine = LLMEngine(model, tok, speculative_config=spec, max_num_seqs=1, num_kv_blocks=256,
                       enable_prefix_caching=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                            detokenize=False)
    outputs, seconds, decoded = [], 0.0, 0
    for i, prompt in enumerate([prompts[0], *prompts]):  # the first: warm-up, not counted
        engine.add_request(str(i), prompt, params)
        engine.step()  # the prefill (and its first token)
        sync()
        start = time.perf_counter()
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    tokens = list(o.outputs[0].token_ids)
        sync()
        if i:
            seconds += time.perf_counter() - start
            decoded += len(tokens) - 1
            outputs.append(tokens)
    st = engine.get_stats()
    return {"outputs": outputs, "tok_s": decoded / seconds if seconds else float("nan"),
            "mean_accepted_length": st.spec_mean_accepted_length if spec else None}


def measure(name: str, model, tok, prompts: list[list[int]], head: str | Path,
            max_tokens: int, rows: list[dict], save) -> bool:
    """Every spec on one target; rows appended and saved as measured; True if all equal."""
    base = None
    same = True
    for method, spec in specs(head).items():
        r = timed(model, tok, prompts, spec, max_tokens)
        base = base or r
        identical = r["outputs"] == base["outputs"]
        same &= identical
        rows.append({"target": name, "method": method, "tok_s": r["tok_s"],
                     "ratio": r["tok_s"] / base["tok_s"],
                     "mean_accepted_length": r["mean_accepted_length"],
                     "identical": identical})
        print(rows[-1], flush=True)
        save()
    return same


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4, help="the first N held-out prompts")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here; --device cpu runs the same code on the CPU")
    out = args.out or (RESULTS / "gpu" if args.device.startswith("cuda")
                       else Path("/tmp/infer_lab_smoke"))
    rows: list[dict[str, Any]] = []
    payload = {"benchmark": "eagle_gpu", "provenance": provenance(args.device),
               "dtype": "float32", "max_tokens": args.max_tokens, "tree": TREE, "rows": rows,
               "command": "python -m benchmarks.eagle_gpu " + " ".join(
                   sys.argv[1:] if argv is None else argv),
               "note": "batch 1, greedy, ignore_eos; tok_s = decode tokens after the first "
                       "over wall time after each prefill (synchronised), a warm-up request "
                       "first; ratio to no speculation on the same target; identical: every "
                       "prompt's tokens equal no speculation's"}

    def save() -> Path:
        return write_results("eagle_gpu", payload, out)

    same = True
    with tempfile.TemporaryDirectory() as tmp:
        head = tiny_head(Path(tmp) / "tiny_head.safetensors")
        model, tok = il.load(device=args.device, dtype=torch.float32)
        words = [" ".join(WORDS[i : i + 6]) for i in range(0, 6 * args.prompts, 6)]
        prompts = [tok.encode(w) for w in words]
        same &= measure("bundled 4-layer model, head trained here", model, tok, prompts, head,
                        args.max_tokens, rows, save)
        del model
    model, tok, name = smollm2(args.device)
    payload["smollm2"] = name
    text = HELD_OUT[: args.prompts]
    prompts = ([chat(tok, t) for t in text] if "RANDOM" not in name
               else [tok.encode(t) for t in text])
    same &= measure(name, model, tok, prompts, HEAD, args.max_tokens, rows, save)
    print_table(rows, ["target", "method", "tok_s", "ratio", "mean_accepted_length",
                       "identical"])
    print(f"wrote {save()}; greedy output {'identical' if same else 'DIFFERS'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
