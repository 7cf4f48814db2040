"""Every quantization format judged by KL divergence from the unquantized model (Chapter 8b).

For each model, on held-out text (the KJV chapters of ``infer_lab/assets/tiny-moe/heldout.txt``,
public domain; calibration from the start of the file, evaluation from after it, disjoint):

- **weights**: every format of :data:`infer_lab.model.quant.formats.WEIGHT_FORMATS` (FP8 at three
  scale granularities, MXFP8, MXFP4, NVFP4, Q4_K/Q5_K/Q6_K, int8, int4 RTN) plus GPTQ and AWQ
  int4 at groups of 128 and 32, calibrated on ``--calib-seqs`` sequences of ``--calib-len``
  tokens: in one pass of the unquantized model (``GPTQ``, ``AWQ``), and GPTQ in its original
  order too (``GPTQ true-sequential``, AutoGPTQ's default: block by block and, inside a block,
  stage by stage on the quantized stages' outputs). The block-only order (AutoGPTQ's
  ``true_sequential=False``, rows ``int4 g128/g32 GPTQ sequential``) runs only when ``--only``
  names it. Bits per weight over the layers' linear weights, scales/zeros/g_idx counted; the
  embedding (tied LM head) is left unquantized in every row.
- **activations**: every layer linear's input in FP8 E4M3 or int8 with a scale per token.
- **kv**: K and V stored as fp16, int8 (+ scale per token and head), FP8 E4M3 without a scale
  and with one.

Each row: mean and 99th-percentile KL (nats per token), each with a 95 % interval from a
bootstrap over whole windows (``kl_mean_ci95``, ``kl_p99_ci95``; the per-window sums are kept,
the per-token values are not), the number of tokens past the 99th percentile (``beyond_p99``)
and of the windows they come from (``windows_beyond_p99``: Chapter 7's events), top-1
agreement, perplexity (and the reference's), over ``--eval-tokens`` scored tokens in windows of
``--window`` (stride ``--stride``). SmolLM2's reference is its GGUF file dequantized
to fp32: its linear weights sit on a Q4_1 grid already (int4 g32 min/scale reproduces them), its
embedding on Q8_0's. The load average is recorded at the start and the end: seconds per row are
only a rough guide.

    python -m benchmarks.quant_formats                                  # both models
    python -m benchmarks.quant_formats --models tiny-kjv --eval-tokens 12000
    python -m benchmarks.quant_formats --merge a/quant_formats.json b/quant_formats.json

``--merge`` joins runs of one model each (run side by side, one process per model) into one
file; every model keeps its own run's provenance, settings and load averages under ``runs``. A
later file with a model already merged replaces those rows (a rerun with ``--only``), recorded
under that model's ``runs[model]["reruns"]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

import infer_lab as il
from benchmarks._common import print_table, provenance, write_results
from infer_lab.cache.kv_quant import with_kv_cache_dtype
from infer_lab.measure.kl import CachedReference, kl_divergence
from infer_lab.model.config import ModelConfig
from infer_lab.model.quant.awq import awq_int4, scales_fold
from infer_lab.model.quant.calibrate import (
    collect_stats,
    fake_quantize,
    quantize_sequential,
    with_activation_format,
)
from infer_lab.model.quant.formats import WEIGHT_FORMATS
from infer_lab.model.quant.fp8 import quantize_fp8
from infer_lab.model.quant.gptq import gptq_int4
from infer_lab.model.quantize import dequantize_int8, quantize_int8

HELDOUT = Path(il.__file__).parent / "assets" / "tiny-moe" / "heldout.txt"
SMOLLM2 = "smollm2-135m-instruct"
# SmolLM2 costs ~15 s per 512-token forward on a loaded core: its list is the chapter's picture
SMOL_WEIGHTS = ("fp8_e4m3 tensor", "fp8_e4m3 channel", "fp8_e4m3 block128", "mxfp8", "Q6_K",
                "Q5_K", "Q4_K", "nvfp4", "mxfp4", "int4 g128 RTN", "int4 g32 RTN", "int8 channel")


def _act_fp8(name: str, x: torch.Tensor) -> torch.Tensor:
    return quantize_fp8(x.float(), "fp8_e4m3", "channel", name=name).dequantize(name)


def _act_int8(name: str, x: torch.Tensor) -> torch.Tensor:
    return dequantize_int8(*quantize_int8(x.float()))


def calibrated(stats: dict, method: str, group: int, config: ModelConfig) -> Callable:
    """GPTQ or AWQ int4 of each layer linear; AWQ leaves o_proj unscaled (plain RTN) where its
    scales could not fold into V (grouped-query attention), as AutoAWQ does."""
    def fn(name: str, w: torch.Tensor) -> tuple[torch.Tensor, float]:
        st = stats[name]
        alphas = ALPHAS if scales_fold(name, config) else (0.0,)
        t = (gptq_int4(w, st.hessian, group, name=name) if method == "gptq"
             else awq_int4(w, st.mean_abs, st.sample, group, alphas=alphas, name=name))
        return t.dequantize(name), t.bits_per_weight
    return fn


ALPHAS = tuple(i / 10 for i in range(11))


def run_model(name: str, args: argparse.Namespace,
              progress: Callable[[dict], None] = lambda m: None) -> dict:
    """Every row of one model; ``progress`` gets the model's result after each row, so a long
    run that is stopped leaves the rows it finished."""
    model, tok = il.load(None if name == "tiny-kjv" else name)
    model.eval()
    ids = torch.tensor(tok.encode(HELDOUT.read_text()))
    n_cal = args.calib_seqs * args.calib_len
    calib = [ids[i: i + args.calib_len] for i in range(0, n_cal, args.calib_len)]
    eval_tokens = args.eval_tokens if name == "tiny-kjv" else args.smol_eval_tokens
    held = ids[n_cal: n_cal + eval_tokens + 1]
    if held.numel() < eval_tokens + 1:
        raise SystemExit(f"{name}: the text has {ids.numel()} tokens, too few for "
                         f"{n_cal} calibration + {eval_tokens} evaluation tokens")
    ref = CachedReference(model)
    stats = OnePassStats(model, calib, name)
    result = {"model": name, "reference": "fp32" if name == "tiny-kjv" else
              "fp32 dequantized from the GGUF file (linears Q4_1, embedding Q8_0)",
              "eval_tokens": eval_tokens, "calibration_tokens": n_cal,
              "calibration_seconds": None, "rows": []}
    for label, family, make in row_jobs(name, model, stats, args.only, calib):
        t0, collected = time.perf_counter(), stats.seconds is not None
        cand, bits = make()
        if not collected and stats.seconds is not None:  # this row was the first to read them
            result["calibration_seconds"] = round(stats.seconds, 1)
            t0 += stats.seconds  # the row's seconds leave the one pass out, as before
        r = kl_divergence(ref, cand, held, args.window, args.stride)
        del cand
        result["rows"].append({
            "format": label, "family": family, "bits": round(bits, 4),
            **{k: v for k, v in r.as_dict().items() if k not in ("window", "stride")},
            "kl_mean_ci95": list(r.kl_mean_ci()),  # windows resampled, not tokens
            "kl_p99_ci95": list(r.kl_p99_ci()),  # likewise; the per-token values not kept
            "beyond_p99": r.beyond_p99,  # tokens past the p99: >= 10 for it to be a tail
            "windows_beyond_p99": r.windows_beyond_p99,  # the passages they come from
            "seconds": round(time.perf_counter() - t0, 1)})
        result["eval_tokens"] = r.tokens
        lo, hi = result["rows"][-1]["kl_p99_ci95"]
        print(f"  {label:>24} {bits:6.3f} b  KL {r.kl_mean:.5f} (p99 {r.kl_p99:.4f} "
              f"[{lo:.4f}, {hi:.4f}])  "
              f"top1 {r.top1_agreement:.3f}  ppl {r.ppl:.3f}/{r.ppl_ref:.3f}", flush=True)
        progress(result)
    return result


class OnePassStats(dict):
    """The one pass's calibration statistics (:func:`collect_stats`), collected when a row
    first reads them: a run of rows that never does (``--only`` of RTN or the sequential GPTQ,
    which collects its own) skips SmolLM2's minutes of it."""

    def __init__(self, model: torch.nn.Module, calib: list[torch.Tensor], name: str) -> None:
        super().__init__()
        self.model, self.calib, self.name = model, calib, name
        self.seconds: float | None = None

    def __missing__(self, key: str) -> object:
        if self.seconds is not None:
            raise KeyError(key)
        t0 = time.perf_counter()
        self.update(collect_stats(self.model, self.calib))
        self.seconds = time.perf_counter() - t0
        print(f"{self.name}: calibration stats in {self.seconds:.0f} s", flush=True)
        return self[key]


Job = tuple[str, str, Callable[[], tuple[Callable, float]]]


def row_jobs(name: str, model: il.Transformer, stats: dict, only: list[str] | None,
             calib: list[torch.Tensor] | None = None) -> list[Job]:
    """The rows to run: weights, activations, KV cache; with ``only``, those in its order (and
    the block-only sequential GPTQ rows, which run only when named)."""
    weights = dict(WEIGHT_FORMATS) if name == "tiny-kjv" else {
        k: WEIGHT_FORMATS[k] for k in SMOL_WEIGHTS}
    for g in (128, 32):
        weights[f"int4 g{g} GPTQ"] = calibrated(stats, "gptq", g, model.config)
        weights[f"int4 g{g} AWQ"] = calibrated(stats, "awq", g, model.config)
    jobs: list[Job] = [(label, "weights", lambda fn=fn: fake_quantize(model, fn))
                       for label, fn in weights.items()]
    named_only: list[Job] = []
    if calib is not None:  # GPTQ's original order: each stage on the quantized stages' outputs
        cal = calib

        def sequential(g: int, true_sequential: bool) -> Callable[[], tuple[Callable, float]]:
            return lambda: quantize_sequential(
                model, cal, lambda st: calibrated(st, "gptq", g, model.config),
                true_sequential=true_sequential)
        jobs += [(f"int4 g{g} GPTQ true-sequential", "weights", sequential(g, True))
                 for g in (128, 32)]
        named_only += [(f"int4 g{g} GPTQ sequential", "weights", sequential(g, False))
                       for g in (128, 32)]  # block by block only
    jobs += [(label, "activations", lambda fn=fn: (with_activation_format(model, fn), 8.0))
             for label, fn in (("act fp8_e4m3 per-token", _act_fp8),
                               ("act int8 per-token", _act_int8))]
    d = model.config.head_dim
    jobs += [(f"kv {kv}", "kv", lambda kv=kv, bits=bits: (with_kv_cache_dtype(model, kv), bits))
             for kv, bits in (("fp16", 16.0), ("int8", 8 + 16 / d), ("fp8_e4m3", 8.0),
                              ("fp8_e4m3_scaled", 8 + 16 / d))]
    if not only:
        return jobs
    by_label = {j[0]: j for j in (*jobs, *named_only)}
    unknown = [o for o in only if o not in by_label]
    if unknown:
        raise SystemExit(f"{name}: no rows named {unknown}; rows: {list(by_label)}")
    return [by_label[o] for o in only]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny-kjv", SMOLLM2])
    p.add_argument("--eval-tokens", type=int, default=12000, help="tiny-kjv's")
    p.add_argument("--smol-eval-tokens", type=int, default=2048)
    p.add_argument("--calib-seqs", type=int, default=128)
    p.add_argument("--calib-len", type=int, default=64)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--stride", type=int, default=384)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", nargs="+", default=None,
                   help="run only these rows (names as in the table), in this order, e.g. on a "
                   "loaded machine")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--merge", nargs="+", type=Path, default=None,
                   help="join these result files into --out (nothing is run)")
    args = p.parse_args()
    if args.merge:
        print("wrote", write_results("quant_formats", merge(args.merge), args.out))
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load_start = os.getloadavg()
    args.provenance = provenance("cpu")  # the commit that runs, not the one at write time
    t0 = time.perf_counter()
    models: list[dict] = []
    for m in args.models:  # written after each row: a long run leaves what it finished
        def progress(partial: dict) -> None:
            write_results("quant_formats", payload(args, load_start, t0, [*models, partial]),
                          args.out)
        models.append(run_model(m, args, progress))
        path = write_results("quant_formats", payload(args, load_start, t0, models), args.out)
    for m in models:
        print(m["model"])
        print_table(m["rows"], ["format", "family", "bits", "kl_mean", "kl_p99",
                                "top1_agreement", "ppl", "seconds"])
    print("wrote", path)


def merge(files: list[Path]) -> dict:
    """One result of several runs' files: the models of all, each run's metadata by model.

    A model that an earlier file already holds is a rerun of some of its rows (``--only``): its
    rows replace the earlier rows of the same format, and its run's metadata is kept under that
    model's ``reruns`` with the formats it replaced."""
    out: dict = {"models": [], "runs": {}}
    for f in files:
        data = json.loads(f.read_text())
        meta = {k: v for k, v in data.items() if k not in ("models", "runs")}
        for m in data["models"]:
            run = data.get("runs", {}).get(m["model"], meta)
            old = next((o for o in out["models"] if o["model"] == m["model"]), None)
            if old is None:
                out["models"].append(m)
                out["runs"][m["model"]] = run
                continue
            new = {r["format"]: r for r in m["rows"]}
            kept = {r["format"] for r in old["rows"]}
            old["rows"] = [new.get(r["format"], r) for r in old["rows"]]
            old["rows"] += [r for fmt, r in new.items() if fmt not in kept]
            scored = {r.get("tokens") for r in old["rows"]}
            if len(scored) == 1 and None not in scored:  # all rerun on one length
                old["eval_tokens"] = scored.pop()
            out["runs"][m["model"]].setdefault("reruns", []).append(
                {"formats": list(new), **{k: v for k, v in run.items() if k != "reruns"}})
    return out


def payload(args: argparse.Namespace, load_start: tuple[float, ...], t0: float,
            models: list[dict]) -> dict:
    return {
        "provenance": args.provenance,
        "load_average_start": [round(x, 2) for x in load_start],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "settings": {k: getattr(args, k) for k in ("eval_tokens", "smol_eval_tokens",
                                                   "calib_seqs", "calib_len", "window",
                                                   "stride", "threads", "only")},
        "text": "infer_lab/assets/tiny-moe/heldout.txt (KJV, public domain)",
        "models": models,
    }


if __name__ == "__main__":
    main()
