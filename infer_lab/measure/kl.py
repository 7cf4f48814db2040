"""How far a model's next-token distribution moves from a reference's: KL divergence per token.

Perplexity averages away what a quantized model gets wrong (it can be lower on one text by luck)
and greedy agreement over a handful of tokens sees only the top choice. llama.cpp's
``perplexity --kl-divergence`` judges a format instead by the KL
divergence ``KL(P_ref || P_q) = sum_v P_ref(v) (log P_ref(v) - log P_q(v))`` at every position of
a held-out text, where ``P_ref`` is the unquantized model's distribution: zero exactly when the
two agree everywhere, and its tail (the 99th percentile over tokens) shows the rare positions
where the candidate goes badly wrong. Beside it: both perplexities and the top-1 agreement.

Both models see the same windows of the text (``window`` tokens, the first ``window - stride``
of each only context after the first window), so every scored position has the same context in
both; the reference's logits of a window are computed once and compared with every candidate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from infer_lab.measure import stats

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # [1, S] ids -> [1, S, vocab] logits


@dataclass(frozen=True)
class KLResult:
    """A candidate against the reference over ``tokens`` scored positions (nats)."""

    kl_mean: float
    kl_p99: float
    kl_max: float
    top1_agreement: float  # fraction of positions where both put the same token first
    ppl: float  # the candidate's perplexity of the text
    ppl_ref: float  # the reference's, on the same positions
    tokens: int
    window: int
    stride: int
    # (sum of KL, scored tokens) per window, in text order: what an interval resamples
    window_sums: tuple[tuple[float, int], ...] = ()
    # every scored token's KL, grouped by window in text order: what the p99's interval
    # resamples (kept in memory, ~10k floats; left out of as_dict, see there)
    window_kls: tuple[tuple[float, ...], ...] = ()

    def as_dict(self) -> dict[str, float | int]:
        """The fields for a result file, less ``window_kls``: a float per scored token would
        make a table of thirty formats megabytes; store :meth:`kl_p99_ci`'s interval instead."""
        return {k: v for k, v in asdict(self).items() if k != "window_kls"}

    def kl_mean_ci(self, level: float = 0.95, n_boot: int = 2000, seed: int = 0
                   ) -> tuple[float, float]:
        """A bootstrap interval of ``kl_mean`` that resamples whole windows, not tokens.

        Neighbouring tokens' divergences are not independent (one hard passage moves a run of
        them), and a window is a stretch of text whose scored tokens no other window scores,
        so windows are the units resampled (a block bootstrap with the window as the block).
        """
        if len(self.window_sums) < 2:
            return (math.nan, math.nan)
        sums = torch.tensor([w[0] for w in self.window_sums], dtype=torch.float64)
        counts = torch.tensor([w[1] for w in self.window_sums], dtype=torch.float64)
        g = torch.Generator().manual_seed(seed)
        picks = torch.randint(0, len(sums), (n_boot, len(sums)), generator=g)
        means = sums[picks].sum(1) / counts[picks].sum(1)
        lo, hi = torch.quantile(means, torch.tensor([(1 - level) / 2, (1 + level) / 2],
                                                    dtype=torch.float64)).tolist()
        return (lo, hi)

    def kl_p99_ci(self, level: float = 0.95, n_boot: int = 2000, seed: int = 0
                  ) -> tuple[float, float]:
        """A bootstrap interval of ``kl_p99`` that resamples whole windows, not tokens.

        For the reason :meth:`kl_mean_ci` gives: one hard passage raises a run of neighbouring
        tokens' divergences, and the tail is made of such runs, so resampling single tokens
        would treat one passage's dozen bad positions as a dozen independent draws and give too
        narrow an interval. Each resample draws windows with replacement, pools their tokens
        and takes the same (linear) percentile as ``kl_p99``: Chapter 7's
        :func:`~infer_lab.measure.stats.bootstrap_ci` with the window as the group. NaN with
        fewer than 2 windows, or when the per-token values were not kept.
        """
        if len(self.window_kls) < 2:
            return (math.nan, math.nan)
        return stats.bootstrap_ci(self.window_kls, ps=(99,), level=level, n_boot=n_boot,
                                  seed=seed)["p99"]

    @property
    def beyond_p99(self) -> int:
        """How many scored tokens lie past ``kl_p99`` (:func:`~infer_lab.measure.stats.beyond`):
        under :data:`~infer_lab.measure.stats.MIN_BEYOND` (10) it is the largest value or two,
        not a tail (Chapter 7's rule); 10,000 tokens give 100."""
        return stats.beyond(self.tokens, 99)

    @property
    def windows_beyond_p99(self) -> int | None:
        """How many windows the :attr:`beyond_p99` tokens come from: Chapter 7's count of events.

        One hard passage raises a run of neighbouring tokens, and a window is such a stretch of
        text, so tokens past the p99 from one window are one event, not several: the tail rests
        on this many independent observations (fewer than ``MIN_BEYOND``: a few passages, however
        many tokens). The tokens past it are the largest by rank, ties in text order, as
        :func:`~infer_lab.measure.stats.stall_events` takes them. None when the per-token values
        were not kept (a result read back from a file).
        """
        if not self.window_kls:
            return None
        ranked = sorted(((v, w) for w, kls in enumerate(self.window_kls) for v in kls),
                        key=lambda vw: vw[0])  # stable: ties stay in text order
        return len({w for _, w in ranked[len(ranked) - stats.beyond(len(ranked), 99):]})


class CachedReference:
    """A reference model whose logits are computed once per window and replayed after.

    Comparing many candidates one at a time (so that only one quantized copy of a model is in
    memory) would otherwise rerun the reference for each: this keeps its logits, keyed by the
    window's tokens (``[S, vocab]`` floats per window: budget ~200 MB per 1k tokens at a 49k
    vocabulary).
    """

    def __init__(self, model: LogitsFn) -> None:
        self.model = model
        self.device = getattr(model, "device", torch.device("cpu"))
        self.cache: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        key = tuple(ids.flatten().tolist())
        if key not in self.cache:
            self.cache[key] = self.model(ids).float()
        return self.cache[key]


def kl_per_token(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``KL(softmax(ref) || softmax(cand))`` per row of ``[T, vocab]`` logits, in fp64 (nats).

    fp64 because the mean KL of a good 8-bit format is ~1e-4 nats: fp32 softmax rounding over a
    49k vocabulary is of that order. Clamped at 0 (rounding can make a tiny value negative).
    """
    if ref_logits.shape != logits.shape:
        raise ValueError(f"logits shapes differ: {tuple(ref_logits.shape)} vs "
                         f"{tuple(logits.shape)}")
    lp = F.log_softmax(ref_logits.double(), dim=-1)
    lq = F.log_softmax(logits.double(), dim=-1)
    return (lp.exp() * (lp - lq)).sum(-1).clamp(min=0.0)


def _windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """``(start, end, first_scored)`` per window; every position 1..n-1 scored exactly once."""
    out, end = [], 0
    while end < n:
        new_end = min(end + stride, n) if end else min(window, n)
        out.append((max(0, new_end - window), new_end, max(end, 1)))
        end = new_end
    return out


def _check(ids: torch.Tensor, window: int, stride: int) -> None:
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    if not 0 < stride < window:  # a window's first scored token needs one token of context
        raise ValueError(f"stride must be in 1..window - 1 ({window - 1}), got {stride}")
    if ids.numel() < 2:
        raise ValueError("KL divergence needs a text of at least 2 tokens")


@torch.inference_mode()
def kl_divergence_many(reference: LogitsFn, candidates: Mapping[str, LogitsFn],
                       token_ids: Sequence[int] | torch.Tensor, window: int = 256,
                       stride: int | None = None) -> dict[str, KLResult]:
    """:class:`KLResult` per candidate, the reference run once per window for all of them."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    stride = window // 2 if stride is None else stride
    _check(ids, window, stride)
    if not candidates:
        raise ValueError("kl_divergence_many needs at least one candidate")
    device = getattr(reference, "device", ids.device)
    kls: dict[str, list[torch.Tensor]] = {name: [] for name in candidates}
    sums: dict[str, list[tuple[float, int]]] = {name: [] for name in candidates}
    nll: dict[str, float] = dict.fromkeys(candidates, 0.0)
    same: dict[str, int] = dict.fromkeys(candidates, 0)
    ref_nll, count = 0.0, 0
    for start, end, first in _windows(ids.numel(), window, stride):
        chunk = ids[start:end].to(device)
        keep = slice(first - start - 1, end - start - 1)  # logits predicting positions first..end-1
        targets = chunk[first - start:]
        ref = reference(chunk[None])[0, keep].float()
        ref_nll += float(F.cross_entropy(ref.double(), targets, reduction="sum"))
        ref_top = ref.argmax(-1)
        for name, cand in candidates.items():
            logits = cand(chunk[None])[0, keep].float()
            kls[name].append(kl_per_token(ref, logits).cpu())
            sums[name].append((float(kls[name][-1].double().sum()), kls[name][-1].numel()))
            nll[name] += float(F.cross_entropy(logits.double(), targets, reduction="sum"))
            same[name] += int((logits.argmax(-1) == ref_top).sum())
        count += targets.numel()
    out = {}
    for name in candidates:
        k = torch.cat(kls[name])
        out[name] = KLResult(
            kl_mean=float(k.mean()), kl_p99=float(torch.quantile(k, 0.99)),
            kl_max=float(k.max()), top1_agreement=same[name] / count,
            ppl=math.exp(nll[name] / count), ppl_ref=math.exp(ref_nll / count),
            tokens=count, window=window, stride=stride, window_sums=tuple(sums[name]),
            window_kls=tuple(tuple(w.tolist()) for w in kls[name]))
    return out


def kl_divergence(reference: LogitsFn, candidate: LogitsFn,
                  token_ids: Sequence[int] | torch.Tensor, window: int = 256,
                  stride: int | None = None) -> KLResult:
    """KL divergence of ``candidate``'s next-token distribution from ``reference``'s over a text.

    Sliding windows as in :func:`infer_lab.measure.quality.perplexity` (``stride`` new tokens
    scored per window of ``window``, default half of it); the first token is never scored.
    """
    return kl_divergence_many(reference, {"candidate": candidate}, token_ids, window,
                              stride)["candidate"]
