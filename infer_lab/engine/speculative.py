"""Speculative decoding: guess several tokens cheaply, check them all in one forward.

A decode step at small batch reads every weight to produce one token per sequence; scoring
``k + 1`` tokens of a sequence in the same forward costs little more. A *proposer* guesses ``k``
tokens; the target model scores the last real token plus the ``k`` guesses in one forward (the
guesses are extra query rows of the flattened batch, with logits at every one of them); the
engine then keeps the longest prefix the target agrees with, plus the target's own next token.

Acceptance has two rules. By default every proposer is *deterministic* (prompt lookup; a draft
model decoded greedily): at each proposed position the engine samples the target's token exactly
as it would without speculation (same distribution, same per-request generator, same draw) and
accepts the guess when the two agree. The accepted tokens are therefore the tokens the request
would have produced alone, token for token: greedy output is unchanged and a seeded request's
output is the same with speculation on or off.

With ``"draft_sampling": "sampled"`` (``draft_model``, ``early_exit``, and ``eagle`` with a chain
rather than a tree) a draft *samples* its guesses from its own distribution q, at the request's
temperature, top-k and top-p, whenever the request samples (greedy requests keep the greedy draft).
The engine then verifies with the rejection rule (:func:`verify_sampled`, built on
:func:`rejection_sample`; Leviathan et al. 2023; Chen et al. 2023): guess x is kept with
probability min(1, p(x)/q(x)); the first one rejected is replaced by a draw from norm(max(0,
p - q)); if all k are kept, a bonus token is drawn from p. The output is distributed exactly as
without speculation, and a seeded request is reproducible (same seed, same batch, same output), but
it is no longer the same token stream as with speculation off: the draws are different ones. A
sampled draft is accepted more often than a greedy one when q is close to p, since the greedy guess
is one fixed token that a sampling target often does not pick.

Proposers:

- :class:`NgramProposer` (``"ngram"``, prompt lookup): find the latest earlier occurrence of the
  sequence's last ``n`` tokens (``prompt_lookup_max`` down to ``prompt_lookup_min``) and propose
  what followed it. Free to run; pays off on copy-heavy tasks.
- :class:`DraftModelProposer` (``"draft_model"``): a smaller model with the target's vocabulary
  on its own paged cache, indexed by the *target's* block tables (so allocation, prefix caching,
  preemption and rollback need nothing extra), decoded ``k`` steps (greedily, or sampled).
- ``"early_exit"``: the same, with the target's first ``num_layers`` layers, final norm and LM
  head as the draft (:func:`early_exit_model`, sharing the target's weights).
- ``"eagle"``: an EAGLE head (``model``: its file, directory or bundled name) drafting from the
  target's own features (:mod:`~infer_lab.engine.eagle`), as a chain of ``k`` or as the tree
  ``speculative_token_tree`` (vLLM's names); trees verify by the deterministic rule only.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from infer_lab.cache.batch import Chunk, flatten_chunks
from infer_lab.cache.kv_quant import attention_backend_for, make_paged_kv_cache
from infer_lab.cache.paged import PagedAttentionContext
from infer_lab.engine.draft_tree import chain_paths, parse_token_tree
from infer_lab.engine.sampler import sampling_probs
from infer_lab.utils import cdiv

if TYPE_CHECKING:
    from infer_lab.model.transformer import Transformer

METHODS = ("ngram", "draft_model", "early_exit", "eagle")
DRAFT_SAMPLING = ("greedy", "sampled")
MAX_SPECULATIVE_TOKENS = 32
_KEYS = {
    "ngram": {"prompt_lookup_max", "prompt_lookup_min"},
    "draft_model": {"model", "draft_sampling"},
    "early_exit": {"num_layers", "draft_sampling"},
    "eagle": {"model", "draft_sampling", "speculative_token_tree"},
}
_COMMON = {"method", "num_speculative_tokens", "disable_by_batch_size"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated ``speculative_config`` (vLLM's names).

    ``disable_by_batch_size``: speculation is off in a step where this many sequences or more are
    running or waiting (with greedy drafts it changes no output: accepted tokens are the model's
    own either way; with sampled drafts, the distribution only).

    ``draft_sampling`` (``draft_model``, ``early_exit``, chain ``eagle``): ``"greedy"`` (the
    default) drafts the draft's argmax and accepts a guess when it equals the target's own
    sample, so output is the same with speculation on or off; ``"sampled"`` makes the draft
    sample from its distribution q at the request's temperature / top-k / top-p when the
    request samples, and verifies with the rejection rule: the output keeps the target's
    distribution, but not its seeded stream.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: Any = None  # a path, a registry name or a loaded Transformer
    num_layers: int | None = None
    disable_by_batch_size: int | None = None
    draft_sampling: str = "greedy"
    speculative_token_tree: Any = None  # eagle: a list of rank paths, or its string

    @property
    def token_tree(self) -> tuple[tuple[int, ...], ...]:
        """The draft's shape as rank paths: the tree given, or the chain of k."""
        if self.speculative_token_tree is None:
            return chain_paths(self.num_speculative_tokens)
        return parse_token_tree(self.speculative_token_tree)

    @property
    def num_lookahead_slots(self) -> int:
        """Proposal slots a sequence needs per step: the tree's nodes (k for a chain)."""
        return len(self.token_tree)

    @classmethod
    def parse(cls, spec: dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """Check a user's dict: known method, known keys, integer ranges; clear errors."""
        if isinstance(spec, SpeculativeConfig):
            return spec
        if not isinstance(spec, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(spec).__name__}")
        method = spec.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, "
                             f"got {method!r}")
        unknown = sorted(set(spec) - _COMMON - _KEYS[method])
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown} for method "
                             f"{method!r}; allowed: {sorted(_COMMON | _KEYS[method])}")
        if "num_speculative_tokens" not in spec:
            raise ValueError("speculative_config needs num_speculative_tokens (k >= 1)")
        cfg = cls(**spec)
        _int_in("num_speculative_tokens", cfg.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        if cfg.disable_by_batch_size is not None:
            _int_in("disable_by_batch_size", cfg.disable_by_batch_size, 1, 1 << 30)
        if cfg.draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(f"speculative_config draft_sampling must be one of "
                             f"{DRAFT_SAMPLING}, got {cfg.draft_sampling!r}")
        cfg._check_method()
        return cfg

    def _check_method(self) -> None:
        """The keys each method needs, in range."""
        if self.method == "ngram":
            _int_in("prompt_lookup_min", self.prompt_lookup_min, 1, 1 << 10)
            _int_in("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min, 1 << 10)
        elif self.method in ("draft_model", "eagle") and self.model is None:
            raise ValueError(f"method {self.method!r} needs 'model' (a path or a model name)")
        elif self.method == "early_exit":
            if self.num_layers is None:
                raise ValueError("method 'early_exit' needs 'num_layers'")
            _int_in("num_layers", self.num_layers, 1, 1 << 16)
        if self.speculative_token_tree is not None:
            tree = self.token_tree
            depth = max(map(len, tree))
            if depth != self.num_speculative_tokens:
                raise ValueError(f"num_speculative_tokens ({self.num_speculative_tokens}) must "
                                 f"equal the depth of speculative_token_tree ({depth})")
            if self.draft_sampling == "sampled" and tree != chain_paths(depth):
                raise ValueError("draft_sampling 'sampled' needs a chain: a tree is verified by "
                                 "the deterministic rule only (use draft_sampling 'greedy')")


def _int_in(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"speculative_config {name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"speculative_config {name} must be in [{low}, {high}], got {value}")


# ---------------------------------------------------------------------- prompt lookup
def ngram_propose(tokens: list[int] | np.ndarray, k: int, n_max: int, n_min: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last n tokens.

    Tries ``n = n_max`` down to ``n_min`` and returns the first continuation found (a longer
    match is stronger evidence); ``[]`` when none occurs.
    """
    arr = np.asarray(tokens, dtype=np.int64)
    length = len(arr)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)
        hits = np.flatnonzero((windows == arr[length - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n  # the latest occurrence (it ends before the last token)
            return arr[start : start + k].tolist()
    return []


class NgramProposer:
    """Prompt lookup over each sequence's own tokens (prompt and output)."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg

    def propose(self, seqs: list, ks: list[int], out: Any) -> list[list[int]]:
        """Each sequence's proposals (``[]`` for none); prompt lookup never sets ``spec_probs``."""
        c = self.cfg
        return [ngram_propose(s.token_ids, k, c.prompt_lookup_max, c.prompt_lookup_min)
                if k else [] for s, k in zip(seqs, ks)]


# ---------------------------------------------------------------------- draft models
def early_exit_model(target: Transformer, num_layers: int) -> Transformer:
    """The target's first ``num_layers`` layers, final norm and LM head, sharing its weights."""
    total = target.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(f"early_exit num_layers must be in [1, {total - 1}] for a model of "
                         f"{total} layers, got {num_layers}")
    draft = copy.copy(target)  # the same parameters; own module dict, so the target is untouched
    draft._modules = dict(target._modules)
    draft._modules["layers"] = nn.ModuleList(list(target.layers[:num_layers]))
    draft.config = dataclasses.replace(target.config, num_hidden_layers=num_layers)
    return draft


class DraftModelProposer:
    """``k``-token drafts from a small model on its own paged cache.

    Greedy by default. With ``sampled``, a sequence whose request samples gets guesses drawn
    from the draft's distribution q (the request's temperature, top-k, top-p; its generator if
    seeded, else the proposer's own), and ``seq.spec_probs`` keeps the q row of each guess for
    the rejection rule.

    The draft cache has the target pool's block count and block size and is addressed through
    the target's block tables: position p of a sequence lives in the same slot in both caches.
    Each step the draft first catches up on every token the target computes this step (prefill
    chunks too), so its cache stays complete; ``Sequence.draft_computed`` says how far it is.
    """

    def __init__(self, draft: Transformer, target: Transformer, engine_config: Any,
                 sampled: bool = False) -> None:
        vocab, dvocab = target.config.vocab_size, draft.config.vocab_size
        if dvocab != vocab:
            raise ValueError(f"the draft model's vocabulary ({dvocab} tokens) differs from the "
                             f"target's ({vocab}): a draft must share the target's tokenizer")
        self.model, self.device = draft, target.device
        self.block_size = engine_config.block_size
        self.scratch = engine_config.num_kv_blocks
        self.cache = make_paged_kv_cache(draft.config, self.scratch + 1, self.block_size,
                                         self.device, draft.dtype)
        self.backend = attention_backend_for(self.cache, None)
        self.max_blocks = cdiv(engine_config.max_model_len, self.block_size)
        self.sampled = sampled
        self.generator = torch.Generator(device=self.device)  # for unseeded sampled requests
        self.generator.manual_seed(engine_config.seed + 1)

    @torch.inference_mode()
    def _forward(self, chunks: list[Chunk], wants: list[bool]):
        """One flattened forward of ``(tokens, start, table)`` chunks; logits of wanted chunks."""
        batch = flatten_chunks(chunks, self.max_blocks, self.scratch, self.block_size,
                               self.device, wants)
        ctx = PagedAttentionContext(self.cache, batch, backend=self.backend)
        return self.model(batch.input_ids, batch.positions, ctx)

    def _choose(self, logits: torch.Tensor, seqs: list, rows: list[int],
                drafts: list[list[int]]) -> None:
        """Append one guess per row: the argmax, or a draw from q for a sampled draft."""
        picks = logits.argmax(-1).tolist()
        if self.sampled:
            live = [r for r, i in enumerate(rows) if not seqs[i].request.params.greedy]
            if live:
                q = sampling_probs(logits[live], [seqs[rows[r]].request.params for r in live])
                for r, q_row in zip(live, q):
                    seq = seqs[rows[r]]
                    gen = seq.generator or self.generator
                    picks[r] = int(torch.multinomial(q_row, 1, generator=gen))
                    seq.spec_probs.append(q_row)
        for i, t in zip(rows, picks):
            drafts[i].append(t)

    def propose(self, seqs: list, ks: list[int], out: Any) -> list[list[int]]:
        """Each sequence's proposals (``[]`` for none); after catching the draft cache up."""
        drafts: list[list[int]] = [[] for _ in seqs]
        for seq in seqs:
            seq.spec_probs = []
        new = dict(zip(map(id, out.seqs), out.num_new))
        chunks, wants, who = [], [], []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            seq.draft_computed = min(seq.draft_computed, seq.num_computed)
            end = seq.num_tokens if k else seq.num_computed + new[id(seq)]
            if end > seq.draft_computed:
                chunks.append((seq.token_ids[seq.draft_computed : end], seq.draft_computed,
                               seq.block_table))
                wants.append(bool(k))
                if k:
                    who.append(i)
                seq.draft_computed = end
        if not chunks or not who:
            if chunks:
                self._forward(chunks, wants)
            return drafts
        self._choose(self._forward(chunks, wants), seqs, who, drafts)
        for step in range(1, max(ks)):
            live = [i for i in who if ks[i] > step]
            if not live:
                break
            chunks = []
            for i in live:
                seq = seqs[i]
                chunks.append(([drafts[i][-1]], seq.num_tokens + step - 1, seq.block_table))
                seq.draft_computed = seq.num_tokens + step
            self._choose(self._forward(chunks, [True] * len(chunks)), seqs, live, drafts)
        return drafts


def make_proposer(cfg: SpeculativeConfig, target: Transformer, engine_config: Any,
                  runner: Any = None):
    """The proposer of ``cfg.method`` for ``target`` (loads a draft model by name if needed;
    EAGLE takes the ``runner``'s hidden states)."""
    if cfg.method == "ngram":
        return NgramProposer(cfg)
    if engine_config.tensor_parallel_size > 1:
        raise ValueError(f"speculative method {cfg.method!r} is not supported with tensor "
                         "parallelism (use 'ngram')")
    sampled = cfg.draft_sampling == "sampled"
    if cfg.method == "eagle":
        from infer_lab.engine.eagle import EagleProposer

        if any(target.config.sliding_windows) and cfg.token_tree != chain_paths(
                cfg.num_speculative_tokens):
            raise ValueError("tree drafts need a model without sliding-window attention")
        return EagleProposer(cfg.model, target, engine_config, runner, cfg.token_tree, sampled)
    draft: Any  # a Transformer: the target's first layers, one given, or one loaded
    if cfg.method == "early_exit":
        assert cfg.num_layers is not None  # SpeculativeConfig checks it for early_exit
        draft = early_exit_model(target, cfg.num_layers)
    elif isinstance(cfg.model, nn.Module):
        draft = cfg.model
    else:
        from infer_lab.model.loader import load

        draft, _ = load(cfg.model, target.device, target.dtype)
    return DraftModelProposer(draft, target, engine_config, sampled=sampled)


# ---------------------------------------------------------------------- acceptance
def accepted_prefix(draft: list[int], target: list[int]) -> list[int]:
    """``target[: a + 1]`` where the first ``a`` drafts equal the target's tokens.

    ``target`` holds the target's own token at each of the ``len(draft) + 1`` positions (argmax
    for greedy requests, a sample for sampled ones): with a deterministic proposal, accepting the
    guess exactly when it equals the target's sample leaves the output what it was.
    """
    a = 0
    while a < len(draft) and draft[a] == target[a]:
        a += 1
    return target[: a + 1]


def rejection_sample(
    p: torch.Tensor, q: torch.Tensor, draft_token: int, generator: torch.Generator | None = None
) -> tuple[int, bool]:
    """The rule for a *sampled* draft: keep ``draft_token`` (drawn from ``q``) with probability
    ``min(1, p/q)``; otherwise draw from ``norm(max(0, p - q))``. The result is distributed as
    ``p`` (Leviathan et al. 2023, Theorem 1). Returns ``(token, accepted)``.
    """
    u = torch.rand((), generator=generator, device=p.device)
    px, qx = p[draft_token], q[draft_token]
    if qx > 0 and u * qx <= px:
        return draft_token, True
    residual = (p - q).clamp_min(0)
    if residual.sum() <= 0:  # p == q: nothing to correct
        residual = p
    return int(torch.multinomial(residual / residual.sum(), 1, generator=generator)), False


def verify_sampled(p: torch.Tensor, q: torch.Tensor, draft: list[int],
                   generator: torch.Generator | None = None) -> list[int]:
    """The tokens a sampled draft's step keeps: the rejection rule at each guess in turn.

    ``p`` ``[k + 1, vocab]``: the target's distribution at each guessed position and after the
    last; ``q`` ``[k, vocab]``: the draft's, from which ``draft`` was drawn. Guesses are kept
    while :func:`rejection_sample` keeps them; the first rejected one is replaced by its
    corrected draw and ends the run; if all are kept, a bonus token is drawn from ``p[k]``.
    """
    kept: list[int] = []
    for j, x in enumerate(draft):
        token, accepted = rejection_sample(p[j], q[j], x, generator)
        kept.append(token)
        if not accepted:
            return kept
    kept.append(int(torch.multinomial(p[len(draft)], 1, generator=generator)))
    return kept
