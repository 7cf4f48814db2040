"""What the engine hands back: per request, its completions so far and its timings (vLLM names)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_ERROR_LEN = 300  # characters of an exception's text kept in a failed request's error


@dataclass(frozen=True)
class RequestFailure:
    """Why the engine failed one request alone: the stage (``"sampling"``,
    ``"log-probabilities"``, ``"its new token"``, ``"its output"``), the exception's type and
    its text.

    A server maps it to a response by its fields, never by parsing the message; ``str()`` is the
    message a person reads, and ``"sampling" in failure`` searches it.
    """

    stage: str
    error_type: str  # the exception's class name: a server maps a few to their own responses
    detail: str

    @classmethod
    def from_exception(cls, stage: str, error: BaseException) -> RequestFailure:
        return cls(stage, type(error).__name__, str(error)[:MAX_ERROR_LEN])

    def __str__(self) -> str:
        return f"the engine failed this request ({self.stage}): {self.error_type}: {self.detail}"

    def __contains__(self, text: str) -> bool:
        return text in str(self)


@dataclass
class SpecDecodeCounts:
    """Speculative decoding's counters (vLLM's ``spec_decode`` names): verification forwards
    that carried proposals, tokens proposed, and tokens of those the target accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # entry i: drafts that had at least i + 1 tokens accepted (the acceptance-length histogram
    # is the differences)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def add(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos += [0] * (accepted - len(per_pos))
        for i in range(accepted):
            per_pos[i] += 1


class SpecDecodeRates:
    """Rates from the speculative-decoding counters (``spec_num_*``) of the class using it."""

    spec_num_drafts: int
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed tokens (None before any proposal)."""
        n = self.spec_num_draft_tokens
        return self.spec_num_accepted_tokens / n if n else None

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens per verification step: accepted proposals plus the model's own token."""
        n = self.spec_num_drafts
        return 1 + self.spec_num_accepted_tokens / n if n else None


@dataclass
class TokenLogprobs:
    """Log-probabilities at one generated (or prompt) position, from the raw distribution.

    ``logprob`` is the sampled token's; ``top`` holds the ``k`` most likely tokens (``k`` is the
    request's ``logprobs``; empty for 0), most likely first, as ``(token_id, logprob)``.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # the token's rank in the distribution (1: most likely), if known


@dataclass
class CompletionOutput:
    """One sample of a request. ``text``/``token_ids`` are everything so far; ``delta_*`` are
    what this step added (what a streaming server sends)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # when each token was sampled
    num_preemptions: int = 0
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asked
    delta_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics(SpecDecodeRates):
    """Timestamps on the engine's clock (``time.perf_counter``) in seconds."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # Speculative decoding, summed over the request's samples: verifications that carried
    # proposals, tokens proposed, tokens of those the model accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to first sampled token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        """End-to-end latency: arrival to the last token."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class RequestOutput:
    """A request's state after a step. ``text``, ``token_ids`` and ``finish_reason`` are those
    of the first completion, so that ``outs[0].text`` works whatever ``n`` is.

    ``error`` is set when the engine failed this request alone (its ``finish_reason`` is then
    ``"error"``); the other requests of the step are not affected."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: RequestFailure | None = None
    # one per prompt token (the first None: nothing predicts it), when prompt_logprobs was asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
