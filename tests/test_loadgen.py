"""The load generator against a stub server that streams with delays the test injects itself.

The stub is a real HTTP/1.1 server on a free loopback port (plain asyncio, chunked SSE), so the
tool is tested exactly as it talks to a real server. The calibration test checks that
``infer-lab bench`` recovers the injected TTFT and inter-token gap: it tests the measuring tool,
not the machine. Everything else checks behaviour (bounds, counts, failures), not time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

from infer_lab.measure import bench
from infer_lab.measure.loadgen import (
    Endpoint,
    RequestSpec,
    _token_chunk,
    run_closed_loop,
    run_open_loop,
    run_sync,
)

TTFT, GAP = 0.200, 0.020  # what the stub injects in the calibration test


class Stub:
    """A tiny OpenAI-compatible streaming server in a background thread.

    ``mode``: ok, http500, error_event (3 tokens, then an error event), drop (3 tokens, then the
    connection closes mid-body), no_done (all tokens, no ``[DONE]``), hang (never answers),
    flaky (every other request answers 500), stale (a kept-alive connection is closed, unanswered,
    when its second request arrives, as a server does that drops idle connections), mute (every
    request closed unanswered). It records every request body and the most
    requests it ever had in flight.
    """

    def __init__(self, ttft: float = TTFT, gap: float = GAP, mode: str = "ok",
                 usage: bool = True) -> None:
        self.ttft, self.gap, self.mode, self.usage = ttft, gap, mode, usage
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = self.max_in_flight = self.connections = 0
        self._tasks: set[asyncio.Task] = set()

    def __enter__(self) -> Stub:
        self.loop = asyncio.new_event_loop()
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0, backlog=1024))
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            self.server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        self.connections += 1
        served = 0
        try:
            while True:  # keep-alive: one connection may carry many requests
                try:
                    head = (await reader.readuntil(b"\r\n\r\n")).decode()
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                method, path, _ = head.split("\r\n")[0].split(" ")
                length = next((int(h.split(":")[1]) for h in head.split("\r\n")
                               if h.lower().startswith("content-length:")), 0)
                body = json.loads(await reader.readexactly(length)) if length else {}
                if method == "GET" and path == "/v1/models":
                    await self._reply(writer, 200, {"object": "list", "data": [{"id": "stub"}]})
                elif self.mode == "mute" or (self.mode == "stale" and served):
                    self.bodies.append(body)  # read, then closed without a status line
                    writer.close()
                    return
                elif not await self._complete(writer, path, body):
                    writer.close()
                    return
                served += 1
        except asyncio.CancelledError:
            writer.close()
        finally:
            self._tasks.discard(task)

    async def _reply(self, writer: asyncio.StreamWriter, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        await writer.drain()

    async def _complete(self, writer: asyncio.StreamWriter, path: str, body: dict) -> bool:
        """Answer one completion request; False if the connection must close."""
        self.bodies.append(body)
        number = len(self.bodies)
        if self.mode == "http500" or (self.mode == "flaky" and number % 2 == 0):
            await self._reply(writer, 500, {"error": {"message": "stub says no"}})
            return True
        if self.mode == "hang":
            await asyncio.sleep(60)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        chat = path.endswith("/chat/completions")
        start = asyncio.get_running_loop().time()

        async def send(event: dict | str) -> None:
            data = event if isinstance(event, str) else json.dumps(event)
            payload = f"data: {data}\n\n".encode()
            writer.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
            await writer.drain()

        counted = True
        try:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            if chat:  # a role-only chunk at once, before any token: it is not the first token
                await send({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                               "content": ""}}]})
            n = body["max_tokens"]
            for i in range(n):
                # absolute schedule, so sleep overshoot does not add up along the stream
                delay = start + self.ttft + i * self.gap - asyncio.get_running_loop().time()
                await asyncio.sleep(max(0.0, delay))
                if self.mode in ("error_event", "drop") and i == 3:
                    if self.mode == "drop":
                        return False
                    await send({"error": {"message": "engine died", "code": 500}})
                    break
                choice: dict[str, Any] = {"index": 0, "finish_reason": None}
                choice |= {"delta": {"content": " tok"}} if chat else {"text": " tok"}
                await send({"id": "x", "choices": [choice]})
            else:
                finish = {"index": 0, "finish_reason": "length"}
                await send({"choices": [finish | ({"delta": {}} if chat else {"text": ""})]})
                if self.usage and body.get("stream_options", {}).get("include_usage"):
                    await send({"choices": [], "usage": {"prompt_tokens": 1,
                                                         "completion_tokens": n}})
                if self.mode != "no_done":
                    await send("[DONE]")
            self.in_flight -= 1  # before the last bytes: the client cannot send again sooner
            counted = False
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        finally:
            if counted:
                self.in_flight -= 1


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_args(url: str, *extra: str) -> argparse.Namespace:
    """Parse ``infer-lab bench`` arguments with the real sub-parser."""
    return bench.parse_bench_args(["--base-url", url, "--no-progress", *extra])


def specs(n: int, output_len: int = 10, input_len: int = 8) -> list[RequestSpec]:
    return [RequestSpec(input_len, output_len, prompt=list(range(input_len))) for _ in range(n)]


# --- calibration: the tool recovers delays that the stub injects ---------------------------


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    with Stub() as stub:
        args = bench_args(stub.url, "--concurrency", "4", "--num-requests", "16",
                          "--num-warmups", "2", "--input-len", "8", "--output-len", "10",
                          # an SLO every request meets, even on a busy machine
                          "--seed", "3", "--slo", "ttft=2s,tpot=200ms",
                          "--out", str(out / "r.json"), "--plot", str(out / "cal"))
        result = bench.run_bench(args)
    return result, stub, out


def test_bench_recovers_injected_ttft_itl_and_tpot(calibration):
    result, _, _ = calibration
    (point,) = result["points"]
    m = point["metrics"]
    assert m["ttft.p50"] == pytest.approx(TTFT, rel=0.15)
    assert m["itl.p50"] == pytest.approx(GAP, rel=0.15)
    assert m["tpot.p50"] == pytest.approx(GAP, rel=0.15)
    assert m["e2el.p50"] == pytest.approx(TTFT + 9 * GAP, rel=0.15)
    summary = point["runs"][0]["summary"]
    assert summary["completed"] == 16 and summary["failed"] == 0
    assert summary["output_tokens"] == 16 * 10 and summary["output_len_mismatch"] == 0
    assert summary["itl"]["n"] == 16 * 9  # pooled: every gap of every request
    assert summary["slo_met"] == 16 and m["goodput"] == pytest.approx(m["request_throughput"])


def test_bench_sends_the_openai_request_it_promises(calibration):
    _, stub, _ = calibration
    assert len(stub.bodies) == 2 + 16  # warm-ups are sent, then left out of every statistic
    for body in stub.bodies:
        assert body["model"] == "stub"  # asked GET /v1/models, as no --model was given
        assert len(body["prompt"]) == 8 and all(isinstance(t, int) for t in body["prompt"])
        assert body["max_tokens"] == 10 and body["ignore_eos"] is True
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["temperature"] == 0
    prompts = {tuple(b["prompt"]) for b in stub.bodies}
    assert len(prompts) == len(stub.bodies)  # no two prompts alike: no prefix-cache hits


def test_bench_table_json_and_plots_state_the_conditions(calibration, capsys):
    result, _, out = calibration
    saved = json.loads((out / "r.json").read_text())
    assert saved["meta"]["seed"] == 3 and saved["meta"]["num_requests"] == 16
    assert saved["points"][0]["concurrency"] == 4
    table = bench.format_table(saved)
    for fact in ("C=4", "N=16", "input 8 / output 10 tokens", "seed 3", "ttft <= 2000 ms",
                 "TTFT ms p50/p90/p99", "ITL ms", "16/16"):
        assert fact in table
    # N = 16: each p99 is the largest value, and the table says so, with its interval
    assert "WARNING at C=4: p99 rests on fewer than 10 samples beyond it" in table
    assert "TTFT p99 ms [CI]" in table
    ci = saved["points"][0]["ci"]
    # p99 of 16 samples sits at index 15 * 0.99 = 14.85: only the largest (index 15) lies beyond
    assert saved["points"][0]["beyond_p99"]["ttft"] == 1
    for key in ("ttft.p50", "ttft.p99", "itl.p99", "tpot.p90", "e2el.p50"):
        lo, hi = ci[key]
        assert 0 < lo <= hi
    assert ci["ttft.p50"][0] <= saved["points"][0]["metrics"]["ttft.p50"] <= ci["ttft.p50"][1]
    names = sorted(p.name for p in out.glob("cal_*.png"))
    assert names == ["cal_cdf.png", "cal_throughput_latency.png", "cal_vs_load.png"]
    assert all((out / n).stat().st_size > 10_000 for n in names)
    assert saved["points"][0]["cdf"]["ttft"][100] == pytest.approx(TTFT, rel=0.15)  # median


@pytest.mark.parametrize("usage", [True, False])
def test_chat_endpoint_and_counting_tokens_without_usage(usage):
    # The stub's chat stream opens with a role-only chunk at t=0: it must not count as a token.
    with Stub(ttft=0.1, gap=0.01, usage=usage) as stub:
        endpoint = Endpoint(stub.url, "m", "chat", timeout=10)
        run = run_sync(run_closed_loop(endpoint, specs(4, output_len=6), concurrency=2))
    assert all(r.success for r in run.results)
    assert all(r.output_tokens == 6 and len(r.chunk_times) == 6 for r in run.results)
    assert all(r.usage_tokens == (6 if usage else None) for r in run.results)
    assert stub.bodies[0]["messages"][0]["role"] == "user"
    assert min(r.chunk_times[0] - r.sent for r in run.results) >= 0.1 - 1e-3


def test_token_chunks_are_those_that_carry_a_token():
    assert _token_chunk([{"text": "a"}])
    assert _token_chunk([{"delta": {"content": "a"}}])
    assert _token_chunk([{"text": "", "token_ids": [5]}])
    assert not _token_chunk([{"delta": {"role": "assistant", "content": ""}}])
    assert not _token_chunk([{"text": "", "finish_reason": "length"}])
    assert not _token_chunk([])


# --- load shape: closed loop bounded at C, open loop at its rate -----------------------------


@pytest.mark.parametrize("concurrency", [1, 3])
def test_closed_loop_holds_exactly_c_in_flight(concurrency):
    with Stub(ttft=0.03, gap=0.005) as stub:
        endpoint = Endpoint(stub.url, "m", timeout=10)
        run = run_sync(run_closed_loop(endpoint, specs(4 * concurrency, 4), concurrency))
    assert stub.max_in_flight == concurrency
    assert len(run.results) == 4 * concurrency and all(r.success for r in run.results)


def test_one_connection_per_slot_kept_from_warm_up_through_repeats():
    # TCP set-up belongs to no server's TTFT: the warm-up opens the connections, runs reuse them.
    with Stub(ttft=0.01, gap=0.005) as stub:
        result = bench.run_bench(bench_args(stub.url, "--concurrency", "3", "-n", "9",
                                            "--num-warmups", "3", "--repeats", "2",
                                            "--output-len", "3"))
    assert stub.connections == 1 + 3  # GET /v1/models, then one per slot
    assert len(stub.bodies) == 3 + 2 * 9
    assert all(run["client_cpu"] > 0 for run in result["points"][0]["runs"])


def test_open_loop_sends_at_the_seeded_poisson_rate():
    args = bench_args("http://127.0.0.1:1", "--request-rate", "40", "-n", "60", "--seed", "5")
    first = bench.build_workload(args, 40.0)
    assert [s.arrival for s in first] == [s.arrival for s in bench.build_workload(args, 40.0)]
    arrivals = np.array([s.arrival for s in first])
    assert arrivals[0] == 0 and np.all(np.diff(arrivals) >= 0)
    assert (len(arrivals) - 1) / arrivals[-1] == pytest.approx(40, rel=0.3)  # this seed's draw
    with Stub(ttft=0.01, gap=0.005) as stub:
        run = run_sync(run_open_loop(Endpoint(stub.url, "m", timeout=10),
                                     [RequestSpec(s.prompt_len, 3, s.arrival, s.prompt)
                                      for s in first], rate=40))
    assert all(r.success for r in run.results) and len(stub.bodies) == 60
    sent = np.array([r.sent for r in run.results])
    # Roughly on schedule (loose: a loaded CI machine may delay a send by a few ms).
    assert np.median(np.abs(sent - arrivals)) < 0.02
    assert (len(sent) - 1) / (sent.max() - sent.min()) == pytest.approx(
        (len(arrivals) - 1) / arrivals[-1], rel=0.2)


def test_burstiness_below_one_makes_gaps_burstier():
    def cv(burstiness: str) -> float:
        args = bench_args("http://127.0.0.1:1", "--request-rate", "10", "-n", "400",
                          "--burstiness", burstiness)
        gaps = np.diff([s.arrival for s in bench.build_workload(args, 10.0)])
        return float(gaps.std() / gaps.mean())

    assert cv("1") == pytest.approx(1.0, abs=0.2)  # Poisson: exponential gaps, CV 1
    assert cv("0.25") > 1.5  # gamma shape 0.25: CV 2


def test_open_loop_max_concurrency_caps_requests_in_flight():
    with Stub(ttft=0.03, gap=0.005) as stub:
        run = run_sync(run_open_loop(Endpoint(stub.url, "m", timeout=10), specs(9, 3),
                                     rate=math.inf, max_concurrency=3))
    assert stub.max_in_flight == 3 and all(r.success for r in run.results)


def test_a_spec_without_a_prompt_fails_the_request_not_the_run():
    with Stub(ttft=0.01, gap=0.005) as stub:
        run = run_sync(run_closed_loop(Endpoint(stub.url, "m", timeout=10),
                                       [RequestSpec(4, 3)], concurrency=1))
    (r,) = run.results
    assert not r.success and "without a prompt" in r.error and stub.bodies == []


def test_long_tail_dataset_is_the_named_workload():
    from infer_lab.measure.workloads import long_tail_mix

    args = bench_args("http://127.0.0.1:1", "--dataset", "long-tail", "--request-rate", "2")
    got = bench.build_workload(args, 2.0)
    want = long_tail_mix(128, seed=0, rate=2.0)
    assert [(s.prompt_len, s.output_len, s.arrival) for s in got] == \
        [(r.prompt_len, r.output_len, r.arrival) for r in want]
    assert all(len(s.prompt) == s.prompt_len for s in got)


# --- bad input: counted and reported as failed, never a crash, never dropped ------------------


@pytest.mark.parametrize(("mode", "message"), [
    ("http500", "HTTP 500: "),
    ("error_event", "error event: engine died"),
    ("drop", "RemoteProtocolError"),
    ("no_done", "without data: [DONE]"),
    ("hang", "timeout"),
])
def test_failing_server_requests_are_counted_failed(mode, message):
    from infer_lab.measure.stats import summarize

    with Stub(ttft=0.02, gap=0.005, mode=mode) as stub:
        endpoint = Endpoint(stub.url, "m", timeout=0.5)
        run = run_sync(run_closed_loop(endpoint, specs(4, 6), concurrency=2))
    assert len(run.results) == 4 and not any(r.success for r in run.results)
    assert all(message in r.error for r in run.results), run.results[0].error
    s = summarize(run.results, run.duration)
    assert (s.num_requests, s.completed, s.failed) == (4, 0, 4)
    assert s.ttft.n == 0 and s.itl.n == 0  # partial streams never leak into latencies
    assert sum(s.errors.values()) == 4


def test_a_stale_kept_alive_connection_costs_a_resend_not_the_request():
    """A request the server closes without any answer is sent once more on a new connection;
    a server that never answers still fails every request, each sent exactly twice."""
    with Stub(ttft=0.01, gap=0.002, mode="stale") as stub:
        run = run_sync(run_closed_loop(Endpoint(stub.url, "m", timeout=5), specs(4, 3),
                                       concurrency=1))
        assert all(r.success for r in run.results), run.results[0].error
        assert stub.connections == 4 and len(stub.bodies) == 7  # 3 requests sent twice
    with Stub(ttft=0.01, gap=0.002, mode="mute") as stub:
        run = run_sync(run_closed_loop(Endpoint(stub.url, "m", timeout=5), specs(3, 3),
                                       concurrency=1))
        assert not any(r.success for r in run.results)
        assert all("RemoteProtocolError" in r.error for r in run.results)
        assert len(stub.bodies) == 6


def test_unreachable_endpoint_is_reported_not_raised(capsys):
    args = bench_args(f"http://127.0.0.1:{closed_port()}", "-n", "5", "--num-warmups", "1",
                      "--concurrency", "2", "--timeout", "5")
    assert bench.bench_command(args) == 1
    captured = capsys.readouterr()
    summary = bench.run_bench(args)["points"][0]["runs"][0]["summary"]
    assert (summary["num_requests"], summary["failed"]) == (5, 5)
    assert "ConnectError" in next(iter(summary["errors"]))
    assert "FAILED at C=2: 5 of 5" in captured.out and "warm-up at C=2: 1 failed" in captured.out
    assert "no request succeeded" in captured.err


def test_some_failures_are_counted_beside_the_successes(capsys):
    with Stub(ttft=0.02, gap=0.005, mode="flaky") as stub:
        args = bench_args(stub.url, "-n", "8", "--num-warmups", "0", "--output-len", "4")
        assert bench.bench_command(args) == 0
    table = capsys.readouterr().out
    assert "4/8" in table and "FAILED at C=1: 4 of 8" in table and "HTTP 500" in table


# --- command line ------------------------------------------------------------------------------


def test_sweep_arguments_and_bad_values():
    args = bench_args("http://127.0.0.1:1", "--concurrency", "1:16", "32")
    assert bench._flat(args.concurrency) == [1, 2, 4, 8, 16, 32]
    args = bench_args("http://127.0.0.1:1", "--request-rate", "0.5", "inf")
    assert bench._flat(args.request_rate) == [0.5, math.inf]
    for bad in (["--concurrency", "1.5"], ["--concurrency", "inf"], ["--repeats", "0"],
                ["--range-ratio", "1"], ["--slo", "ttft=fast"]):
        with pytest.raises(ValueError):
            bench.run_bench(bench_args("http://127.0.0.1:1", *bad))
    with pytest.raises(SystemExit):
        bench_args("http://127.0.0.1:1", "--concurrency", "2", "--request-rate", "1")


def test_main_entry_reports_bad_arguments(capsys):
    assert bench.main(["--base-url", "http://127.0.0.1:1", "--repeats", "0"]) == 1
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_repeats_report_their_spread(capsys):
    with Stub(ttft=0.02, gap=0.005) as stub:
        result = bench.run_bench(bench_args(stub.url, "-n", "4", "--num-warmups", "0",
                                            "--output-len", "3", "--repeats", "3",
                                            "--concurrency", "1", "2"))
    for point in result["points"]:
        assert len(point["runs"]) == 3
        spread = point["spread"]["ttft.p50"]
        assert spread["min"] <= point["metrics"]["ttft.p50"] == spread["median"] <= spread["max"]
    assert "spread over 3 repeats" in capsys.readouterr().out


def test_run_sync_works_inside_a_running_loop():
    async def inner() -> int:
        await asyncio.sleep(0)
        return 7

    async def notebook_cell() -> int:
        return run_sync(inner())  # as in Jupyter, where a loop is already running

    assert asyncio.run(notebook_cell()) == 7


def test_importing_the_package_does_not_import_httpx():
    code = ("import sys, infer_lab, infer_lab.measure.stats, infer_lab.measure.loadgen, "
            "infer_lab.measure.bench; assert 'httpx' not in sys.modules, 'httpx'; "
            "assert 'matplotlib.pyplot' not in sys.modules")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:] + f" ({time.perf_counter() - start:.0f}s)"


def test_infer_lab_command_line_runs_bench(capsys):
    from infer_lab.cli import build_parser, main

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", "--help"])
    assert e.value.code == 0
    capsys.readouterr()
    assert main(["bench", "--slo", "ttft=soon"]) == 1
    assert "bad SLO" in capsys.readouterr().err


# --- a file of prompts (e.g. copy-heavy ones for speculative decoding) -----------------------


def test_bench_sends_a_prompt_file_in_order_and_cycles_it(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "copy this text: a b c", "output_len": 4}\n\n'
                    '{"prompt": [5, 6, 7]}\n'
                    '{"prompt": "and this one", "output_len": 2}\n')
    with Stub(ttft=0.01, gap=0.005) as stub:
        result = bench.run_bench(bench_args(
            stub.url, "--dataset", "file", "--dataset-path", str(path), "--concurrency", "1",
            "-n", "4", "--num-warmups", "0", "--output-len", "3", "--repeats", "2"))
    sent = [(b["prompt"], b["max_tokens"]) for b in stub.bodies]
    first = [("copy this text: a b c", 4), ([5, 6, 7], 3), ("and this one", 2),
             ("copy this text: a b c", 4)]
    assert sent[:4] == first  # in order, cycled, each line's output_len or --output-len
    assert sent[4][0] == [5, 6, 7]  # the repeat starts further along the file
    assert result["meta"]["dataset"] == "file" and result["meta"]["dataset_path"] == str(path)
    assert result["points"][0]["runs"][0]["summary"]["completed"] == 4


@pytest.mark.parametrize("content, message", [
    ("", "no prompts"),
    ("not json\n", ":1: not JSON"),
    ('{"prompt": ""}\n', ":1: 'prompt' must be"),
    ('{"text": "hi"}\n', ":1: 'prompt' must be"),
    ('{"prompt": [1, -2]}\n', ":1: 'prompt' must be"),
    ('{"prompt": "ok"}\n{"prompt": "x", "output_len": 0}\n', ":2: 'output_len' must be"),
    ('{"prompt": "x", "output_len": true}\n', ":1: 'output_len' must be"),
])
def test_a_bad_prompt_file_is_refused_naming_the_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    args = bench_args("http://127.0.0.1:1", "--dataset", "file", "--dataset-path", str(path))
    with pytest.raises(ValueError, match=message):
        bench.build_workload(args, None)
    with pytest.raises(ValueError, match="needs --dataset-path"):
        bench._check(bench_args("http://127.0.0.1:1", "--dataset", "file"))


def test_a_file_run_says_where_its_prompts_came_from():
    from infer_lab.measure.report import describe

    meta = {"dataset": "file", "dataset_path": "copy.jsonl", "output_len": 64, "range_ratio": 0,
            "ignore_eos": True, "mode": "closed", "num_requests": 8, "seed": 0, "repeats": 1,
            "num_warmups": 2}
    assert "prompts of copy.jsonl" in describe(meta)
