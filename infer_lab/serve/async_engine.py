"""The engine loop beside the event loop.

The model forward takes milliseconds to seconds; run on the event loop it would freeze every
connection for that long. So the engine steps in its own thread, and the event loop only talks to
it through two doors: a command queue in (add, abort) and one :class:`RequestOutputCollector` per
request out (each step's new tokens). The engine is never touched from two threads at once.

Each output carries the request's text, token ids, times and log-probabilities *so far*, so a
queue of them would cost a client that stops reading n x t^2 memory. A collector keeps those
cumulative fields on its newest output only, the older ones reduced to their deltas, and merges
the oldest when more than a few dozen wait (vLLM's output collector merges every time): a slow
reader costs n x t.

The event-loop side also keeps the books a server needs before the engine sees a request: how
many admitted requests are still waiting for their first token (grammar compilations count as
waiting), and the tokens every request in flight may occupy, n x (prompt + max_tokens), which
bound admission (429 beyond them); and which requests are in flight, which a draining server
waits for.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from infer_lab.engine import CompletionOutput, LLMEngine, RequestOutput, SamplingParams
from infer_lab.serve.errors import APIError, server_busy
from infer_lab.serve.metrics import ServerMetrics

log = logging.getLogger("infer_lab.serve")

MAX_STEP_FAILURES = 3  # consecutive failed steps after which the engine is declared dead


class RequestFailed(RuntimeError):
    """This request will get no more tokens (the engine died, or the server is shutting down)."""


class EngineDeadError(RequestFailed):
    """The engine loop is not running."""


class RequestOutputCollector:
    """The outputs of one request its reader has not taken yet, in memory O(n x t).

    Each engine output carries the request's text, token ids, times and log-probabilities so
    far: a queue of them costs a reader that stops reading n x t^2. Here only the newest
    pending output keeps those cumulative fields; older ones keep only their step's deltas, so
    that a reader a few steps behind still gets one event per step. Past ``MAX_PENDING`` such
    records the two oldest merge into one (their deltas concatenated, as vLLM's output collector
    does for every output), so a reader that never reads holds one output's worth of deltas
    and one copy of the cumulative fields. An exception (the request failed) replaces whatever
    is pending and stays."""

    MAX_PENDING = 64

    def __init__(self) -> None:
        self.pending: deque[RequestOutput | Exception] = deque()
        self._ready = asyncio.Event()

    @property
    def output(self) -> RequestOutput | Exception | None:
        """The newest pending output (None when the reader has taken everything)."""
        return self.pending[-1] if self.pending else None

    def put(self, item: RequestOutput | Exception) -> None:
        if self.pending and isinstance(self.pending[-1], Exception):
            return
        if isinstance(item, Exception):
            self.pending.clear()
        elif self.pending:
            self.pending[-1] = _deltas_only(self.pending[-1])
            if len(self.pending) >= self.MAX_PENDING:
                first = self.pending.popleft()
                self.pending[0] = merge_outputs(first, self.pending[0])
        self.pending.append(item)
        self._ready.set()

    async def get(self) -> RequestOutput | Exception:
        """The oldest pending output (waits for one)."""
        while not self.pending:
            self._ready.clear()
            await self._ready.wait()
        return self.pending.popleft()


def _deltas_only(out: RequestOutput) -> RequestOutput:
    """``out`` without its cumulative fields (a newer output carries them)."""
    return dataclasses.replace(out, outputs=[dataclasses.replace(
        c, text="", token_ids=[], token_times=[], logprobs=None) for c in out.outputs])


def merge_outputs(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """``new`` with the deltas of ``old`` (not yet sent) before its own."""
    before = {c.index: c for c in old.outputs}
    outputs = [_merge_completion(before.get(c.index), c) for c in new.outputs]
    return dataclasses.replace(new, outputs=outputs)


def _merge_completion(old: CompletionOutput | None, new: CompletionOutput) -> CompletionOutput:
    if old is None:
        return new
    return dataclasses.replace(
        new, delta_text=old.delta_text + new.delta_text,
        delta_token_ids=old.delta_token_ids + new.delta_token_ids,
        delta_logprobs=list(old.delta_logprobs or ()) + list(new.delta_logprobs or ()))


@dataclass
class _Stream:
    collector: RequestOutputCollector
    cost: int  # tokens the request may occupy: n x (prompt + max_tokens)
    waiting: bool = True  # admitted, no output yet


class AsyncEngine:
    """Thread-owned :class:`LLMEngine` with awaitable ``add_request`` and per-request streams."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None, *,
                 max_waiting_requests: int = 256, max_waiting_tokens: int = 1 << 18,
                 max_inflight_tokens: int = 0) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_tokens = max_waiting_tokens
        kv_tokens = engine.config.num_kv_blocks * engine.config.block_size
        self.max_inflight_tokens = max_inflight_tokens or 2 * kv_tokens
        self.draining = False
        self.dead: str | None = None
        self.compiling = 0  # grammar compilations under way: they count as waiting requests
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # event-loop side
        self._engine_ids: set[str] = set()  # engine-thread side: requests it is running
        self._waiting_tokens = 0  # what the waiting requests may occupy
        self._inflight_tokens = 0  # what every request in flight may occupy
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._seen_stats = (0, 0, 0)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # ------------------------------------------------------------------ event-loop side
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()  # tensor-parallel workers, if any

    @property
    def state(self) -> str:
        """"ok", "draining" or "dead" (what /health reports)."""
        if self.dead is not None or not self._thread.is_alive():
            return "dead"
        return "draining" if self.draining else "ok"

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        return sum(s.waiting for s in self._streams.values()) + self.compiling

    @property
    def inflight_tokens(self) -> int:
        """Tokens the requests in flight may occupy (n x (prompt + max_tokens), summed)."""
        return self._inflight_tokens

    def refuse(self, reason: str, message: str) -> APIError:
        """429 with ``Retry-After``, counted under ``reason`` in ``/metrics``."""
        if self.metrics:
            self.metrics.refuse(reason)
        return server_busy(message)

    def check_admission(self, cost: int = 0) -> None:
        """Raise 429 if admitting a request that may occupy ``cost`` tokens would pass the
        waiting bounds or the budget of tokens in flight (a request alone always passes it)."""
        waiting = self.num_waiting
        if waiting + 1 > self.max_waiting_requests:
            raise self.refuse("waiting_requests", f"the server has {waiting} requests waiting "
                              f"(the limit is {self.max_waiting_requests}); retry later")
        if waiting and self._waiting_tokens + cost > self.max_waiting_tokens:
            raise self.refuse("waiting_tokens", f"the requests waiting may occupy "
                              f"{self._waiting_tokens} tokens (the limit is "
                              f"{self.max_waiting_tokens}); retry later")
        if self._streams and self._inflight_tokens + cost > self.max_inflight_tokens:
            raise self.refuse("inflight_tokens", f"the requests in flight may occupy "
                              f"{self._inflight_tokens} tokens and this one {cost} (the budget "
                              f"is {self.max_inflight_tokens}); retry later")

    async def add_request(self, request_id: str, prompt: Sequence[int],
                          params: SamplingParams) -> RequestOutputCollector:
        """Admit and queue a request (token ids); returns the collector its outputs arrive in.
        Raises 429 beyond the admission bounds, and what the engine raises for a request it
        cannot take (``ValueError``: too long, bad token ids, ...)."""
        if self.state == "dead":
            raise EngineDeadError("the engine loop is not running")
        cost = params.n * (len(prompt) + params.max_tokens)
        self.check_admission(cost)
        loop = asyncio.get_running_loop()
        stream = _Stream(RequestOutputCollector(), cost)
        self._streams[request_id] = stream
        self._waiting_tokens += cost
        self._inflight_tokens += cost
        done: asyncio.Future = loop.create_future()

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt, params)
            except Exception as e:  # handed back to the caller, who turns it into a 400
                loop.call_soon_threadsafe(_settle, done, e)
                return
            self._engine_ids.add(request_id)
            loop.call_soon_threadsafe(_settle, done, None)

        try:
            self._submit(add)
            await done
        except BaseException:
            self._forget(request_id)
            raise
        return stream.collector

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone); its KV blocks are freed before the next step."""
        self._forget(request_id)

        def abort() -> None:
            self._engine_ids.discard(request_id)
            if self.engine.abort(request_id) and self.metrics:
                self.metrics.labels(self.metrics.requests_aborted).inc()

        if self._thread.is_alive():
            self._submit(abort)

    def end_all(self, message: str) -> int:
        """Give every request in flight ``RequestFailed(message)`` and abort it; returns how
        many (the end of a drain)."""
        ids = list(self._streams)
        for request_id in ids:
            self._streams[request_id].collector.put(RequestFailed(message))
            self.abort(request_id)
        return len(ids)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until no request is in flight."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._streams and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not self._streams

    def _forget(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._inflight_tokens -= stream.cost
            if stream.waiting:
                self._waiting_tokens -= stream.cost

    def _on_output(self, request_id: str, item: RequestOutput | Exception) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if stream.waiting:
            stream.waiting = False
            self._waiting_tokens -= stream.cost
        if isinstance(item, Exception) or item.finished:
            self._forget(request_id)
        stream.collector.put(item)

    def _submit(self, command: Callable[[], None]) -> None:
        if not self._thread.is_alive():
            raise EngineDeadError("the engine loop is not running")
        self._commands.put(command)
        self._wake.set()

    # ------------------------------------------------------------------ engine-thread side
    def _run(self) -> None:
        try:
            self._steps()
        except Exception as e:  # a bug outside a step: say so on /health, end every request
            log.exception("the engine loop died")
            self.dead = f"the engine loop died: {type(e).__name__}"
            self._fail_all(self.dead)

    def _steps(self) -> None:
        failures = 0
        while not self._stopping:
            self._run_commands()
            if not self.engine.has_unfinished_requests():
                self._update_gauges()
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
                failures = 0
            except Exception:  # the engine isolates a request's own failure; this is the engine's
                failures += 1
                log.exception("engine step failed (%d in a row)", failures)
                self._fail_all("the engine failed on this batch")
                if failures >= MAX_STEP_FAILURES:
                    self.dead = f"the engine failed {failures} steps in a row"
                    return
                continue
            for out in outputs:
                self._deliver(out)
            self._update_gauges()

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _deliver(self, out: RequestOutput) -> None:
        if self.metrics:
            self._observe(out)
        if out.request_id not in self._engine_ids:
            return
        if out.finished:
            self._engine_ids.discard(out.request_id)
        self._loop.call_soon_threadsafe(self._on_output, out.request_id, out)

    def _fail_all(self, message: str) -> None:
        for request_id in list(self._engine_ids):
            self.engine.abort(request_id)
            if self.metrics:
                self.metrics.labels(self.metrics.requests_failed).inc()
            self._loop.call_soon_threadsafe(self._on_output, request_id,
                                            EngineDeadError(message))
        self._engine_ids.clear()

    def _update_gauges(self) -> None:
        if self.metrics:
            stats = self.engine.get_stats()
            self._seen_stats = self.metrics.update(stats, self._seen_stats)
            structured = self.engine.structured
            self.metrics.update_structured(structured.stats, structured.cache_bytes)

    def _observe(self, out: RequestOutput) -> None:
        m = self.metrics
        for c in out.outputs:
            new = len(c.delta_token_ids)
            if not new:
                continue
            m.labels(m.generation_tokens).inc(new)
            times = c.token_times
            first_new = len(times) - new
            if first_new == 0 and c.index == 0 and out.metrics.ttft is not None:
                m.labels(m.ttft).observe(out.metrics.ttft)
                m.labels(m.prompt_tokens).inc(len(out.prompt_token_ids))
            for i in range(max(1, first_new), len(times)):
                m.labels(m.itl).observe(times[i] - times[i - 1])
        if out.finished:
            failed = getattr(out, "error", None) or any(c.finish_reason == "error"
                                                        for c in out.outputs)
            m.labels(m.requests_failed if failed else m.requests_ok).inc()
            if out.metrics.e2e is not None and not failed:
                m.labels(m.e2e).observe(out.metrics.e2e)


def _settle(future: asyncio.Future, error: Exception | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
