"""Prompt log-probabilities (vLLM's ``prompt_logprobs``; OpenAI's ``echo`` with ``logprobs``).

An evaluation harness scores a text by asking for the log-probability the model gives each of
its tokens after the ones before it. Those come from the prefill: position ``p`` of the prompt
predicts token ``p + 1``. A normal step computes logits only at the last position of a chunk
(the one that samples); a request that asks for prompt log-probabilities gets a logits row at
*every* position of its prompt chunks, and each costs a full-vocabulary ``log_softmax``: that is
what scoring costs, and only such requests pay it.

It works with chunked prefill (each chunk fills its positions of the list, in any number of
steps) and with preemption (a recomputed chunk writes the same values again, or is skipped once
the list is full). Prefix caching keeps K/V, not logits: a request asking for prompt
log-probabilities does not read the prefix cache (it recomputes its whole prompt, as vLLM v1
does), so no position is ever missing or taken from another request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer_lab.engine.outputs import TokenLogprobs
from infer_lab.engine.sequence import Sequence


@dataclass
class PromptChunk:
    """A chunk whose every position gets a logits row: ``rows`` rows from ``first_row`` of the
    step's logits, for positions ``start ...``; the last is the sampling row if ``complete``."""

    seq: Sequence
    start: int
    first_row: int
    rows: int
    complete: bool


def wants_prompt_logprobs(seq: Sequence, start: int) -> bool:
    """Whether the chunk of ``seq`` starting at ``start`` holds prompt positions whose
    log-probabilities its request asked for and has not got yet."""
    request = seq.request
    if request.params.prompt_logprobs is None or start >= seq.num_prompt_tokens - 1:
        return False
    have = request.prompt_logprobs
    return have is None or any(e is None for e in have[start + 1 :])


def logits_rows(lens: list[int], wants: list[bool], spec_rows: dict[int, int],
                prompt: dict[int, Sequence], starts: list[int],
                device: torch.device) -> tuple[torch.Tensor, list[PromptChunk]]:
    """The rows of the step's hidden states that get logits: every position of a chunk in
    ``prompt``, else the last token of a wanted chunk and each proposal before it
    (``spec_rows``); and where the prompt chunks' rows are."""
    idx: list[int] = []
    chunks: list[PromptChunk] = []
    end = 0
    for b, n in enumerate(lens):
        end += n
        if b in prompt:
            chunks.append(PromptChunk(prompt[b], starts[b], len(idx), n, wants[b]))
            idx += range(end - n, end)
        elif wants[b]:
            k = spec_rows.get(b, 0)
            idx += range(end - 1 - k, end)
    return torch.tensor(idx, dtype=torch.long, device=device), chunks


def record_prompt_logprobs(logits: torch.Tensor, chunks: list[PromptChunk]) -> torch.Tensor:
    """Write each chunk's prompt log-probabilities into its request's ``prompt_logprobs`` and
    return only the rows the sampler reads (the last of each complete chunk, every row of the
    other chunks), in order."""
    keep: list[int] = []
    at = {c.first_row: c for c in chunks}
    r = 0
    while r < logits.shape[0]:
        chunk = at.get(r)
        if chunk is None:
            keep.append(r)
            r += 1
            continue
        _record(logits[r : r + chunk.rows], chunk)
        if chunk.complete:
            keep.append(r + chunk.rows - 1)
        r += chunk.rows
    return logits[keep]


def _record(rows: torch.Tensor, chunk: PromptChunk) -> None:
    """Log-probabilities of the prompt tokens these rows predict (position p predicts p + 1)."""
    seq, start = chunk.seq, chunk.start
    num_prompt = seq.num_prompt_tokens
    count = min(chunk.rows, num_prompt - 1 - start)  # rows that predict a prompt token
    if count <= 0:
        return
    request = seq.request
    if request.prompt_logprobs is None:
        request.prompt_logprobs = [None] * num_prompt
    targets = torch.tensor(request.prompt_token_ids[start + 1 : start + 1 + count],
                           device=rows.device)
    logprobs = torch.log_softmax(rows[:count].float(), dim=-1)
    chosen_t = logprobs.gather(1, targets[:, None])
    ranks = ((logprobs > chosen_t).sum(1) + 1).tolist()  # vLLM reports each token's rank
    chosen = chosen_t.squeeze(1).tolist()
    k = min(request.params.prompt_logprobs or 0, logprobs.shape[1])
    top = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], targets[:, None][:, :0])
    top_lp, top_ids = top[0].tolist(), top[1].tolist()
    ids = targets.tolist()
    for j in range(count):
        request.prompt_logprobs[start + 1 + j] = TokenLogprobs(
            ids[j], chosen[j], list(zip(top_ids[j], top_lp[j])), ranks[j])
