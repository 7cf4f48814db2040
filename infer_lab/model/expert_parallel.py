"""Splitting a mixture of experts across processes: expert parallelism, and tensor-parallel experts.

**Expert parallelism** (``mode="ep"``): rank ``r`` of ``ep`` holds experts ``[r E/ep, (r+1) E/ep)``
whole, and its own share of the requests (attention is data-parallel: each rank runs attention
only for its own sequences, with its own KV cache). In every MoE layer:

1. *dispatch*: each (token, expert) pair's hidden state goes to the rank that holds the expert,
   one ``all_to_all`` for the whole layer (the counts first, then the rows and their local expert
   ids);
2. each rank runs its experts on the rows it received (one grouped computation);
3. *combine*: the outputs travel back the same way (a second ``all_to_all``) and each token's home
   rank adds them up with its routing weights.

A pair whose expert is local never leaves its rank. Each remote pair crosses the wire twice, one
hidden state each way: ``2 k H b (ep - 1) / ep`` bytes per token and MoE layer on average when
routing is uniform (``b`` bytes per element); :class:`CommStats` counts what was really sent.

**Tensor-parallel experts** (``mode="tp"``): every rank holds a ``1/tp`` slice of *every* expert's
hidden units (rows of ``w13``, columns of ``w2``, as Chapter 10 splits a dense MLP) and sees every
token; each computes a partial sum of the layer's output and one ``all_reduce`` adds them up:
``2 (tp - 1) / tp * H b`` bytes sent per rank per token and layer, for a token that every rank
processes. :func:`shard_moe_block_tp` makes the split, here and inside the engine's
tensor-parallel workers alike.

The collectives are ``torch.distributed``'s (gloo on CPU, NCCL on GPU). :func:`run_parallel`
starts the ranks for real (``torchrun``) and returns what each generated; the tests and Chapter 12
check it against one process, token for token.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from infer_lab.kernels.moe import fused_experts
from infer_lab.model.config import ModelConfig
from infer_lab.model.moe import SharedExpert, SparseMoeBlock, moe_blocks

MODES = ("ep", "tp")


class ExpertParallelError(ValueError):
    """An expert-parallel or tensor-parallel split that the model's experts do not allow."""


def parallel_size_problem(cfg: ModelConfig, size: int, mode: str = "ep") -> str | None:
    """Why ``size`` ranks cannot split ``cfg``'s experts in ``mode`` (None if they can)."""
    if mode not in MODES:
        return f"mode must be one of {MODES}, not {mode!r}"
    if size < 1:
        return "the size must be at least 1"
    if not cfg.num_experts or not cfg.moe_layers:
        return "the model has no experts (it is dense)"
    if mode == "ep" and cfg.num_experts % size:
        return (f"{cfg.num_experts} experts do not divide into {size} ranks: every rank must "
                "hold the same number of whole experts")
    if mode == "tp" and cfg.moe_intermediate_size % size:
        return (f"each expert's {cfg.moe_intermediate_size} hidden units do not divide into "
                f"{size} equal slices")
    if mode == "tp" and cfg.shared_expert_intermediate_size % size:
        return (f"the shared expert's {cfg.shared_expert_intermediate_size} hidden units do not "
                f"divide into {size} equal slices")
    return None


def valid_sizes(cfg: ModelConfig, mode: str = "ep", most: int = 64) -> list[int]:
    return [n for n in range(1, most + 1) if parallel_size_problem(cfg, n, mode) is None]


def check_parallel_size(cfg: ModelConfig, size: int, mode: str = "ep") -> None:
    """Raise :class:`ExpertParallelError` with the reason and the sizes that work."""
    problem = parallel_size_problem(cfg, size, mode)
    if problem is not None:
        name = "expert_parallel_size" if mode == "ep" else "tensor_parallel_size"
        raise ExpertParallelError(f"{name}={size} does not fit this model ({problem}); sizes "
                                  f"that work: {valid_sizes(cfg, mode)}")


def experts_of_rank(cfg: ModelConfig, rank: int, ep: int) -> range:
    """The global expert ids rank ``rank`` holds under expert parallelism."""
    per = cfg.num_experts // ep
    return range(rank * per, (rank + 1) * per)


@dataclass
class CommStats:
    """What the MoE layers of one rank sent: rows and bytes that crossed to *other* ranks."""

    calls: int = 0  # collective calls (all_to_all or all_reduce)
    tokens: int = 0  # tokens that entered an MoE layer on this rank (summed over layers)
    rows_remote: int = 0  # (token, expert) rows sent to another rank, dispatch and combine
    rows_local: int = 0  # rows whose expert was on this rank (never sent)
    payload_bytes: int = 0  # hidden states sent to other ranks
    meta_bytes: int = 0  # counts and expert ids sent alongside
    seconds: float = 0.0  # wall time inside the collectives

    def add(self, other: CommStats) -> None:
        for f in ("calls", "tokens", "rows_remote", "rows_local", "payload_bytes", "meta_bytes",
                  "seconds"):
            setattr(self, f, getattr(self, f) + getattr(other, f))


class ExpertParallelExperts(nn.Module):
    """This rank's experts, and the all-to-all dispatch and combine around them."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, first: int, num_experts: int,
                 rank: int, ep: int, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.w13_weight = nn.Parameter(w13.contiguous(), requires_grad=False)
        self.w2_weight = nn.Parameter(w2.contiguous(), requires_grad=False)
        self.first, self.num_experts, self.rank, self.ep, self.group = (
            first, num_experts, rank, ep, group)
        self.stats = CommStats()

    def _exchange(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]
                  ) -> torch.Tensor:
        out = send.new_empty((sum(recv_splits), *send.shape[1:]))
        start = time.perf_counter()
        dist.all_to_all_single(out, send.contiguous(), recv_splits, send_splits, group=self.group)
        self.stats.seconds += time.perf_counter() - start
        self.stats.calls += 1
        return out

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        t, k = topk_ids.shape
        per = self.num_experts // self.ep
        flat = topk_ids.flatten()
        dest = flat // per
        order = torch.argsort(dest, stable=True)  # pairs grouped by the rank that holds them
        send_counts = torch.bincount(dest, minlength=self.ep)
        recv_counts = torch.empty_like(send_counts)
        start = time.perf_counter()
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        self.stats.seconds += time.perf_counter() - start
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        # 1. dispatch: the rows and, beside them, which of the receiver's experts each is for
        rows = self._exchange(x[order // k], send_splits, recv_splits)
        local_ids = self._exchange((flat[order] - dest[order] * per)[:, None], send_splits,
                                   recv_splits)
        # 2. this rank's experts on what it received (weight 1: weights stay at home)
        y = fused_experts(rows, self.w13_weight, self.w2_weight,
                          rows.new_ones(rows.shape[0], 1, dtype=torch.float32), local_ids)
        # 3. combine: back to the home ranks, weighted, summed per token
        back = self._exchange(y, recv_splits, send_splits)
        back = back * topk_weights.flatten()[order, None].to(x.dtype)
        remote = sum(send_splits) - send_splits[self.rank]
        s = self.stats
        s.tokens += t
        s.rows_local += send_splits[self.rank]
        s.rows_remote += 2 * remote  # there and back
        s.payload_bytes += 2 * remote * x.shape[1] * x.element_size()
        s.meta_bytes += remote * local_ids.element_size() + 2 * (self.ep - 1) * 8
        return torch.zeros_like(x).index_add_(0, order // k, back)


class TensorParallelExperts(nn.Module):
    """A ``1/tp`` slice of every expert's hidden units: the output is a partial sum, which the
    block's one all-reduce completes (:class:`TensorParallelMoeBlock`)."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.w13_weight = nn.Parameter(w13.contiguous(), requires_grad=False)
        self.w2_weight = nn.Parameter(w2.contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)


def _expert_slice(w13: torch.Tensor, w2: torch.Tensor, rank: int, tp: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s hidden units of every expert: gate rows, up rows, and w2's columns."""
    i = w2.shape[-1]
    n = i // tp
    units = torch.arange(rank * n, (rank + 1) * n, device=w13.device)
    return w13[:, torch.cat([units, i + units])], w2[..., units]


@torch.no_grad()
def shard_experts(model: nn.Module, rank: int, size: int, mode: str = "ep",
                  group: dist.ProcessGroup | None = None) -> list[CommStats]:
    """Keep only rank ``rank``'s part of every MoE layer's experts, in place; the rest of the
    model stays whole (replicated). Returns each layer's :class:`CommStats`."""
    cfg = model.config
    check_parallel_size(cfg, size, mode)
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank}")
    for block in moe_blocks(model):
        w13, w2 = block.experts.w13_weight, block.experts.w2_weight
        if mode == "ep":
            mine = experts_of_rank(cfg, rank, size)
            block.experts = ExpertParallelExperts(
                w13[mine.start:mine.stop].clone(), w2[mine.start:mine.stop].clone(),
                mine.start, cfg.num_experts, rank, size, group)
        else:
            shard_moe_block_tp(block, rank, size, group)
    return [b.stats if mode == "tp" else b.experts.stats for b in moe_blocks(model)]


class TensorParallelMoeBlock(SparseMoeBlock):
    """A sparse MLP split by hidden units, experts and shared expert alike: every piece of it
    yields a partial sum of the output, and one ``all_reduce`` per layer adds them up."""

    tp_group: dist.ProcessGroup | None
    stats: CommStats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)  # a partial sum: the experts' and shared expert's slices
        start = time.perf_counter()
        dist.all_reduce(out, group=self.tp_group)
        tp, s = dist.get_world_size(self.tp_group), self.stats
        s.seconds += time.perf_counter() - start
        s.calls += 1
        s.tokens += out.numel() // out.shape[-1]
        s.payload_bytes += round(2 * (tp - 1) / tp * out.numel() * out.element_size())
        return out


@torch.no_grad()
def shard_moe_block_tp(block: SparseMoeBlock, rank: int, tp: int,
                       group: dist.ProcessGroup | None) -> None:
    """Rank ``rank``'s slice of ``block``, in place, for the engine's tensor-parallel workers
    (:func:`infer_lab.model.tensor_parallel.shard_model` calls this for each sparse layer)."""
    experts = block.experts
    w13, w2 = _expert_slice(experts.w13_weight, experts.w2_weight, rank, tp)
    block.experts = TensorParallelExperts(w13, w2)
    if block.shared_expert is not None:
        shared = block.shared_expert
        s = shared.down_proj.in_features
        n = s // tp
        units = torch.arange(rank * n, (rank + 1) * n, device=w13.device)
        local = SharedExpert(shared.down_proj.out_features, n).to(w13.device, w13.dtype)
        local.gate_up_proj.weight.copy_(shared.gate_up_proj.weight[torch.cat([units, s + units])])
        local.down_proj.weight.copy_(shared.down_proj.weight[:, units])
        block.shared_expert = local
    block.__class__ = TensorParallelMoeBlock
    block.tp_group = group  # type: ignore[attr-defined]
    block.stats = CommStats()  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- running it
def _split_prompts(prompts: Sequence[Sequence[int]], rank: int, size: int, mode: str
                   ) -> list[list[int]]:
    """EP: rank r takes prompts r, r + size, ... (data-parallel attention); TP: all of them."""
    if mode == "tp":
        return [list(p) for p in prompts]
    return [list(p) for p in prompts[rank::size]]


def _worker(args: argparse.Namespace) -> None:
    """One rank: for each mode, load the model, keep its part, greedy-decode its prompts, and
    report to rank 0 (several modes share one start-up of the processes)."""
    from infer_lab.model.baselines import generate_cached
    from infer_lab.model.loader import load

    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    prompts = json.loads(args.prompts)
    reports = {}
    for mode in args.mode.split(","):
        model, tok = load(args.model, device="cpu", dtype=args.dtype)
        stats = shard_experts(model, rank, size, mode)
        mine = _split_prompts(prompts, rank, size, mode)
        start = time.perf_counter()
        outs = generate_cached(model, tok, mine, args.max_tokens, ignore_eos=True)
        wall = time.perf_counter() - start
        total = CommStats()
        for st in stats:
            total.add(st)
        reports[mode] = {"rank": rank, "tokens": [o.token_ids for o in outs], "wall_s": wall,
                         "stats": dataclasses.asdict(total), "num_layers": len(stats)}
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, reports)
    if rank == 0:
        print(json.dumps({"ranks": gathered}), flush=True)
    dist.destroy_process_group()


def _collect(ranks: list[dict[str, Any]], prompts: Sequence[Sequence[int]], size: int,
             mode: str) -> list[list[int]]:
    """Every prompt's tokens, in order, from the ranks' reports (TP ranks must all agree)."""
    tokens: list[list[int]] = [[] for _ in prompts]
    for r in ranks:
        idx = range(len(prompts)) if mode == "tp" else range(r["rank"], len(prompts), size)
        for i, toks in zip(idx, r["tokens"], strict=True):
            if mode == "tp" and r["rank"] != 0:
                if toks != tokens[i]:
                    raise RuntimeError(f"tensor-parallel ranks disagree on prompt {i}")
                continue
            tokens[i] = toks
    return tokens


def run_parallel(model: str | os.PathLike, prompts: Sequence[Sequence[int]], size: int,
                 mode: str | Sequence[str] = "ep", max_tokens: int = 16, dtype: str = "float32",
                 backend: str = "gloo", timeout: float = 600.0) -> dict[str, Any]:
    """Greedy-decode ``prompts`` (token ids; with ``ep`` at least one per rank) on ``size``
    processes splitting the experts by ``mode``; returns the tokens of every prompt, in order,
    and each rank's :class:`CommStats`. Several modes (``("ep", "tp")``) run one after the other
    in the same processes and return ``{mode: result}``.

    Each rank is a fresh interpreter started by ``torchrun``, holding only its part of the
    experts.
    """
    from infer_lab.model.loader import resolve_model_path

    modes = [mode] if isinstance(mode, str) else list(mode)
    cfg = ModelConfig.from_file(resolve_model_path(model))
    for m in modes:
        check_parallel_size(cfg, size, m)
    if "ep" in modes and len(prompts) < size:
        raise ValueError(f"expert parallelism over {size} ranks needs at least {size} prompts "
                         f"(each rank decodes its own), got {len(prompts)}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={size}", "-m", "infer_lab.model.expert_parallel",
           "--model", str(model), "--mode", ",".join(modes), "--max-tokens", str(max_tokens),
           "--dtype", dtype, "--backend", backend, "--prompts", json.dumps([list(p) for p in
                                                                           prompts])]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith('{"ranks"')]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"torchrun failed ({done.returncode}): {done.stderr[-3000:]}")
    per_rank = json.loads(lines[-1])["ranks"]
    results = {}
    for m in modes:
        ranks = [r[m] for r in per_rank]
        results[m] = {"tokens": _collect(ranks, prompts, size, m), "ranks": ranks, "mode": m,
                      "size": size}
    return results[modes[0]] if isinstance(mode, str) else results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="one rank of an expert-parallel run (torchrun)")
    p.add_argument("--model", required=True)
    p.add_argument("--mode", default="ep", help="ep, tp, or both: ep,tp")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--backend", default="gloo")
    p.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    _worker(p.parse_args(argv))


if __name__ == "__main__":
    main()
