"""The batched greedy generators of Chapters 2 and 3, beside Chapter 1's ``generate_naive``.

They are baselines and proofs, not an engine: ``generate_cached`` runs a static batch through
the contiguous cache, ``generate_paged`` a batch through the paged cache with Chapter 3's block
manager. Both must produce, token for token, what ``generate_naive`` produces, which is how the
book shows that each cache is right. The memory and attention backends they drive live in
:mod:`infer_lab.cache`; the engine of Chapter 5 replaces these loops.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infer_lab.cache.block_pool import BlockManager
from infer_lab.cache.contiguous import ContiguousAttentionContext, ContiguousKVCache
from infer_lab.cache.paged import PagedAttentionContext, PagedKVCache, build_paged_batch
from infer_lab.model.generate import GenerationOutput, prepare_batch
from infer_lab.model.tokenizer import Tokenizer
from infer_lab.model.transformer import Transformer
from infer_lab.utils import cdiv

__all__ = ["default_num_blocks", "generate_cached", "generate_paged"]


@torch.inference_mode()
def generate_cached(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: Sequence[str | Sequence[int]],
    max_tokens: int = 32,
    ignore_eos: bool = False,
) -> list[GenerationOutput]:
    """Greedy continuations of a static batch with a contiguous KV cache.

    Prompts are right-padded to the longest; one prefill step fills the cache, then every decode
    step runs all ``B`` rows, one token each, at each row's own length. Rows that have finished
    keep being computed (their output is ignored) until the last one finishes: that is the
    static-batching cost Chapter 5 removes.
    """
    cfg = model.config
    ids, budgets, stops = prepare_batch(model, tokenizer, prompts, max_tokens, ignore_eos)
    batch, lens = len(ids), [len(p) for p in ids]
    cache = ContiguousKVCache(cfg, batch, max(lens) + max_tokens, model.device, model.dtype)
    device = model.device

    # Prefill: the padded [B, S] prompt block, logits at each row's last real token.
    width = max(lens)
    padded = torch.zeros(batch, width, dtype=torch.long, device=device)
    for b, p in enumerate(ids):
        padded[b, : len(p)] = torch.tensor(p, device=device)
    last = torch.tensor([b * width + n - 1 for b, n in enumerate(lens)], device=device)
    ctx = ContiguousAttentionContext(cache, torch.zeros(batch, dtype=torch.long), width, last)
    logits = model(padded.flatten(), ctx.positions.flatten(), ctx)

    outs: list[list[int]] = [[] for _ in ids]
    done = [False] * batch
    while True:
        tokens = logits.argmax(-1).tolist()
        for b, t in enumerate(tokens):
            if done[b]:
                continue
            outs[b].append(t)
            done[b] = t in stops or len(outs[b]) >= budgets[b]
            if not done[b]:
                lens[b] += 1  # the new token will be written at position lens[b] - 1
        if all(done):
            break
        # Decode: row b feeds its last token at position lens[b] - 1; finished rows recompute
        # a dummy token in place (they no longer advance).
        feed = torch.tensor([o[-1] for o in outs], device=device)
        start = torch.tensor([n - 1 for n in lens])
        ctx = ContiguousAttentionContext(cache, start, 1)
        logits = model(feed, ctx.positions.flatten(), ctx)

    return [
        GenerationOutput(
            tokenizer.decode(o), o, p, "stop" if o and o[-1] in stops else "length"
        )
        for o, p in zip(outs, ids, strict=True)
    ]


def default_num_blocks(prompt_lens: Sequence[int], budgets: Sequence[int], block_size: int) -> int:
    """Enough blocks for every sequence at its longest (each needs prompt + budget - 1 slots)."""
    return sum(cdiv(p + n - 1, block_size) for p, n in zip(prompt_lens, budgets, strict=True))


@torch.inference_mode()
def generate_paged(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: Sequence[str | Sequence[int]],
    max_tokens: int = 32,
    block_size: int = 16,
    num_blocks: int | None = None,
    ignore_eos: bool = False,
    *,
    block_manager: BlockManager | None = None,
) -> list[GenerationOutput]:
    """Greedy continuations through the paged cache: the proof that the paged path is right.

    One flattened prefill step for all prompts, then decode steps of one token per unfinished
    sequence; a sequence's blocks go back to the pool as soon as it finishes. There is no
    preemption here (that is the scheduler's job): too few blocks raises ``NoFreeBlocksError``.
    Pass ``block_manager`` to watch the pool (its block size and pool size are then used).
    """
    cfg, device = model.config, model.device
    ids, budgets, stops = prepare_batch(model, tokenizer, prompts, max_tokens, ignore_eos)
    if block_manager is None:
        if num_blocks is None:
            num_blocks = default_num_blocks([len(p) for p in ids], budgets, block_size)
        block_manager = BlockManager(num_blocks, block_size)
    mgr = block_manager
    cache = PagedKVCache(cfg, mgr.pool.num_blocks, mgr.block_size, device, model.dtype)

    def step(chunks: dict[int, list[int]]) -> dict[int, int]:
        """Run one flattened step; ``chunks`` maps a sequence to its new tokens (already
        reserved in the block manager). Returns each sequence's greedy next token."""
        batch = build_paged_batch(
            [(t, mgr.num_tokens(s) - len(t), mgr.block_table(s)) for s, t in chunks.items()],
            mgr.block_size, mgr.pool.num_blocks, device,
        )
        logits = model(batch.input_ids, batch.positions, PagedAttentionContext(cache, batch))
        return dict(zip(chunks, logits.argmax(-1).tolist(), strict=True))

    for s, p in enumerate(ids):
        mgr.allocate_slots(s, len(p))
    outs: list[list[int]] = [[] for _ in ids]
    next_tokens = step(dict(enumerate(ids)))
    while next_tokens:
        feed: dict[int, list[int]] = {}
        for s, t in next_tokens.items():
            outs[s].append(t)
            if t in stops or len(outs[s]) >= budgets[s]:
                mgr.free(s)
            else:
                cache.copy_blocks(mgr.allocate_slots(s, 1))
                feed[s] = [t]
        next_tokens = step(feed) if feed else {}

    return [
        GenerationOutput(tokenizer.decode(o), o, p, "stop" if o and o[-1] in stops else "length")
        for o, p in zip(outs, ids, strict=True)
    ]
