"""The server soaked: well-behaved clients, vanishing clients and hostile requests at once.

Well-behaved clients loop (streaming or not, greedy, known prompts) and check every answer
against a naive greedy reference; other clients hang up mid-stream or before a non-streaming
answer; a trickle of hostile requests (int64 ``top_k``, lone surrogates, image parts, chunked
bodies over the limit, half-sent headers, a flood of stop strings, a body framed twice, a schema
nested 5,000 deep, a grammar that accepts nothing, ``min_p`` out of [0, 1], ``typical_p``,
a ``logit_bias`` key outside the vocabulary, ``n`` = 64) arrives throughout.
Beside them, issue 24's attackers (``attackers=True``): *stalled readers* open big streams and
never read (the server must cut them after its send timeout), *slot hogs* ask for ``n`` =
``max_n`` long greedy samples (admitted within the token budget, or 429; every sample checked),
and a *compile flood* sends a new JSON schema every time (compiled, or 429 when the compile
thread is full; every output checked against its enum). The report counts outcomes by kind and
status, the 429s beyond the queue bound (each must carry ``Retry-After``), and the worst gap
between two events of a well-behaved stream while the hostile requests arrived (target: at most
100 ms on a 2-core CPU; not asserted anywhere).

``tests/test_server_soak.py`` runs :func:`soak` for ~30 s against an in-process server and
asserts on the report; this script runs it longer against a real ``infer-lab serve`` process:

    python -m benchmarks.server_soak [--duration 120] [--clients 16] [--no-hostile]

and writes ``benchmarks/results/server_soak.json`` (``server_soak_baseline.json`` without the
hostile requests and attackers, to tell their cost from that of the load itself), with the
server's RSS growth over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

PROMPTS = ["And God said,", "In the beginning", "Blessed are the", "Thou shalt",
           "And it came to pass", "The LORD is my shepherd", "For God so loved",
           "And the LORD spake unto Moses"]
MAX_TOKENS = 24


@dataclass
class SoakReport:
    duration_s: float
    ok: int = 0  # well-behaved requests with their full, correct output
    wrong: list[str] = field(default_factory=list)  # well-behaved requests with another output
    busy: int = 0  # 429 answers (each with Retry-After)
    busy_without_retry_after: int = 0
    disconnects: int = 0
    hostile: dict[str, int] = field(default_factory=dict)  # "kind status" -> count
    server_errors: list[str] = field(default_factory=list)  # any 5xx, anywhere
    stream_gaps_ms: list[float] = field(default_factory=list)  # worst gap per stream
    attacks: dict[str, int] = field(default_factory=dict)  # issue 24's: "kind outcome" -> count

    def count(self, kind: str, outcome: object) -> None:
        key = f"{kind} {outcome}"
        self.attacks[key] = self.attacks.get(key, 0) + 1

    @property
    def worst_gap_ms(self) -> float:
        return max(self.stream_gaps_ms, default=0.0)

    def summary(self) -> dict[str, Any]:
        gaps = sorted(self.stream_gaps_ms)
        out = asdict(self)
        out.pop("stream_gaps_ms")
        out["wrong"] = self.wrong[:10]
        out["streams"] = len(gaps)
        out["worst_gap_ms"] = round(self.worst_gap_ms, 1)
        out["p99_worst_gap_ms"] = round(gaps[int(0.99 * (len(gaps) - 1))], 1) if gaps else 0.0
        out["median_worst_gap_ms"] = round(gaps[len(gaps) // 2], 1) if gaps else 0.0
        return out


def references(max_tokens: int = MAX_TOKENS) -> dict[str, list[str]]:
    """For each prompt, the text after n greedy tokens, n = 1..max_tokens (naive decode)."""
    import infer_lab as il

    model, tok = il.load(device="cpu")
    refs = {}
    for prompt in PROMPTS:
        ids = il.generate_naive(model, tok, prompt, max_tokens=max_tokens,
                                ignore_eos=True).token_ids
        prompt_ids, texts = tok.encode(prompt), []
        for n in range(1, max_tokens + 1):  # what the engine sends for a request of n tokens
            detok = tok.detokenizer(prompt_ids)
            texts.append("".join(detok.add(t) for t in ids[:n]) + detok.flush())
        refs[prompt] = texts
    return refs


def _matches(refs: dict[str, list[str]], prompt: str, n: int, text: str) -> bool:
    want = refs[prompt][n - 1]
    # a stream holds back nothing at the end, but a mid-text cut may differ in a trailing
    # partial character: compare what both have settled
    return text == want or text.rstrip("\ufffd") == want.rstrip("\ufffd")


async def _good_client(http: httpx.AsyncClient, base: str, rng: random.Random, refs: dict,
                       report: SoakReport, deadline: float, hostile_phase: list[bool]) -> None:
    while time.monotonic() < deadline:
        prompt, n = rng.choice(PROMPTS), rng.randint(4, MAX_TOKENS)
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        stream = rng.random() < 0.5
        try:
            if stream:
                status, text, gap = await _stream(http, base, body)
                if status == 200 and hostile_phase[0]:
                    report.stream_gaps_ms.append(gap * 1000)
            else:
                r = await http.post(f"{base}/v1/completions", json=body)
                status = r.status_code
                text = r.json()["choices"][0]["text"] if status == 200 else ""
                if status == 429:
                    report.busy_without_retry_after += "retry-after" not in r.headers
        except httpx.HTTPError as e:
            report.server_errors.append(f"transport: {type(e).__name__}")
            continue
        if status == 200:
            if _matches(refs, prompt, n, text):
                report.ok += 1
            else:
                report.wrong.append(f"{prompt!r} n={n}: {text!r}")
        elif status == 429:
            report.busy += 1
            await asyncio.sleep(0.2 + rng.random() * 0.3)  # a client honouring Retry-After
        else:
            report.server_errors.append(f"good request: {status}")


async def _stream(http: httpx.AsyncClient, base: str, body: dict) -> tuple[int, str, float]:
    """(status, text, worst gap in s between two events) of a streamed completion."""
    text, worst, last = "", 0.0, None
    async with http.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, "", 0.0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            if last is not None:
                worst = max(worst, now - last)
            last = now
            if line != "data: [DONE]":
                payload = json.loads(line[6:])
                if "error" in payload:
                    return 500, "", worst
                if payload["choices"]:
                    text += payload["choices"][0]["text"]
    return 200, text, worst


async def _quitter(http: httpx.AsyncClient, base: str, rng: random.Random, report: SoakReport,
                   deadline: float) -> None:
    while time.monotonic() < deadline:
        body = {"prompt": rng.choice(PROMPTS), "max_tokens": 400, "ignore_eos": True}
        if rng.random() < 0.5:
            async with http.stream("POST", f"{base}/v1/completions",
                                   json={**body, "stream": True}) as r:
                seen, stop_at = 0, rng.randint(1, 5)
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= stop_at:
                        break
        else:
            with contextlib.suppress(httpx.TimeoutException):
                await http.post(f"{base}/v1/completions", json=body,
                                timeout=0.2 + rng.random() * 0.5)
        report.disconnects += 1
        await asyncio.sleep(rng.random() * 0.3)


def _hostile_requests() -> list[tuple[str, str, Any]]:
    """(kind, path, body) of requests that must each get a 4xx."""
    chat = "/v1/chat/completions"
    big = b'{"prompt": "' + b"x" * (2 << 20) + b'"}'
    deep = (b'{"prompt": "Amen", "structured_outputs": {"json": '
            + b'{"type":"object","properties":{"a":' * 5000 + b"{}" + b"}}" * 5000 + b"}}")
    return [
        ("deep_schema", "/v1/completions", deep),
        ("grammar_accepts_nothing", "/v1/completions",
         {"prompt": "Amen", "structured_outputs": {"grammar": "root ::= root"}}),
        ("ambiguous_grammar", "/v1/completions",
         {"prompt": "Amen", "structured_outputs": {"grammar": 'root ::= s\ns ::= s s | "a"'}}),
        ("min_p_out_of_range", "/v1/completions", {"prompt": "Amen", "min_p": 1.5}),
        ("typical_p", "/v1/completions", {"prompt": "Amen", "typical_p": 0.5}),
        ("n_64", "/v1/completions", {"prompt": "Amen", "n": 64, "max_tokens": 400}),
        ("top_k_int64", "/v1/completions", {"prompt": "Amen", "top_k": 2**63,
                                            "temperature": 1.0, "max_tokens": 4}),
        ("lone_surrogate", chat, b'{"messages": [{"role": "user", "content": "a\\ud800"}]}'),
        ("text_part_not_str", chat,
         {"messages": [{"role": "user", "content": [{"type": "text", "text": [1]}]}]}),
        ("image_part", chat, {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}),
        ("stop_flood", "/v1/completions", {"prompt": "Amen", "stop": ["s"] * 100_000}),
        ("nan_temperature", "/v1/completions", b'{"prompt": "Amen", "temperature": NaN}'),
        ("over_limit", "/v1/completions", big),
        ("not_json", "/v1/completions", b"{{{{"),
        ("logit_bias_outside_vocab", "/v1/completions",
         {"prompt": "Amen", "logit_bias": {str(2**40): 100}}),
    ]


async def _hostile_client(http: httpx.AsyncClient, base: str, rng: random.Random,
                          report: SoakReport, deadline: float, hostile_phase: list[bool]) -> None:
    kinds = _hostile_requests()
    port = int(base.rsplit(":", 1)[1])
    while time.monotonic() < deadline:
        hostile_phase[0] = True
        kind, path, body = rng.choice(kinds + [("half_header", "", None),
                                                ("cl_and_te", "", None)])
        if kind == "half_header":
            status = await _half_header(port)
        elif kind == "cl_and_te":
            status = await _smuggle(port)
        else:
            if isinstance(body, bytes):
                r = await http.post(f"{base}{path}", content=body,
                                    headers={"content-type": "application/json"})
            else:
                r = await http.post(f"{base}{path}", json=body)
            status = r.status_code
        key = f"{kind} {status}"
        report.hostile[key] = report.hostile.get(key, 0) + 1
        if status >= 500:
            report.server_errors.append(f"hostile {key}")
        await asyncio.sleep(0.05 + rng.random() * 0.2)


async def _smuggle(port: int) -> int:
    """A body framed by both Content-Length and Transfer-Encoding, a GET smuggled after it:
    the status of the one answer (the connection must close after it)."""
    body = b'{"prompt": "Amen", "max_tokens": 2}'
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                 b"Transfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n"
                 b"%x\r\n%s\r\n0\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
                 % (len(body), body))
    reply = await asyncio.wait_for(reader.read(), 60)  # to EOF: the server closes
    writer.close()
    answers = reply.count(b"HTTP/1.1 ")
    return int(reply[9:12]) if answers == 1 else 500  # a second answer: smuggled


async def _half_header(port: int) -> int:
    """Open a socket, send half a header, leave it; the server drops it later (0 = sent)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    asyncio.get_running_loop().call_later(15, sock.close)  # bounded: we close it ourselves too
    return 0


async def _stalled_reader(base: str, rng: random.Random, report: SoakReport,
                          deadline: float, n: int) -> None:
    """Open a big stream on a socket with a small receive buffer and read nothing until the
    soak ends (at least 10 s); then see whether the server cut the connection (``cut``) or
    finished the answer into the socket's buffers (``completed``)."""
    port = int(base.rsplit(":", 1)[1])
    while time.monotonic() < deadline:
        body = json.dumps({"prompt": rng.choice(PROMPTS), "max_tokens": 300, "n": n,
                           "logprobs": 5, "ignore_eos": True, "stream": True}).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await asyncio.sleep(max(10.0, deadline - time.monotonic()))
        try:
            reply = await asyncio.wait_for(reader.read(-1), 60)
            report.count("stalled_reader", "completed" if b"[DONE]" in reply else "cut")
        except (ConnectionError, asyncio.TimeoutError):
            report.count("stalled_reader", "cut")
        writer.close()


async def _slot_hog(http: httpx.AsyncClient, base: str, rng: random.Random, refs: dict,
                    report: SoakReport, deadline: float, n: int) -> None:
    """n greedy samples of a long answer: every sample must begin with the greedy text."""
    while time.monotonic() < deadline:
        prompt = rng.choice(PROMPTS)
        r = await http.post(f"{base}/v1/completions", json={
            "prompt": prompt, "n": n, "max_tokens": 120, "temperature": 0, "ignore_eos": True})
        if r.status_code == 200:
            want = refs[prompt][-1].rstrip("\ufffd")
            texts = [c["text"] for c in r.json()["choices"]]
            if len(texts) != n or not all(t.startswith(want) for t in texts):
                report.wrong.append(f"slot hog {prompt!r}: {texts[0][:60]!r}")
        elif r.status_code >= 500:
            report.server_errors.append(f"slot hog: {r.status_code}")
        report.count("slot_hog", r.status_code)
        await asyncio.sleep(0.5 if r.status_code == 429 else 0.1)


async def _compile_flood(http: httpx.AsyncClient, base: str, rng: random.Random,
                         report: SoakReport, deadline: float) -> None:
    """A schema never seen before each time: compiled (its output one of its values), or 429
    while the compile thread is full."""
    while time.monotonic() < deadline:
        values = [f"{rng.getrandbits(40):x}" for _ in range(200)]
        schema = {"type": "object", "properties": {"v": {"enum": values}}, "required": ["v"]}
        r = await http.post(f"{base}/v1/completions", json={
            "prompt": "Amen", "max_tokens": 40, "structured_outputs": {"json": schema}})
        if r.status_code == 200:
            text = r.json()["choices"][0]["text"]
            finish = r.json()["choices"][0]["finish_reason"]
            if finish == "stop" and json.loads(text).get("v") not in values:
                report.wrong.append(f"compile flood: {text[:60]!r}")
        elif r.status_code >= 500:
            report.server_errors.append(f"compile flood: {r.status_code}")
        report.count("compile_flood", r.status_code)
        await asyncio.sleep(0.05)


async def soak(base: str, duration_s: float, clients: int = 12, quitters: int = 4,
               seed: int = 0, refs: dict | None = None, hostile: bool = True,
               attackers: bool = False, max_n: int = 8) -> SoakReport:
    """Run the mix against ``base`` for ``duration_s`` seconds; every loop stops by then.
    ``hostile=False`` leaves the hostile requests out (the baseline for the stream gaps);
    ``attackers`` adds a stalled reader, a slot hog (``n = max_n``) and a compile flood."""
    refs = refs or references()
    rng = random.Random(seed)
    report = SoakReport(duration_s)
    hostile_phase = [not hostile]
    deadline = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=clients + quitters + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        tasks = [_good_client(http, base, random.Random(rng.random()), refs, report, deadline,
                              hostile_phase) for _ in range(clients)]
        tasks += [_quitter(http, base, random.Random(rng.random()), report, deadline)
                  for _ in range(quitters)]
        if hostile:
            tasks.append(_hostile_client(http, base, random.Random(rng.random()), report,
                                         deadline, hostile_phase))
        if attackers:
            tasks += [_stalled_reader(base, random.Random(rng.random()), report, deadline,
                                      max_n),
                      _slot_hog(http, base, random.Random(rng.random()), refs, report,
                                deadline, max_n),
                      _compile_flood(http, base, random.Random(rng.random()), report,
                                     deadline)]
        await asyncio.wait_for(asyncio.gather(*tasks), duration_s + 180)
    return report


def main() -> None:
    import os
    import subprocess
    import sys

    import psutil

    from benchmarks._common import provenance, write_results
    from tests.live_server import free_port, metric, wait_for

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-waiting-requests", type=int, default=8)
    parser.add_argument("--no-hostile", action="store_true",
                        help="leave the hostile requests and the attackers out (a baseline)")
    parser.add_argument("--send-timeout", type=float, default=2.0)
    args = parser.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "infer_lab.cli", "serve", "--port", str(port),
                             "--device", "cpu", "--num-kv-blocks", "512", "--max-num-seqs", "32",
                             "--max-waiting-requests", str(args.max_waiting_requests),
                             "--send-timeout", str(args.send_timeout),
                             "--send-buffer-bytes", "16384"],
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert wait_for(lambda: _up(base), 120), "the server did not come up"
        refs = references()
        server = psutil.Process(proc.pid)
        asyncio.run(soak(base, 10, args.clients, refs=refs))  # warm-up: allocator, caches
        rss0 = server.memory_info().rss
        report = asyncio.run(soak(base, args.duration, args.clients, refs=refs,
                                  hostile=not args.no_hostile, attackers=not args.no_hostile))
        rss1 = server.memory_info().rss
        assert wait_for(lambda: metric(base, "kv_cache_blocks_used") == 0, 30)
        result = {**report.summary(), "rss_growth_mb": round((rss1 - rss0) / 2**20, 1),
                  "kv_blocks_used_after": metric(base, "kv_cache_blocks_used"),
                  "clients": args.clients, "max_waiting_requests": args.max_waiting_requests,
                  "with_hostile_requests": not args.no_hostile,
                  "send_timeout_s": args.send_timeout, "target_worst_gap_ms": 100,
                  "load_average_1min": os.getloadavg()[0],
                  "command": "python -m benchmarks.server_soak " + " ".join(sys.argv[1:])}
        print(json.dumps(result, indent=2))
        name = "server_soak_baseline" if args.no_hostile else "server_soak"
        write_results(name, {**provenance("cpu"), **result})
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _up(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


if __name__ == "__main__":
    main()
