"""Turn one step's logits into tokens, each row under its own request's settings, in one call.

Rows may differ in temperature, top-k, top-p and seed. The work is done on the whole batch at
once; the only per-row loop is drawing noise for rows with their own seed.

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
    """Batched greedy / temperature / top-k / top-p sampling with per-row generators."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator  # for rows without a seed of their own

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int]:
        """One token per row of ``logits`` ``[B, vocab]``."""
        if logits.shape[0] != len(params):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(params)} requests")
        if all(p.temperature == 0 for p in params):
            return logits.argmax(-1).tolist()
        logits = logits.float()
        device = logits.device
        greedy = torch.tensor([p.temperature == 0 for p in params], device=device)
        temps = torch.tensor([p.temperature or 1.0 for p in params], device=device)
        scaled = logits / temps[:, None]
        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        top_p = [p.top_p for p in params]
        if any(top_k) or any(tp < 1 for tp in top_p):
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        probs = torch.softmax(scaled, dim=-1)
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


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]
) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k / top-p set (0 / 1.0: no limit)."""
    vocab = logits.shape[1]
    k = torch.tensor([t if t > 0 else vocab for t in top_k], device=logits.device)
    p = torch.tensor(list(top_p), device=logits.device, dtype=logits.dtype)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    drop = rank[None, :] >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)  # top-k first
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above this one
    drop |= before >= p[:, None]  # the top token always stays (its "before" is 0)
    mask = torch.empty_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(mask, float("-inf"))
