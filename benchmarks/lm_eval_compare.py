"""lm-evaluation-harness against ``infer-lab serve``, side by side with lm-eval's own ``hf``
backend on the same weights.

An evaluation harness is the client that asks the most of a server's API: ``local-completions``
scores each choice of a multiple-choice task by sending prompt + choice as token ids with
``echo: true, logprobs: 1, max_tokens: 1`` and summing the log-probabilities of the choice's
tokens, and ``local-chat-completions`` runs ``generate_until`` through the chat endpoint. If the
server is right, the accuracy is exactly the ``hf`` backend's and each log-likelihood agrees to
float32 noise.

The task is the project's own (``tests/fixtures/lm_eval/``: 20 King James Bible verses, public
domain, as a 4-way "which ending" task and as a generation task); nothing comes from a hub
(``HF_HUB_OFFLINE=1``; lm-eval reads the model's local tokenizer). The model is the bundled
tiny-kjv (fp32), which transformers loads as it is.

    python -m benchmarks.lm_eval_compare [--limit N] [--write-reference]

writes ``benchmarks/results/lm_eval_compare.json`` (both runs, per-item log-likelihoods and
generations, the largest difference, wall times, the load average) and, with
``--write-reference``, the ``hf`` values the CI test compares against
(``tests/fixtures/lm_eval/hf_reference.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import provenance

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "lm_eval"
MODEL_DIR = ROOT / "infer_lab" / "assets" / "tiny-kjv"
MODEL_NAME = "tiny-kjv"
MC_TASK, GEN_TASK = "kjv_verses", "kjv_verses_gen"
RESULT = ROOT / "benchmarks" / "results" / "lm_eval_compare.json"
REFERENCE = FIXTURES / "hf_reference.json"


def write_tasks(dest: Path) -> Path:
    """The task YAMLs with the absolute path of the JSONL in place of ``DATA_FILE``."""
    dest.mkdir(parents=True, exist_ok=True)
    data = str(FIXTURES / "kjv_verses.jsonl")
    for name in (MC_TASK, GEN_TASK):
        text = (FIXTURES / f"{name}.yaml").read_text()
        (dest / f"{name}.yaml").write_text(text.replace("DATA_FILE", data))
    return dest


def evaluate(model: str, model_args: dict[str, Any], task: str, task_dir: Path,
             limit: int | None, chat: bool = False) -> dict[str, Any]:
    """One ``simple_evaluate`` run: the task's metrics and, per item, the log-likelihood of
    each choice (multiple choice) or the generated text."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    start = time.perf_counter()
    out = simple_evaluate(model=model, model_args=model_args, tasks=[task], limit=limit,
                          task_manager=TaskManager(include_path=str(task_dir),
                                                       include_defaults=False),
                          log_samples=True, apply_chat_template=chat, batch_size=1,
                          random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                          fewshot_random_seed=0)
    seconds = time.perf_counter() - start
    metrics = {k.split(",")[0]: v for k, v in out["results"][task].items()
               if isinstance(v, (int, float)) and "stderr" not in k}
    items = {}
    for s in out["samples"][task]:
        if task == MC_TASK:
            items[str(s["doc_id"])] = [float(r[0]) for r in s["filtered_resps"]]
        else:
            items[str(s["doc_id"])] = s["filtered_resps"][0]
    return {"metrics": metrics, "items": items, "seconds": round(seconds, 2)}


def hf_runs(task_dir: Path, limit: int | None) -> dict[str, Any]:
    """lm-eval's own transformers backend on the bundled weights (fp32, CPU)."""
    args = {"pretrained": str(MODEL_DIR), "dtype": "float32", "device": "cpu"}
    return {MC_TASK: evaluate("hf", args, MC_TASK, task_dir, limit),
            GEN_TASK: evaluate("hf", args, GEN_TASK, task_dir, limit, chat=True)}


def server_runs(base: str, task_dir: Path, limit: int | None,
                untokenized: bool = True) -> dict[str, Any]:
    """``local-completions`` (token ids, and text if ``untokenized``) for the multiple choice,
    ``local-chat-completions`` for the generation, against the server at ``base``."""
    common = {"model": MODEL_NAME, "num_concurrent": 1, "max_retries": 1, "timeout": 300}
    completions = {**common, "base_url": f"{base}/v1/completions", "tokenizer": str(MODEL_DIR),
                   "tokenizer_backend": "huggingface"}
    runs = {MC_TASK: evaluate("local-completions", completions, MC_TASK, task_dir, limit)}
    if untokenized:
        runs[MC_TASK + "_text"] = evaluate(
            "local-completions", {**completions, "tokenized_requests": False}, MC_TASK,
            task_dir, limit)
    chat = {**common, "base_url": f"{base}/v1/chat/completions"}
    runs[GEN_TASK] = evaluate("local-chat-completions", chat, GEN_TASK, task_dir, limit,
                              chat=True)
    return runs


def compare(hf: dict[str, Any], served: dict[str, Any]) -> dict[str, Any]:
    """Accuracy side by side; the largest per-choice log-likelihood difference; whether every
    generation is the same text."""
    out: dict[str, Any] = {}
    for name, run in served.items():
        ref = hf[MC_TASK if name.startswith(MC_TASK) and name != GEN_TASK else GEN_TASK]
        row: dict[str, Any] = {"hf": ref["metrics"], "server": run["metrics"]}
        if name == GEN_TASK:
            row["same_generations"] = sum(run["items"][k] == v for k, v in ref["items"].items())
            row["items"] = len(ref["items"])
        else:
            row["max_abs_loglikelihood_diff"] = max(
                abs(a - b) for k, v in ref["items"].items() for a, b in zip(v, run["items"][k]))
        out[name] = row
    return out


def serve(port: int) -> subprocess.Popen:
    """``infer-lab serve`` of the bundled model, unchanged, in its own process."""
    cmd = [sys.executable, "-m", "infer_lab.cli", "serve", "--port", str(port),
           "--device", "cpu"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def wait_ready(base: str, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server at {base} did not come up in {timeout} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=None, help="items per task (all: 20)")
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--write-reference", action="store_true",
                        help=f"write the hf values to {REFERENCE.relative_to(ROOT)}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        task_dir = write_tasks(Path(tmp))
        hf = hf_runs(task_dir, args.limit)
        if args.write_reference:
            REFERENCE.write_text(json.dumps({"lm_eval": _version(), "model": MODEL_NAME,
                                             "dtype": "float32", **hf}, indent=1) + "\n")
            print(f"wrote {REFERENCE.relative_to(ROOT)}")
        base = f"http://127.0.0.1:{args.port}"
        proc = serve(args.port)
        try:
            wait_ready(base)
            served = server_runs(base, task_dir, args.limit)
        finally:
            proc.terminate()
            proc.wait(30)
    table = compare(hf, served)
    for name, row in table.items():
        print(f"{name:24s} hf {row['hf']}  server {row['server']}  "
              + ", ".join(f"{k} {v}" for k, v in row.items() if k not in ("hf", "server")))
    record = {"command": "python -m benchmarks.lm_eval_compare"
              + (f" --limit {args.limit}" if args.limit else ""),
              "provenance": {**provenance("cpu"), "load_average": os.getloadavg()},
              "model": MODEL_NAME, "dtype": "float32", "lm_eval": _version(),
              "comparison": table, "hf": hf, "server": served}
    RESULT.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {RESULT.relative_to(ROOT)}")


def _version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


if __name__ == "__main__":
    main()
