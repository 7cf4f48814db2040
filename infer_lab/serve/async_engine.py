"""The engine loop beside the event loop.

The model forward takes milliseconds to seconds; run on the event loop it would freeze every
connection for that long. So the engine steps in its own thread, and the event loop only talks to
it through two doors: a command queue in (add, abort) and per-request asyncio queues out (each
step's new tokens). The engine is never touched from two threads at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from infer_lab.engine import LLMEngine, RequestOutput, SamplingParams
from infer_lab.serve.metrics import ServerMetrics

log = logging.getLogger("infer_lab.serve")


class EngineDeadError(RuntimeError):
    """The engine loop failed; in-flight requests get this instead of more tokens."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """Thread-owned :class:`LLMEngine` with awaitable ``add_request`` and per-request streams."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)

    # ------------------------------------------------------------------ event-loop side
    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)

    async def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> asyncio.Queue:
        """Queue a request; returns the queue its outputs arrive on. Raises what the engine
        raises for a request it cannot take (``ValueError``: too long, bad token ids, ...)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        stream = _Stream(loop, asyncio.Queue())

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt, params)
            except Exception as e:  # handed back to the caller, who turns it into a 400
                loop.call_soon_threadsafe(_settle, done, e)
                return
            self._streams[request_id] = stream
            loop.call_soon_threadsafe(_settle, done, None)

        self._submit(add)
        await done
        return stream.queue

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone); its KV blocks are freed before the next step."""

        def abort() -> None:
            if self.engine.abort(request_id) and self.metrics:
                self.metrics.labels(self.metrics.requests_aborted).inc()
            self._streams.pop(request_id, None)

        self._submit(abort)

    async def run_on_engine(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps (for consistent snapshots)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def call() -> None:
            try:
                result = fn(self.engine)
            except Exception as e:
                loop.call_soon_threadsafe(_settle, done, e)
            else:
                loop.call_soon_threadsafe(_resolve, done, result)

        self._submit(call)
        return await done

    def _submit(self, command: Callable[[], None]) -> None:
        if not self._thread.is_alive():
            raise EngineDeadError("the engine loop is not running")
        self._commands.put(command)
        self._wake.set()

    # ------------------------------------------------------------------ engine-thread side
    def _loop(self) -> None:
        while not self._stopping:
            self._run_commands()
            if not self.engine.has_unfinished_requests():
                self._update_gauges()
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # keep serving: fail what was in flight, free its blocks
                log.exception("engine step failed; aborting %d requests", len(self._streams))
                self._fail_all(e)
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
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _fail_all(self, error: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, EngineDeadError(str(error)))
        self._streams.clear()

    def _update_gauges(self) -> None:
        if not self.metrics:
            return
        m, stats = self.metrics, self.engine.get_stats()
        m.labels(m.running).set(stats.num_running)
        m.labels(m.waiting).set(stats.num_waiting)
        m.labels(m.kv_used).set(stats.num_kv_blocks_used)
        m.labels(m.kv_usage).set(stats.num_kv_blocks_used / max(1, stats.num_kv_blocks_total))

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
            m.labels(m.requests_ok).inc()
            if out.metrics.e2e is not None:
                m.labels(m.e2e).observe(out.metrics.e2e)


def _settle(future: asyncio.Future, error: Exception | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _resolve(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)
