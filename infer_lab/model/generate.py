"""The reference generator of Chapter 1: greedy decode with no cache at all.

Every new token re-runs the model over the whole prefix. It is slow on purpose — it is what every
faster path in the book is checked against, token for token.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from infer_lab.model.tokenizer import Tokenizer
from infer_lab.model.transformer import Transformer


@dataclass
class GenerationOutput:
    """A continuation: only the generated part, not the prompt."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (an end-of-sequence token) or "length"


def encode_prompt(
    tokenizer: Tokenizer, prompt: str | Sequence[int], max_context: int
) -> list[int]:
    """Token ids of ``prompt``; raises if it is empty or does not fit the model's context."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not ids:
        raise ValueError("the prompt is empty (no tokens)")
    if len(ids) >= max_context:
        raise ValueError(
            f"the prompt has {len(ids)} tokens but the model's context is {max_context} tokens, "
            "leaving no room to generate"
        )
    return ids


def stop_token_ids(model: Transformer, tokenizer: Tokenizer) -> set[int]:
    """End-of-sequence ids from the tokenizer and the model config together."""
    ids = set(tokenizer.eos_token_ids)
    eos = model.config.eos_token_id
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def prepare_batch(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: Sequence[str | Sequence[int]],
    max_tokens: int,
    ignore_eos: bool,
) -> tuple[list[list[int]], list[int], set[int]]:
    """Checked prompt ids, each prompt's token budget, and the stop ids, for a batch generator.

    A prompt's budget is ``max_tokens``, or less where the context runs out (the rule of
    :func:`generate_naive`), so every batched generator stops where the naive one does.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty list of prompts")
    context = model.config.max_position_embeddings
    ids = [encode_prompt(tokenizer, p, context) for p in prompts]
    budgets = [min(max_tokens, context - len(p)) for p in ids]
    stops = set() if ignore_eos else stop_token_ids(model, tokenizer)
    return ids, budgets, stops


def stream_naive(
    model: Transformer,
    prompt_ids: Sequence[int],
    max_tokens: int,
    stops: set[int],
    temperature: float = 0.0,
    seed: int | None = None,
) -> Iterator[int]:
    """Yield tokens one by one, re-running the whole prefix each time (no cache).

    ``temperature`` 0 is greedy; above 0 it samples from ``softmax(logits / temperature)``.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    gen = torch.Generator(device=model.device)
    if seed is not None:
        gen.manual_seed(seed)
    max_context = model.config.max_position_embeddings
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    for _ in range(max_tokens):
        if ids.shape[1] >= max_context:
            return
        with torch.inference_mode():
            logits = model(ids, last_only=True)[0, -1].float()
        if temperature == 0:
            token = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=gen))
        yield token
        if token in stops:
            return
        ids = torch.cat([ids, ids.new_tensor([[token]])], dim=1)


def generate_naive(
    model: Transformer,
    tokenizer: Tokenizer,
    prompt: str | Sequence[int],
    max_tokens: int = 32,
    *,
    ignore_eos: bool = False,
) -> GenerationOutput:
    """Greedy continuation of ``prompt``, recomputing the whole prefix for every token."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    prompt_ids = encode_prompt(tokenizer, prompt, model.config.max_position_embeddings)
    stops = set() if ignore_eos else stop_token_ids(model, tokenizer)
    out = list(stream_naive(model, prompt_ids, max_tokens, stops))
    finish = "stop" if out and out[-1] in stops else "length"
    return GenerationOutput(tokenizer.decode(out), out, prompt_ids, finish)
