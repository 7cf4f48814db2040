"""The engine's step loop: schedule, run the model once, sample, detokenize, retire.

:class:`LLMEngine` knows nothing of HTTP or of wall-clock arrival patterns: a caller adds requests
(:meth:`add_request`), calls :meth:`step` as often as it likes, and gets back, per request that
moved, what the step added. The offline :class:`~infer_lab.engine.llm.LLM` and the server of
Chapter 6 are both thin loops around it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from infer_lab.cache.kv_quant import kv_storage_bytes
from infer_lab.cache.planner import plan_memory
from infer_lab.engine.config import EngineConfig
from infer_lab.engine.kv_cache_manager import KVCacheManager
from infer_lab.engine.model_runner import ModelRunner
from infer_lab.engine.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    SpecDecodeRates,
    TokenLogprobs,
)
from infer_lab.engine.sampler import Sampler, apply_penalties, sampling_probs
from infer_lab.engine.sampling_params import SamplingParams
from infer_lab.engine.scheduler import make_scheduler
from infer_lab.engine.sequence import Request, Sequence, SequenceStatus
from infer_lab.engine.speculative import (
    SpeculativeConfig,
    accepted_prefix,
    make_proposer,
    verify_sampled,
)
from infer_lab.engine.stop import StopMatcher
from infer_lab.engine.structured import StructuredOutputs
from infer_lab.model.generate import stop_token_ids
from infer_lab.model.quantize import check_model_quantization, model_weight_bytes
from infer_lab.model.tokenizer import Tokenizer
from infer_lab.model.transformer import Transformer
from infer_lab.utils import cdiv

CPU_KV_BYTES = 1 << 30  # default KV pool on CPU: 1 GiB (or less, if that already fits everything)
MAX_ERROR_LEN = 300  # characters of an exception's text kept in a failed request's error

log = logging.getLogger(__name__)


@dataclass
class EngineStats(SpecDecodeRates):
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which found cached
    num_steps: int
    num_failed_requests: int = 0  # requests the engine finished with finish_reason "error"
    # Speculative decoding (vLLM's spec_decode names): verification forwards that carried
    # proposals for a sequence, tokens proposed, and of those accepted by the target.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0



@dataclass
class StepRecord:
    """What one step did (kept when ``log_steps``): the raw material of the timeline pictures.

    ``work`` holds ``(slot, request_id, num_tokens, kind)`` with kind "prefill", "decode",
    "pad" (static padding, in ``num_tokens`` extra tokens) or "idle" (a finished request's slot).
    """

    index: int
    start: float
    end: float
    num_tokens: int
    work: list[tuple[int, str, int, str]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    num_waiting: int = 0
    kv_blocks_used: int = 0


def sample_seed(seed: int, index: int) -> int:
    """Seed of sample ``index`` of a request seeded with ``seed`` (sample 0 uses ``seed``)."""
    return seed if index == 0 else hash((seed, index)) & (2**63 - 1)


class LLMEngine:
    """Continuous (or static) batching over a paged KV cache, one :meth:`step` at a time.

    ``LLMEngine(model, tokenizer, config)`` or ``LLMEngine(model, tokenizer, max_num_seqs=...)``:
    keywords replace fields of ``config`` (or of the default :class:`EngineConfig`). The engine
    resolves what the config leaves open (``max_model_len``: the model's context;
    ``num_kv_blocks``: from the memory) and keeps the result as :attr:`config`, the one place the
    scheduler, the KV manager and the runner read their limits from.
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        **kwargs: Any,
    ) -> None:
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.model, self.tokenizer = model, tokenizer
        config = EngineConfig.from_kwargs(config, **kwargs)
        check_model_quantization(model, config.quantization)
        if config.tensor_parallel_size > 1:
            # Rank 0 keeps its slice and starts the other ranks; from here on the model is the
            # driver that mirrors every forward on them (CUDA graphs would not capture that).
            from infer_lab.engine.tensor_parallel import TensorParallelWorkers

            model = self.model = TensorParallelWorkers.start(model, config.tensor_parallel_size)
            config = config.replace(use_cuda_graphs=False)
        self.config = self._resolve(config)
        self.kv = KVCacheManager(self.config)
        self.scheduler = make_scheduler(self.config, self.kv)
        self.runner = ModelRunner(model, self.config)
        self.spec: SpeculativeConfig | None = None
        self.proposer = None
        if self.config.speculative_config is not None:
            self.spec = SpeculativeConfig.parse(self.config.speculative_config)
            self.proposer = make_proposer(self.spec, model, self.config)
        self.spec_counts = [0, 0, 0]  # drafts, draft tokens, accepted tokens
        gen = torch.Generator(device=model.device)
        gen.manual_seed(self.config.seed)
        self.sampler = Sampler(gen)
        self.eos_ids = frozenset(stop_token_ids(model, tokenizer))
        self.structured = StructuredOutputs(tokenizer, model.config.vocab_size, self.eos_ids)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self.num_steps = 0
        self.num_failed_requests = 0
        self.step_log: list[StepRecord] = []

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def _resolve(self, config: EngineConfig) -> EngineConfig:
        """``config`` with ``max_model_len`` and ``num_kv_blocks`` made concrete."""
        context = self.model.config.max_position_embeddings
        max_model_len = min(config.max_model_len or context, context)
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            num_blocks = self._default_num_blocks(config, max_model_len)
        return config.replace(max_model_len=max_model_len, num_kv_blocks=num_blocks)

    def _default_num_blocks(self, config: EngineConfig, max_model_len: int) -> int:
        cfg, dtype_bytes = self.model.config, self.model.dtype.itemsize
        block_size, util = config.block_size, config.gpu_memory_utilization
        # Chapter 8: quantized weights leave more room, an 8-bit KV cache costs less per token
        per_block = int(kv_storage_bytes(cfg, config.kv_cache_dtype, dtype_bytes)) * block_size
        weight_bytes: float = dtype_bytes
        if getattr(self.model, "quantization", None):
            weight_bytes = model_weight_bytes(self.model) / cfg.num_parameters()
        if self.model.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.model.device).total_memory
            plan = plan_memory(int(total * util), cfg, weight_dtype_bytes=weight_bytes,
                               kv_dtype_bytes=dtype_bytes, reserve_bytes=0)
            free_now = torch.cuda.mem_get_info(self.model.device)[0]
            return max(1, min(plan.kv_budget_bytes // per_block, int(free_now * util) // per_block))
        everything = config.max_num_seqs * cdiv(max_model_len, block_size)
        return max(1, min(everything, CPU_KV_BYTES // per_block))

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a prompt (text or token ids). Raises ``ValueError`` if it cannot ever run."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.model.config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary of "
                                 f"{self.model.config.vocab_size}")
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}: "
                f"{len(ids) + params.max_tokens} tokens exceed the model's context of "
                f"{self.max_model_len}"
            )
        need = cdiv(len(ids) + params.max_tokens, self.config.block_size)
        if need > self.config.num_kv_blocks:
            raise ValueError(f"this request may need {need} KV blocks but the pool has only "
                             f"{self.config.num_kv_blocks}")
        if params.structured_outputs is not None:  # compiled once per constraint (cached)
            self.structured.compile(params.structured_outputs)
        self.scheduler.check(params)
        stops = frozenset(params.stop_token_ids or ())
        if not params.ignore_eos:
            stops |= self.eos_ids
        now = time.perf_counter()
        request = Request(request_id, text, ids, params,
                          now if arrival_time is None else arrival_time, stops)
        request.forked = params.n == 1
        if params.stop_strings:
            request.stop_matcher = StopMatcher(params.stop_strings)
        request.seqs.append(self._new_seq(request, 0, list(ids)))
        self.requests[request_id] = request
        self.scheduler.add(request.seqs[0])

    def _new_seq(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        params = request.params
        seq = Sequence(next(self._seq_ids), request, index, token_ids,
                       len(request.prompt_token_ids))
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.model.device)
            seq.generator.manual_seed(sample_seed(params.seed, index))
        if params.detokenize:
            seq.detokenizer = self.tokenizer.detokenizer(request.prompt_token_ids)
        if params.structured_outputs is not None:
            self.structured.attach(seq, params.structured_outputs, index == 0)
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False if it is unknown or already done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        live = [s for s in request.seqs if not s.is_finished]
        self.scheduler.abort(request.seqs)
        for seq in live:
            seq.finish_reason = "abort"
        request.finish_time = time.perf_counter()
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (also done at interpreter exit)."""
        workers = getattr(self.model, "tp_workers", None)
        if workers is not None:
            workers.shutdown()

    def get_stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_kv_blocks_used=self.kv.num_used_blocks, num_kv_blocks_total=self.kv.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv.prefix_queries, prefix_cache_hits=self.kv.prefix_hits,
            num_steps=self.num_steps, num_failed_requests=self.num_failed_requests,
            spec_num_drafts=self.spec_counts[0], spec_num_draft_tokens=self.spec_counts[1],
            spec_num_accepted_tokens=self.spec_counts[2],
        )

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample; returns the requests that got new tokens.

        Whatever goes wrong with one request after the forward (sampling it, detokenizing it,
        matching its stop strings) fails that request alone: it finishes with
        ``finish_reason="error"`` and an ``error`` message, its blocks go back, and every other
        request of the step continues untouched. Only a failure of the forward itself, which
        belongs to no single request, propagates.
        """
        start = time.perf_counter()
        if self.spec is not None:
            self.scheduler.num_lookahead = self._lookahead()
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        record = self._record(out, start) if self.config.log_steps else None
        speculating = self.spec is not None and self._propose(out)
        logits, sampled = self.runner.execute(out)
        for seq, n in zip(out.seqs, out.num_new):
            seq.num_computed += n - len(seq.spec_token_ids)
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = start
        if self.kv.enable_prefix_caching:
            for seq in out.seqs:
                self.kv.cache_blocks(seq)
        if any(not s.request.forked for s in sampled):
            logits, sampled = self._fork(logits, sampled)
        failed: dict[Request, str] = {}
        if speculating:
            rows, prefixes, states = self._spec_rows(sampled)
            tokens, verified = self._sample_speculative(logits, rows, failed, prefixes)
        else:
            rows, states, verified = sampled, {}, {}
            tokens = self._sample(logits, rows, failed) if sampled else []
        logprobs = self._logprobs(logits, rows, tokens, failed)
        runs = (self._accept(sampled, tokens, logprobs, states, verified) if speculating
                else [[tl] for tl in zip(tokens, logprobs)])
        now = time.perf_counter()
        finished = []
        for seq, run in zip(sampled, runs):
            if seq.request in failed:
                continue
            try:
                for token, lp in run:
                    self._append(seq, token, now, lp)
                    if seq.is_finished:
                        break
            except Exception as e:
                failed[seq.request] = self._describe(seq.request, "its new token", e)
                continue
            if seq.is_finished:
                finished.append(seq)
        if speculating:
            self._rollback(out)
        self.scheduler.finish(finished)
        self.num_steps += 1
        outputs = []
        for request in dict.fromkeys(s.request for s in sampled):
            if request not in failed:
                if request.is_finished:
                    request.finish_time = now
                    self.requests.pop(request.request_id, None)
                try:
                    outputs.append(self._output(request))
                    continue
                except Exception as e:
                    failed[request] = self._describe(request, "its output", e)
            outputs.append(self._fail(request, failed[request], now))
        if record is not None:
            record.end = now
            self.step_log.append(record)
        return outputs

    def _fork(self, logits: torch.Tensor, sampled: list[Sequence]):
        """Parallel samples: a request whose prompt was just prefilled becomes n sequences."""
        rows, seqs, r = [], [], 0
        for seq in sampled:
            rows += range(r, r + 1 + len(seq.spec_token_ids))  # a speculating sequence's rows
            seqs.append(seq)
            request = seq.request
            if not request.forked:
                children = [self._new_seq(request, k, list(seq.token_ids))
                            for k in range(1, request.params.n)]
                self.scheduler.add_forked(seq, children)
                request.seqs += children
                rows += [r] * len(children)
                seqs += children
            r += 1 + len(seq.spec_token_ids)
        return logits[rows], seqs

    # ------------------------------------------------------------------ per request, isolated
    def _sample(self, logits: torch.Tensor, sampled: list[Sequence],
                failed: dict[Request, str], prefixes: list[list[int]] | None = None) -> list[int]:
        """One token per row; if the batched call raises, row by row, failing only bad rows.

        ``prefixes`` (speculation): the proposals before each row's position, which count as
        output for the penalties of that row.
        """
        params = [s.request.params for s in sampled]
        gens = [s.generator for s in sampled]
        penalised = any(p.has_penalties for p in params)
        prompts = [s.token_ids[: s.num_prompt_tokens] for s in sampled] if penalised else None
        outs = [s.output_token_ids for s in sampled] if penalised else None
        if outs is not None and prefixes is not None:
            outs = [o + p for o, p in zip(outs, prefixes)]
        logits = self.structured.mask_logits(logits, sampled)  # constrained rows only
        try:
            return self.sampler(logits, params, gens, prompts, outs)
        except Exception:
            pass
        tokens = []
        for i, seq in enumerate(sampled):
            try:
                row = self.sampler(logits[i : i + 1], params[i : i + 1], gens[i : i + 1],
                                   prompts and prompts[i : i + 1], outs and outs[i : i + 1])
                tokens.append(row[0])
            except Exception as e:
                failed.setdefault(seq.request, self._describe(seq.request, "sampling", e))
                tokens.append(-1)
        return tokens

    def _logprobs(self, logits: torch.Tensor, sampled: list[Sequence], tokens: list[int],
                  failed: dict[Request, str]) -> list[TokenLogprobs | None]:
        """Log-probabilities of the raw logits for the rows whose request asked (others: None)."""
        out: list[TokenLogprobs | None] = [None] * len(sampled)
        rows = [i for i, s in enumerate(sampled)
                if s.request.params.logprobs is not None and s.request not in failed]
        if not rows:
            return out
        try:
            raw = torch.log_softmax(logits[rows].float(), dim=-1)
            k = min(max(sampled[i].request.params.logprobs for i in rows), raw.shape[1])
            chosen = raw.gather(1, torch.tensor([[tokens[i]] for i in rows],
                                                device=raw.device)).squeeze(1).tolist()
            top_lp, top_ids = raw.topk(k, dim=-1) if k else (raw[:, :0], raw[:, :0].long())
            top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
        except Exception as e:
            for i in rows:
                failed.setdefault(sampled[i].request, self._describe(
                    sampled[i].request, "log-probabilities", e))
            return out
        for r, i in enumerate(rows):
            want = sampled[i].request.params.logprobs
            out[i] = TokenLogprobs(tokens[i], chosen[r],
                                   list(zip(top_ids[r][:want], top_lp[r][:want])))
        return out

    # ------------------------------------------------------------------ speculative decoding
    def _lookahead(self) -> int:
        """Proposals per sequence this step: k, or 0 above ``disable_by_batch_size``."""
        limit = self.spec.disable_by_batch_size
        if limit is not None and self.scheduler.num_running + self.scheduler.num_waiting >= limit:
            return 0
        return self.spec.num_speculative_tokens

    def _propose(self, out) -> bool:
        """Fill the lookahead slots the scheduler granted; False if nothing was proposed."""
        ks = [s.spec_slots for s in out.seqs]
        if not any(ks):
            return False
        drafts = self.proposer.propose(out.seqs, ks, out)
        proposed = False
        for i, (seq, k, d) in enumerate(zip(out.seqs, ks, drafts)):
            if not k:
                continue
            if self.structured.is_attached(seq):
                d = []  # constrained: proposals are not checked against the grammar
            if d:
                seq.spec_token_ids = d[:k]
                seq.spec_probs = seq.spec_probs[:k] if seq.spec_probs else []
                out.num_new[i] = 1 + len(seq.spec_token_ids)
                proposed = True
            else:  # nothing to verify: the lookahead slots go back before the forward
                seq.spec_slots, out.num_new[i], seq.spec_probs = 0, 1, []
                self.kv.trim(seq, seq.num_computed + 1)
        return proposed

    def _spec_rows(self, sampled: list[Sequence]):
        """One row per position to score: each sequence's last token and its proposals."""
        rows, prefixes, states = [], [], {}
        for seq in sampled:
            spec = seq.spec_token_ids
            for j in range(len(spec) + 1):
                rows.append(seq)
                prefixes.append(spec[:j])
            if (spec and not seq.spec_probs and seq.generator is not None
                    and not seq.request.params.greedy):
                states[seq] = seq.generator.get_state()  # rewound once we know what is kept
        return rows, prefixes, states

    def _sample_speculative(self, logits: torch.Tensor, rows: list[Sequence],
                            failed: dict[Request, str], prefixes: list[list[int]]):
        """A token for every scored row, and the run each sampled draft keeps.

        Rows of deterministic proposals are sampled as without speculation (:meth:`_sample`).
        The rows of a sequence whose draft *sampled* its guesses (``spec_probs`` holds q) get
        the target's distribution p instead (penalties counting the guesses before each row,
        then temperature, top-k, top-p: what the request samples from there), and the rejection
        rule decides the run (:func:`verify_sampled`); rows past the run's end are unused.
        """
        rej = [i for i, s in enumerate(rows) if s.spec_probs]
        if not rej:
            return self._sample(logits, rows, failed, prefixes), {}
        is_rej = set(rej)
        plain = [i for i in range(len(rows)) if i not in is_rej]
        tokens = [0] * len(rows)
        if plain:
            sub = self._sample(logits[plain], [rows[i] for i in plain], failed,
                               [prefixes[i] for i in plain])
            for i, t in zip(plain, sub):
                tokens[i] = t
        seqs = [rows[i] for i in rej]
        verified: dict[Sequence, list[int]] = {}
        try:
            sub_logits, params = logits[rej], [s.request.params for s in seqs]
            if any(p.has_penalties for p in params):
                sub_logits = apply_penalties(
                    sub_logits, params, [s.token_ids[: s.num_prompt_tokens] for s in seqs],
                    [s.output_token_ids + prefixes[i] for s, i in zip(seqs, rej)])
            probs = sampling_probs(sub_logits, params)
        except Exception as e:
            for seq in seqs:
                failed.setdefault(seq.request, self._describe(seq.request, "sampling", e))
            return tokens, {s: [0] for s in seqs}
        r = 0
        while r < len(rej):
            seq = seqs[r]
            m = len(seq.spec_token_ids) + 1
            try:
                run = verify_sampled(probs[r : r + m], torch.stack(seq.spec_probs),
                                     seq.spec_token_ids, seq.generator or self.sampler.generator)
            except Exception as e:
                failed.setdefault(seq.request, self._describe(seq.request, "sampling", e))
                run = [0]
            verified[seq] = run
            for j, t in enumerate(run):
                tokens[rej[r + j]] = t
            r += m
        return tokens, verified

    def _accept(self, sampled, tokens, logprobs, states, verified) -> list[list[tuple]]:
        """Per sequence, the run of tokens kept: the target's own token at each position,
        up to and including the first one that differs from the proposal (or, for a sampled
        draft, the run the rejection rule kept)."""
        runs, r = [], 0
        vocab = self.model.config.vocab_size
        for seq in sampled:
            spec = seq.spec_token_ids
            m = len(spec) + 1
            if not spec:
                runs.append([(tokens[r], logprobs[r])])
                r += 1
                continue
            kept = verified.get(seq) or accepted_prefix(spec, tokens[r : r + m])
            runs.append(list(zip(kept, logprobs[r : r + len(kept)])))
            r += m
            gen = seq.generator
            if seq in states:  # as many draws as tokens kept, as without speculation
                gen.set_state(states[seq])
                for _ in kept:
                    torch.empty(vocab, device=self.model.device).exponential_(generator=gen)
            accepted = len(kept) - 1
            seq.spec_steps += 1
            seq.spec_proposed += len(spec)
            seq.spec_accepted += accepted
            self.spec_counts[0] += 1
            self.spec_counts[1] += len(spec)
            self.spec_counts[2] += accepted
        return runs

    def _rollback(self, out) -> None:
        """After verification: the KV of the kept tokens counts as computed; the slots of
        rejected proposals go back to the pool; the proposals are cleared."""
        for seq in out.seqs:
            if not seq.spec_slots:
                continue
            seq.spec_slots, seq.spec_token_ids, seq.spec_probs = 0, [], []
            if seq.is_finished or seq.status is not SequenceStatus.RUNNING:
                continue  # its blocks go back whole (finished, or failed and aborted)
            # the last real token and every kept token but the newest have their K/V now
            seq.num_computed = seq.num_tokens - 1
            seq.draft_computed = min(seq.draft_computed, seq.num_computed)
            self.kv.trim(seq, seq.num_computed)
            self.kv.cache_blocks(seq)

    def _describe(self, request: Request, stage: str, error: Exception) -> str:
        log.warning("request %s failed alone in %s", request.request_id, stage, exc_info=error)
        text = f"{type(error).__name__}: {error}"
        return f"the engine failed this request ({stage}): {text[:MAX_ERROR_LEN]}"

    def _fail(self, request: Request, message: str, now: float) -> RequestOutput:
        """Finish ``request`` with ``finish_reason="error"`` and free what it holds."""
        self.scheduler.abort(request.seqs)
        for seq in request.seqs:
            seq.finish_reason, seq.stop_reason = "error", None
        request.finish_time = now
        self.requests.pop(request.request_id, None)
        self.num_failed_requests += 1
        completions = []
        for seq in request.seqs:
            text = seq.text[: seq.emitted_text_len]  # only what was already handed out
            out_ids = seq.output_token_ids[: seq.emitted_tokens]
            completions.append(CompletionOutput(
                seq.index, text, out_ids, "error", None, "", [],
                list(seq.token_times[: seq.emitted_tokens]), seq.num_preemptions,
                None if seq.logprobs is None else seq.logprobs[: seq.emitted_tokens], [],
            ))
        metrics = _request_metrics(request)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             completions, True, metrics, message)

    def _append(self, seq: Sequence, token: int, now: float,
                logprobs: TokenLogprobs | None = None) -> None:
        request, params = seq.request, seq.request.params
        seq.token_ids.append(token)
        seq.token_times.append(now)
        if logprobs is not None:
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(logprobs)
        if request.first_token_time is None:
            request.first_token_time = now
        searched = len(seq.text)
        if seq.detokenizer is not None:
            seq.text += seq.detokenizer.add(token)
        complete = self.structured.advance(seq, token)  # raises if it breaks the grammar
        if token in request.stop_ids:
            self._finish(seq, "stop", None if token in self.eos_ids else token)
        elif request.stop_matcher is not None and self._stop_string(seq, searched):
            return
        elif seq.num_output_tokens >= params.max_tokens:
            self._finish(seq, "length", None)
        elif complete:  # the grammar took its stop token though EOS is ignored
            self._finish(seq, "stop", None)

    def _stop_string(self, seq: Sequence, searched: int) -> bool:
        """Find a stop string ending in the text added since ``searched``; trim it and finish."""
        hit = seq.request.stop_matcher.find(seq.text, searched)
        if hit is None:
            return False
        at, stop = hit
        seq.text = seq.text[:at]
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = "stop", stop
        return True

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | None) -> None:
        if seq.detokenizer is not None:
            searched = len(seq.text)
            seq.text += seq.detokenizer.flush()
            if seq.request.stop_matcher is not None and self._stop_string(seq, searched):
                return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason

    def _output(self, request: Request) -> RequestOutput:
        completions = []
        for seq in request.seqs:
            hold = 0 if seq.is_finished else max(0, seq.request.params.max_stop_len - 1)
            safe = max(seq.emitted_text_len, len(seq.text) - hold)
            delta_text = seq.text[seq.emitted_text_len : safe]
            seq.emitted_text_len = safe
            out_ids = seq.output_token_ids
            delta_ids = out_ids[seq.emitted_tokens :]
            lps = seq.logprobs
            delta_lps = [] if lps is None else lps[seq.emitted_tokens :]
            seq.emitted_tokens = len(out_ids)
            completions.append(CompletionOutput(
                seq.index, seq.text[:safe], out_ids, seq.finish_reason, seq.stop_reason,
                delta_text, delta_ids, list(seq.token_times), seq.num_preemptions,
                None if lps is None else list(lps), delta_lps,
            ))
        metrics = _request_metrics(request)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             completions, request.is_finished, metrics)

    def _record(self, out, start: float) -> StepRecord:
        work = []
        for seq, n in zip(out.seqs, out.num_new):
            decode = n == 1 and seq.num_output_tokens > 0 and seq.num_computed == seq.num_tokens - 1
            work.append((seq.slot, seq.request.request_id, n, "decode" if decode else "prefill"))
        for seq, pad in zip(out.seqs, out.pad_tokens):
            if pad:
                work.append((seq.slot, seq.request.request_id, pad, "pad"))
        for slot in out.idle_slots:
            work.append((slot, "", 1, "idle"))
        return StepRecord(
            self.num_steps, start, start, out.num_tokens + sum(out.pad_tokens) + out.num_idle,
            work, [s.request.request_id for s in out.preempted], self.scheduler.num_waiting,
            self.kv.num_used_blocks,
        )


def _request_metrics(request: Request) -> RequestMetrics:
    """A request's timestamps and its samples' speculative-decoding counts, summed."""
    return RequestMetrics(request.arrival_time, request.first_scheduled_time,
                          request.first_token_time, request.finish_time,
                          sum(s.spec_steps for s in request.seqs),
                          sum(s.spec_proposed for s in request.seqs),
                          sum(s.spec_accepted for s in request.seqs))
