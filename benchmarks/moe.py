"""Mixture of experts, measured (Chapter 12): what it costs to decode, each way of computing it,
and what routing on real text looks like.

Sections of ``benchmarks/results/moe.json`` (``moe_gpu.json`` with ``--gpu``):

- ``headline``: decode step time at batch 1 and 64 (contiguous KV cache, ``--context`` tokens
  already cached, median of ``--steps`` steps, the models taking turns) of three random-weight
  models with the same
  attention and embeddings: a Mixtral-shaped MoE (8 experts, top-2), a dense model with the MoE's
  *active* MLP width (2 experts' worth) and one with its *total* MLP width (all 8);
- ``paths``: one MoE layer (8 experts, top-2, hidden 1024, expert width 1792) at batch 1, 8 and 64
  by the naive loop over experts, grouped by expert, and one ``grouped_mm`` per projection (on a
  GPU also the fused Triton kernel), interleaved repeats, medians;
- ``step_vs_batch``: that layer's time (the fastest CPU path) at batch 1..64 beside the expected
  number of distinct experts the batch touches, and a dense layer of the same total size;
- ``distinct``: distinct experts per layer at batch B, the formula E (1 - (1 - k/E)^B) against
  the routing of ``tiny-moe`` on its held-out chapters (B random tokens; mean over 200 draws);
- ``imbalance``: tiny-moe's tokens per expert on the held-out text, per layer; the busiest
  expert's and the busiest expert-parallel rank's load over the mean; pairs a capacity factor
  would drop in batches of 64 and 512 tokens;
- ``parallel``: tiny-moe greedy on 4 held-out prompts with expert parallelism and with
  tensor-parallel experts over 2 processes (gloo): identical tokens to one process?, bytes per
  token per MoE layer counted from the collectives' sizes against the formulas, time in them.

One torch thread unless ``--threads``; on a shared machine the absolute times are poor, the
ratios measured side by side in one run are what to quote (the load average is recorded).

    python -m benchmarks.moe [--threads 1] [--only headline paths ...] [--gpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import infer_lab as il
from benchmarks._common import print_table, provenance, write_results
from infer_lab.cache.contiguous import ContiguousAttentionContext, ContiguousKVCache
from infer_lab.kernels import moe as moe_k
from infer_lab.measure import moe as mm
from infer_lab.model.config import ModelConfig
from infer_lab.model.expert_parallel import run_parallel
from infer_lab.model.random import random_model

ROOT = Path(__file__).resolve().parent.parent
TINY_MOE = ROOT / "infer_lab" / "assets" / "tiny-moe"
SECTIONS = ("headline", "paths", "step_vs_batch", "distinct", "imbalance", "parallel")
BATCHES = (1, 8, 64)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, device: str
                ) -> dict[str, float]:
    """Median seconds of each function, the functions taking turns (load spikes hit all)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


# ----------------------------------------------------------------------------- models
def shapes(gpu: bool) -> dict[str, Any]:
    """The benchmark's Mixtral-shaped MoE: Mixtral-8x7B's own layers on a GPU (two of them), a
    quarter of its width on a CPU (hidden 1024, experts 1792 wide: 176 MB of fp32 experts per
    layer, four layers)."""
    if gpu:
        return dict(hidden=4096, expert=14336, experts=8, top_k=2, layers=2, heads=32, kv=8,
                    vocab=32000)
    return dict(hidden=1024, expert=1792, experts=8, top_k=2, layers=4, heads=16, kv=4,
                vocab=32000)


def model_configs(s: dict[str, Any]) -> dict[str, ModelConfig]:
    base = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                num_attention_heads=s["heads"], num_key_value_heads=s["kv"],
                max_position_embeddings=4096, tie_word_embeddings=True)
    return {
        "moe": ModelConfig.from_dict(dict(base, model_type="mixtral",
                                          intermediate_size=s["expert"],
                                          num_local_experts=s["experts"],
                                          num_experts_per_tok=s["top_k"])),
        "dense_active": ModelConfig.from_dict(dict(base, model_type="llama",
                                                   intermediate_size=s["top_k"] * s["expert"])),
        "dense_total": ModelConfig.from_dict(dict(base, model_type="llama",
                                                  intermediate_size=s["experts"] * s["expert"])),
    }


class Decoder:
    """One model decoding a batch through the contiguous KV cache, a step at a time."""

    def __init__(self, model: torch.nn.Module, batch: int, context: int, steps: int,
                 device: str) -> None:
        cfg = model.config
        self.model, self.batch, self.context, self.device, self.i = model, batch, context, \
            device, 0
        self.cache = ContiguousKVCache(cfg, batch, context + steps + 4, device, model.dtype)
        self.gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, cfg.vocab_size, (batch, context), generator=self.gen)
        ctx = ContiguousAttentionContext(self.cache, torch.zeros(batch, dtype=torch.long),
                                         context)
        with torch.inference_mode():
            model(prompt.to(device).flatten(), ctx.positions.flatten(), ctx)

    @torch.inference_mode()
    def step(self) -> None:
        feed = torch.randint(0, self.model.config.vocab_size, (self.batch,), generator=self.gen)
        ctx = ContiguousAttentionContext(self.cache, torch.full((self.batch,),
                                                                self.context + self.i), 1)
        self.model(feed.to(self.device), ctx.positions.flatten(), ctx)
        self.i += 1


def headline(args: argparse.Namespace) -> dict[str, Any]:
    """The three models' decode steps interleaved, step by step, so that the machine's load
    falls on all three alike."""
    cfgs = model_configs(shapes(args.gpu))
    models = {name: random_model(cfg, args.device, args.dtype) for name, cfg in cfgs.items()}
    rows = []
    for b in (1, 64):
        decoders = {n: Decoder(m, b, args.context, args.steps + 1, args.device)
                    for n, m in models.items()}
        times = interleaved({n: d.step for n, d in decoders.items()}, args.steps, args.device)
        for name, cfg in cfgs.items():
            rows.append(dict(model=name, batch=b, params=cfg.num_parameters(),
                             active_params=cfg.num_active_parameters(),
                             step_ms=1e3 * times[name]))
        del decoders
    by = {(r["model"], r["batch"]): r for r in rows}
    for r in rows:
        r["vs_dense_total"] = r["step_ms"] / by["dense_total", r["batch"]]["step_ms"]
        r["vs_dense_active"] = r["step_ms"] / by["dense_active", r["batch"]]["step_ms"]
    print_table(rows, ["model", "batch", "params", "active_params", "step_ms", "vs_dense_total",
                       "vs_dense_active"])
    return {"rows": rows, "shape": shapes(args.gpu), "context": args.context,
            "steps": args.steps}


# ----------------------------------------------------------------------------- one layer
def layer(s: dict[str, Any], device: str, dtype: torch.dtype, seed: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, i, e = s["hidden"], s["expert"], s["experts"]
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(device, dtype)
    w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).to(device, dtype)
    router = (torch.randn(e, h, generator=gen) / h**0.5).to(device, dtype)
    return w13, w2, router


def routed(x: torch.Tensor, router: torch.Tensor, top_k: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    return moe_k.select_experts(x @ router.T, top_k, renormalize=True)


def paths(args: argparse.Namespace) -> dict[str, Any]:
    s = shapes(args.gpu)
    w13, w2, router = layer(s, args.device, args.dtype)
    impls = ["naive", "grouped", "grouped_mm"] + (["triton"] if args.gpu else [])
    rows = []
    for b in BATCHES:
        x = torch.randn(b, s["hidden"], generator=torch.Generator().manual_seed(b)).to(
            args.device, args.dtype)
        w, ids = routed(x, router, s["top_k"])
        fns = {n: (lambda n=n, x=x, w=w, ids=ids: moe_k.fused_experts(x, w13, w2, w, ids,
                                                                       impl=n)) for n in impls}
        # fp64 on a CPU; on a GPU the naive loop in the same dtype (Mixtral's experts in fp64
        # would take 11 GB more), so rel_err there is agreement with the reference path
        ref_t = (lambda t: t) if args.gpu else (lambda t: t.double())
        ref = moe_k.moe_naive(ref_t(x), ref_t(w13), ref_t(w2), ref_t(w), ids).double()
        times = interleaved(fns, args.repeats, args.device)
        for n in impls:
            out = fns[n]()
            err = float((out.double() - ref).abs().max() / ref.abs().max())
            rows.append(dict(impl=n, batch=b, ms=1e3 * times[n],
                             vs_naive=times[n] / times["naive"], rel_err=err,
                             distinct_experts=int(ids.unique().numel())))
    print_table(rows, ["impl", "batch", "ms", "vs_naive", "rel_err", "distinct_experts"])
    fastest = {b: min((r for r in rows if r["batch"] == b and r["impl"] != "triton"),
                      key=lambda r: r["ms"])["impl"] for b in BATCHES}
    expert_bytes = 3 * s["hidden"] * s["expert"] * w13.element_size()
    return {"rows": rows, "fastest_torch": fastest, "shape": s, "expert_bytes": expert_bytes,
            "note": "the Triton kernel is timed on a GPU only; on a CPU it runs in Triton's "
                    "interpreter, which checks correctness, not speed"}


def step_vs_batch(args: argparse.Namespace) -> dict[str, Any]:
    s = shapes(args.gpu)
    w13, w2, router = layer(s, args.device, args.dtype)
    dense_up = w13.reshape(-1, s["hidden"])  # all experts side by side: one dense MLP of E*I
    dense_down = w2.permute(1, 0, 2).reshape(s["hidden"], -1)
    impl = "triton" if args.gpu else moe_k.CPU_DEFAULT
    rows = []
    for b in (1, 2, 4, 8, 16, 32, 64):
        x = torch.randn(b, s["hidden"], generator=torch.Generator().manual_seed(b)).to(
            args.device, args.dtype)
        w, ids = routed(x, router, s["top_k"])

        def dense(x: torch.Tensor = x) -> torch.Tensor:
            g, u = (x @ dense_up.T).chunk(2, dim=-1)
            return (torch.nn.functional.silu(g) * u) @ dense_down.T

        t = interleaved({"moe": lambda x=x, w=w, ids=ids: moe_k.fused_experts(
            x, w13, w2, w, ids, impl=impl), "dense_total": dense}, args.repeats, args.device)
        rows.append(dict(batch=b, moe_ms=1e3 * t["moe"], dense_total_ms=1e3 * t["dense_total"],
                         distinct=int(ids.unique().numel()),
                         expected_distinct=float(mm.expected_distinct_experts(
                             s["experts"], s["top_k"], b))))
    print_table(rows, ["batch", "moe_ms", "dense_total_ms", "distinct", "expected_distinct"])
    return {"rows": rows, "impl": impl, "shape": s}


# ----------------------------------------------------------------------------- real routing
def heldout_chapters(tok: il.Tokenizer, most: int = 24) -> list[list[int]]:
    text = (TINY_MOE / "heldout.txt").read_text(encoding="utf-8")
    return [tok.encode(c)[:256] for c in text.strip().split("\n\n")[:most]]


def tiny_moe_routing() -> tuple[ModelConfig, dict[int, torch.Tensor], il.Tokenizer]:
    model, tok = il.load("tiny-moe", device="cpu", dtype="float32")
    routing = mm.routing_on(model, heldout_chapters(tok))
    return model.config, routing, tok


def distinct(args: argparse.Namespace, routing: dict[int, torch.Tensor], cfg: ModelConfig
             ) -> dict[str, Any]:
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    gen = torch.Generator().manual_seed(1)
    n = next(iter(routing.values())).shape[0]
    uniform = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    rows = []
    for b in (1, 2, 4, 8, 16, 32, 64, 128):
        measured = statistics.mean(mm.sampled_distinct_experts(ids, b) for ids in
                                   routing.values())
        rows.append(dict(batch=b, formula=float(mm.expected_distinct_experts(e, k, b)),
                         uniform_sampled=mm.sampled_distinct_experts(uniform, b),
                         tiny_moe=measured))
    print_table(rows, ["batch", "formula", "uniform_sampled", "tiny_moe"])
    return {"rows": rows, "num_experts": e, "top_k": k, "tokens": n}


def imbalance(args: argparse.Namespace, routing: dict[int, torch.Tensor], cfg: ModelConfig
              ) -> dict[str, Any]:
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    layers = []
    for layer, ids in routing.items():
        counts = mm.tokens_per_expert(ids, e)
        ranks = {ep: mm.imbalance(counts.view(ep, -1).sum(1)) for ep in (2, 4)}
        drops = {}
        for batch in (64, 512):
            for cf in (1.0, 1.25, 2.0):
                cap = mm.expert_capacity(batch, e, k, cf)
                dropped = sum(mm.dropped_pairs(mm.tokens_per_expert(ids[i:i + batch], e), cap)
                              for i in range(0, ids.shape[0] - batch + 1, batch))
                windows = ids.shape[0] // batch
                drops[f"b{batch}_cf{cf}"] = dropped / (windows * batch * k)
        layers.append(dict(layer=layer, share=(counts / counts.sum()).tolist(),
                           max_over_mean=mm.imbalance(counts), rank_max_over_mean=ranks,
                           dropped_fraction=drops))
        print(f"layer {layer}: max/mean {mm.imbalance(counts):.2f}, ep2 {ranks[2]:.2f}, "
              f"ep4 {ranks[4]:.2f}, dropped at cf 1.0 (64 tokens) {drops['b64_cf1.0']:.1%}")
    return {"layers": layers, "tokens": int(next(iter(routing.values())).shape[0])}


def parallel(args: argparse.Namespace, tok: il.Tokenizer, cfg: ModelConfig) -> dict[str, Any]:
    from infer_lab.model.baselines import generate_cached

    prompts = [c[:24] for c in heldout_chapters(tok, 4)]
    model, _ = il.load("tiny-moe", device="cpu", dtype="float32")
    ref = [o.token_ids for o in generate_cached(model, tok, prompts, args.parallel_tokens,
                                                ignore_eos=True)]
    h, k, n = cfg.hidden_size, cfg.num_experts_per_tok, 2
    out: dict[str, Any] = {"prompts": len(prompts), "max_tokens": args.parallel_tokens,
                           "formula_bytes_per_token_layer": {
                               "ep": 2 * k * h * 4 * (n - 1) / n,
                               "tp_per_rank": 2 * (n - 1) / n * h * 4}}
    t0 = time.perf_counter()
    runs = run_parallel(TINY_MOE, prompts, n, ("ep", "tp"), max_tokens=args.parallel_tokens)
    out["wall_s_both"] = time.perf_counter() - t0
    for mode, res in runs.items():
        stats = [r["stats"] for r in res["ranks"]]
        tokens = sum(s["tokens"] for s in stats)  # token-layers, over the ranks
        out[mode] = dict(
            identical=res["tokens"] == ref, decode_wall_s=max(r["wall_s"] for r in res["ranks"]),
            payload_bytes=sum(s["payload_bytes"] for s in stats),
            meta_bytes=sum(s["meta_bytes"] for s in stats),
            token_layers=tokens, collective_s=max(s["seconds"] for s in stats),
            bytes_per_token_layer=sum(s["payload_bytes"] for s in stats) / tokens,
            remote_fraction=(sum(s["rows_remote"] for s in stats) / 2
                             / max(1, sum(s["rows_local"] + s["rows_remote"] // 2
                                          for s in stats))))
        print(f"{mode}: identical {out[mode]['identical']}, "
              f"{out[mode]['bytes_per_token_layer']:.0f} B per token and layer "
              f"(formula {out['formula_bytes_per_token_layer']})")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--gpu", action="store_true", help="GPU sizes on cuda, bf16, Triton row")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--parallel-tokens", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.device = "cuda" if args.gpu else "cpu"
    args.dtype = torch.bfloat16 if args.gpu else torch.float32
    payload: dict[str, Any] = {**provenance(args.device), "load_average": os.getloadavg(),
                               "dtype": str(args.dtype)}
    if "headline" in args.only:
        payload["headline"] = headline(args)
    if "paths" in args.only:
        payload["paths"] = paths(args)
    if "step_vs_batch" in args.only:
        payload["step_vs_batch"] = step_vs_batch(args)
    if {"distinct", "imbalance", "parallel"} & set(args.only) and not args.gpu:
        cfg, routing, tok = tiny_moe_routing()
        if "distinct" in args.only:
            payload["distinct"] = distinct(args, routing, cfg)
        if "imbalance" in args.only:
            payload["imbalance"] = imbalance(args, routing, cfg)
        if "parallel" in args.only:
            payload["parallel"] = parallel(args, tok, cfg)
    payload["load_average_after"] = os.getloadavg()
    path = write_results("moe_gpu" if args.gpu else "moe", payload,
                         Path(args.out) if args.out else None)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
