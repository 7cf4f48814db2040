"""Shared by the engine tests: a tiny model, a varied prompt set, and the leak check."""

from __future__ import annotations

import random

import torch

import infer_lab as il
from infer_lab.engine import LLMEngine
from tests.helpers import assert_greedy_equal, make_checkpoint


def tiny_model(tmp_path_factory, family: str = "llama3", **overrides):
    path = tmp_path_factory.mktemp(f"engine-{family}")
    make_checkpoint(path, family, max_position_embeddings=256, **overrides)
    return il.load(path, device="cpu", dtype=torch.float32)


def varied_prompts(n: int, seed: int = 0, vocab: int = 384) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids, max_tokens) pairs: prompts of 1-120 tokens, outputs of 1-24."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.choice([1, 2, 3, 5, 8, 15, 16, 17, 31, 33, 48, 64, 97, 120])
        prompt = [rng.randrange(3, vocab) for _ in range(length)]
        out.append((prompt, 1 + (i * 7) % 24))
    return out


def logits_after(model, prompt: list[int]):
    def at(prefix: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([prompt + prefix]), last_only=True)[0, -1]
    return at


def assert_matches_naive(model, prompts, outputs, references) -> None:
    for (prompt, budget), out, ref in zip(prompts, outputs, references, strict=True):
        assert len(out.token_ids) == len(ref) or out.finish_reason == "stop"
        assert_greedy_equal(out.token_ids, ref, logits_after(model, prompt))
        assert len(out.token_ids) <= budget


def assert_no_leak(engine: LLMEngine) -> None:
    """Every KV block is back in the pool and no request is left anywhere."""
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert len(engine.scheduler._free_slots) == engine.config.max_num_seqs
    assert engine.scheduler._reserved_slots == 0
