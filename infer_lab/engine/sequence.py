"""Request and sequence state: what the scheduler moves between queues and the runner reads.

A :class:`Request` is what a user sent (one prompt, one :class:`SamplingParams`); it owns ``n``
:class:`Sequence` objects, one per parallel sample. Until its prompt is prefilled a request has a
single sequence; the others are forked from it then, sharing the prompt's KV blocks.

A sequence's tokens are its prompt plus what it generated. ``num_computed`` of them have K/V in
the cache; the rest (a prompt not yet prefilled, or the last sampled token) are what the next
steps compute. Preemption by recompute just sets ``num_computed`` back to 0: the tokens stay, so
the resumed sequence continues exactly where it stopped.

Every field has one writer, named beside it: the engine (when it makes the sequence), the
:class:`~infer_lab.engine.scheduler.Scheduler` (tokens, status, accounting), the
:class:`~infer_lab.engine.kv_cache_manager.KVCacheManager` (blocks), the
:class:`~infer_lab.engine.spec_decode.SpeculativeDecoder` (proposals) or the
:class:`~infer_lab.engine.output_processor.OutputProcessor` (text and what was handed out).
Everyone else only reads.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from infer_lab.cache.block_pool import BlockKey
from infer_lab.engine.outputs import SpecDecodeCounts, TokenLogprobs
from infer_lab.engine.sampling_params import SamplingParams
from infer_lab.engine.stop import StopMatcher
from infer_lab.model.tokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One stream of tokens (one sample of a request) and its place in the KV cache."""

    # Set once, by the engine, when the sequence is made.
    seq_id: int
    request: Request
    index: int  # which of the request's n samples
    token_ids: list[int]  # Scheduler: appended as tokens are accepted, cut at a stop string
    num_prompt_tokens: int
    generator: torch.Generator | None = None  # the request's seed (drawn from, never replaced)
    detokenizer: IncrementalDetokenizer | None = None
    # Scheduler.
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache
    slot: int = -1  # batch slot while running (the runner keys its rows by it)
    num_preemptions: int = 0
    spec_slots: int = 0  # lookahead slots granted this step for proposals
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    # KVCacheManager. Table entries are appended; any other change is a new list.
    block_table: list[int] = field(default_factory=list)
    block_keys: list[BlockKey] = field(default_factory=list)  # prefix keys of full blocks
    num_cached_blocks: int = 0  # full blocks already named in the prefix cache
    shared_tail: bool = False  # the last block may be shared (after a fork): copy before writing
    # SpeculativeDecoder: this step's proposals (node tokens of the draft tree, in order, and
    # each node's parent, -1 for the root; empty parents: a chain), a sampled draft's q row at
    # each, how far a draft model's own cache is filled, and the counts.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_parents: list[int] = field(default_factory=list)
    spec_probs: list[torch.Tensor] = field(default_factory=list)
    draft_computed: int = 0
    spec_counts: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)
    # OutputProcessor.
    text: str = ""
    emitted_text_len: int = 0  # characters already handed out in step deltas
    emitted_tokens: int = 0  # tokens already handed out in step deltas
    token_times: list[float] = field(default_factory=list)  # when each output token was taken
    logprobs: list[TokenLogprobs] | None = None  # one per output token, if the request asked

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(eq=False)
class Request:
    """A prompt and its sampling settings, with its samples and its timings."""

    # Set once, by the engine, in ``add_request``.
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    stop_ids: frozenset[int]
    stop_matcher: StopMatcher | None = None  # its stop strings, if any
    seqs: list[Sequence] = field(default_factory=list)  # engine: the first, then the forks
    # Scheduler.
    forked: bool = False  # the n samples exist (n == 1: from the start)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # ModelRunner: one entry per prompt token (the first is None), if params.prompt_logprobs.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def may_speculate(self) -> bool:
        """Whether proposals may be verified for this request: one sample, and no constrained
        (structured) output, whose matcher must see every token before the next is chosen."""
        return self.params.n == 1 and not getattr(self.params, "structured_outputs", None)

    @property
    def is_finished(self) -> bool:
        if len(self.seqs) == 1:
            return self.forked and self.seqs[0].status is SequenceStatus.FINISHED
        return self.forked and all(s.is_finished for s in self.seqs)
