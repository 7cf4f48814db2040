"""Sampling for one step's sequences, with each request's failure kept to itself.

The :class:`~infer_lab.engine.sampler.Sampler` turns a batch of logits into tokens in one call.
Around it, a step needs a little more: the constrained rows masked by their grammar, each row's
token history for its penalties, the log-probabilities a request asked for, and isolation — if
the batched call raises, the rows are sampled one by one so that only the bad row's request
fails. What comes out is :class:`SampledTokens`: for each sequence, the tokens it keeps this step
(one, or a run of accepted proposals with speculative decoding) and the requests that failed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from infer_lab.engine.outputs import RequestFailure, TokenLogprobs
from infer_lab.engine.sampler import Sampler
from infer_lab.engine.sequence import Request, Sequence
from infer_lab.engine.structured import StructuredOutputs

log = logging.getLogger(__name__)

Run = list[tuple[int, TokenLogprobs | None]]  # the tokens a sequence keeps, with log-probs


@dataclass
class SampledTokens:
    """What a step produced: ``runs[i]`` for ``seqs[i]``, and the requests that failed alone."""

    seqs: list[Sequence]
    runs: list[Run] = field(default_factory=list)
    failed: dict[Request, RequestFailure] = field(default_factory=dict)

    def fail(self, request: Request, stage: str, error: BaseException) -> None:
        """Fail ``request`` alone (the first failure is the one reported)."""
        if request not in self.failed:
            log.warning("request %s failed alone in %s", request.request_id, stage,
                        exc_info=error)
            self.failed[request] = RequestFailure.from_exception(stage, error)


class StepSampler:
    """One token per logits row, for the sequences the rows belong to."""

    def __init__(self, sampler: Sampler, structured: StructuredOutputs) -> None:
        self.sampler, self.structured = sampler, structured

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampledTokens:
        """The step without speculation: one token per sequence, with its log-probs."""
        out = SampledTokens(seqs)
        tokens = self.tokens(logits, seqs, out) if seqs else []
        logprobs = self.logprobs(logits, seqs, tokens, out)
        out.runs = [[(t, lp)] for t, lp in zip(tokens, logprobs)]
        return out

    def tokens(self, logits: torch.Tensor, rows: list[Sequence], out: SampledTokens,
               prefixes: list[list[int]] | None = None,
               generators: list[torch.Generator | None] | None = None) -> list[int]:
        """One token per row; if the batched call raises, row by row, failing only bad rows.

        ``prefixes`` (speculation): the proposals before each row's position, which count as
        output for the penalties of that row. ``generators``: each row's noise source (default:
        its sequence's; a draft tree gives its nodes one per depth).
        """
        params = [s.request.params for s in rows]
        gens = [s.generator for s in rows] if generators is None else generators
        prompts = outs = None
        if any(p.has_penalties for p in params):
            prompts = [s.token_ids[: s.num_prompt_tokens] for s in rows]
            outs = [s.output_token_ids for s in rows]
            if prefixes is not None:
                outs = [o + p for o, p in zip(outs, prefixes)]
        logits = self.structured.mask_logits(logits, rows)  # constrained rows only
        try:
            return self.sampler(logits, params, gens, prompts, outs)
        except Exception:
            pass
        tokens = []
        for i, seq in enumerate(rows):
            one = slice(i, i + 1)
            try:
                tokens.append(self.sampler(logits[one], params[one], gens[one],
                                           prompts and prompts[one], outs and outs[one])[0])
            except Exception as e:
                out.fail(seq.request, "sampling", e)
                tokens.append(-1)
        return tokens

    def logprobs(self, logits: torch.Tensor, rows: list[Sequence], tokens: list[int],
                 out: SampledTokens) -> list[TokenLogprobs | None]:
        """Log-probabilities of the raw logits for the rows whose request asked (others: None)."""
        result: list[TokenLogprobs | None] = [None] * len(rows)
        asked = [i for i, s in enumerate(rows)
                 if s.request.params.logprobs is not None and s.request not in out.failed]
        if not asked:
            return result
        try:
            raw = torch.log_softmax(logits[asked].float(), dim=-1)
            k = min(max(rows[i].request.params.logprobs or 0 for i in asked), raw.shape[1])
            chosen = raw.gather(1, torch.tensor([[tokens[i]] for i in asked],
                                                device=raw.device)).squeeze(1).tolist()
            top = raw.topk(k, dim=-1) if k else (raw[:, :0], raw[:, :0].long())
            top_lp, top_ids = top[0].tolist(), top[1].tolist()
        except Exception as e:
            for i in asked:
                out.fail(rows[i].request, "log-probabilities", e)
            return result
        for r, i in enumerate(asked):
            want = rows[i].request.params.logprobs
            result[i] = TokenLogprobs(tokens[i], chosen[r],
                                      list(zip(top_ids[r][:want], top_lp[r][:want])))
        return result
