"""Helpers for the tool-calling tests: reading a stream of tool-call deltas the way a client
does, steering a served model to write a given text, and a copy of the bundled model whose
tokenizer has the tool-call markers as special tokens (as Mistral's and Llama 3's real
tokenizers do)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infer_lab.model.loader import BUNDLED_MODEL_DIR

# The two markers, each put in place of a token nothing else is built from (the last merges of
# the bundled BPE vocabulary: " overth", " overl"), so the model, whose vocabulary is full, can
# write them as one token.
MARKER_TOKENS = {"[TOOL_CALLS]": "Ġoverth", "<|python_tag|>": "Ġoverl"}


def steered(real: Callable[..., Any], start: int, script: list[int],
            pause: float = 0.0) -> Callable[..., Any]:
    """A model runner's forward that makes the model write ``script``: the token at position
    ``start + k`` (``start``: the prompt's length) gets +1000 on ``script[k]``'s logit, so greedy
    decoding picks it unless a grammar refuses it. ``pause`` seconds per step give a stream's
    reader time to send each token as its own chunk (a reader that lags gets the tokens it
    missed merged into one chunk)."""

    def forward(ids: Any, positions: Any, ctx: Any) -> Any:
        if pause:
            time.sleep(pause)
        logits = real(ids, positions, ctx)
        idx = ctx.logits_indices
        rows = (positions[idx] if idx is not None else positions).tolist()
        for r, p in enumerate(rows):
            k = p + 1 - start
            if 0 <= k < len(script):
                logits[r, script[k]] += 1000.0
        return logits

    return forward


def accumulate(chunks: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """The content, the calls and the last finish reason of streamed chunks (``openai``
    objects), each call ``{"id", "name", "arguments", "pieces", "first"}`` put together by its
    ``index`` as OpenAI's streaming spec says (``pieces``: its argument fragments; ``first``:
    its first delta as sent)."""
    content, calls, reason = "", [], None
    for chunk in chunks:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.index == len(calls):
                    calls.append({"id": d.id, "name": d.function.name, "arguments": "",
                                  "pieces": [], "first": d.model_dump()})
                call = calls[d.index]
                if d.function and d.function.arguments:
                    call["arguments"] += d.function.arguments
                    call["pieces"].append(d.function.arguments)
            reason = c.finish_reason or reason
    return content, calls, reason


def strict(tool: dict[str, Any]) -> dict[str, Any]:
    """``tool`` marked ``strict``: what the ``openai`` client's stream helper needs to
    assemble and parse calls (the server's calls follow the schema either way)."""
    return {**tool, "function": {**tool["function"], "strict": True}}


def marker_model(path: Path) -> Path:
    """The bundled model at ``path`` (its files linked) with ``[TOOL_CALLS]`` and
    ``<|python_tag|>`` as special added tokens of its tokenizer, in the ids of two tokens that
    no merge builds on (their merges dropped)."""
    path.mkdir(parents=True, exist_ok=True)
    for f in BUNDLED_MODEL_DIR.iterdir():
        if f.name != "tokenizer.json":
            os.symlink(f, path / f.name)
    data = json.loads((BUNDLED_MODEL_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]
    for marker, old in MARKER_TOKENS.items():
        assert not any(old in m for m in merges if "".join(m) != old)  # nothing builds on it
        token_id = vocab.pop(old)
        vocab[marker] = token_id
        data["model"]["merges"] = merges = [m for m in merges if "".join(m) != old]
        data["added_tokens"].append({"id": token_id, "content": marker, "single_word": False,
                                     "lstrip": False, "rstrip": False, "normalized": False,
                                     "special": True})
    (path / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return path


def streamed_like_whole(client: Any, **kw: Any) -> tuple[Any, list[dict[str, Any]], str]:
    """Ask the same greedy question whole and streamed through the ``openai`` client's stream
    helper, and check that the stream sent each call as it was written and agrees with the whole
    answer: each call's first delta carries its ``index``, ``id``, ``type`` and name; its
    arguments came in more than one piece, which add up (in the client's own accumulation and
    in ours) to exactly the whole answer's arguments; no markup reached ``content``.
    Returns the whole answer's choice, the streamed calls and the streamed content."""
    whole = client.chat.completions.create(**kw).choices[0]
    with client.chat.completions.stream(**kw) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion().choices[0]
    content, calls, reason = accumulate(chunks)
    want = [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or []]
    assert want and reason == whole.finish_reason == final.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == want
    assert [(t.function.name, t.function.arguments) for t in final.message.tool_calls] == want
    for k, call in enumerate(calls):
        first = call["first"]
        assert first["index"] == k and first["type"] == "function" and first["id"]
        assert first["function"]["name"] == call["name"]
        assert len(call["pieces"]) > 1, call  # the arguments grew as they were written
    later = [d for chunk in chunks for c in chunk.choices for d in c.delta.tool_calls or []
             if d.id is None]
    assert later and all(d.function.name is None and d.type is None for d in later)
    return whole, calls, content
