"""Who runs in the next step, and what a step's output changes: two policies, static and
continuous batching.

Both sit behind one interface. :meth:`Scheduler.schedule` returns the step's work: for each
sequence, how many of its tokens to compute. After the forward the scheduler owns the accounting
(vLLM v1's ``update_from_output``): :meth:`~Scheduler.update_after_forward` counts the K/V the
forward wrote, :meth:`~Scheduler.update_from_output` appends the tokens the step kept and stops a
sequence at a stop token, at ``max_tokens`` or at the end of its grammar, and
:meth:`~Scheduler.retire` cuts at the stop strings the output processor found, gives back
lookahead slots that verification rejected, and frees what finished. The queues, the batch
slots, preemption and abort are shared; each policy is a subclass.

- :class:`StaticScheduler` (the baseline): when nothing runs, take up to ``max_num_seqs``
  waiting requests, reserve KV for each one's prompt plus ``max_tokens``, prefill them padded to
  the longest prompt, and keep the batch until its last request finishes. Finished requests keep
  their slot: a padded batch computes a row for them anyway, so the runner computes a filler row
  (``num_idle``).
- :class:`ContinuousScheduler` (Orca, vLLM): every step, first the running sequences (oldest
  first) get their next tokens (1 for a decode, up to the rest of the prompt for a prefill in
  progress), then waiting requests are admitted while batch slots, free KV blocks and the step's
  token budget allow. A prompt longer than what is left of the budget is cut into chunks computed
  over several steps, mixed with the decodes (chunked prefill). When a running sequence needs a
  block and none is free, the newest running sequence is preempted: its blocks are freed and it
  goes back to the front of the queue, to be recomputed later (its tokens are kept, so its output
  is unchanged).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from infer_lab.engine.config import EngineConfig
from infer_lab.engine.kv_cache_manager import KVCacheManager
from infer_lab.engine.sampling_params import SamplingParams
from infer_lab.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from infer_lab.engine.step_sampler import SampledTokens
    from infer_lab.engine.structured import StructuredOutputs

WATERMARK = 0.01  # fraction of the KV blocks kept free when admitting (fewer preemptions)


@dataclass
class SchedulerOutput:
    """One step's work: compute ``num_new[i]`` tokens of ``seqs[i]``, in this order."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    pad_tokens: list[int] = field(default_factory=list)  # static prefill: padding per row
    num_idle: int = 0  # static decode: slots of finished requests, computed as filler
    idle_slots: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


class Scheduler:
    """The waiting queue, the running batch and the batch slots; a subclass is the policy.

    Limits come from ``config`` (``max_num_seqs``, ``max_num_batched_tokens``,
    ``enable_chunked_prefill``, and ``max_model_len``, which the engine has resolved).
    ``eos_ids`` tell a stop token that is the model's end of text (finish reason "stop", no
    stop reason) from one the request named; ``structured`` checks constrained tokens.
    """

    policy = ""

    def __init__(self, config: EngineConfig, kv: KVCacheManager,
                 eos_ids: Collection[int] = (),
                 structured: StructuredOutputs | None = None) -> None:
        if config.max_model_len is None:
            raise ValueError("the scheduler needs config.max_model_len (the engine resolves it)")
        self.config, self.kv = config, kv
        self.eos_ids, self.structured = frozenset(eos_ids), structured
        self.budget = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            self.budget = max(self.budget, config.max_model_len)  # a whole prompt in one step
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(config.max_num_seqs))
        self._reserved_slots = 0  # promised to samples not yet forked (n > 1)
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queues
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return sum(1 for s in self.running if not s.is_finished)

    def check(self, params: SamplingParams) -> None:
        """Raise ``ValueError`` if this policy can never run a request with ``params``."""
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} parallel samples cannot run together: the engine "
                             f"runs at most max_num_seqs={self.config.max_num_seqs}")

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self, num_lookahead: int = 0) -> SchedulerOutput:
        """The next step's work. ``num_lookahead``: proposal slots a decode may get (speculative
        decoding; they count against the token budget)."""
        out = self._schedule(num_lookahead)
        out.block_copies = self.kv.take_pending_copies()
        return out

    def _schedule(self, num_lookahead: int) -> SchedulerOutput:
        raise NotImplementedError

    # ------------------------------------------------------------------ after the forward
    def update_after_forward(self, out: SchedulerOutput, start: float) -> None:
        """The forward wrote the K/V of the scheduled tokens (proposals are settled later)."""
        for seq, n in zip(out.seqs, out.num_new):
            seq.num_computed += n - len(seq.spec_token_ids)
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = start
        if self.kv.enable_prefix_caching:
            for seq in out.seqs:
                self.kv.cache_blocks(seq)

    def update_from_output(self, sampled: SampledTokens, now: float) -> None:
        """Append the tokens each sequence keeps; stop it at a stop token, at ``max_tokens`` or
        where its grammar ends. A token that breaks the grammar fails that request alone."""
        for seq, run in zip(sampled.seqs, sampled.runs):
            if seq.request in sampled.failed:
                continue
            try:
                for token, _ in run:
                    self._append(seq, token, now)
                    if seq.is_finished:
                        break
            except Exception as e:
                sampled.fail(seq.request, "its new token", e)

    def _append(self, seq: Sequence, token: int, now: float) -> None:
        request = seq.request
        seq.token_ids.append(token)
        if request.first_token_time is None:
            request.first_token_time = now
        complete = self.structured is not None and self.structured.advance(seq, token)
        if token in request.stop_ids:
            self._mark_finished(seq, "stop", None if token in self.eos_ids else token)
        elif seq.num_output_tokens >= request.params.max_tokens:
            self._mark_finished(seq, "length", None)
        elif complete:  # the grammar took its stop token though EOS is ignored
            self._mark_finished(seq, "stop", None)

    def retire(self, out: SchedulerOutput, sampled: SampledTokens,
               stops: dict[Sequence, tuple[int, str]], now: float) -> None:
        """End the step: cut each sequence in ``stops`` after its first ``n`` output tokens (a
        stop string ended there), give back the lookahead slots of rejected proposals, free the
        sequences that finished and the requests that failed."""
        for seq, (n, stop) in stops.items():
            del seq.token_ids[seq.num_prompt_tokens + n :]
            self._mark_finished(seq, "stop", stop)
        for seq in out.seqs:
            if seq.spec_slots:
                self._settle_lookahead(seq)
        self.finish([s for s in sampled.seqs if s.is_finished and s.request not in sampled.failed])
        for request in sampled.failed:
            self.abort(request.seqs, "error", now, every=True)
        for request in dict.fromkeys(s.request for s in sampled.seqs):
            if request.is_finished and request.finish_time is None:
                request.finish_time = now

    def _settle_lookahead(self, seq: Sequence) -> None:
        """After verification: the KV of the kept tokens counts as computed; the slots of the
        rejected proposals go back to the pool."""
        seq.spec_slots = 0
        if seq.is_finished or seq.status is not SequenceStatus.RUNNING:
            return  # its blocks go back whole (finished, or failed and aborted)
        # the last real token and every kept token but the newest have their K/V now
        seq.num_computed = seq.num_tokens - 1
        self.kv.trim(seq, seq.num_computed)
        self.kv.cache_blocks(seq)

    def return_lookahead(self, out: SchedulerOutput, i: int, keep: int) -> None:
        """Only ``keep`` proposals for ``out.seqs[i]`` (0: none; its slots go back now)."""
        seq = out.seqs[i]
        out.num_new[i] = 1 + keep
        if not keep:
            seq.spec_slots = 0
            self.kv.trim(seq, seq.num_computed + 1)

    def _mark_finished(self, seq: Sequence, reason: str, stop: str | int | None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop

    def finish(self, seqs: list[Sequence]) -> None:
        """Retire the sequences that finished in the last step."""
        raise NotImplementedError

    def abort(self, seqs: list[Sequence], reason: str = "abort", now: float | None = None,
              every: bool = False) -> None:
        """Drop ``seqs`` wherever they are; their blocks go back to the pool now. Sequences
        still running get ``reason`` (``every``: all of them)."""
        gone = set(map(id, seqs))
        for seq in seqs:
            if every or not seq.is_finished:
                seq.finish_reason, seq.stop_reason = reason, None
            self.kv.free(seq)
            self._release_slot(seq)
            seq.status = SequenceStatus.FINISHED
        self.waiting = deque(s for s in self.waiting if id(s) not in gone)
        self.running = [s for s in self.running if id(s) not in gone]
        if seqs and now is not None:
            seqs[0].request.finish_time = now

    # ------------------------------------------------------------------ slots
    def _start(self, seq: Sequence, slots: int) -> None:
        seq.status = SequenceStatus.RUNNING
        seq.slot = heapq.heappop(self._free_slots)
        self._reserved_slots += slots - 1
        self.running.append(seq)

    def _release_slot(self, seq: Sequence) -> None:
        """Give back a running sequence's slot (and the slots reserved for its samples)."""
        if seq.slot < 0:
            return
        heapq.heappush(self._free_slots, seq.slot)
        seq.slot = -1
        if not seq.request.forked:
            self._reserved_slots -= seq.request.params.n - 1

    def add_forked(self, parent: Sequence, children: list[Sequence]) -> None:
        """Parallel samples: ``children`` share ``parent``'s blocks and take reserved slots."""
        parent.request.forked = True
        self._reserved_slots -= len(children)
        at = self.running.index(parent) + 1
        for child in children:
            self.kv.fork(parent, child)
            child.num_computed = parent.num_computed
            child.status = SequenceStatus.RUNNING
            child.slot = heapq.heappop(self._free_slots)
        self.running[at:at] = children


class ContinuousScheduler(Scheduler):
    """Iteration-level batching with a token budget, chunked prefill and preemption."""

    policy = "continuous"

    def __init__(self, config: EngineConfig, kv: KVCacheManager,
                 eos_ids: Collection[int] = (),
                 structured: StructuredOutputs | None = None) -> None:
        super().__init__(config, kv, eos_ids, structured)
        self._watermark = int(WATERMARK * kv.num_blocks)

    def _schedule(self, num_lookahead: int) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.budget, num_lookahead)
        if out.preempted:
            return out  # memory is short: admit nobody this step
        self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, num_lookahead: int) -> int:
        """The running sequences' next tokens, oldest first, preempting the newest for room;
        returns what is left of the token budget."""
        running, block_size, i = self.running, self.kv.block_size, 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(len(seq.token_ids) - seq.num_computed, budget)
            if num_lookahead and self._lookahead(seq, n, budget, num_lookahead):
                n += seq.spec_slots
            else:
                room = (seq.num_computed + n <= len(seq.block_table) * block_size
                        and not seq.shared_tail)
                if not room and not self._make_room(out, seq, n):
                    continue  # ``seq`` itself was preempted
            out.seqs.append(seq)
            out.num_new.append(n)
            budget -= n
            i += 1
        return budget

    def _make_room(self, out: SchedulerOutput, seq: Sequence, n: int) -> bool:
        """Allocate ``n`` slots for ``seq``, preempting the newest running sequences until they
        fit; False if ``seq`` itself had to go."""
        while not self.kv.allocate_slots(seq, n):
            victim = self.running.pop()  # the newest running sequence
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests (first come, first served) while slots, blocks and budget last;
        a prompt longer than the budget left is chunked when chunked prefill is on."""
        waiting, kv = self.waiting, self.kv
        while waiting and budget > 0:
            seq = waiting[0]
            request = seq.request
            slots = 1 if request.forked else request.params.n
            if slots > len(self._free_slots) - self._reserved_slots:
                break
            cached, computed = kv.get_computed_tokens(seq) if seq.num_computed == 0 else ([], 0)
            n = seq.num_tokens - computed
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    break
                n = budget
            if not kv.allocate_slots(seq, n, cached, reserve=self._watermark,
                                     num_computed=computed):
                break
            waiting.popleft()
            seq.num_computed = computed
            self._start(seq, slots)
            out.seqs.append(seq)
            out.num_new.append(n)
            budget -= n

    def _lookahead(self, seq: Sequence, n: int, budget: int, num_lookahead: int) -> bool:
        """Give a decoding sequence room for its next token plus up to ``num_lookahead``
        proposals (never past ``max_tokens``); False, changing nothing, if it gets none."""
        request = seq.request
        if n != 1 or seq.num_output_tokens == 0 or not request.may_speculate:
            return False
        left = request.params.max_tokens - seq.num_output_tokens - 1
        k = min(num_lookahead, budget - 1, left)
        if k <= 0 or not self.kv.allocate_slots(seq, 1 + k):
            return False  # no proposals this step (never preempt another sequence for them)
        seq.spec_slots = k
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: drop the K/V, keep the tokens, queue at the front."""
        self.kv.free(seq)
        self._release_slot(seq)
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seqs: list[Sequence]) -> None:
        """Finished sequences leave at once: their blocks and slots serve the next step."""
        for seq in seqs:
            self.kv.free_finished(seq)
            self._release_slot(seq)
        if seqs:
            self.running = [s for s in self.running if not s.is_finished]


class StaticScheduler(Scheduler):
    """The baseline: one padded batch at a time, held until its longest request finishes."""

    policy = "static"

    def __init__(self, config: EngineConfig, kv: KVCacheManager,
                 eos_ids: Collection[int] = (),
                 structured: StructuredOutputs | None = None) -> None:
        super().__init__(config, kv, eos_ids, structured)
        assert config.max_model_len is not None  # resolve_config filled it
        self.budget = max(self.budget, config.max_model_len)  # whole prompts, never chunked

    def check(self, params: SamplingParams) -> None:
        super().check(params)
        if params.n > 1:
            raise ValueError("the static baseline does not support n > 1")

    def _schedule(self, num_lookahead: int) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.running:
            for seq in self.running:
                if seq.is_finished:
                    out.num_idle += 1
                    out.idle_slots.append(seq.slot)
                else:
                    out.seqs.append(seq)
                    out.num_new.append(1)
            return out
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            whole = seq.request.params.max_tokens + seq.num_tokens - seq.num_output_tokens
            if not self.kv.allocate_slots(seq, whole):
                break
            self.waiting.popleft()
            self._start(seq, 1)
        longest = max((s.num_tokens for s in self.running), default=0)
        for seq in self.running:
            out.seqs.append(seq)
            out.num_new.append(seq.num_tokens)
            out.pad_tokens.append(longest - seq.num_tokens)
        return out

    def finish(self, seqs: list[Sequence]) -> None:
        """Finished requests keep their memory and slot until the whole batch is done."""
        if self.running and all(s.is_finished for s in self.running):
            self._end_batch()

    def abort(self, seqs: list[Sequence], reason: str = "abort", now: float | None = None,
              every: bool = False) -> None:
        super().abort(seqs, reason, now, every)
        if self.running and all(s.is_finished for s in self.running):
            self._end_batch()

    def _end_batch(self) -> None:
        """The last request of the batch is done: now its memory and slots come back."""
        for seq in self.running:
            self.kv.free(seq)
            self._release_slot(seq)
        self.running = []


SCHEDULERS: dict[str, type[Scheduler]] = {"continuous": ContinuousScheduler,
                                          "static": StaticScheduler}


def make_scheduler(config: EngineConfig, kv: KVCacheManager, eos_ids: Collection[int] = (),
                   structured: StructuredOutputs | None = None) -> Scheduler:
    """The scheduler of ``config.policy``."""
    return SCHEDULERS[config.policy](config, kv, eos_ids, structured)
