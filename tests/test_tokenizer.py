"""infer_lab's tokenizer agrees with transformers, and its streaming detokenizer with `decode`.

Every tokenizer here is trained in the test (tiny vocabularies, a few milliseconds) and saved with
`transformers`' `save_pretrained`; nothing comes from the hub.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from infer_lab.model.tokenizer import (
    ChatTemplateError,
    IncrementalDetokenizer,
    Tokenizer,
    check_chat_template,
    template_reads,
)

CORPUS = [
    "café naïve résumé, déjà vu à la crème brûlée.",
    "日本語の文章です。東京と京都に行きました。",
    "emoji 🙂🚀👍🏽 and more 🙂 smiles 🚀 rockets 👍🏽.",
    "The quick brown fox jumps over the lazy dog. Don't stop, it's fine!",
    "Prefill is compute-bound; decode is memory-bandwidth-bound.",
] * 10

SAMPLES = [
    "Hello world",
    "café naïve",
    "日本語の文章",
    "🙂🚀👍🏽",
    "  leading and trailing spaces  ",
    "mixed: café 日本 🙂 end.\nnew line\ttab",
    "<s> literal special token </s> in text",
    "",
]

# A Llama-3 / ChatML-ish template exercising what real ones use: bos_token, raise_exception,
# add_generation_prompt, a `tojson` of non-ASCII data, strftime_now, a `generation` block, a
# `tools is not none` test, and block tags on their own indented lines (trim_blocks/lstrip_blocks).
CHAT_TEMPLATE = """{{ bos_token }}
{% if tools is not none %}
<|tools|>{{ tools | tojson }}
{% endif %}
{% if meta is defined %}
<|meta|>{{ meta | tojson }}
{% endif %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
<|im_start|>{{ message['role'] }}
    {% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] | trim }}{% endgeneration %}
    {% else %}
{{ message['content'] | trim }}
    {% endif %}
{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
{% if strftime_now('%Y') | length != 4 %}
{{ raise_exception('strftime_now is broken') }}
{% endif %}"""

CONVERSATIONS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say café in Japanese 🙂"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! 日本語?"},
        {"role": "user", "content": "  Yes, please.  "},
    ],
    [{"role": "user", "content": "only one", "name": None}],
]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which the ByteLevel pre-tokenizer uses."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def train_byte_level(vocab_size: int = 400) -> BackendTokenizer:
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def train_sentencepiece_style(byte_fallback_decoder: bool) -> BackendTokenizer:
    """A Llama-2-like BPE: '▁' for spaces, `<0x..>` byte fallback for rare characters.

    With `byte_fallback_decoder` the decoder is Llama-2's (Replace, ByteFallback, Fuse, Strip);
    otherwise a Metaspace decoder (prepend_scheme="first"), as newer SentencePiece conversions use.
    """
    tok = BackendTokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=40,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # the byte tokens live in the model vocabulary, as in Llama 2
        vocab[f"<0x{b:02X}>"] = len(vocab)
    spec["model"]["byte_fallback"] = True
    spec["model"]["fuse_unk"] = True
    tok = BackendTokenizer.from_str(json.dumps(spec))
    if byte_fallback_decoder:
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
             decoders.Strip(" ", 1, 0)]
        )
    else:
        tok.normalizer = None
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace("▁", "first")])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def save_hf(backend: BackendTokenizer, path: Path, chat_template: str | None = None,
            **kwargs: Any) -> Path:
    """Wrap in transformers' fast tokenizer and save it the way a real checkpoint is saved."""
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", **kwargs
    )
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf(train_byte_level(), tmp_path_factory.mktemp("bpe"), CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def tok(bpe_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(bpe_dir)


@pytest.fixture(scope="module")
def hf_tok(bpe_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(bpe_dir))


@pytest.fixture(scope="module", params=["byte_fallback", "metaspace"])
def sp_tok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    backend = train_sentencepiece_style(byte_fallback_decoder=request.param == "byte_fallback")
    return Tokenizer.from_dir(save_hf(backend, tmp_path_factory.mktemp(request.param)))


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    pieces = [detok.add(t) for t in ids]
    pieces.append(detok.flush())
    return pieces


# ------------------------------------------------------------------------------ loading


def test_reads_special_tokens_and_template(tok: Tokenizer, hf_tok: Any, bpe_dir: Path) -> None:
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>"
    assert tok.bos_token_id == hf_tok.bos_token_id == tok.token_to_id("<s>")
    assert tok.eos_token_id == hf_tok.eos_token_id == tok.token_to_id("</s>")
    assert tok.bos_token_id != tok.eos_token_id
    assert tok.pad_token_id is None
    assert tok.eos_token_ids == {tok.eos_token_id}
    assert tok.vocab_size == len(hf_tok)
    assert tok.chat_template == CHAT_TEMPLATE == hf_tok.chat_template
    # transformers 5 writes the template beside the config; from_dir must have read one of them.
    config = json.loads((bpe_dir / "tokenizer_config.json").read_text())
    assert (bpe_dir / "chat_template.jinja").is_file() or "chat_template" in config


def test_missing_tokenizer_json_names_the_path(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError) as excinfo:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(excinfo.value)
    assert "tokenizer.json" in str(excinfo.value)


def test_chat_template_from_config_string_or_named_list(bpe_dir: Path, tmp_path: Path) -> None:
    shutil.copy(bpe_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": "A{{ messages|length }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(tmp_path).chat_template == "A{{ messages|length }}"

    config["chat_template"] = [
        {"name": "tool_use", "template": "T"},
        {"name": "default", "template": "D{{ messages|length }}"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    t = Tokenizer.from_dir(tmp_path)
    assert t.chat_template == "D{{ messages|length }}"
    assert t.apply_chat_template([{"role": "user", "content": "x"}] * 3) == "D3"

    (tmp_path / "chat_template.jinja").write_text("J")  # the separate file wins, as in transformers
    assert Tokenizer.from_dir(tmp_path).chat_template == "J"


@pytest.mark.parametrize("eos_in_generation_config", ["int", "list"])
def test_eos_token_ids_include_generation_config(
    bpe_dir: Path, tmp_path: Path, eos_in_generation_config: str
) -> None:
    shutil.copytree(bpe_dir, tmp_path, dirs_exist_ok=True)
    base = Tokenizer.from_dir(tmp_path)
    other = base.encode("fox", add_special_tokens=False)[0]
    assert other != base.eos_token_id
    value: Any = other if eos_in_generation_config == "int" else [base.eos_token_id, other]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
    t = Tokenizer.from_dir(tmp_path)
    assert t.eos_token_ids == {base.eos_token_id, other}
    assert t.eos_token_id == base.eos_token_id


# -------------------------------------------------------------------------- encode/decode


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(tok: Tokenizer, hf_tok: Any, add_special_tokens: bool) -> None:
    for text in SAMPLES:
        expected = hf_tok(text, add_special_tokens=add_special_tokens)["input_ids"]
        assert tok.encode(text, add_special_tokens=add_special_tokens) == expected, text
    with_bos = tok.encode("Hello", add_special_tokens=True)
    assert with_bos[0] == tok.bos_token_id
    assert with_bos[1:] == tok.encode("Hello", add_special_tokens=False)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(
    tok: Tokenizer, hf_tok: Any, skip_special_tokens: bool
) -> None:
    rng = random.Random(0)
    cases = [tok.encode(t) + [tok.eos_token_id] for t in SAMPLES]
    for _ in range(50):
        cases.append([rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))])
    for ids in cases:
        ours = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours == hf_tok.decode(ids, skip_special_tokens=skip_special_tokens), ids
    for text in SAMPLES:  # round trip, and the special tokens really are dropped or kept
        assert tok.decode(tok.encode(text)) == text.replace("<s>", "").replace("</s>", "")
        kept = tok.decode(tok.encode(text), skip_special_tokens=False)
        assert kept == "<s>" + text


def test_decode_matches_transformers_sentencepiece_style(
    sp_tok: Tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = tmp_path_factory.mktemp("sp_copy")
    sp_tok.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    for text in SAMPLES:
        ids = sp_tok.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert sp_tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        if "<s>" not in text and not text.startswith(" "):
            assert sp_tok.decode(ids) == text
    byte_ids = [sp_tok.token_to_id(f"<0x{b:02X}>") for b in "🚀".encode()]
    assert sp_tok.decode(byte_ids) == "🚀"


# --------------------------------------------------------------------------- chat template


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tok: Any, conversation: int, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[conversation]
    kwargs: dict[str, Any] = {}
    if conversation == 0:
        kwargs["tools"] = [{"type": "function", "function": {"name": "météo", "parameters": {}}}]
    if conversation == 1:
        kwargs["meta"] = {"city": "Zürich", "n": 1}
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    expected = hf_tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
    )
    assert text == expected
    assert text.startswith("<s>\n<|")
    assert text.count("<|im_start|>") == len(messages) + add_generation_prompt
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    if conversation == 0:
        assert '<|tools|>[{"type": "function", "function": {"name": "météo"' in text
    if conversation == 1:
        assert '<|meta|>{"city": "Zürich", "n": 1}' in text  # tojson without ASCII escapes

    ids = tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
    )
    expected_ids = hf_tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False,
        **kwargs,
    )
    assert ids == list(expected_ids)
    assert ids.count(tok.bos_token_id) == 1  # from the template only: no second bos from encode
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_chat_template_bad_role_raises_clear_error(tok: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="Unknown role: robot") as excinfo:
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])
    assert isinstance(excinfo.value, ValueError)


def test_no_chat_template_is_a_clear_error(bpe_dir: Path, tmp_path: Path) -> None:
    save_hf(train_byte_level(), tmp_path)
    t = Tokenizer.from_dir(tmp_path)
    assert t.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])
    # An explicit template still works for a model without one.
    assert t.apply_chat_template([{"role": "user", "content": "hi"}], chat_template="X") == "X"


@pytest.mark.parametrize(("source", "reads"), [
    ("{% if tools %}{% for t in tools %}{{ t.function.name }}{% endfor %}{% endif %}", True),
    ("{{ tools | tojson }}", True),
    ("{% macro f() %}{{ tools }}{% endmacro %}{{ f() }}", True),
    ("{# tools #}{{ 'tools' }}{{ messages[0].tools }}", False),  # a comment, a string, a key
    ("{% set tools_doc = 'tools' %}{{ tools_doc }}", False),
    ("{% if %}{{ tools }}", False),  # does not parse
    ("{{ 'a' * 2000000000 }}{{ tools }}", True),  # parsed, not compiled: no 2 GB string here
])
def test_template_reads_finds_the_variable_in_the_parsed_template(source: str,
                                                                   reads: bool) -> None:
    assert template_reads(source, "tools") is reads


def test_check_chat_template_says_where_it_does_not_parse() -> None:
    check_chat_template("{% generation %}{{ messages }}{% endgeneration %}")  # transformers' tag
    with pytest.raises(ValueError, match="does not parse: line 2"):
        check_chat_template("ok\n{% for m in messages %}")
    with pytest.raises(ValueError, match="does not parse"):
        check_chat_template("{{ }")


# --------------------------------------------------------------------- streaming detokenizer


def test_stream_equals_decode_for_multibyte_texts(tok: Tokenizer) -> None:
    for text in SAMPLES + CORPUS[:5]:
        for skip in (True, False):
            ids = tok.encode(text)
            detok = tok.detokenizer(skip_special_tokens=skip)
            pieces = stream(detok, ids)
            assert "".join(pieces) == detok.text == tok.decode(ids, skip_special_tokens=skip)
            assert not any("\ufffd" in p for p in pieces), pieces


def test_half_an_emoji_waits_for_the_rest(tok: Tokenizer) -> None:
    byte_token = bytes_to_unicode()
    emoji = "🙂"
    ids = [tok.token_to_id(byte_token[b]) for b in emoji.encode()]
    assert len(ids) == 4 and None not in ids
    detok = tok.detokenizer()
    assert detok.add(tok.encode("ok", add_special_tokens=False)[0]) == "o"
    assert [detok.add(t) for t in ids] == ["", "", "", emoji]
    assert detok.text == "o" + emoji
    # The trained merges split characters too: 🙂 is two tokens, neither valid UTF-8 alone.
    for text in ("🙂", "日本語の文章"):
        ids = tok.encode(text, add_special_tokens=False)
        assert any("\ufffd" in tok.decode([t]) for t in ids)
        pieces = stream(tok.detokenizer(), ids)
        assert "".join(pieces) == text
        assert pieces[0] == ""  # the first token is only part of a character
        assert not any("\ufffd" in p for p in pieces)


def test_truly_invalid_bytes_come_out_at_flush(tok: Tokenizer) -> None:
    byte_token = bytes_to_unicode()
    lead = tok.token_to_id(byte_token["日".encode()[0]])  # a lead byte that never gets finished
    ids = [*tok.encode("ab", add_special_tokens=False), lead]
    detok = tok.detokenizer()
    assert "".join(detok.add(t) for t in ids) == "ab"
    assert detok.flush() == "\ufffd"
    assert detok.text == tok.decode(ids) == "ab\ufffd"


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_stream_equals_decode_for_random_ids(
    tok: Tokenizer, data: st.DataObject, skip: bool
) -> None:
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
    detok = tok.detokenizer(skip_special_tokens=skip)
    assert "".join(stream(detok, ids)) == tok.decode(ids, skip_special_tokens=skip)


def test_stream_window_stays_small(tok: Tokenizer) -> None:
    """O(1) per token: each step decodes a few tokens, not the whole sequence."""
    ids = tok.encode(" ".join(CORPUS), add_special_tokens=False)
    assert len(ids) > 500
    detok = tok.detokenizer()
    longest = 0
    original = tok._raw_decode

    def counting(window: list[int], skip: bool) -> str:
        nonlocal longest
        longest = max(longest, len(window))
        return original(window, skip)

    tok._raw_decode = counting  # type: ignore[method-assign]
    try:
        text = "".join(stream(detok, ids))
    finally:
        del tok._raw_decode
    assert text == tok.decode(ids)
    assert longest <= 8


def test_stream_after_prompt_matches_decode_of_the_whole(tok: Tokenizer, sp_tok: Tokenizer) -> None:
    for t in (tok, sp_tok):
        text = "café naïve résumé 日本語の文章 🙂 and 👍🏽 then words"
        ids = t.encode(text, add_special_tokens=False)
        for split in range(1, len(ids)):
            prompt, output = ids[:split], ids[split:]
            head = t.decode(prompt)
            if "\ufffd" in head:  # the prompt ends inside a character
                continue
            detok = t.detokenizer(prompt_ids=prompt)
            assert "".join(stream(detok, output)) == t.decode(ids)[len(head):], split


ALPHABET = "abcdefghij .,!?'" + "éïàü" + "日本語の文章" + "🙂🚀👍🏽" + "\n"


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=ALPHABET, max_size=40), data=st.data())
def test_stream_equals_decode_sentencepiece_style(
    sp_tok: Tokenizer, text: str, data: st.DataObject
) -> None:
    """Valid text, plus random non-byte tokens (leading '▁' words, specials) spliced in."""
    ids = sp_tok.encode(text, add_special_tokens=data.draw(st.booleans()))
    plain = [i for i in range(sp_tok.vocab_size) if not sp_tok.id_to_token(i).startswith("<0x")]
    for _ in range(data.draw(st.integers(0, 4))):
        pos = data.draw(st.integers(0, len(ids)))
        # only between characters: a byte token next to an inserted one stays valid
        if pos < len(ids) and sp_tok.id_to_token(ids[pos]).startswith("<0x"):
            continue
        ids.insert(pos, data.draw(st.sampled_from(plain)))
    skip = data.draw(st.booleans())
    detok = sp_tok.detokenizer(skip_special_tokens=skip)
    pieces = stream(detok, ids)
    assert "".join(pieces) == sp_tok.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in p for p in pieces)


def test_stream_with_space_clean_up(tmp_path: Path) -> None:
    """WordPiece-era tokenizers: transformers removes ' .', ' n't', ... after decoding; so must we.

    The clean-up is not local to one token (" ." may be two tokens), so the detokenizer holds a
    few characters back; the streamed text must still equal `decode`, which equals transformers'.
    """
    words = ["hello", "world", ".", "?", "!", ",", "'", "s", "'s", "n't", "'m", "'ve", "'re",
             "re", "ve", "m", "n", "t", "a"]
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *words])}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    save_hf(backend, tmp_path, clean_up_tokenization_spaces=True)
    t = Tokenizer.from_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert t.clean_up_tokenization_spaces
    rng = random.Random(0)
    checked = 0
    for _ in range(300):
        ids = [rng.randrange(len(vocab)) for _ in range(rng.randrange(0, 16))]
        expected = t.decode(ids)
        assert expected == hf.decode(ids, skip_special_tokens=True)
        checked += t._raw_decode(ids, True) != expected
        assert "".join(stream(t.detokenizer(), ids)) == expected, ids
    assert checked > 10  # the clean-up really happened in many of the cases


def test_named_special_tokens_are_special_even_if_tokenizer_json_disagrees(
    bpe_dir: Path, tmp_path: Path
) -> None:
    """transformers marks bos/eos/... special on load, so `skip_special_tokens` drops them."""
    shutil.copytree(bpe_dir, tmp_path, dirs_exist_ok=True)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    for added in spec["added_tokens"]:
        added["special"] = False
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    assert BackendTokenizer.from_file(str(tmp_path / "tokenizer.json")).decode([0, 1]) == "<s></s>"
    t = Tokenizer.from_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ids = t.encode("café </s> fin") + [t.eos_token_id]
    assert t.decode(ids) == hf.decode(ids, skip_special_tokens=True) == "café  fin"
