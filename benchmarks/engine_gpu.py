"""The engine on a random-weight Llama-3.2-1B-shaped model against transformers, same weights.

    python -m benchmarks.engine_gpu --save-dir /tmp/llama1b   # on a GPU: results/gpu/engine.json
    python -m benchmarks.engine_gpu --cpu-smoke               # the plumbing on CPU, tiny shapes

Random weights (transformers' own init), saved once with ``save_pretrained`` and read back by
``infer_lab.model.loader.load_model``, so both engines run the same bytes. Prompts are token ids
(a random model needs no tokenizer). Rows are written to the JSON as each is measured, so a step
cut short by its time limit still leaves what it finished. Measured, per row:

- batch-1 decode tok/s, eager and with CUDA graphs (median engine step), and its fraction of the
  bound ``copy bandwidth / weight bytes`` (a decode step reads every weight once);
- transformers ``generate`` at batch 1, greedy, the same prompt (tok/s of the decode part);
- offline throughput of ``LLM.generate`` on the long-tail mix (output tokens / wall second).

``--save-dir`` keeps the checkpoint for ``infer-lab serve`` (device_check.sh's server step).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import infer_lab as il
from benchmarks._common import RESULTS, print_table, provenance, write_results
from infer_lab.engine import LLMEngine
from infer_lab.measure import measure_copy_bandwidth
from infer_lab.measure.workloads import long_tail_mix

# Llama-3.2-1B's published shape (tied embeddings, head_dim 64).
LLAMA_32_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                   num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                   head_dim=64, max_position_embeddings=8192, rope_theta=500000.0,
                   tie_word_embeddings=True, rms_norm_eps=1e-5)
SMOKE = dict(LLAMA_32_1B, vocab_size=512, hidden_size=128, intermediate_size=256,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


class IdsOnly:
    """A tokenizer for token-id prompts: no stop tokens, ids decoded as numbers."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id = None

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: list[int], **_: Any) -> str:
        return " ".join(map(str, ids))

    def detokenizer(self, prompt_ids: Any = None, **_: Any) -> None:
        return None  # the engine then keeps token ids only


def save_random_checkpoint(shape: dict[str, Any], directory: Path, dtype: torch.dtype) -> Path:
    """A transformers Llama with its own random init, saved as safetensors (reused if there)."""
    if (directory / "config.json").exists():
        return directory
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**shape)).to(dtype)
    hf.save_pretrained(directory)
    return directory


def decode_ms(model: Any, graphs: bool, steps: int, prompt: list[int]) -> float:
    """Median ms of a batch-1 decode engine step."""
    engine = LLMEngine(model, IdsOnly(), max_num_seqs=1, use_cuda_graphs=graphs,
                       enable_prefix_caching=False,
                       num_kv_blocks=-(-(len(prompt) + steps + 16) // 16) + 4)
    engine.add_request("0", prompt, il.SamplingParams(max_tokens=steps + 8, temperature=0,
                                                      ignore_eos=True))
    for _ in range(4):  # the prefill and warm-up decodes (graph capture happens here)
        engine.step()
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        engine.step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    if graphs and not engine.runner.graphs:
        raise RuntimeError(f"CUDA graphs were not captured: {engine.runner.graph_error}")
    del engine
    return statistics.median(times)


def hf_decode_tok_s(directory: Path, device: str, dtype: torch.dtype, prompt: list[int],
                    new: int) -> float:
    """transformers generate at batch 1, greedy: decode tokens per second (prefill subtracted)."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    ids = torch.tensor([prompt], device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(n: int) -> float:
        sync()
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        sync()
        return time.perf_counter() - start

    timed(2)  # warm-up
    one, full = timed(1), timed(new)
    return (new - 1) / max(full - one, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, eager only")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128, help="long-tail requests, offline")
    ap.add_argument("--save-dir", type=Path, default=Path("/tmp/infer_lab_llama32_1b"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU; --cpu-smoke tests the plumbing")
    dtype = torch.bfloat16
    steps, n_req = (4, 8) if args.cpu_smoke else (args.steps, args.requests)
    shape = SMOKE if args.cpu_smoke else LLAMA_32_1B
    out = args.out or (Path("/tmp/infer_lab_smoke") if args.cpu_smoke else RESULTS / "gpu")
    directory = save_random_checkpoint(shape, args.save_dir, dtype)
    from infer_lab.model.loader import load_model

    model = load_model(directory, device=device, dtype=dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    copy_bw = measure_copy_bandwidth(device, 2**30 if device == "cuda" else 2**24)
    bound = copy_bw / weight_bytes  # tok/s if a batch-1 step only read the weights, at copy speed
    prompt = np.random.default_rng(0).integers(3, shape["vocab_size"], 32).tolist()
    rows: list[dict[str, Any]] = []
    payload = {"benchmark": "engine_gpu", **provenance(device), "dtype": str(dtype),
               "model": "random-weight Llama-3.2-1B shape" if not args.cpu_smoke else "smoke",
               "shape": shape, "weight_bytes": weight_bytes, "copy_bandwidth": copy_bw,
               "bound_tok_s": bound, "rows": rows}

    def record(row: dict[str, Any]) -> None:
        rows.append(row)
        print(row, flush=True)
        write_results("engine", payload, out)  # as measured: a cut-short run keeps its rows

    for graphs in ((False, True) if device == "cuda" else (False,)):
        ms = decode_ms(model, graphs, steps, prompt)
        record({"what": "infer_lab batch-1 decode", "cuda_graphs": graphs, "step_ms": ms,
                "tok_s": 1e3 / ms, "of_bound": 1e3 / ms / bound})
    reqs = long_tail_mix(n_req)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, shape["vocab_size"], r.prompt_len).tolist() for r in reqs]
    params = [il.SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True)
              for r in reqs]
    llm = il.LLM(model, tokenizer=IdsOnly(), max_num_seqs=64 if device == "cuda" else 8)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    made = sum(len(o.outputs[0].token_ids) if hasattr(o, "outputs") else len(o.token_ids)
               for o in outs)
    record({"what": "infer_lab offline long-tail", "requests": n_req, "output_tokens": made,
            "wall_s": wall, "tok_s": made / wall})
    del llm
    hf = hf_decode_tok_s(directory, device, dtype, prompt, steps)
    record({"what": "transformers batch-1 decode", "tok_s": hf, "of_bound": hf / bound})
    print_table([{k: r.get(k, "") for k in ("what", "cuda_graphs", "tok_s", "of_bound")}
                 for r in rows], ["what", "cuda_graphs", "tok_s", "of_bound"])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [r["what"] + (" (graphs)" if r.get("cuda_graphs") else "") for r in rows]
    ax.barh(labels, [r["tok_s"] for r in rows])
    ax.axvline(bound, ls="--", c="k", label="copy bandwidth / weight bytes (batch 1)")
    ax.set_xlabel("tokens / s")
    ax.set_title(f"{payload['model']}, {dtype}, {payload['device_name']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "engine.png", dpi=100)
    print("wrote", out / "engine.json", "and engine.png")


if __name__ == "__main__":
    main()
