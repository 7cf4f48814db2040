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

A constraint is client input, and a hostile one can cost memory and time: :class:`GrammarLimits`
bounds its size (bytes, nesting depth, enum values), the bytes of the compile cache, and the CPU
time the matcher may take for one token (a request over it fails alone); :meth:`prepare` also
refuses a constraint that accepts no output at all, and a grammar or regex whose matching slows
down as the output grows (an ambiguous grammar such as ``s ::= s s | "a"``).

Preemption keeps a sequence's generated tokens, so its matcher stays valid across it.
Speculative decoding is off for constrained requests (the engine checks ``is_constrained``).
"""

from __future__ import annotations

import json
import random
import re
import statistics
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\]\s*\S+:\d+:\s*")
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled (the message says what is wrong with it)."""


class GrammarLimitError(StructuredOutputError):
    """A constraint over one of :class:`GrammarLimits` (``reason`` names which one)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class GrammarTooSlowError(StructuredOutputError):
    """Matching the constraint took more CPU time for one token than the budget allows."""


@dataclass
class GrammarLimits:
    """What one constraint may cost. The defaults follow OpenAI's limits for strict schemas
    where it has them (1,000 enum values) and are generous elsewhere.

    - ``max_bytes``: the schema's JSON text, the regex or the grammar; ``max_depth``: nesting of
      a JSON schema's JSON (objects and arrays; one level of ``properties`` is two);
      ``max_enum_values``: ``enum`` values in a schema, or ``choice`` strings.
    - ``cache_bytes``: compiled grammars kept for reuse (least recently used go first).
    - ``token_seconds``: CPU time the matcher may take to fill one token's mask.
    - ``probe_tokens``: tokens :meth:`StructuredOutputs.prepare` walks through a grammar or
      regex to see whether its matching slows down as the output grows.
    """

    max_bytes: int = 64 * 1024
    max_depth: int = 64
    max_enum_values: int = 1000
    cache_bytes: int = 256 * 1024 * 1024
    token_seconds: float = 0.05
    probe_tokens: int = 160


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One request's constraint; exactly one of the fields is set.

    - ``json``: a JSON Schema (a dict or its JSON text); ``json_object``: any JSON object;
    - ``regex``: the output matches this regular expression; ``choice``: it is one of these
      strings; ``grammar``: an EBNF grammar (XGrammar's dialect, root rule ``root``);
      ``structural_tag``: XGrammar's structural tag (a dict or its JSON text: free text with
      tagged, schema-checked parts, what tool calling with ``tool_choice: "auto"`` uses).
    - ``whitespace``: allow free whitespace between JSON tokens (off: compact JSON, which a
      small model cannot pad with newlines until it runs out of tokens).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    whitespace: bool = False
    key: tuple[str, str, bool] = field(init=False, repr=False, compare=False)
    # set by StructuredOutputs.prepare: the engine then uses this grammar, not a cache lookup
    compiled: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            self._set_key()
        except RecursionError:
            raise StructuredOutputError("the JSON schema is nested too deeply") from None

    def _set_key(self) -> None:
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
        elif kind == "structural_tag":
            text = value if isinstance(value, str) else json.dumps(value)
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
    never loads it. ``limits`` (a :class:`GrammarLimits`) may be replaced before serving."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int] | set[int],
                 limits: GrammarLimits | None = None):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_ids = sorted(eos_ids)
        self.limits = limits or GrammarLimits()
        self.stats = StructuredStats()
        self._compiler: Any = None
        self._cache: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()  # key -> (grammar, bytes)
        self._cache_bytes = 0
        self._vetted: OrderedDict[tuple, None] = OrderedDict()  # keys that passed _vet
        self._lock = threading.Lock()
        self._matchers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._too_slow: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # ---------------------------------------------------------------- compile (any thread)
    def _xgr(self) -> Any:
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
                info = xgr.TokenizerInfo.from_huggingface(
                    hf, vocab_size=self.vocab_size, stop_token_ids=self.eos_ids or None)
                # our cache is the one (bounded in bytes); XGrammar's own would grow forever
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return xgr

    @property
    def cache_bytes(self) -> int:
        """Bytes of the compiled grammars kept for reuse (at most ``limits.cache_bytes``)."""
        return self._cache_bytes

    def check(self, spec: StructuredOutputsParams) -> None:
        """Raise :class:`GrammarLimitError` if ``spec`` is over a limit (cheap: no compile)."""
        kind, text, _ = spec.key
        lim = self.limits
        if len(text.encode("utf-8")) > lim.max_bytes:
            raise GrammarLimitError(f"the {kind.replace('_', ' ')} constraint is "
                                    f"{len(text.encode('utf-8'))} bytes; the limit is "
                                    f"{lim.max_bytes}", "grammar_size")
        if kind == "choice" and len(spec.choice or ()) > lim.max_enum_values:
            raise GrammarLimitError(f"choice has {len(spec.choice or ())} strings; the limit is "
                                    f"{lim.max_enum_values}", "enum_values")
        if kind == "json":
            depth, values = _schema_shape(json.loads(text))
            if depth > lim.max_depth:
                raise GrammarLimitError(f"the JSON schema nests {depth} JSON levels; the limit "
                                        f"is {lim.max_depth}", "schema_depth")
            if values > lim.max_enum_values:
                raise GrammarLimitError(f"the JSON schema has {values} enum values; the limit "
                                        f"is {lim.max_enum_values}", "enum_values")

    def is_prepared(self, spec: StructuredOutputsParams) -> bool:
        """True when :meth:`prepare` would only look ``spec`` up (compiled and tried before)."""
        with self._lock:
            return spec.key in self._vetted and (spec.compiled is not None
                                                 or spec.key in self._cache)

    def prepare(self, spec: StructuredOutputsParams) -> Any:
        """Check, compile and try ``spec`` before a request is admitted, and keep the compiled
        grammar on it (the engine then needs no cache lookup). Raises
        :class:`StructuredOutputError` for a constraint that cannot compile, accepts no output,
        or whose matching slows down as the output grows; :class:`GrammarLimitError` beyond
        :attr:`limits`."""
        self.check(spec)
        compiled = self.compile(spec)
        if spec.key not in self._vetted:
            self._vet(spec, compiled)
            with self._lock:
                self._vetted[spec.key] = None
                while len(self._vetted) > 4096:
                    self._vetted.popitem(last=False)
        object.__setattr__(spec, "compiled", compiled)
        return compiled

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``spec`` (cached); ``StructuredOutputError`` if it has none."""
        if spec.compiled is not None:
            return spec.compiled
        with self._lock:
            cached = self._cache.get(spec.key)
            if cached is not None:
                self._cache.move_to_end(spec.key)
                return cached[0]
        self._xgr()
        start = time.perf_counter()
        compiled = self._compile(spec)
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds += time.perf_counter() - start
            self._remember(spec.key, compiled)
        return compiled

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        kind, text, whitespace = spec.key
        try:
            if kind == "json":
                return self._compiler.compile_json_schema(text, any_whitespace=whitespace)
            if kind == "json_object":
                return self._compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=whitespace)
            if kind == "regex":
                return self._compiler.compile_regex(text)
            if kind == "choice":
                return self._compiler.compile_regex(
                    "|".join(f"({_escape_regex(c)})" for c in spec.choice or ()))
            if kind == "structural_tag":
                return self._compiler.compile_structural_tag(text)
            return self._compiler.compile_grammar(text)
        except RecursionError:
            raise StructuredOutputError(f"the {kind} constraint is nested too deeply") from None
        except Exception as e:  # XGrammar raises RuntimeError / ValueError with a message
            lines = str(e).strip().splitlines()
            # XGrammar prefixes "[time] file.cc:line: " to its message: not the client's concern
            detail = _SOURCE_PREFIX.sub("", lines[0]) if lines else type(e).__name__
            raise StructuredOutputError(f"the {kind.replace('_', ' ')} constraint cannot be "
                                        f"compiled: {detail}") from None

    def _remember(self, key: tuple, compiled: Any) -> None:
        """Cache ``compiled`` (under the lock), evicting the least recently used beyond the
        byte limit; a grammar larger than the whole limit is used once and not kept."""
        size = int(getattr(compiled, "memory_size_bytes", 0)) + len(key[1])
        if key in self._cache or size > self.limits.cache_bytes:
            return
        self._cache[key] = (compiled, size)
        self._cache_bytes += size
        while self._cache_bytes > self.limits.cache_bytes:
            _, (_, old) = self._cache.popitem(last=False)
            self._cache_bytes -= old

    def _vet(self, spec: StructuredOutputsParams, compiled: Any) -> None:
        """Refuse a constraint that accepts nothing, and (grammars and regexes: the client
        writes the automaton) one whose mask takes longer to fill as the output grows: walk
        fresh matchers through allowed tokens and time every fill (CPU time). Three walks repeat
        their first token while they can (``s ::= s s | "a"``, ``(a*)*b`` slow down on runs),
        one picks at random. A heuristic: the per-token budget of :meth:`mask_logits` is the
        bound."""
        xgr = self._xgr()
        kind, text, _ = spec.key
        walks = ("repeat",) * 3 + ("random",) if kind in ("grammar", "regex") else ("first",)
        rng = random.Random(zlib.crc32(text.encode("utf-8")))
        spent: list[float] = []
        firsts: list[int] = []  # the repeating walks start on different tokens
        for policy in walks:
            times: list[float] = []
            matcher, previous = xgr.GrammarMatcher(compiled), None
            bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
            for _ in range(self.limits.probe_tokens if policy != "first" else 1):
                start = time.thread_time()
                matcher.fill_next_token_bitmask(bitmask, 0)
                times.append(time.thread_time() - start)
                self._check_growth(kind, times, spent)
                allowed = _bits(bitmask[0], self.vocab_size)
                if not allowed and len(times) == 1:
                    raise StructuredOutputError(f"the {kind} constraint accepts no output")
                tokens = [t for t in allowed if t not in self.eos_ids]
                if not tokens or matcher.is_terminated():
                    break
                if previous is None and policy == "repeat":
                    firsts = firsts or rng.sample(tokens, len(tokens))
                    previous = firsts.pop()
                elif not (policy == "repeat" and previous in tokens):
                    previous = rng.choice(tokens)
                matcher.accept_token(previous)
            spent += times

    def _check_growth(self, kind: str, times: list[float], spent: list[float]) -> None:
        budget = self.limits.token_seconds
        if times[-1] > budget or sum(times) + sum(spent) > 40 * budget:
            raise GrammarTooSlowError(f"the {kind} constraint takes {times[-1] * 1e3:.0f} ms "
                                      "to match one token; the limit is "
                                      f"{budget * 1e3:g} ms")
        if len(times) >= 24:
            first, last = statistics.median(times[:8]), statistics.median(times[-8:])
            if last > max(20 * first, budget / 25):
                raise GrammarTooSlowError(
                    f"matching the {kind} constraint slows down as the output grows "
                    f"({first * 1e3:.2f} ms per token at first, {last * 1e3:.2f} ms after "
                    f"{len(times)} tokens): is it ambiguous (like s ::= s s | \"a\")?")

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
        only (a float32 copy); ``logits`` itself when no row is constrained.

        A row whose fill takes more than ``limits.token_seconds`` of CPU time is marked: its
        next :meth:`advance` raises, which fails that request alone."""
        rows = [i for i, s in enumerate(seqs) if s in self._matchers]
        if not rows:
            return logits
        xgr = self._xgr()
        start = time.perf_counter()
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for j, i in enumerate(rows):
            self._fill(seqs[i], bitmask, j)
        masked = logits.float().clone()
        sub = masked[rows]
        xgr.apply_token_bitmask_inplace(sub, bitmask.to(sub.device), vocab_size=self.vocab_size)
        masked[rows] = sub
        self.stats.mask_steps += 1
        self.stats.mask_rows += len(rows)
        self.stats.mask_seconds += time.perf_counter() - start
        return masked

    def _fill(self, seq: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher = self._matchers[seq]
        if matcher.is_terminated() or seq in self._too_slow:
            return
        start = time.thread_time()
        matcher.fill_next_token_bitmask(bitmask, row)
        spent = time.thread_time() - start
        if spent > self.limits.token_seconds:
            self._too_slow[seq] = spent

    def advance(self, seq: Any, token: int) -> bool:
        """Feed the sampled token to ``seq``'s matcher; True once the grammar is complete (the
        output is whole and valid). Raises ``ValueError`` if the token breaks the grammar, and
        :class:`GrammarTooSlowError` if filling this token's mask went over the budget."""
        matcher = self._matchers.get(seq)
        if matcher is None:
            return False
        spent = self._too_slow.pop(seq, None)
        if spent is not None:
            raise GrammarTooSlowError(f"the output constraint took {spent * 1e3:.0f} ms of CPU "
                                      "to match one token; the limit is "
                                      f"{self.limits.token_seconds * 1e3:g} ms")
        if matcher.is_terminated():
            return True
        if not matcher.accept_token(token):
            raise ValueError(f"token {token} breaks the request's output constraint")
        return matcher.is_terminated()

    def release(self, seq: Any) -> None:
        self._matchers.pop(seq, None)
        self._too_slow.pop(seq, None)

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


def _bits(words: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids set in one row of an XGrammar bitmask (int32 words, lowest bit first)."""
    raw = words.numpy().view(np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little")[:vocab_size]).tolist()


def _schema_shape(schema: Any) -> tuple[int, int]:
    """(nesting depth, number of ``enum`` values) of a JSON value, without recursion."""
    depth, values, stack = 0, 0, [(schema, 1)]
    while stack:
        node, level = stack.pop()
        depth = max(depth, level)
        if isinstance(node, dict):
            if isinstance(node.get("enum"), list):
                values += len(node["enum"])
            stack.extend((v, level + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, level + 1) for v in node if isinstance(v, (dict, list)))
    return depth, values


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
