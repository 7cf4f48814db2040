"""A load generator for any OpenAI-compatible server: it speaks only HTTP.

It sends streaming ``/v1/completions`` (or ``/v1/chat/completions``) requests, closed loop at a
fixed concurrency or open loop at given arrival times, and records when each request was sent and
when each streamed chunk that carries a token arrived. Everything else (TTFT, TPOT, ITL, E2EL,
throughput, goodput) is computed from those timestamps in :mod:`infer_lab.measure.stats`, so the
definitions live in one place. A request that fails (connection refused, HTTP error, an error
event mid-stream, a timeout) is recorded as failed with its message; it never raises.

httpx is imported inside the functions that send, so importing this module (and the records it
defines) costs nothing on a machine without the HTTP stack.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from infer_lab.measure.workloads import RequestSpec

__all__ = ["ClientPool", "Endpoint", "RequestResult", "RequestSpec", "RunResult", "fetch_model",
           "make_prompt", "run_closed_loop", "run_open_loop", "run_sync", "send_request"]

T = TypeVar("T")

# Ordinary English words, roughly one token each for BPE tokenizers (with the leading space), so
# a chat prompt of n words is close to n tokens without our needing the server's tokenizer.
_WORD_TEXT = (
    "the of and to in is was that for on with as by at from his her they be this have not are "
    "but had which one were all we when there can an your been has more if will would who so "
    "about out up them some could into time only new other then do what their its also after "
    "first two like our over man years way may down should because each just those people how "
    "too little state good very make world still own see men work long get here between both "
    "life being under never day same another know while last might us great old year off come "
    "since against go came right used take three house water light word land river city"
)
WORDS = tuple(_WORD_TEXT.split())


@dataclass
class RequestResult:
    """What happened to one request. Times are seconds since the run started (perf_counter).

    ``chunk_times`` holds the arrival of every streamed chunk that carried a token (non-empty text
    or token ids); role-only and finish-only chunks are not tokens and are not timed.
    """

    prompt_len: int
    output_len: int
    scheduled: float = 0.0
    sent: float = math.nan
    end: float = math.nan
    chunk_times: list[float] = field(default_factory=list)
    usage_tokens: int | None = None
    success: bool = False
    error: str = ""

    @property
    def output_tokens(self) -> int:
        """Tokens generated: the server's ``usage.completion_tokens`` if sent, else chunks seen."""
        return self.usage_tokens if self.usage_tokens is not None else len(self.chunk_times)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record (times in seconds, rounded to microseconds)."""
        r = lambda x: None if x is None or math.isnan(x) else round(x, 6)
        return {
            "success": self.success, "error": self.error, "prompt_len": self.prompt_len,
            "output_len": self.output_len, "output_tokens": self.output_tokens,
            "scheduled": r(self.scheduled), "sent": r(self.sent), "end": r(self.end),
            "chunk_times": [r(t) for t in self.chunk_times],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestResult:
        """Inverse of :meth:`to_dict`, so saved runs can be re-analysed and re-plotted."""
        nan = lambda x: math.nan if x is None else float(x)
        return cls(
            prompt_len=d["prompt_len"], output_len=d["output_len"],
            scheduled=nan(d["scheduled"]), sent=nan(d["sent"]), end=nan(d["end"]),
            chunk_times=[float(t) for t in d["chunk_times"]],
            usage_tokens=d["output_tokens"], success=d["success"], error=d["error"],
        )


@dataclass
class RunResult:
    """One measured run: its per-request records and how long it took (first send to last end)."""

    results: list[RequestResult]
    duration: float
    mode: str  # "closed" or "open"
    load: float  # concurrency (closed) or mean request rate in requests/s (open; inf = all at t=0)
    # CPU this process used per second of run (1.0 = one core busy). Near 1 the generator is the
    # bottleneck and adds to the latencies it measures: a number to check, not to hide.
    client_cpu: float = math.nan


def _cpu(c0: float, duration: float) -> float:
    return (time.process_time() - c0) / duration if duration > 0 else math.nan


@dataclass
class Endpoint:
    """Where and how to send: an OpenAI-compatible server, a model name and the request knobs."""

    base_url: str = "http://127.0.0.1:8000"
    model: str = "default"
    kind: str = "completions"  # or "chat"
    timeout: float = 300.0  # seconds for a whole request, first byte to last
    ignore_eos: bool = True
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in ("completions", "chat"):
            raise ValueError(f"endpoint must be 'completions' or 'chat', not {self.kind!r}")
        if not self.timeout > 0:
            raise ValueError("timeout must be positive")

    @property
    def root(self) -> str:
        """Base URL without a trailing ``/v1``: both ``http://h:p`` and ``http://h:p/v1`` work."""
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    @property
    def url(self) -> str:
        path = "/v1/completions" if self.kind == "completions" else "/v1/chat/completions"
        return self.root + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        """The JSON body: greedy, exactly ``output_len`` tokens (``ignore_eos``), streamed."""
        if spec.prompt is None:
            raise ValueError("a RequestSpec without a prompt cannot be sent: fill it first "
                             "(bench.build_workload does, with make_prompt)")
        body: dict[str, Any] = {
            "model": self.model, "max_tokens": spec.output_len, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.kind == "completions":
            body["prompt"] = spec.prompt
        else:
            text = spec.prompt if isinstance(spec.prompt, str) else " ".join(map(str, spec.prompt))
            body["messages"] = [{"role": "user", "content": text}]
            body["max_completion_tokens"] = spec.output_len
        body.update(self.extra_body)
        return body


def make_prompt(rng: np.random.Generator, n: int, kind: str = "ids",
                id_range: tuple[int, int] = (10, 3000)) -> list[int] | str:
    """A random prompt of ``n`` tokens: token ids hit the length exactly; text approximately.

    Random ids also keep a server's prefix cache from turning one request into another's hit.
    """
    if kind == "ids":
        return rng.integers(id_range[0], id_range[1], n).tolist()
    return " ".join(rng.choice(WORDS, n).tolist())


def _token_chunk(choices: Sequence[Any]) -> bool:
    """True if a chunk's choices carry a token: text, delta content, or token ids."""
    for c in choices:
        if not isinstance(c, dict):
            continue
        delta = c.get("delta") if isinstance(c.get("delta"), dict) else {}
        if c.get("text") or c.get("token_ids") or delta.get("content") \
                or delta.get("reasoning_content") or delta.get("token_ids"):
            return True
    return False


async def send_request(client: Any, endpoint: Endpoint, spec: RequestSpec, t0: float,
                       scheduled: float = 0.0) -> RequestResult:
    """Send one streaming request and time its chunks; never raises (except on cancellation).

    ``t0`` is the run's start on the ``time.perf_counter`` clock. A request fails on a non-200
    status, an ``error`` event, an unparsable event, a stream that ends without ``[DONE]`` or
    without any token, a connection error, or when it takes longer than ``endpoint.timeout``.
    """
    res = RequestResult(spec.prompt_len, spec.output_len, scheduled=scheduled)
    answered = False  # did the server send a status line?

    async def stream() -> None:
        nonlocal answered
        async with client.stream("POST", endpoint.url, json=endpoint.body(spec),
                                 headers=endpoint.headers()) as resp:
            answered = True
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace").strip()
                res.error = f"HTTP {resp.status_code}: {text[:300]}"
                return
            done = False
            data: list[str] = []
            stamp = 0.0

            def dispatch(final: bool) -> bool:
                """Handle the event gathered so far; return True to stop reading (an error).

                Each ``data:`` line is tried on its own (servers send one JSON object a line);
                only at a blank line (``final``) is an event that does not parse an error.
                After ``[DONE]`` the body is read to its end, so the connection can be reused.
                """
                nonlocal done
                payload = "\n".join(data).strip()
                if done or payload == "[DONE]":
                    data.clear()
                    done = True
                    return False
                try:
                    event = json.loads(payload)
                except json.JSONDecodeError:
                    if not final:
                        return False
                    res.error = f"unparsable event: {payload[:200]}"
                    return True
                data.clear()
                if not isinstance(event, dict):
                    res.error = f"unexpected event: {payload[:200]}"
                    return True
                if event.get("error"):
                    err = event["error"]
                    msg = err.get("message", err) if isinstance(err, dict) else err
                    res.error = f"error event: {str(msg)[:300]}"
                    return True
                usage = event.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    res.usage_tokens = int(usage["completion_tokens"])
                if _token_chunk(event.get("choices") or []):
                    res.chunk_times.append(stamp)
                return False

            async for line in resp.aiter_lines():
                stamp = time.perf_counter() - t0
                if line.startswith("data:"):
                    data.append(line[6:] if line.startswith("data: ") else line[5:])
                    if dispatch(final=False):
                        break
                elif not line.strip() and data and dispatch(final=True):
                    break
                # other SSE fields (event:, id:, retry:, ": comment") carry nothing we time
            if data and not done and not res.error:
                dispatch(final=True)  # a last event cut off before its blank line
            if res.error:
                return
            if not done:
                res.error = "stream ended without data: [DONE]"
            elif not res.chunk_times:
                res.error = "no token was streamed"
            else:
                res.success = True

    import httpx

    async def stream_once_more_if_stale() -> None:
        """A kept-alive connection the server closed as this request went out (llama.cpp's
        server drops idle ones after 5 s) fails with no answer at all; the request is sent
        once more on a new connection, as HTTP clients do for a stale connection."""
        try:
            await stream()
        except httpx.RemoteProtocolError:
            if answered:
                raise
            await stream()

    res.sent = time.perf_counter() - t0
    try:
        await asyncio.wait_for(stream_once_more_if_stale(), endpoint.timeout)
    except asyncio.TimeoutError:
        res.error = f"timeout: no complete response within {endpoint.timeout:g} s"
    except httpx.TimeoutException as e:
        res.error = f"timeout: {type(e).__name__}: {e}"
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    except Exception as e:  # a benchmark reports what went wrong; it does not crash on it
        res.error = f"{type(e).__name__}: {e}"
    res.end = time.perf_counter() - t0
    if res.error:
        res.success = False
    return res


class ClientPool:
    """One single-connection httpx client per request in flight, reused as requests end.

    Why not one shared client: httpcore's pool scans every connection on every request and
    every state change, so at 64 requests in flight the client itself spent most of its time
    there and added ~0.5 s to TTFT (measured against a stub). With one connection per client
    the cost per request is constant. The clients share one TLS context: building one per
    client costs ~40 ms, which would land in the TTFT of whoever opened it. ``prepare(n)``
    makes the clients before the clock starts; a pool that lives across warm-up and the
    measured run also keeps its connections open. ``trust_env=False``: no proxy setting can
    reroute a benchmark.
    """

    def __init__(self, endpoint: Endpoint) -> None:
        import httpx

        self.endpoint = endpoint
        self._tls = httpx.create_ssl_context()
        self.idle: list[Any] = []
        self.all: list[Any] = []

    def _new(self) -> Any:
        import httpx

        client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.endpoint.timeout), verify=self._tls, trust_env=False,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
        self.all.append(client)
        return client

    def prepare(self, n: int) -> None:
        """Have at least ``n`` idle clients ready."""
        for _ in range(n - len(self.idle)):
            self.idle.append(self._new())

    async def send(self, spec: RequestSpec, t0: float, scheduled: float) -> RequestResult:
        client = self.idle.pop() if self.idle else self._new()
        try:
            return await send_request(client, self.endpoint, spec, t0, scheduled)
        finally:
            self.idle.append(client)

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.all), return_exceptions=True)
        self.all.clear()
        self.idle.clear()

    async def __aenter__(self) -> ClientPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def run_closed_loop(
    endpoint: Endpoint, specs: Sequence[RequestSpec], concurrency: int,
    on_done: Callable[[RequestResult], None] | None = None, pool: ClientPool | None = None,
) -> RunResult:
    """``concurrency`` workers, each sending its next request as soon as its last one ends.

    This holds the number of requests in flight at C (until the queue runs dry at the end), so
    the server sees a steady batch; arrival times in ``specs`` are ignored. Pass a ``pool`` to
    keep connections across runs (the caller closes it); otherwise one is made and closed.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    results: list[RequestResult | None] = [None] * len(specs)
    next_index = iter(range(len(specs)))
    clients = pool or ClientPool(endpoint)
    clients.prepare(min(concurrency, len(specs)))
    t0, c0 = time.perf_counter(), time.process_time()

    async def worker() -> None:
        for i in next_index:  # shared iterator: each index goes to exactly one worker
            res = await clients.send(specs[i], t0, time.perf_counter() - t0)
            results[i] = res
            if on_done:
                on_done(res)

    try:
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(specs)))))
    finally:
        if pool is None:
            await clients.aclose()
    done = [r for r in results if r is not None]
    duration = _duration(done)
    return RunResult(done, duration, "closed", float(concurrency), _cpu(c0, duration))


async def run_open_loop(
    endpoint: Endpoint, specs: Sequence[RequestSpec], rate: float = math.inf,
    max_concurrency: int | None = None,
    on_done: Callable[[RequestResult], None] | None = None, pool: ClientPool | None = None,
) -> RunResult:
    """Send each request at its ``arrival`` time, whether or not earlier ones have finished.

    The arrivals come with the specs (seeded Poisson or gamma, see ``workloads.arrival_times``);
    ``rate`` only labels the run. ``max_concurrency`` optionally caps requests in flight, as
    vLLM's ``--max-concurrency`` does; a capped request waits, and its wait counts in its TTFT
    only from when it is actually sent (``scheduled`` keeps the intended time). ``pool``: as
    in :func:`run_closed_loop`.
    """
    order = sorted(range(len(specs)), key=lambda i: specs[i].arrival)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[RequestResult | None] = [None] * len(specs)
    clients = pool or ClientPool(endpoint)
    clients.prepare(min(max_concurrency or len(specs), len(specs), 256))
    t0, c0 = time.perf_counter(), time.process_time()

    async def one(i: int) -> None:
        if gate:
            async with gate:
                res = await clients.send(specs[i], t0, specs[i].arrival)
        else:
            res = await clients.send(specs[i], t0, specs[i].arrival)
        results[i] = res
        if on_done:
            on_done(res)

    tasks = []
    try:
        for i in order:
            delay = specs[i].arrival - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        if pool is None:
            await clients.aclose()
    done = [r for r in results if r is not None]
    duration = _duration(done)
    return RunResult(done, duration, "open", rate, _cpu(c0, duration))


def _duration(results: Sequence[RequestResult]) -> float:
    """Run length: t = 0 (the start) to the end of the last request, failed ones included."""
    ends = [r.end for r in results if not math.isnan(r.end)]
    return max(ends) if ends else 0.0


async def fetch_model(endpoint: Endpoint) -> str | None:
    """The first model id that ``GET /v1/models`` lists, or None if the server does not answer."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=min(endpoint.timeout, 10.0), trust_env=False) as c:
            resp = await c.get(endpoint.root + "/v1/models", headers=endpoint.headers())
            return str(resp.json()["data"][0]["id"]) if resp.status_code == 200 else None
    except Exception:  # no answer is an answer: the requests themselves will report the failure
        return None


def run_sync(coro: Awaitable[T]) -> T:
    """Run a coroutine to completion, also from inside a running loop (a Jupyter notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)  # type: ignore[arg-type]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()  # type: ignore[arg-type]
