"""lm-evaluation-harness, unchanged, against the server (issue 29).

``local-completions`` scores a multiple-choice task (each choice: prompt + choice as token ids,
``echo``, ``logprobs: 1``, ``max_tokens: 1``; and once as text), and
``local-chat-completions`` runs ``generate_until`` through the chat route. The values are
compared with lm-eval's own ``hf`` backend on the same weights, committed in
``tests/fixtures/lm_eval/hf_reference.json`` by ``python -m benchmarks.lm_eval_compare
--write-reference``: the same accuracy, each choice's log-likelihood within 1e-3 nats (fp32),
the same generated text. 20 items in all (12 scored, 8 generated, plus 4 scored as text), from
the project's own task (King James verses; nothing from a hub).
"""

from __future__ import annotations

import json

import pytest

from benchmarks.lm_eval_compare import (
    FIXTURES,
    GEN_TASK,
    MC_TASK,
    MODEL_DIR,
    MODEL_NAME,
    REFERENCE,
    evaluate,
    write_tasks,
)
from infer_lab.serve.server import make_app
from tests.live_server import metric, running, wait_for

NATS = 1e-3
MC_ITEMS, GEN_ITEMS, TEXT_ITEMS = 12, 8, 4


@pytest.fixture(scope="module")
def reference():
    return json.loads(REFERENCE.read_text())


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("lm_eval_tasks"))


@pytest.fixture(scope="module")
def server():
    with running(make_app(None, device="cpu")) as base:
        yield base


def completions_args(base: str, **extra) -> dict:
    return {"model": MODEL_NAME, "base_url": f"{base}/v1/completions", "num_concurrent": 1,
            "max_retries": 1, "timeout": 300, "tokenizer": str(MODEL_DIR),
            "tokenizer_backend": "huggingface", **extra}


def labels(limit: int) -> list[int]:
    lines = (FIXTURES / "kjv_verses.jsonl").read_text().splitlines()[:limit]
    return [json.loads(line)["label"] for line in lines]


def check_scores(run: dict, reference: dict, limit: int) -> None:
    ref = reference[MC_TASK]["items"]
    assert set(run["items"]) == {str(i) for i in range(limit)}
    for doc, lls in run["items"].items():
        assert len(lls) == 4
        assert max(abs(a - b) for a, b in zip(lls, ref[doc])) < NATS, doc
    want = sum(max(range(4), key=lambda c: ref[str(i)][c]) == label
               for i, label in enumerate(labels(limit))) / limit
    assert run["metrics"]["acc"] == pytest.approx(want)  # the accuracy, to the item


def test_local_completions_scores_like_the_hf_backend(server, tasks, reference):
    run = evaluate("local-completions", completions_args(server), MC_TASK, tasks, MC_ITEMS)
    check_scores(run, reference, MC_ITEMS)
    assert wait_for(lambda: metric(server, "kv_cache_blocks_used") == 0, 30)


def test_local_completions_untokenized_requests(server, tasks, reference):
    run = evaluate("local-completions", completions_args(server, tokenized_requests=False),
                   MC_TASK, tasks, TEXT_ITEMS)
    check_scores(run, reference, TEXT_ITEMS)


def test_local_chat_completions_generates_like_the_hf_backend(server, tasks, reference):
    chat = {"model": MODEL_NAME, "base_url": f"{server}/v1/chat/completions",
            "num_concurrent": 1, "max_retries": 1, "timeout": 300}
    run = evaluate("local-chat-completions", chat, GEN_TASK, tasks, GEN_ITEMS, chat=True)
    ref = reference[GEN_TASK]["items"]
    assert len(run["items"]) == GEN_ITEMS
    for doc, text in run["items"].items():
        assert text == ref[doc], doc
    from lm_eval.api.metrics import exact_match_hf_evaluate

    docs = [json.loads(line) for line in (FIXTURES / "kjv_verses.jsonl").read_text()
            .splitlines()[:GEN_ITEMS]]
    want = exact_match_hf_evaluate(
        predictions=[ref[str(i)] for i in range(GEN_ITEMS)],
        references=[d["choices"][d["label"]] for d in docs], ignore_case=True,
        ignore_punctuation=True)["exact_match"]
    assert run["metrics"]["exact_match"] == pytest.approx(want)
