"""How one request wants its tokens chosen and when it wants to stop (vLLM's ``SamplingParams``).

Every field is checked when the object is built, so that a bad value fails where it was written,
not steps later inside a batch it would take down with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Sampling and stopping settings of one request.

    - ``n``: parallel samples of one prompt; they share the prompt's KV blocks (one prefill).
    - ``max_tokens``: most tokens generated per sample.
    - ``temperature``: 0 is greedy (argmax); above 0 samples ``softmax(logits / temperature)``.
    - ``top_k``: keep the k most likely tokens (0 or -1: all). ``top_p``: keep the smallest set
      of most likely tokens whose probability reaches ``top_p`` (1: all).
    - ``seed``: a private random stream for this request, so its samples do not depend on what
      else is in the batch.
    - ``stop``: strings that end the output (trimmed from the text, as vLLM does);
      ``stop_token_ids``: extra token ids that end it; ``ignore_eos``: keep going past EOS.
    - ``detokenize``: build the text (off only for measuring the engine without the tokenizer).
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    detokenize: bool = True
    stop_strings: tuple[str, ...] = field(init=False, repr=False)
    max_stop_len: int = field(init=False, repr=False)  # text a stream holds back

    def __post_init__(self) -> None:
        def integer(name: str, value: object) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an integer, got {value!r}")
            return value

        if integer("n", self.n) < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if integer("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise TypeError(f"temperature must be a number, got {self.temperature!r}")
        if not self.temperature >= 0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if integer("top_k", self.top_k) < -1:
            raise ValueError(f"top_k must be -1, 0 (both: no limit) or positive, got {self.top_k}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise TypeError(f"top_p must be a number, got {self.top_p!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            integer("seed", self.seed)
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self.stop_strings = tuple(stops)
        self.max_stop_len = max((len(s) for s in stops), default=0)
        ids = list(self.stop_token_ids or [])
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
        self.stop_token_ids = ids

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
