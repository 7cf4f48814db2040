"""Shared test helpers: tiny random-weight checkpoints made with transformers, and greedy checks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

VOCAB = 384
CORPUS = [
    "In the beginning was the word, and the word was with the model.",
    "Prefill is compute-bound; decode is memory-bandwidth-bound.",
    "café naïve résumé — 日本語の文章 🙂🚀",
    "The quick brown fox jumps over the lazy dog. 0123456789",
] * 20

# Small configs, one per supported family, each switching on the family's peculiarity.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama3": dict(
        model_type="llama",
        tie_word_embeddings=True,
        rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=32,
        ),
    ),
    "llama2_bias": dict(model_type="llama", attention_bias=True, mlp_bias=True),
    "mistral_window": dict(model_type="mistral", sliding_window=8),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", head_dim=32),
}
BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
)


def save_tokenizer(path: Path) -> None:
    """Train a byte-level BPE on a tiny corpus and save it in Hugging Face layout."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    fast.save_pretrained(path)


def make_checkpoint(path: Path, family: str, seed: int = 0, **overrides: Any) -> Any:
    """Save a random-weight transformers model of ``family`` (and a tokenizer) to ``path``.

    Weights are redrawn with a large spread (and norms and biases moved off their 1/0 init) so
    that the logits are well separated and a wrongly loaded tensor cannot go unnoticed.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {**BASE, **FAMILIES[family], **overrides}
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.3 if p.dim() > 1 else 0.1)
    model.save_pretrained(path)
    save_tokenizer(path)
    return model


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or of the shorter length), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_greedy_equal(
    ours: Sequence[int],
    reference: Sequence[int],
    logits_at: Callable[[list[int]], torch.Tensor],
    tol: float = 1e-4,
) -> None:
    """Demand equal greedy tokens; a difference is accepted only at a near-tie (top-2 gap <= tol).

    ``logits_at(prefix)`` returns the next-token logits after the generated ``prefix``. After an
    accepted near-tie the two continuations legitimately differ, so the comparison stops there.
    """
    i = first_divergence(ours, reference)
    if i is None:
        return
    assert i < min(len(ours), len(reference)), f"lengths differ: {len(ours)} vs {len(reference)}"
    top2 = logits_at(list(ours[:i])).double().topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap <= tol, (
        f"token {i} differs ({ours[i]} vs {reference[i]}) and is no near-tie (top-2 gap {gap:.2e})"
    )
