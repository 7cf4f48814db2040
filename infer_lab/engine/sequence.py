"""Request and sequence state: what the scheduler moves between queues and the runner reads.

A :class:`Request` is what a user sent (one prompt, one :class:`SamplingParams`); it owns ``n``
:class:`Sequence` objects, one per parallel sample. Until its prompt is prefilled a request has a
single sequence; the others are forked from it then, sharing the prompt's KV blocks.

A sequence's tokens are its prompt plus what it generated. ``num_computed`` of them have K/V in
the cache; the rest (a prompt not yet prefilled, or the last sampled token) are what the next
steps compute. Preemption by recompute just sets ``num_computed`` back to 0: the tokens stay, so
the resumed sequence continues exactly where it stopped.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from infer_lab.cache.block_pool import BlockKey
from infer_lab.engine.outputs import TokenLogprobs
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

    seq_id: int
    request: Request
    index: int  # which of the request's n samples
    token_ids: list[int]
    num_prompt_tokens: int
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache
    # Written by the KV manager only. Entries are appended; any other change is a new list.
    block_table: list[int] = field(default_factory=list)
    block_keys: list[BlockKey] = field(default_factory=list)  # prefix keys of full blocks
    num_cached_blocks: int = 0  # full blocks already named in the prefix cache
    shared_tail: bool = False  # the last block may be shared (after a fork): copy before writing
    slot: int = -1  # batch slot while running (the scheduler's; the runner keys its rows by it)
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    text: str = ""
    emitted_text_len: int = 0  # characters already handed out in step deltas
    emitted_tokens: int = 0  # tokens already handed out in step deltas
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    logprobs: list[TokenLogprobs] | None = None  # one per output token, if the request asked
    # Speculative decoding: lookahead slots the scheduler granted this step, the proposals the
    # engine put in them (with the draft's distribution at each, if it sampled them), how far a
    # draft model's own cache is filled, and the counts.
    spec_slots: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: list[torch.Tensor] = field(default_factory=list)  # a sampled draft's q rows
    draft_computed: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_steps: int = 0  # verification forwards that carried proposals

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

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    stop_ids: frozenset[int]
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False  # the n samples exist (n == 1: from the start)
    stop_matcher: StopMatcher | None = None  # its stop strings, if any
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

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
