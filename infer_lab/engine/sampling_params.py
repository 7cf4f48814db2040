"""How one request wants its tokens chosen and when it wants to stop (vLLM's ``SamplingParams``).

Every field is checked when the object is built, against what the engine can represent (int64
seeds, float32 logits, a vocabulary-sized top-k), so that a bad value fails where it was written,
not steps later inside a batch it would take down with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from infer_lab.engine.structured import StructuredOutputsParams

# A temperature below this is greedy: dividing float32 logits by it overflows or underflows
# (1e-40 is subnormal in float32, 1e-46 is 0), and the argmax is what it means anyway. vLLM uses
# the same epsilon.
GREEDY_EPSILON = 1e-5
MAX_TEMPERATURE = 1e4  # beyond this every distribution is flat in float32 anyway
MAX_STOP_STRINGS = 512  # per request; matching costs per new character, not per stop string
MAX_STOP_STRING_LEN = 256  # characters; a stream holds back this much text minus one
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's chat limit)
PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency penalties (OpenAI)
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # keeps penalised float32 logits finite
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: -100 bans a token, +100 forces it
MAX_LOGIT_BIAS = 1024  # entries per request; each costs one indexed add per step
INT64_MAX = 2**63 - 1


@dataclass
class SamplingParams:
    """Sampling and stopping settings of one request.

    - ``n``: parallel samples of one prompt; they share the prompt's KV blocks (one prefill).
    - ``max_tokens``: most tokens generated per sample.
    - ``temperature``: 0 (or below ``GREEDY_EPSILON``) is greedy (argmax); above, it samples
      ``softmax(logits / temperature)``.
    - ``top_k``: keep the k most likely tokens (0 or -1: all; more than the vocabulary: all).
      ``top_p``: keep the smallest set of most likely tokens whose probability reaches ``top_p``
      (1: all; the most likely token always stays).
    - ``seed``: a private random stream for this request (0 <= seed < 2**63), so its samples do
      not depend on what else is in the batch.
    - ``presence_penalty``, ``frequency_penalty`` (OpenAI, in [-2, 2]): subtracted from the logit
      of every token already generated, once / once per occurrence. ``repetition_penalty`` (HF,
      vLLM; 1 is off): the logit of every token in the prompt or the output is divided by it if
      positive and multiplied by it if negative.
    - ``min_p`` (in [0, 1]; 0 is off): after temperature, drop every token whose probability
      is below ``min_p`` times the most likely token's (vLLM, llama.cpp).
    - ``logit_bias`` (OpenAI): ``{token_id: bias}``, bias in [-100, 100] added to that token's
      logit before anything else (-100 in effect bans it, +100 forces it).
    - ``min_tokens``: no stop token (EOS or ``stop_token_ids``) and no stop string can end the
      output before this many tokens (vLLM; at most ``max_tokens``).
    - ``logprobs``: None (not asked), 0 (the sampled token's log-probability) or k <= 20 (and the
      k most likely tokens'), from the model's raw distribution, before temperature, top-k/top-p
      and penalties. ``prompt_logprobs`` (vLLM): the same for every prompt token after the
      first (from the prefill's logits at every position; the prompt is then recomputed rather
      than read from the prefix cache).
    - ``stop``: strings that end the output (trimmed from the text, as vLLM does; at most
      ``MAX_STOP_STRINGS`` of at most ``MAX_STOP_STRING_LEN`` characters);
      ``stop_token_ids``: extra token ids that end it; ``ignore_eos``: keep going past EOS.
    - ``detokenize``: build the text (off only for measuring the engine without the tokenizer).
      ``keep_special_token_ids``: special tokens whose text stays in it although the others
      are skipped (a tool-call marker that is one special token: the server's parser reads it).
    - ``structured_outputs``: a :class:`~infer_lab.engine.structured.StructuredOutputsParams`
      (JSON Schema, JSON object, regex, choice or grammar): every token is chosen among those
      that keep the output valid (constrained decoding; no speculation for such a request).
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    keep_special_token_ids: frozenset[int] | Sequence[int] = frozenset()
    stop_strings: tuple[str, ...] = field(init=False, repr=False)
    max_stop_len: int = field(init=False, repr=False)  # text a stream holds back
    # The ids ``min_tokens`` holds back: the engine sets them when the request is added (its
    # EOS unless ``ignore_eos``, plus ``stop_token_ids``), as vLLM's ``all_stop_token_ids``.
    all_stop_token_ids: frozenset[int] = field(default=frozenset(), init=False, repr=False)

    def __post_init__(self) -> None:
        self._check_numbers()
        for name in ("ignore_eos", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise TypeError("structured_outputs must be StructuredOutputsParams, got "
                            f"{type(self.structured_outputs).__name__}")
        self.stop_strings = _stop_strings(self.stop)
        self.max_stop_len = max((len(s) for s in self.stop_strings), default=0)
        self.stop_token_ids = _stop_token_ids(self.stop_token_ids)
        self.all_stop_token_ids = frozenset(self.stop_token_ids)
        self.logit_bias = _logit_bias(self.logit_bias)
        self.keep_special_token_ids = frozenset(
            _integer("keep_special_token_ids", t) for t in self.keep_special_token_ids)
        if self.min_tokens and self.structured_outputs is not None:
            raise ValueError("min_tokens cannot be combined with structured_outputs: the "
                             "grammar decides where the output ends")

    def _check_numbers(self) -> None:
        if _integer("n", self.n) < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if _integer("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= _number("temperature", self.temperature) <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got "
                             f"{self.temperature}")
        if _integer("top_k", self.top_k) < -1:
            raise ValueError(f"top_k must be -1, 0 (both: no limit) or positive, got {self.top_k}")
        if not 0 < _number("top_p", self.top_p) <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= _number("min_p", self.min_p) <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= _integer("min_tokens", self.min_tokens) <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got "
                             f"{self.min_tokens}")
        if self.seed is not None and not 0 <= _integer("seed", self.seed) <= INT64_MAX:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.logprobs is not None and not 0 <= _integer("logprobs", self.logprobs) <= (
                MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or in [0, {MAX_LOGPROBS}], got "
                             f"{self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= _integer(
                "prompt_logprobs", self.prompt_logprobs) <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be None or in [0, {MAX_LOGPROBS}], got "
                             f"{self.prompt_logprobs}")
        self._check_penalties()

    def _check_penalties(self) -> None:
        lo, hi = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            if not lo <= _number(name, getattr(self, name)) <= hi:
                raise ValueError(f"{name} must be in [{lo:g}, {hi:g}], got {getattr(self, name)}")
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= _number("repetition_penalty", self.repetition_penalty) <= hi:
            raise ValueError(f"repetition_penalty must be in [{lo:g}, {hi:g}] (1: off), got "
                             f"{self.repetition_penalty}")

    def bind(self, stop_ids: frozenset[int], vocab_size: int) -> None:
        """What the engine knows and the request does not: the stop ids ``min_tokens`` holds
        back (EOS unless ``ignore_eos``, plus ``stop_token_ids``; those outside the vocabulary
        can never be sampled), and whether the ``logit_bias`` ids are in the vocabulary."""
        bad = [t for t in (self.logit_bias or {}) if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary of "
                             f"{vocab_size}")
        self.all_stop_token_ids = frozenset(t for t in stop_ids if t < vocab_size)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def is_constrained(self) -> bool:
        return self.structured_outputs is not None

    @property
    def has_penalties(self) -> bool:
        """Whether the row's logits are edited before sampling: the penalties, ``logit_bias``
        or ``min_tokens`` (what :func:`~infer_lab.engine.sampler.apply_penalties` does; only
        such rows pay for it, and only they need their token history)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias or self.min_tokens)


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return value


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


def _stop_strings(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, Sequence) and not isinstance(stop, bytes):
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        stops = list(stop)
    else:
        raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        if len(s) > MAX_STOP_STRING_LEN:
            raise ValueError(f"a stop string is at most {MAX_STOP_STRING_LEN} characters, got "
                             f"one of {len(s)}")
    return tuple(dict.fromkeys(stops))


def _stop_token_ids(ids: object) -> list[int]:
    if ids is None:
        return []
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"stop_token_ids must be a list of token ids, got {ids!r}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(ids)}")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT64_MAX:
            raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
    return list(ids)


def _logit_bias(bias: object) -> dict[int, float] | None:
    """``{token_id: bias}`` with integer ids >= 0 and biases in ``LOGIT_BIAS_RANGE`` (whether an
    id is in the vocabulary is the engine's check: it knows the vocabulary)."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise TypeError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries, got {len(bias)}")
    lo, hi = LOGIT_BIAS_RANGE
    out = {}
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= INT64_MAX:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if not lo <= _number("logit_bias value", value) <= hi:
            raise ValueError(f"logit_bias values must be in [{lo:g}, {hi:g}], got {value} for "
                             f"token {token}")
        out[token] = float(value)
    return out or None
