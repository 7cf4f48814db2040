"""Every bound the server puts on one request, in one place, with its default.

A server shared by clients who do not trust each other must bound what one request may cost:
the batch slots and KV tokens it may occupy, the bytes of its answer, the grammar it asks to
compile, the time a chat template may take to render it, the time a client may leave a send
waiting. Each field is an ``infer-lab serve`` option of the same name (``max_n`` is
``--max-n``; ``tests/test_server_hardening.py`` checks the defaults agree), and every refusal is
counted in ``/metrics`` as ``infer_lab:request_refused_total{reason=...}``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from infer_lab.engine.structured import GrammarLimits

_GRAMMAR = GrammarLimits()


@dataclass(frozen=True)
class ServerLimits:
    """The limits of one server.

    - ``max_n``: most parallel samples (``n``, ``best_of``) per request; each holds a batch
      slot, so the default is well below ``max_num_seqs`` (64).
    - ``max_inflight_tokens``: admission budget over the requests in flight, each counted as
      ``n x (prompt + max_tokens)``, the tokens it can occupy; 0 means twice the KV cache's
      tokens. A request alone is always admitted (if the engine can ever run it).
    - ``max_logprobs_per_request``: ``n x max_tokens x (1 + top_logprobs)`` (a chat without
      ``max_tokens`` counts the rest of the context): the default lets one answer fill an 8k
      context with 20 alternatives per token, and keeps a body near 20 MB at most (such a body
      is built and encoded off the event loop).
    - ``send_timeout``: seconds a send may wait on a client that does not read; then the
      request is aborted and the connection closed. ``send_buffer_bytes``: each connection's
      socket send buffer (0: the OS's, which Linux grows to 4 MB): what a client that does not
      read can leave in the kernel before the deadline starts.
    - ``max_schema_bytes``, ``max_schema_depth``, ``max_enum_values``, ``grammar_cache_bytes``,
      ``grammar_token_ms``: see :class:`~infer_lab.engine.structured.GrammarLimits`.
    - ``max_compiles``: grammar compilations running or queued (one thread compiles them).
    - ``template_timeout``: seconds the chat template may take for one conversation (it renders
      in a child process; its output counts against the prompt's byte limit).
    """

    max_n: int = 8
    max_inflight_tokens: int = 0
    max_logprobs_per_request: int = 1 << 18
    send_timeout: float = 10.0
    send_buffer_bytes: int = 0
    max_schema_bytes: int = _GRAMMAR.max_bytes
    max_schema_depth: int = _GRAMMAR.max_depth
    max_enum_values: int = _GRAMMAR.max_enum_values
    grammar_cache_bytes: int = _GRAMMAR.cache_bytes
    max_compiles: int = 4
    grammar_token_ms: float = _GRAMMAR.token_seconds * 1e3
    template_timeout: float = 5.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{f.name} must be a number >= 0, got {value!r}")
        for name in ("max_n", "max_compiles", "max_logprobs_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")

    def grammar_limits(self) -> GrammarLimits:
        return GrammarLimits(max_bytes=self.max_schema_bytes, max_depth=self.max_schema_depth,
                             max_enum_values=self.max_enum_values,
                             cache_bytes=self.grammar_cache_bytes,
                             token_seconds=self.grammar_token_ms / 1e3)

    @classmethod
    def from_namespace(cls, args: Any) -> ServerLimits:
        """The limits an ``argparse`` namespace of ``infer-lab serve`` gives."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
