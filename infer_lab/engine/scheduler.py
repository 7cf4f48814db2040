"""Who runs in the next step: two policies, static batching and continuous batching.

Both sit behind one interface, :meth:`Scheduler.schedule`, which returns the step's work: for each
sequence, how many of its tokens to compute. The runner turns that into one flattened forward; the
engine samples, then tells the scheduler what finished (:meth:`Scheduler.finish`). The queues, the
batch slots, preemption and abort are shared; each policy is a subclass.

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
from dataclasses import dataclass, field

from infer_lab.engine.config import EngineConfig
from infer_lab.engine.kv_cache_manager import KVCacheManager
from infer_lab.engine.sampling_params import SamplingParams
from infer_lab.engine.sequence import Sequence, SequenceStatus

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
    """

    policy = ""

    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        if config.max_model_len is None:
            raise ValueError("the scheduler needs config.max_model_len (the engine resolves it)")
        self.config, self.kv = config, kv
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

    def schedule(self) -> SchedulerOutput:
        out = self._schedule()
        out.block_copies = self.kv.pending_copies
        self.kv.pending_copies = []
        return out

    def _schedule(self) -> SchedulerOutput:
        raise NotImplementedError

    def finish(self, seqs: list[Sequence]) -> None:
        """Retire the sequences that finished in the last step."""
        raise NotImplementedError

    def abort(self, seqs: list[Sequence]) -> None:
        """Drop ``seqs`` wherever they are; their blocks go back to the pool now."""
        gone = set(map(id, seqs))
        for seq in seqs:
            self.kv.free(seq)
            self._release_slot(seq)
            seq.status = SequenceStatus.FINISHED
        self.waiting = deque(s for s in self.waiting if id(s) not in gone)
        self.running = [s for s in self.running if id(s) not in gone]

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


class ContinuousScheduler(Scheduler):
    """Iteration-level batching with a token budget, chunked prefill and preemption."""

    policy = "continuous"

    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        super().__init__(config, kv)
        self._watermark = int(WATERMARK * kv.num_blocks)
        # Speculative decoding: lookahead slots a decoding sequence may get this step (the
        # engine sets it per step; 0: none). They count against the token budget.
        self.num_lookahead = 0

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        seqs, num_new = out.seqs, out.num_new
        budget, kv, running, bs = self.budget, self.kv, self.running, self.kv.block_size
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(len(seq.token_ids) - seq.num_computed, budget)
            if self.num_lookahead and self._lookahead(seq, n, budget):
                seqs.append(seq)
                num_new.append(1 + seq.spec_slots)
                budget -= 1 + seq.spec_slots
                i += 1
                continue
            room = seq.num_computed + n <= len(seq.block_table) * bs and not seq.shared_tail
            while not room and not kv.allocate_slots(seq, n):
                victim = running.pop()  # the newest running sequence
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                seqs.append(seq)
                num_new.append(n)
                budget -= n
                i += 1
        if out.preempted:
            return out  # memory is short: admit nobody this step
        waiting = self.waiting
        while waiting and budget > 0:
            seq = waiting[0]
            request = seq.request
            slots = 1 if request.forked else request.params.n
            if slots > len(self._free_slots) - self._reserved_slots:
                break
            cached = kv.get_computed_blocks(seq) if seq.num_computed == 0 else []
            n = seq.num_tokens - len(cached) * kv.block_size
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    break
                n = budget
            if not kv.allocate_slots(seq, n, cached, reserve=self._watermark):
                break
            waiting.popleft()
            seq.num_computed = len(cached) * kv.block_size
            self._start(seq, slots)
            seqs.append(seq)
            num_new.append(n)
            budget -= n
        return out

    def _lookahead(self, seq: Sequence, n: int, budget: int) -> bool:
        """Give a decoding sequence room for its next token plus up to ``num_lookahead``
        proposals (never past ``max_tokens``); False, changing nothing, if it gets none."""
        request = seq.request
        if n != 1 or seq.num_output_tokens == 0 or not request.may_speculate:
            return False
        left = request.params.max_tokens - seq.num_output_tokens - 1
        k = min(self.num_lookahead, budget - 1, left)
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

    def add_forked(self, parent: Sequence, children: list[Sequence]) -> None:
        """Parallel samples: ``children`` share ``parent``'s blocks and take reserved slots."""
        parent.request.forked = True
        self._reserved_slots -= len(children)
        at = self.running.index(parent) + 1
        for child in children:
            self.kv.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            child.slot = heapq.heappop(self._free_slots)
        self.running[at:at] = children

    def finish(self, seqs: list[Sequence]) -> None:
        """Finished sequences leave at once: their blocks and slots serve the next step."""
        for seq in seqs:
            self.kv.free(seq)
            self._release_slot(seq)
        if seqs:
            self.running = [s for s in self.running if not s.is_finished]


class StaticScheduler(Scheduler):
    """The baseline: one padded batch at a time, held until its longest request finishes."""

    policy = "static"

    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        super().__init__(config, kv)
        self.budget = max(self.budget, config.max_model_len)  # whole prompts, never chunked

    def check(self, params: SamplingParams) -> None:
        super().check(params)
        if params.n > 1:
            raise ValueError("the static baseline does not support n > 1")

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if not self.running:
            while self.waiting and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                whole = seq.request.params.max_tokens + seq.num_tokens - seq.num_output_tokens
                if not self.kv.allocate_slots(seq, whole):
                    break
                self.waiting.popleft()
                self._start(seq, 1)
            if not self.running:
                return out
            longest = max(s.num_tokens for s in self.running)
            for seq in self.running:
                out.seqs.append(seq)
                out.num_new.append(seq.num_tokens)
                out.pad_tokens.append(longest - seq.num_tokens)
            return out
        for seq in self.running:
            if seq.is_finished:
                out.num_idle += 1
                out.idle_slots.append(seq.slot)
            else:
                out.seqs.append(seq)
                out.num_new.append(1)
        return out

    def finish(self, seqs: list[Sequence]) -> None:
        """Finished requests keep their memory and slot until the whole batch is done."""
        if self.running and all(s.is_finished for s in self.running):
            self._end_batch()

    def abort(self, seqs: list[Sequence]) -> None:
        super().abort(seqs)
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


def make_scheduler(config: EngineConfig, kv: KVCacheManager) -> Scheduler:
    """The scheduler of ``config.policy``."""
    return SCHEDULERS[config.policy](config, kv)
