"""Structured output by constrained decoding: JSON Schema, JSON, regex, choice and grammars.

At every step a grammar engine says which tokens keep a request's output valid; the sampler's
logits of every other token become -inf, so the output is valid by construction (what vLLM and
SGLang do). The grammar engine is XGrammar (``pip install xgrammar``): it compiles a schema once
against the tokenizer's vocabulary — sorting tokens into those it can decide ahead of time and
the few it must check at run time — and then fills a bitmask of the vocabulary per step.

- :class:`StructuredOutputsParams`: the constraint of one request (vLLM's field names).
- :class:`StructuredOutputs`: the engine's side: compiles (cached per distinct constraint),
  gives each constrained sequence its matcher, fills one bitmask for all constrained rows of a
  step, applies it to those rows only (unconstrained requests pay nothing), advances matchers.
- :func:`mask_cache_counts`: what a compiled grammar decided ahead of time (Chapter 11).

Preemption keeps a sequence's generated tokens, so its matcher stays valid across it.
Speculative decoding is off for constrained requests (the engine checks ``is_constrained``).
"""

from __future__ import annotations

import json
import re
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\]\s*\S+:\d+:\s*")
KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled (the message says what is wrong with it)."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One request's constraint; exactly one of the fields is set.

    - ``json``: a JSON Schema (a dict or its JSON text); ``json_object``: any JSON object;
    - ``regex``: the output matches this regular expression; ``choice``: it is one of these
      strings; ``grammar``: an EBNF grammar (XGrammar's dialect, root rule ``root``).
    - ``whitespace``: allow free whitespace between JSON tokens (off: compact JSON, which a
      small model cannot pad with newlines until it runs out of tokens).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    whitespace: bool = False
    key: tuple[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputError("structured_outputs needs exactly one of "
                                        f"{', '.join(KINDS)}; got {given or 'none'}")
        kind = given[0]
        value: Any = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise StructuredOutputError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(value, (dict, bool)):
                raise StructuredOutputError("a JSON schema must be an object")
            text = json.dumps(value)  # property order kept: it is the output's order
        elif kind == "json_object":
            text = ""
        elif kind == "choice":
            if isinstance(value, str) or not value or not all(isinstance(c, str) and c
                                                              for c in value):
                raise StructuredOutputError("choice must be a non-empty list of non-empty "
                                            "strings")
            object.__setattr__(self, "choice", tuple(value))
            text = json.dumps(list(value))
        else:
            if not isinstance(value, str) or not value:
                raise StructuredOutputError(f"{kind} must be a non-empty string")
            text = value
        object.__setattr__(self, "key", (kind, text, self.whitespace))


@dataclass
class StructuredStats:
    """Counters for ``/metrics``: constrained requests, compile time, mask time per step."""

    constrained_requests: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0
    mask_steps: int = 0
    mask_rows: int = 0
    mask_seconds: float = 0.0


def _escape_regex(text: str) -> str:
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/" else c for c in text)


class StructuredOutputs:
    """Compile, cache and apply constraints for one engine (one tokenizer, one vocabulary).

    XGrammar is imported on the first constrained request, so an engine that never sees one
    never loads it."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int] | set[int]):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_ids = sorted(eos_ids)
        self.stats = StructuredStats()
        self._compiler: Any = None
        self._cache: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        self._matchers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # ---------------------------------------------------------------- compile (any thread)
    def _xgr(self) -> Any:
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
                info = xgr.TokenizerInfo.from_huggingface(
                    hf, vocab_size=self.vocab_size, stop_token_ids=self.eos_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return xgr

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``spec`` (cached); ``StructuredOutputError`` if it has none."""
        cached = self._cache.get(spec.key)
        if cached is not None:
            return cached
        self._xgr()
        start = time.perf_counter()
        kind, text, whitespace = spec.key
        try:
            if kind == "json":
                compiled = self._compiler.compile_json_schema(text, any_whitespace=whitespace)
            elif kind == "json_object":
                compiled = self._compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=whitespace)
            elif kind == "regex":
                compiled = self._compiler.compile_regex(text)
            elif kind == "choice":
                compiled = self._compiler.compile_regex(
                    "|".join(f"({_escape_regex(c)})" for c in spec.choice))
            else:
                compiled = self._compiler.compile_grammar(text)
        except Exception as e:  # XGrammar raises RuntimeError / ValueError with a message
            lines = str(e).strip().splitlines()
            # XGrammar prefixes "[time] file.cc:line: " to its message: not the client's concern
            detail = _SOURCE_PREFIX.sub("", lines[0]) if lines else type(e).__name__
            raise StructuredOutputError(f"the {kind.replace('_', ' ')} constraint cannot be "
                                        f"compiled: {detail}") from None
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds += time.perf_counter() - start
            self._cache[spec.key] = compiled
        return compiled

    # ---------------------------------------------------------------- per sequence (engine)
    def attach(self, seq: Any, spec: StructuredOutputsParams, new_request: bool) -> None:
        """Give ``seq`` a fresh matcher (at the start of its output)."""
        xgr = self._xgr()
        self._matchers[seq] = xgr.GrammarMatcher(self.compile(spec))
        if new_request:
            self.stats.constrained_requests += 1

    def is_attached(self, seq: Any) -> bool:
        return seq in self._matchers

    def mask_logits(self, logits: torch.Tensor, seqs: list[Any]) -> torch.Tensor:
        """``logits`` with every token that breaks a constraint at -inf, in the constrained rows
        only (a float32 copy); ``logits`` itself when no row is constrained."""
        rows = [i for i, s in enumerate(seqs) if s in self._matchers]
        if not rows:
            return logits
        xgr = self._xgr()
        start = time.perf_counter()
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for j, i in enumerate(rows):
            matcher = self._matchers[seqs[i]]
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, j)
        masked = logits.float().clone()
        sub = masked[rows]
        xgr.apply_token_bitmask_inplace(sub, bitmask.to(sub.device), vocab_size=self.vocab_size)
        masked[rows] = sub
        self.stats.mask_steps += 1
        self.stats.mask_rows += len(rows)
        self.stats.mask_seconds += time.perf_counter() - start
        return masked

    def advance(self, seq: Any, token: int) -> bool:
        """Feed the sampled token to ``seq``'s matcher; True once the grammar is complete (the
        output is whole and valid). Raises ``ValueError`` if the token breaks the grammar."""
        matcher = self._matchers.get(seq)
        if matcher is None:
            return False
        if matcher.is_terminated():
            return True
        if not matcher.accept_token(token):
            raise ValueError(f"token {token} breaks the request's output constraint")
        return matcher.is_terminated()

    def release(self, seq: Any) -> None:
        self._matchers.pop(seq, None)

    # ---------------------------------------------------------------- reading a mask (book, tests)
    def matcher(self, spec: StructuredOutputsParams) -> Any:
        """A fresh XGrammar matcher for ``spec``, outside any sequence: to read the mask of one
        state by hand (``allowed_token_ids``), as Chapter 11 does."""
        xgr = self._xgr()
        return xgr.GrammarMatcher(self.compile(spec))

    def allowed_token_ids(self, matcher: Any) -> list[int]:
        """The token ids ``matcher`` allows next, in order: the bits the engine's bitmask keeps
        for that state (empty once the matcher has taken its stop token)."""
        xgr = self._xgr()
        if matcher.is_terminated():
            return []
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        bits = torch.arange(32, dtype=torch.int32)
        kept = (bitmask[0].unsqueeze(1) >> bits) & 1  # int32 words, lowest bit first
        return kept.flatten()[: self.vocab_size].nonzero().flatten().tolist()


def mask_cache_counts(compiled: Any) -> list[dict[str, int]]:
    """What XGrammar decided at compile time, per position of the grammar's automaton: its
    *adaptive token mask cache*, read from the compiled grammar's serialized form.

    For each cached position: ``accepted`` and ``rejected``, tokens decided there whatever the
    parser's stack holds (context-independent), and ``uncertain``, those left to check at run
    time against the stack (context-dependent). ``ValueError`` if XGrammar's format is not the
    one this reads (``__VERSION__`` v18, xgrammar 0.2.9)."""
    data = json.loads(compiled.serialize_json())
    vocab = data.get("tokenizer_metadata", {}).get("vocab_size")
    cache = data.get("adaptive_token_mask_cache")
    if data.get("__VERSION__") != "v18" or vocab is None or cache is None:
        raise ValueError(f"unknown XGrammar serialization {data.get('__VERSION__')!r}: "
                         "mask_cache_counts reads v18 (xgrammar 0.2.9)")
    rows = []
    for _, mask in cache:
        uncertain = len(mask["uncertain_indices"])
        if mask["store_type"] == 0:  # the accepted ids are listed, the rest rejected
            accepted = len(mask["accepted_indices"])
        elif mask["store_type"] == 1:  # the rejected ids are listed, the rest accepted
            accepted = vocab - len(mask["rejected_indices"]) - uncertain
        else:  # a bitset of the accepted ids: [bits, words, word, word, ...]
            accepted = sum(bin(w & 0xFFFFFFFF).count("1") for w in mask["accepted_bitset"][2:])
        rows.append({"accepted": accepted, "rejected": vocab - accepted - uncertain,
                     "uncertain": uncertain})
    return rows
