"""Where a batch-1 decode step of ``infer-lab serve``'s CPU default goes, and what
``torch.compile`` does to it: SmolLM2-135M-Instruct with its GGUF file's own blocks kept.

1. **Anatomy.** One request (a 64-token prompt) decodes through ``LLMEngine.step``; steps 33 to
   96 are timed without a profiler (the median step), then steps 35 to 50 of another request
   are profiled (``torch.profiler``). The
   profiled self time is split by op: the Q4_1 layers' int4 matmuls
   (``_weight_int4pack_mm_for_cpu``), the Q8_0 head's per-group int8 calls
   (``_weight_int8pack_mm``), attention's kernels (the KV gather through the block table, the
   attention itself, the cache write), and every other op; what the profiled step spends outside
   any op is the interpreter and the engine's own bookkeeping. The profiler adds its own cost per
   op, so the split is of the profiled step; the unprofiled median is the step's real length.
   Each matmul class's bytes per step ÷ its time is the bandwidth it achieves, beside what one
   thread reads from memory (``Tensor.sum`` over 256 MiB, best of 5).
2. **torch.compile.** The model's forward for one token against a static contiguous KV cache (256
   positions; the paged cache's gather is data-dependent and out of this comparison), eager
   against ``torch.compile(fullgraph=True)`` with inductor's Python wrapper and with its C++
   wrapper (``cpp_wrapper``): compile seconds from an empty inductor cache (a first start; the
   C++ wrapper compiles its kernels into its own file),
   median ms a step over 60 steps, interleaved in rounds, and the generated code's fused C++
   kernels and the aten ops it still calls.

    python -m benchmarks.cpu_step [--threads 1] [--rounds 3] [--skip-compile] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import infer_lab as il
from benchmarks._common import cpu_model, provenance, write_results
from infer_lab.measure.ops import CountOps
from infer_lab.model.loader import cpu_serving_quantization

NAME = "smollm2-135m-instruct"
PROMPT = [1, *range(100, 163)]  # 64 tokens
FIRST, LAST = 33, 96  # the decode steps timed
STATIC_LEN = 256  # the compile comparison's cache length


def cpu_flags() -> dict[str, Any]:
    """The vector and matrix extensions /proc/cpuinfo lists (AVX2, AVX-512 and its VNNI/BF16
    parts, AMX), and the processor's family and model numbers."""
    out: dict[str, Any] = {}
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("cpu family", "model") and key not in out:
            out[key] = int(value)
        elif key == "flags" and "flags" not in out:
            out["flags"] = sorted(f for f in value.split() if f == "avx2"
                                  or f.startswith(("avx512", "amx", "avx_vnni")))
    return out


def read_bandwidth() -> float:
    """Best bytes/s of one thread summing 256 MiB (a pure read stream)."""
    a = torch.ones(64 * 2**20)
    a.sum()
    best = min(_seconds(a.sum) for _ in range(5))
    return a.numel() * a.element_size() / best


def _seconds(fn: Any) -> float:  # noqa: ANN401
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def op_class(name: str, shapes: list) -> str:
    """The part of a decode step an aten op belongs to, by its name (and, for ``index``, by
    whether it reads a 4-d KV cache through a block table)."""
    if name == "aten::_weight_int4pack_mm_for_cpu":
        return "int4 matmuls (Q4_1 layers)"
    if name == "aten::_weight_int8pack_mm":
        return "int8 head calls (Q8_0)"
    if name in ("aten::_scaled_dot_product_flash_attention_for_cpu",
                "aten::scaled_dot_product_attention", "aten::_index_put_impl_"):
        return "attention (kernel, cache write)"
    if name in ("aten::index", "aten::index_select") and shapes and len(shapes[0]) == 4:
        return "attention (KV gather)"  # through the block table, from a 4-d cache
    return "other ops"


def matmul_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes each matmul class reads a step: every int4 layer's buffers; the head's."""
    int4 = sum(b.numel() * b.element_size() for m in model.modules()
               if getattr(m, "fmt", None) == "int4" for b in m.buffers())
    head = model.lm_head if model.lm_head is not None else model.embed_tokens.table
    return {"int4 matmuls (Q4_1 layers)": int4,
            "int8 head calls (Q8_0)": sum(b.numel() * b.element_size() for b in head.buffers())}


def hot_and_cold(model: torch.nn.Module, repeats: int = 200) -> dict[str, float]:
    """GB/s of the int4 kernel at one row on the gate/up matrices: one layer's again and again
    (its 1.1 MB stays in the caches, L3 here) and the thirty layers' in turn (from memory). Equal
    rates mean the kernel, not the memory, sets the pace."""
    from infer_lab.kernels.quant import quant_linear

    layers = [layer.mlp.gate_up_proj for layer in model.layers]
    x = torch.randn(1, layers[0].in_features)
    size = sum(b.numel() * b.element_size() for b in layers[0].buffers())
    with torch.inference_mode():
        for layer in layers:
            quant_linear(x, layer)  # builds each layer's CPU packing once
        hot = min(_seconds(lambda: [quant_linear(x, layers[0]) for _ in range(30)])
                  for _ in range(repeats // 30 + 1))
        cold = min(_seconds(lambda: [quant_linear(x, layer) for layer in layers])
                   for _ in range(repeats // 30 + 1))
    return {"hot_gb_s": 30 * size / hot / 1e9, "cold_gb_s": 30 * size / cold / 1e9,
            "matrix_bytes": size}


def anatomy(threads: int) -> dict[str, Any]:
    llm = il.LLM(NAME, max_num_seqs=1, quantization=cpu_serving_quantization(NAME))
    engine = llm.engine
    params = il.SamplingParams(max_tokens=LAST + 1, temperature=0.0, ignore_eos=True,
                               detokenize=False)
    steps: list[float] = []
    for rep in range(2):  # the second request is timed (the first warms)
        engine.add_request(f"r{rep}", PROMPT, params)
        engine.step()  # the prefill
        for i in range(1, LAST + 1):
            took = _seconds(engine.step)
            if rep == 1 and i >= FIRST:
                steps.append(took)
    engine.add_request("ops", PROMPT, params)
    engine.step()
    for _ in range(FIRST):
        engine.step()
    with CountOps() as count:
        engine.step()
    from torch.profiler import ProfilerActivity, profile
    n = 16
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        for _ in range(n):
            engine.step()
        profiled = (time.perf_counter() - start) / n
    while engine.has_unfinished_requests():
        engine.step()
    by_class: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for e in prof.key_averages(group_by_input_shape=True):
        cls = op_class(e.key, e.input_shapes)
        by_class[cls] += e.self_cpu_time_total / 1e3 / n  # ms a step
        calls[cls] += e.count // n
    in_ops = sum(by_class.values())
    parts = {k: dict(ms=v, calls=calls[k]) for k, v in sorted(by_class.items())}
    parts["outside any op"] = dict(ms=1e3 * profiled - in_ops, calls=0)
    for k, b in matmul_bytes(engine.model).items():
        parts[k]["bytes"] = b
        parts[k]["gb_s"] = b / (parts[k]["ms"] / 1e3) / 1e9
    kernel = hot_and_cold(engine.model)
    llm.shutdown()
    return dict(step_ms=1e3 * statistics.median(steps), profiled_step_ms=1e3 * profiled,
                ops_per_step=count.n, steps=[FIRST, LAST], parts=parts, int4_gate_up=kernel)


class StaticCache:
    """A contiguous cache of ``STATIC_LEN`` positions: the model's ``ctx`` for one token."""

    logits_indices = None
    want_hidden_states = False

    def __init__(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        self.k, self.v, self.pos = k, v, pos

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None) -> torch.Tensor:
        self.k[layer].index_copy_(2, self.pos, k.transpose(0, 1)[None])
        self.v[layer].index_copy_(2, self.pos, v.transpose(0, 1)[None])
        mask = torch.arange(self.k.shape[3])[None, :] <= self.pos[:, None]
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], self.k[layer],
                                           self.v[layer], attn_mask=mask, enable_gqa=True)
        return o[0].transpose(0, 1)


def compile_comparison(rounds: int) -> dict[str, Any]:
    """Eager vs compiled forward of one token (see the module docstring)."""
    # a fresh cache directory: the compile times are a first start's, not a cached one's
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="cpu_step_inductor_")
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from infer_lab.kernels import torch_path

    model, _ = il.load(NAME, device="cpu", quantization=cpu_serving_quantization(NAME))
    cfg = model.config
    shape = (cfg.num_hidden_layers, 1, cfg.num_key_value_heads, STATIC_LEN, cfg.head_dim)
    kc, vc = torch.zeros(shape), torch.zeros(shape)

    def forward(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return model(ids, pos, StaticCache(kc, vc, pos))

    ids = torch.tensor([100])
    variants: dict[str, Any] = {"eager": forward}
    out: dict[str, Any] = {}
    # the CPU path reuses RoPE tables across layers by comparing positions' values (a data-
    # dependent branch); under compile the tables are computed in the graph instead
    reuse = torch_path.rope_tables

    def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if not torch.compiler.is_compiling():
            return reuse(positions, inv_freq, dtype)
        cos, sin = torch_path.rope_cos_sin(positions, inv_freq, dtype)
        half = sin.shape[-1] // 2
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cos.unsqueeze(-2), signed.unsqueeze(-2)

    torch_path.rope_tables = rope_tables
    try:
        with torch.inference_mode():
            with CountOps() as count:
                forward(ids, torch.tensor([0]))
            out["eager_ops_per_step"] = count.n
            for name, cpp in (("compiled", False), ("compiled_cpp_wrapper", True)):
                torch._dynamo.reset()
                inductor_config.cpp_wrapper = cpp
                fn = torch.compile(forward, fullgraph=True, dynamic=False)
                start = time.perf_counter()
                _, code = run_and_get_code(fn, ids, torch.tensor([0]))
                src = "\n".join(code)
                out[name] = dict(
                    compile_s=time.perf_counter() - start,
                    fused_cpp_kernels=len(set(re.findall(r"cpp_fused_\w+", src))),
                    aten_calls=len(re.findall(r"aten[.:]+\w+", src)),
                    # the names of the int4 matmul entry points the code calls (comment lines
                    # left out); int4mm_packed_weight_cpu and _weight_int4pack_mm_cpu_tensor
                    # (the C++ wrapper's name for it) wrap the eager kernel
                    int4_kernels=sorted(set(re.findall(
                        r"int4mm_packed_weight_cpu|_weight_int4pack_mm_cpu_tensor"
                        r"|_weight_int4pack_mm_for_cpu|_convert_weight_to_int4pack_for_cpu",
                        "\n".join(line for line in src.splitlines()
                                  if not line.lstrip().startswith(("#", "//")))))))
                variants[name] = fn
            inductor_config.cpp_wrapper = False
            runs: dict[str, list[float]] = {k: [] for k in variants}
            for r in range(rounds):
                order = list(variants) if r % 2 == 0 else list(reversed(variants))
                for k in order:
                    fn = variants[k]
                    for i in range(5):
                        fn(ids, torch.tensor([i]))
                    ts = [_seconds(lambda fn=fn, i=i: fn(ids, torch.tensor([8 + i])))
                          for i in range(60)]
                    runs[k].append(1e3 * statistics.median(ts))
                print(f"compile round {r + 1}: " + "  ".join(
                    f"{k} {v[-1]:.2f} ms" for k, v in runs.items())
                    + f"  load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    finally:
        torch_path.rope_tables = reuse
    for k, v in runs.items():
        out.setdefault(k, {})["step_ms"] = statistics.median(v)
        out[k]["runs_ms"] = v
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    bandwidth = read_bandwidth()
    anat = anatomy(args.threads)
    print(f"decode step (median of steps {FIRST}-{LAST}): {anat['step_ms']:.2f} ms, "
          f"{anat['ops_per_step']} aten ops; profiled {anat['profiled_step_ms']:.2f} ms:")
    for k, p in anat["parts"].items():
        bw = f"  {p['gb_s']:.1f} GB/s" if "gb_s" in p else ""
        print(f"  {k:32s} {p['ms']:6.2f} ms  {p['calls']:5d} profiler events{bw}")
    print(f"one thread reads {bandwidth / 1e9:.1f} GB/s (sum over 256 MiB)")
    k = anat["int4_gate_up"]
    print(f"int4 kernel, one row, gate/up ({k['matrix_bytes'] / 1e6:.2f} MB): "
          f"{k['hot_gb_s']:.1f} GB/s from cache, {k['cold_gb_s']:.1f} GB/s from memory")
    comp = None if args.skip_compile else compile_comparison(args.rounds)
    if comp is not None:
        print(f"forward of one token, static cache: eager {comp['eager']['step_ms']:.2f} ms "
              f"({comp['eager_ops_per_step']} aten ops)")
        for k in ("compiled", "compiled_cpp_wrapper"):
            c = comp[k]
            print(f"  {k}: {c['step_ms']:.2f} ms, compiled in {c['compile_s']:.0f} s, "
                  f"{c['fused_cpp_kernels']} fused C++ kernels, {c['aten_calls']} aten calls "
                  f"in the generated code")
    payload = dict(provenance("cpu"), cpu_model=cpu_model(), cpu=cpu_flags(), model=NAME,
                   path="the GGUF file's own blocks kept (infer-lab serve's CPU default)",
                   threads=args.threads, rounds=args.rounds, load_before=load_before,
                   load_after=os.getloadavg(), read_gb_s=bandwidth / 1e9, anatomy=anat,
                   compile=comp)
    print(f"wrote {write_results('cpu_step', payload, args.out)}")


if __name__ == "__main__":
    main()
