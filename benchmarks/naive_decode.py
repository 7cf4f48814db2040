"""Time per token of naive decode (no KV cache) against the length so far: ours vs transformers.

Both run the same weights: the bundled model, and a larger random-weight Llama-shaped model whose
weights do not fit in CPU caches. transformers runs ``generate(use_cache=False)``; we run
``il.generate_naive``'s loop (``stream_naive``: the same greedy steps, without detokenizing).
Each measurement generates a few tokens from a prompt of the given length and reports the median
of the time per token over repeats.

    python -m benchmarks.naive_decode [--lengths 64 128 256 512] [--tokens 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import infer_lab as il
from benchmarks._common import print_table, provenance, write_results
from infer_lab.model.generate import stream_naive
from infer_lab.model.loader import BUNDLED_MODEL_DIR


def big_checkpoint(path: Path, gpu: bool) -> None:
    """Save a random-weight Llama-shaped checkpoint (~125 M params on CPU, ~1.2 B on GPU)."""
    dims = (
        dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
        if gpu else
        dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
             num_attention_heads=12, num_key_value_heads=4, vocab_size=32000)
    )
    cfg = LlamaConfig(max_position_embeddings=4096, tie_word_embeddings=False, **dims)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)


def per_token_seconds(fns, tokens: int, repeats: int) -> list[float]:
    """Median seconds per token of each function, run interleaved (a, b, a, b, ...) so that a
    slow spell of a shared machine hits both sides alike."""
    for fn in fns:
        fn()  # warm-up
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, samples):
            start = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            out.append((time.perf_counter() - start) / tokens)
    return [statistics.median(s) for s in samples]


@torch.inference_mode()
def run(path: Path, name: str, lengths: list[int], tokens: int, repeats: int, device: str,
        dtype: torch.dtype) -> list[dict]:
    ours = il.load_model(path, device=device, dtype=dtype)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    hf.generation_config.eos_token_id = None
    vocab = ours.config.vocab_size
    rows = []
    for length in lengths:
        ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(length))
        prompt = ids[0].tolist()
        ids = ids.to(device)

        def ours_fn(prompt=prompt):  # generate_naive's loop, without detokenizing
            return list(stream_naive(ours, prompt, tokens, stops=set()))

        def hf_fn(ids=ids):
            return hf.generate(ids, max_new_tokens=tokens, do_sample=False, use_cache=False,
                               pad_token_id=0)

        t_ours, t_hf = per_token_seconds([ours_fn, hf_fn], tokens, repeats)
        rows.append({"model": name, "length": length, "ours_ms": t_ours * 1e3,
                     "transformers_ms": t_hf * 1e3, "speedup": t_hf / t_ours})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: on a shared 2-core machine, two "
                             "threads per process thrash); 0 keeps torch's default")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    rows = run(BUNDLED_MODEL_DIR, "bundled tiny-kjv", args.lengths, args.tokens, args.repeats,
               device, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        big_checkpoint(Path(tmp), device == "cuda")
        name = f"random Llama-shaped ({il.ModelConfig.from_file(tmp).num_parameters() / 1e6:.0f} M)"
        rows += run(Path(tmp), name, args.lengths, args.tokens, args.repeats, device, dtype)
    print_table(rows, ["model", "length", "ours_ms", "transformers_ms", "speedup"])
    payload = {"benchmark": "naive_decode", **provenance(device), "dtype": str(dtype),
               "lengths": args.lengths,
               "tokens_per_measurement": args.tokens, "repeats": args.repeats, "rows": rows}
    print("wrote", write_results("naive_decode", payload, args.out))


if __name__ == "__main__":
    main()
