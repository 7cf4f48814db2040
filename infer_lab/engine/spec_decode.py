"""Speculative decoding as one object the engine calls three times a step.

:meth:`SpeculativeDecoder.propose` fills the lookahead slots the scheduler granted with guesses
(:mod:`~infer_lab.engine.speculative` has the proposers); the forward then scores each
sequence's last real token and its guesses in one go; :meth:`~SpeculativeDecoder.verify` turns
those logits rows into the run of tokens each sequence keeps; :meth:`~SpeculativeDecoder.rollback`
forgets the guesses. (The scheduler, which owns the KV accounting, gives the rejected guesses'
slots back when it retires the step.)

Guesses are a :class:`DraftTree`: node tokens in order, each with its parent (``-1``: the
sequence's last real token). The proposers here make chains (every node's parent is the node
before it); verification walks any tree, keeping the longest path whose every token is the one
the target itself samples at its parent. Scoring a tree with more than one branch needs a tree
attention mask in the forward, which the runner does not build yet: only chains reach it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from infer_lab.engine import speculative
from infer_lab.engine.outputs import SpecDecodeCounts, TokenLogprobs
from infer_lab.engine.sampler import apply_penalties, sampling_probs
from infer_lab.engine.scheduler import Scheduler, SchedulerOutput
from infer_lab.engine.sequence import Sequence
from infer_lab.engine.speculative import SpeculativeConfig, make_proposer
from infer_lab.engine.step_sampler import Run, SampledTokens, StepSampler


@dataclass(frozen=True)
class DraftTree:
    """Proposed tokens as a tree: ``parents[j]`` is node ``j``'s parent (``-1``: the root, the
    sequence's last real token); parents come before their children."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    @classmethod
    def chain(cls, tokens: list[int]) -> DraftTree:
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def accepted_path(self, target: list[int]) -> list[int]:
        """The target's tokens along the longest path it agrees with, plus its own next one.

        ``target[0]`` is the target's token at the root, ``target[j + 1]`` at node ``j``. From
        the root, step to the child whose token is the target's there; stop where none is.
        """
        kept, at = [target[0]], -1
        while True:
            child = next((j for j, p in enumerate(self.parents)
                          if p == at and self.tokens[j] == kept[-1]), None)
            if child is None:
                return kept
            at = child
            kept.append(target[child + 1])


class SpeculativeDecoder:
    """Proposals, their verification in the target's forward, and the counts."""

    def __init__(self, spec: dict[str, Any] | SpeculativeConfig, model: Any, config: Any,
                 step_sampler: StepSampler, scheduler: Scheduler) -> None:
        self.cfg = SpeculativeConfig.parse(spec)
        self.proposer = make_proposer(self.cfg, model, config)
        self.step_sampler, self.scheduler = step_sampler, scheduler
        self.device, self.vocab = model.device, model.config.vocab_size
        self.counts = SpecDecodeCounts()

    def num_lookahead(self) -> int:
        """Proposals per sequence this step: k, or 0 above ``disable_by_batch_size``."""
        limit, sched = self.cfg.disable_by_batch_size, self.scheduler
        if limit is not None and sched.num_running + sched.num_waiting >= limit:
            return 0
        return self.cfg.num_speculative_tokens

    # ------------------------------------------------------------------ propose
    def propose(self, out: SchedulerOutput) -> None:
        """Fill the lookahead slots the scheduler granted; slots left empty go back at once."""
        ks = [s.spec_slots for s in out.seqs]
        if not any(ks):
            return
        drafts = self.proposer.propose(out.seqs, ks, out)
        for i, (seq, k, draft) in enumerate(zip(out.seqs, ks, drafts)):
            if not k:
                continue
            if self.step_sampler.structured.is_attached(seq):
                draft = []  # constrained: proposals are not checked against the grammar
            seq.spec_token_ids = draft[:k]
            seq.spec_probs = seq.spec_probs[:k] if draft and seq.spec_probs else []
            self.scheduler.return_lookahead(out, i, len(seq.spec_token_ids))

    # ------------------------------------------------------------------ verify
    def verify(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampledTokens:
        """The run each sequence keeps, from ``1 + len(proposals)`` logits rows per sequence.

        Rows of deterministic proposals are sampled as without speculation, and the run is the
        accepted path (:meth:`DraftTree.accepted_path`). The rows of a sequence whose draft
        *sampled* its guesses (``spec_probs`` holds q) get the rejection rule instead
        (:func:`~infer_lab.engine.speculative.verify_sampled`).
        """
        out = SampledTokens(seqs)
        rows, prefixes, states = self._rows(seqs)
        tokens = [0] * len(rows)
        plain = [i for i, s in enumerate(rows) if not s.spec_probs]
        if len(plain) == len(rows):
            tokens = self.step_sampler.tokens(logits, rows, out, prefixes)
        elif plain:
            picked = self.step_sampler.tokens(logits[plain], [rows[i] for i in plain], out,
                                              [prefixes[i] for i in plain])
            for i, t in zip(plain, picked):
                tokens[i] = t
        verified = self._verify_sampled(logits, rows, prefixes, tokens, out)
        logprobs = self.step_sampler.logprobs(logits, rows, tokens, out)
        out.runs = self._runs(seqs, tokens, logprobs, states, verified)
        return out

    def _rows(self, seqs: list[Sequence]):
        """One row per position to score: each sequence's last token and its proposals; the
        proposals before each row; the generator state of seeded rows, to rewind."""
        rows, prefixes, states = [], [], {}
        for seq in seqs:
            spec = seq.spec_token_ids
            for j in range(len(spec) + 1):
                rows.append(seq)
                prefixes.append(spec[:j])
            if (spec and not seq.spec_probs and seq.generator is not None
                    and not seq.request.params.greedy):
                states[seq] = seq.generator.get_state()  # rewound once we know what is kept
        return rows, prefixes, states

    def _verify_sampled(self, logits: torch.Tensor, rows: list[Sequence],
                        prefixes: list[list[int]], tokens: list[int],
                        out: SampledTokens) -> dict[Sequence, list[int]]:
        """The rejection rule for sampled drafts: their rows' tokens (filled in ``tokens``) and
        the run each keeps. p is what the request samples from there: penalties counting the
        guesses before each row, then temperature, top-k, top-p."""
        at = [i for i, s in enumerate(rows) if s.spec_probs]
        if not at:
            return {}
        seqs = [rows[i] for i in at]
        try:
            sub, params = logits[at], [s.request.params for s in seqs]
            if any(p.has_penalties for p in params):
                sub = apply_penalties(
                    sub, params, [s.token_ids[: s.num_prompt_tokens] for s in seqs],
                    [s.output_token_ids + prefixes[i] for s, i in zip(seqs, at)])
            probs = sampling_probs(sub, params)
        except Exception as e:
            for seq in seqs:
                out.fail(seq.request, "sampling", e)
            return {s: [0] for s in seqs}
        verified: dict[Sequence, list[int]] = {}
        r = 0
        while r < len(at):
            seq = seqs[r]
            width = len(seq.spec_token_ids) + 1
            try:
                run = speculative.verify_sampled(
                    probs[r : r + width], torch.stack(seq.spec_probs), seq.spec_token_ids,
                    seq.generator or self.step_sampler.sampler.generator)
            except Exception as e:
                out.fail(seq.request, "sampling", e)
                run = [0]
            verified[seq] = run
            for j, t in enumerate(run):
                tokens[at[r + j]] = t
            r += width
        return verified

    def _runs(self, seqs: list[Sequence], tokens: list[int],
              logprobs: list[TokenLogprobs | None], states: dict,
              verified: dict[Sequence, list[int]]) -> list[Run]:
        """Per sequence, the tokens kept (with their log-probs), and the counts updated."""
        runs, r = [], 0
        for seq in seqs:
            spec = seq.spec_token_ids
            width = len(spec) + 1
            kept = verified.get(seq) or DraftTree.chain(spec).accepted_path(tokens[r : r + width])
            runs.append(list(zip(kept, logprobs[r : r + len(kept)])))
            r += width
            if not spec:
                continue
            if seq in states:  # as many draws as tokens kept, as without speculation
                seq.generator.set_state(states[seq])
                for _ in kept:
                    torch.empty(self.vocab, device=self.device).exponential_(
                        generator=seq.generator)
            seq.spec_counts.add(len(spec), len(kept) - 1)
            self.counts.add(len(spec), len(kept) - 1)
        return runs

    # ------------------------------------------------------------------ rollback
    def rollback(self, out: SchedulerOutput) -> None:
        """Forget this step's proposals; a draft model's cache is valid only up to the tokens
        whose K/V the target computed."""
        for seq in out.seqs:
            if not seq.spec_slots:
                continue
            seq.spec_token_ids, seq.spec_probs = [], []
            seq.draft_computed = min(seq.draft_computed, seq.num_tokens - 1)
