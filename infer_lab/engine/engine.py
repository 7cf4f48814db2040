"""The engine's step loop: schedule, (propose), execute, sample, update, output.

:class:`LLMEngine` knows nothing of HTTP or of wall-clock arrival patterns: a caller adds requests
(:meth:`add_request`), calls :meth:`step` as often as it likes, and gets back, per request that
moved, what the step added. The offline :class:`~infer_lab.engine.llm.LLM` and the server of
Chapter 6 are both thin loops around it.

Each part of a step has one owner, as in vLLM v1: the :class:`~.scheduler.Scheduler` decides who
runs and keeps every sequence's accounting; the :class:`~.executor.Executor` runs the model; the
:class:`~.step_sampler.StepSampler` (or the :class:`~.spec_decode.SpeculativeDecoder`, which also
proposes) picks the tokens; the :class:`~.output_processor.OutputProcessor` turns them into text
and outputs. The engine makes requests and sequences and calls the parts in order.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from infer_lab.engine.config import EngineConfig
from infer_lab.engine.executor import Executor
from infer_lab.engine.kv_cache_manager import KVCacheManager
from infer_lab.engine.output_processor import OutputProcessor
from infer_lab.engine.outputs import RequestOutput, SpecDecodeRates
from infer_lab.engine.sampler import Sampler
from infer_lab.engine.sampling_params import SamplingParams
from infer_lab.engine.scheduler import SchedulerOutput, make_scheduler
from infer_lab.engine.sequence import Request, Sequence
from infer_lab.engine.spec_decode import SpeculativeDecoder
from infer_lab.engine.step_sampler import SampledTokens, StepSampler
from infer_lab.engine.stop import StopMatcher
from infer_lab.engine.structured import StructuredOutputs
from infer_lab.model.generate import stop_token_ids
from infer_lab.model.tokenizer import Tokenizer
from infer_lab.model.transformer import Transformer
from infer_lab.utils import cdiv


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
    keywords replace fields of ``config`` (or of the default :class:`EngineConfig`). The executor
    resolves what the config leaves open (``max_model_len``: the model's context;
    ``num_kv_blocks``: from the memory) and the result is :attr:`config`, the one place the
    scheduler, the KV manager and the runner read their limits from.
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer,
                 config: EngineConfig | None = None, **kwargs: Any) -> None:
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.executor = Executor(model, EngineConfig.from_kwargs(config, **kwargs))
        self.model, self.tokenizer = self.executor.model, tokenizer
        self.config, self.runner = self.executor.config, self.executor.runner
        self.eos_ids = frozenset(stop_token_ids(model, tokenizer))
        self.structured = StructuredOutputs(tokenizer, model.config.vocab_size, self.eos_ids)
        self.kv = KVCacheManager(self.config)
        self.scheduler = make_scheduler(self.config, self.kv, self.eos_ids, self.structured)
        generator = torch.Generator(device=model.device)
        generator.manual_seed(self.config.seed)
        self.sampler = StepSampler(Sampler(generator), self.structured)
        self.spec: SpeculativeDecoder | None = None
        if self.config.speculative_config is not None:
            self.spec = SpeculativeDecoder(self.config.speculative_config, self.model, self.config,
                                           self.sampler, self.scheduler, self.runner)
        self.output_processor = OutputProcessor(self.scheduler)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self.num_steps = 0
        self.step_log: list[StepRecord] = []

    @property
    def max_model_len(self) -> int:
        assert self.config.max_model_len is not None  # resolve_config filled it
        return self.config.max_model_len

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule → (propose) → execute → sample → update → output.

        Whatever goes wrong with one request after the forward (sampling it, detokenizing it,
        building its output) fails that request alone: it finishes with ``finish_reason="error"``
        and an ``error``, its blocks go back, and every other request of the step continues
        untouched. Only a failure of the forward itself, which belongs to no request, propagates.
        """
        start = time.perf_counter()
        scheduled = self.scheduler.schedule(self.spec.num_lookahead() if self.spec else 0)
        if scheduled.is_empty:
            return []
        record = self._record(scheduled, start) if self.config.log_steps else None
        if self.spec is not None:
            self.spec.propose(scheduled)
        logits, seqs = self.executor.execute_model(scheduled)
        self.scheduler.update_after_forward(scheduled, start)
        logits, seqs = self._fork(logits, seqs)
        sampled = self._sample(logits, seqs)
        now = time.perf_counter()
        self.scheduler.update_from_output(sampled, now)
        stops = self.output_processor.detokenize(sampled, now)
        if self.spec is not None:
            self.spec.rollback(scheduled)
        self.scheduler.retire(scheduled, sampled, stops, now)
        outputs = self.output_processor.make_outputs(sampled, now)
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        self.num_steps += 1
        if record is not None:
            record.end = now
            self.step_log.append(record)
        return outputs

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampledTokens:
        if self.spec is not None:
            return self.spec.verify(logits, seqs)
        return self.sampler.sample(logits, seqs)

    def _fork(self, logits: torch.Tensor, seqs: list[Sequence]):
        """Parallel samples: a request whose prompt was just prefilled becomes n sequences."""
        if all(s.request.forked for s in seqs):
            return logits, seqs
        rows: list[int] = []
        forked: list[Sequence] = []
        r = 0
        for seq in seqs:
            width = 1 + len(seq.spec_token_ids)  # a speculating sequence's rows
            rows += range(r, r + width)
            forked.append(seq)
            request = seq.request
            if not request.forked:
                children = [self._new_seq(request, k, list(seq.token_ids))
                            for k in range(1, request.params.n)]
                self.scheduler.add_forked(seq, children)
                request.seqs += children
                rows += [r] * len(children)
                forked += children
            r += width
        return logits[rows], forked

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | Seq[int],
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a prompt (text or token ids). Raises ``ValueError`` if it cannot ever run."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = (prompt, self.tokenizer.encode(prompt)) if isinstance(prompt, str) else (
            None, self._check_ids(prompt))
        self._check_fits(len(ids), params)
        if params.structured_outputs is not None:  # compiled once per constraint (cached)
            self.structured.compile(params.structured_outputs)
        self.scheduler.check(params)
        stops = frozenset(params.stop_token_ids or ())
        if not params.ignore_eos:
            stops |= self.eos_ids
        params.bind(stops, self.model.config.vocab_size)  # min_tokens, logit_bias
        request = Request(request_id, text, ids, params,
                          time.perf_counter() if arrival_time is None else arrival_time, stops,
                          StopMatcher(params.stop_strings) if params.stop_strings else None)
        request.forked = params.n == 1
        request.seqs.append(self._new_seq(request, 0, list(ids)))
        self.requests[request_id] = request
        self.scheduler.add(request.seqs[0])

    def _check_ids(self, prompt: Seq[int]) -> list[int]:
        ids = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary of {vocab}")
        return ids

    def _check_fits(self, num_prompt: int, params: SamplingParams) -> None:
        if not num_prompt:
            raise ValueError("the prompt is empty (no tokens)")
        total = num_prompt + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"the prompt has {num_prompt} tokens and max_tokens is {params.max_tokens}: "
                f"{total} tokens exceed the model's context of {self.max_model_len}")
        need = cdiv(total, self.config.block_size)
        assert self.config.num_kv_blocks is not None  # resolve_config filled it
        if need > self.config.num_kv_blocks:
            raise ValueError(f"this request may need {need} KV blocks but the pool has only "
                             f"{self.config.num_kv_blocks}")

    def _new_seq(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        params = request.params
        generator = detokenizer = None
        if params.seed is not None:
            generator = torch.Generator(device=self.model.device)
            generator.manual_seed(sample_seed(params.seed, index))
        if params.detokenize:
            detokenizer = self.tokenizer.detokenizer(request.prompt_token_ids,
                                                     keep=params.keep_special_token_ids)
        seq = Sequence(next(self._seq_ids), request, index, token_ids,
                       len(request.prompt_token_ids), generator, detokenizer)
        if params.structured_outputs is not None:
            self.structured.attach(seq, params.structured_outputs, index == 0)
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False if it is unknown or already done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.abort(request.seqs, "abort", time.perf_counter())
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (also done when the engine goes)."""
        self.executor.shutdown()

    def get_stats(self) -> EngineStats:
        counts = self.spec.counts if self.spec is not None else None
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_kv_blocks_used=self.kv.num_used_blocks, num_kv_blocks_total=self.kv.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv.prefix_queries, prefix_cache_hits=self.kv.prefix_hits,
            num_steps=self.num_steps,
            num_failed_requests=self.output_processor.num_failed_requests,
            spec_num_drafts=counts.num_drafts if counts else 0,
            spec_num_draft_tokens=counts.num_draft_tokens if counts else 0,
            spec_num_accepted_tokens=counts.num_accepted_tokens if counts else 0,
        )

    def _record(self, out: SchedulerOutput, start: float) -> StepRecord:
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
