"""Turn one step's logits into tokens, each row under its own request's settings, in one call.

Rows may differ in temperature, top-k, top-p, min-p, penalties, logit bias, min_tokens and seed.
The work is done on the whole batch at once; the only per-row loops are drawing noise for rows
with their own seed and gathering the token histories (and bias tables) of rows that edit their
logits (rows without pay nothing for either, and min-p costs only the rows that set it).

Sampling uses the *exponential race*: with ``E_i ~ Exp(1)`` independent, ``argmax_i p_i / E_i``
is a sample from ``p``. Its appeal here is that the randomness (``E``) is drawn separately from
the probabilities, one vector per row from that row's own generator. A seeded request thus sees
the same noise whatever else is in the batch, and the top-k / top-p masks (computed on sorted
rows, then scattered back to vocabulary order) cannot change which noise a token gets.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infer_lab.engine.sampling_params import SamplingParams


class Sampler:
    """Batched greedy / temperature / top-k / top-p / min-p sampling with penalties, logit
    bias, min_tokens and per-row seeds."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator  # for rows without a seed of their own

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        prompt_ids: Sequence[Sequence[int]] | None = None,
        output_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[int]:
        """One token per row of ``logits`` ``[B, vocab]`` (never modified).

        ``prompt_ids`` / ``output_ids`` (each row's prompt and generated tokens) are needed only
        when some row has a penalty, a logit bias or ``min_tokens``.
        """
        if logits.shape[0] != len(params):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(params)} requests")
        if any(p.has_penalties for p in params):
            if prompt_ids is None or output_ids is None:
                raise ValueError("penalties, logit_bias and min_tokens need each row's prompt "
                                 "and output token ids")
            logits = apply_penalties(logits, params, prompt_ids, output_ids)
        if all(p.greedy for p in params):
            return logits.argmax(-1).tolist()
        logits = logits.float()
        device = logits.device
        greedy = torch.tensor([p.greedy for p in params], device=device)
        probs = sampling_probs(logits, params)
        noise = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            rows = torch.empty((len(unseeded), probs.shape[1]), device=device)
            noise[unseeded] = rows.exponential_(generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        sampled = (probs / noise).argmax(-1)
        return torch.where(greedy, logits.argmax(-1), sampled).tolist()


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: softmax after temperature, top-k, top-p and
    min-p (float32; penalties, if any, already in ``logits``). A greedy row gets temperature 1.

    The sampler draws from it, and speculative decoding's rejection rule reads it as p (the
    target) and as q (a sampled draft), so the three can never disagree about a row.
    """
    logits = logits.float()
    device, vocab = logits.device, logits.shape[1]
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device)
    scaled = logits / temps[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]  # clamp to the vocab
    top_p = [p.top_p for p in params]
    if any(top_k) or any(tp < 1 for tp in top_p):
        scaled = apply_top_k_top_p(scaled, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)
    rows = [i for i, p in enumerate(params) if p.min_p > 0]
    if rows:
        probs[rows] = apply_min_p(probs[rows], [params[i].min_p for i in rows])
    return probs


def apply_min_p(probs: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    """Renormalized ``probs`` without the tokens less likely than ``min_p`` times the row's most
    likely token (vLLM's and llama.cpp's min-p; the most likely token always stays)."""
    floor = torch.tensor(list(min_p), device=probs.device)[:, None] * probs.amax(-1, True)
    kept = probs.masked_fill(probs < floor, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """A float32 copy of ``logits`` with each row's edits applied (rows without: unchanged).

    ``logit_bias`` first (OpenAI adds it to the raw logits), then the repetition penalty (HF,
    vLLM): a token seen in the prompt or the output has its logit divided by the penalty if
    positive, multiplied if not. Then OpenAI's: ``frequency_penalty`` times the token's count in
    the output plus ``presence_penalty`` if it occurs there at all, subtracted. Last,
    ``min_tokens``: while a row has fewer output tokens than that, its stop tokens are -inf.
    """
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    out = logits.float().clone()
    if not rows:
        return out
    _apply_logit_bias(out, params)
    _apply_min_tokens(out, params, output_ids)
    rows = [i for i in rows if params[i].presence_penalty or params[i].frequency_penalty
            or params[i].repetition_penalty != 1.0]
    if not rows:
        return out
    device, vocab = out.device, out.shape[1]
    counts = torch.zeros(len(rows), vocab, device=device)
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    for r, i in enumerate(rows):
        outs = torch.as_tensor(list(output_ids[i]), dtype=torch.long, device=device)
        counts[r].index_add_(0, outs, torch.ones(len(outs), device=device))
        seen[r, torch.as_tensor(list(prompt_ids[i]), dtype=torch.long, device=device)] = True
    seen |= counts > 0

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(params[i], name) for i in rows], device=device)[:, None]

    sub = out[rows]
    rep = column("repetition_penalty")
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0)
    out[rows] = sub
    return out


def _apply_logit_bias(out: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Add each row's ``logit_bias`` in place: one indexed add for the whole batch."""
    rows, cols, vals = [], [], []
    for i, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            rows.append(i)
            cols.append(token)
            vals.append(bias)
    if rows:
        index = (torch.tensor(rows, device=out.device), torch.tensor(cols, device=out.device))
        out.index_put_(index, torch.tensor(vals, device=out.device), accumulate=True)


def _apply_min_tokens(out: torch.Tensor, params: Sequence[SamplingParams],
                      output_ids: Sequence[Sequence[int]]) -> None:
    """Set to -inf, in place, the stop tokens of rows that have not yet reached ``min_tokens``
    (vLLM's ``MinTokensLogitsProcessor``)."""
    rows, cols = [], []
    for i, p in enumerate(params):
        if p.min_tokens and len(output_ids[i]) < p.min_tokens:
            for token in p.all_stop_token_ids:
                rows.append(i)
                cols.append(token)
    if rows:
        out[torch.tensor(rows, device=out.device), torch.tensor(cols, device=out.device)] = (
            float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]
) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k / top-p set (0 / 1.0: no limit).

    The most likely token always stays, so a row never loses every token, even for a ``top_p``
    that is 0 in float32.
    """
    vocab = logits.shape[1]
    k = torch.tensor([t if 0 < t < vocab else vocab for t in top_k], device=logits.device)
    p = torch.tensor(list(top_p), device=logits.device, dtype=logits.dtype)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    drop = rank[None, :] >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)  # top-k first
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above this one
    drop |= before >= p[:, None]
    drop[:, 0] = False
    mask = torch.empty_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(mask, float("-inf"))
