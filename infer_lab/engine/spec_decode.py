"""Speculative decoding as one object the engine calls three times a step.

:meth:`SpeculativeDecoder.propose` fills the lookahead slots the scheduler granted with guesses
(:mod:`~infer_lab.engine.speculative` has the proposers); the forward then scores each
sequence's last real token and its guesses in one go; :meth:`~SpeculativeDecoder.verify` turns
those logits rows into the run of tokens each sequence keeps; :meth:`~SpeculativeDecoder.rollback`
forgets the guesses. (The scheduler, which owns the KV accounting, gives the rejected guesses'
slots back when it retires the step.)

Guesses are a :class:`~infer_lab.engine.draft_tree.DraftTree`: node tokens in order, each with
its parent (``-1``: the sequence's last real token). Prompt lookup and the draft models make
chains; EAGLE makes chains or trees. Verification walks any tree, keeping the longest path whose
every token is the one the target itself samples at its parent; the runner scores a tree in one
forward under a tree attention mask, and :meth:`~SpeculativeDecoder.rollback` moves the kept
path's K/V down to where the sequence continues.

A tree stays lossless for sampled requests too: every row at depth d samples with the same
noise, the d-th draw of the request's generator (the exponential race of the sampler), so the
kept path's tokens are exactly the draws the request makes without speculation.
"""

from __future__ import annotations

from typing import Any

import torch

from infer_lab.engine import speculative
from infer_lab.engine.draft_tree import DraftTree
from infer_lab.engine.outputs import SpecDecodeCounts, TokenLogprobs
from infer_lab.engine.sampler import apply_penalties, sampling_probs
from infer_lab.engine.scheduler import Scheduler, SchedulerOutput
from infer_lab.engine.sequence import Sequence, SequenceStatus
from infer_lab.engine.speculative import SpeculativeConfig, make_proposer
from infer_lab.engine.step_sampler import Run, SampledTokens, StepSampler


class SpeculativeDecoder:
    """Proposals, their verification in the target's forward, and the counts.

    ``runner``: the engine's model runner, whose paged cache a tree's accepted path is moved in
    (and whose hidden states an EAGLE head reads).
    """

    def __init__(self, spec: dict[str, Any] | SpeculativeConfig, model: Any, config: Any,
                 step_sampler: StepSampler, scheduler: Scheduler, runner: Any = None) -> None:
        self.cfg = SpeculativeConfig.parse(spec)
        self.num_slots = self.cfg.num_lookahead_slots  # k, or a tree's nodes
        budget = scheduler.budget
        if self.num_slots > self.cfg.num_speculative_tokens and self.num_slots + 1 > budget:
            raise ValueError(
                f"a draft tree of {self.num_slots} nodes needs {self.num_slots + 1} query rows "
                f"per sequence in one step, more than the step's token budget of {budget} "
                f"(max_num_batched_tokens): use a smaller speculative_token_tree or a larger "
                f"budget")
        self.proposer = make_proposer(self.cfg, model, config, runner)
        self.step_sampler, self.scheduler, self.runner = step_sampler, scheduler, runner
        self.device, self.vocab = model.device, model.config.vocab_size
        self.counts = SpecDecodeCounts()
        self._paths: dict[Sequence, list[int]] = {}  # a tree's accepted nodes, this step

    def num_lookahead(self) -> int:
        """Proposal slots per sequence this step: k (a tree's nodes), or 0 above
        ``disable_by_batch_size``."""
        limit, sched = self.cfg.disable_by_batch_size, self.scheduler
        if limit is not None and sched.num_running + sched.num_waiting >= limit:
            return 0
        return self.num_slots

    # ------------------------------------------------------------------ propose
    def propose(self, out: SchedulerOutput) -> None:
        """Fill the lookahead slots the scheduler granted; slots left empty go back at once."""
        copy_blocks = getattr(self.proposer, "copy_blocks", None)
        if copy_blocks is not None and out.block_copies:
            copy_blocks(out.block_copies)  # a draft's own per-slot state follows the target's
        ks = [s.spec_slots for s in out.seqs]
        if not any(ks):
            return
        drafts = self.proposer.propose(out.seqs, ks, out)
        for i, (seq, k, draft) in enumerate(zip(out.seqs, ks, drafts)):
            if not k:
                continue
            tree = draft if isinstance(draft, DraftTree) else DraftTree.chain(draft)
            if self.step_sampler.structured.is_attached(seq):
                tree = DraftTree.chain([])  # constrained: proposals are not checked against it
            tree = tree.prefix(k)  # parents come first: any prefix is a tree
            seq.spec_token_ids = list(tree.tokens)
            seq.spec_parents = [] if tree.is_chain else list(tree.parents)
            seq.spec_probs = seq.spec_probs[:k] if tree.tokens and seq.spec_probs else []
            self.scheduler.return_lookahead(out, i, len(seq.spec_token_ids))

    @staticmethod
    def tree(seq: Sequence) -> DraftTree:
        """A sequence's proposals as a tree (a chain when it has no parents listed)."""
        if seq.spec_parents:
            return DraftTree(tuple(seq.spec_token_ids), tuple(seq.spec_parents))
        return DraftTree.chain(seq.spec_token_ids)

    # ------------------------------------------------------------------ verify
    def verify(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampledTokens:
        """The run each sequence keeps, from ``1 + len(proposals)`` logits rows per sequence.

        Rows of deterministic proposals are sampled as without speculation, and the run is the
        accepted path (:meth:`DraftTree.accepted_path`). The rows of a sequence whose draft
        *sampled* its guesses (``spec_probs`` holds q) get the rejection rule instead
        (:func:`~infer_lab.engine.speculative.verify_sampled`).
        """
        out = SampledTokens(seqs)
        rows, prefixes, states, gens = self._rows(seqs)
        tokens = [0] * len(rows)
        plain = [i for i, s in enumerate(rows) if not s.spec_probs]
        if len(plain) == len(rows):
            tokens = self.step_sampler.tokens(logits, rows, out, prefixes, gens)
        elif plain:
            picked = self.step_sampler.tokens(logits[plain], [rows[i] for i in plain], out,
                                              [prefixes[i] for i in plain],
                                              [gens[i] for i in plain])
            for i, t in zip(plain, picked):
                tokens[i] = t
        verified = self._verify_sampled(logits, rows, prefixes, tokens, out)
        logprobs = self.step_sampler.logprobs(logits, rows, tokens, out)
        out.runs = self._runs(seqs, tokens, logprobs, states, verified)
        return out

    def _rows(self, seqs: list[Sequence]):
        """One row per position to score: each sequence's last token and its proposals; the
        proposals on the path to each row; the generator each row draws its noise from; the
        generator state of seeded rows, to rewind."""
        rows, prefixes, states, gens = [], [], {}, []
        for seq in seqs:
            spec, tree = seq.spec_token_ids, self.tree(seq)
            generator = seq.generator
            seeded = (spec and not seq.spec_probs and generator is not None
                      and not seq.request.params.greedy)
            by_depth = None
            if seeded and generator is not None and not tree.is_chain:  # the d-th draw per depth
                by_depth = self._draws(generator, max(tree.depths()) + 1)
            depths = [0] + tree.depths()
            for j in range(len(spec) + 1):
                rows.append(seq)
                prefixes.append([spec[n] for n in tree.path_to(j - 1)])
                gens.append(self._generator_at(by_depth[depths[j]], generator)
                            if by_depth and generator is not None else generator)
            if seeded and generator is not None:
                states[seq] = generator.get_state()  # rewound once we know what is kept
        return rows, prefixes, states, gens

    def _draws(self, generator: torch.Generator, n: int) -> list[torch.Tensor]:
        """``n`` generator states: the i-th is ``generator``'s after i noise draws."""
        probe = torch.Generator(device=generator.device)
        probe.set_state(generator.get_state())
        states = []
        for _ in range(n):
            states.append(probe.get_state())
            torch.empty(self.vocab, device=self.device).exponential_(generator=probe)
        return states

    @staticmethod
    def _generator_at(state: torch.Tensor, like: torch.Generator) -> torch.Generator:
        """A generator of its own for one row (siblings must not advance each other's)."""
        g = torch.Generator(device=like.device)
        g.set_state(state)
        return g

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
            if seq in verified:
                kept = verified[seq]
                nodes = list(range(len(kept) - 1))
            else:
                tree = self.tree(seq)
                nodes = tree.accepted_nodes(tokens[r : r + width])
                kept = [tokens[r]] + [tokens[r + 1 + j] for j in nodes]
                if seq.spec_parents and nodes:
                    self._paths[seq] = nodes
            at = [r] + [r + 1 + j for j in nodes]
            runs.append([(t, logprobs[i]) for t, i in zip(kept, at)])
            r += width
            if not spec:
                continue
            if seq in states and seq.generator is not None:  # as many draws as tokens kept
                seq.generator.set_state(states[seq])
                for _ in kept:
                    torch.empty(self.vocab, device=self.device).exponential_(
                        generator=seq.generator)
            seq.spec_counts.add(len(spec), len(kept) - 1)
            self.counts.add(len(spec), len(kept) - 1)
        return runs

    # ------------------------------------------------------------------ rollback
    def rollback(self, out: SchedulerOutput) -> None:
        """Forget this step's proposals. A tree's accepted path moves down to the slots where
        its sequence continues (K/V, and an EAGLE head's features); a draft model's cache is
        valid only up to the tokens whose K/V the target computed."""
        for seq in out.seqs:
            if not seq.spec_slots:
                continue
            nodes = self._paths.pop(seq, None)
            if nodes and seq.status is SequenceStatus.RUNNING:
                self._compact(seq, nodes)
            seq.spec_token_ids, seq.spec_parents, seq.spec_probs = [], [], []
            seq.draft_computed = min(seq.draft_computed, seq.num_tokens - 1)

    def _compact(self, seq: Sequence, nodes: list[int]) -> None:
        """Copy the accepted nodes' K/V from their slots (node j at sequence index
        ``num_computed + j``: the root is the last computed token) to consecutive ones."""
        src, dst = self.tree(seq).compaction(nodes, seq.num_computed)
        if not src:
            return
        bs, table = self.scheduler.kv.block_size, seq.block_table
        slots = [[table[i // bs] * bs + i % bs for i in idx] for idx in (src, dst)]
        self.runner.cache.copy_slots(*slots)
        move = getattr(self.proposer, "move_slots", None)
        if move is not None:
            move(*slots)
