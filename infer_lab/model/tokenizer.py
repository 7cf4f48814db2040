"""Tokenizer, chat template and incremental detokenizer, read from a Hugging Face model directory.

The engine needs three things from a tokenizer: text -> ids for the prompt, the chat template that
turns OpenAI-style messages into that prompt, and ids -> text *one token at a time* for streaming.
`transformers` does the first two, but importing it costs seconds and pulls in far more than a
serving engine needs, so this module reads the same files (`tokenizer.json` through the small
`tokenizers` library, `tokenizer_config.json`, `chat_template.jinja`, `generation_config.json`) and
reproduces what `transformers` does with them. The tests check the agreement id for id and character
for character.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as _BackendTokenizer

__all__ = [
    "ChatTemplateError", "IncrementalDetokenizer", "TemplateLimitError", "Tokenizer",
    "check_chat_template", "render_chat_template", "template_reads",
]

# The named special tokens `transformers` hands to a chat template (its `special_tokens_map`).
_NAMED_SPECIAL_TOKENS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)
REPLACEMENT_CHAR = "\ufffd"
# How many prompt tokens the detokenizer re-decodes before the first generated one, so that a
# leading space (SentencePiece "▁") or a character split across the prompt boundary comes out as it
# would in the decode of prompt + output. vLLM uses the same number.
_PROMPT_CONTEXT_TOKENS = 5


class ChatTemplateError(jinja2.TemplateError, ValueError):
    """Raised by a chat template's `raise_exception(...)`, e.g. for a role the model does not know.

    It is a `jinja2.TemplateError` (what `transformers` raises) and a `ValueError`, so that a server
    can answer it as a bad request without knowing about jinja2.
    """


class TemplateLimitError(ChatTemplateError):
    """A chat template went over a limit for one conversation: ``reason`` is
    ``"template_output"`` (it wrote, or tried to hold, too many bytes) or
    ``"template_timeout"`` (it ran too long; only a child-process renderer can stop it)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token in a config is a string or a serialized `AddedToken` dict: its text."""
    if value is None:
        return None
    if isinstance(value, dict):
        content = value.get("content")
        return str(content) if content is not None else None
    return str(value)


def _clean_up_tokenization(text: str) -> str:
    """`transformers`' `clean_up_tokenization`: undo the spaces WordPiece-era decoders put before
    punctuation and contractions. Every pattern starts with a space and is at most 4 characters."""
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )


def _pick_chat_template(value: Any) -> str | None:
    """`chat_template` in `tokenizer_config.json` is a string or a list of {name, template}."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        template = named.get("default")
        return template if isinstance(template, str) else None
    if isinstance(value, dict):
        template = value.get("default")
        return template if isinstance(template, str) else None
    return None


# --------------------------------------------------------------------------------------------------
# Chat templates: the same jinja environment that transformers builds.


class _GenerationTag(Extension):
    """Accept `{% generation %}...{% endgeneration %}` and render the body unchanged.

    Templates mark assistant text with it so that `transformers` can build a training mask; for
    inference it is a no-op, but without the tag jinja would refuse to compile those templates.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, so templates cannot reach CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes, got {name!r}"
            )


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own `tojson` escapes HTML characters and forces ASCII; templates expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.Environment:
    """The environment `transformers` builds. Templates come from the hub: untrusted code, so
    sandboxed."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = dict
    env.globals["namespace"] = _TemplateNamespace
    return env


@lru_cache(maxsize=16)
def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile once per template."""
    return _environment().from_string(source)


def check_chat_template(source: str) -> None:
    """Compile ``source`` (nothing is rendered): a ``ValueError`` saying where, if it does not
    parse. A server checks a template it is given this way at startup."""
    try:
        _compile_chat_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: line {e.lineno}: {e.message}"
                         ) from None
    except RecursionError:
        raise ValueError("the chat template does not parse: it nests too deeply") from None


@lru_cache(maxsize=16)
def template_reads(source: str, name: str) -> bool:
    """Whether the chat template ``source`` reads the variable ``name`` (``tools``: whether it
    has a tools section). Found in the parsed template, not by searching its text, so a comment,
    a string or a key that says "tools" does not count. False for a template that does not parse.

    Only parsed, never compiled: jinja's compiler folds constants, so compiling ``{{ 'a' *
    2000000000 }}`` builds that string, and a model's template is untrusted (it renders in a
    child process, :mod:`infer_lab.serve.template`)."""
    try:
        tree = _environment().parse(source)
        return any(n.name == name and n.ctx == "load" for n in tree.find_all(nodes.Name))
    except (jinja2.TemplateSyntaxError, RecursionError):
        return False


def render_chat_template(
    source: str,
    messages: list[dict],
    add_generation_prompt: bool,
    variables: dict[str, Any],
    max_bytes: int | None = None,
) -> str:
    """Render a chat template; with ``max_bytes``, stop with :class:`TemplateLimitError` as soon
    as the output passes that many bytes (jinja's ``generate`` hands the output over piece by
    piece, so a template writing gigabytes is stopped after the first piece over the limit).

    A template is code from a model file: in-process, nothing stops one that loops forever or
    builds one huge string in a single expression. A server renders it in a child process with
    a deadline and a memory limit (``infer_lab.serve.template``), through :func:`template_worker`.
    """
    template = _compile_chat_template(source)
    pieces = template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                               **variables)
    if max_bytes is None:
        return "".join(pieces)
    out, size = [], 0
    for piece in pieces:
        size += len(piece)  # characters: a lower bound of the bytes
        if size > max_bytes:
            break
        out.append(piece)
    text = "".join(out)
    if size > max_bytes or len(text.encode("utf-8", "surrogatepass")) > max_bytes:
        raise TemplateLimitError(f"the chat template wrote more than {max_bytes} bytes for this "
                                 "conversation", "template_output")
    return text


def template_worker(memory_bytes: int = 0) -> None:
    """Serve :func:`render_chat_template` to a parent process over stdin/stdout until stdin
    closes: frames of a 4-byte little-endian length and JSON. Run in a child process loaded
    from this file alone (no ``infer_lab`` import, no torch), with its address space limited to
    ``memory_bytes`` (POSIX), so that a template's runaway string is a ``MemoryError`` here."""
    import sys

    if memory_bytes:
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        except (ImportError, ValueError, OSError):
            pass
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    _write_frame(stdout, {"ready": True})
    while (request := _read_frame(stdin)) is not None:
        _write_frame(stdout, _render_reply(request))


def _render_reply(request: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"text": render_chat_template(**request)}
    except TemplateLimitError as e:
        return {"error": str(e), "reason": e.reason}
    except MemoryError:
        return {"error": "the chat template ran out of memory for this conversation",
                "reason": "template_output"}
    except RecursionError:
        return {"error": "the chat template recursed too deeply", "reason": "template_output"}
    except ChatTemplateError as e:  # the template's raise_exception(...): about the conversation
        return {"error": str(e)[:1000], "reason": None}
    except Exception as e:  # raise_exception(...), a sandbox refusal, a template bug
        return {"error": f"{type(e).__name__}: {e}"[:1000], "reason": None}


def _read_frame(stream: Any) -> dict[str, Any] | None:
    head = stream.read(4)
    if len(head) < 4:
        return None
    return json.loads(stream.read(int.from_bytes(head, "little")))


def _write_frame(stream: Any, payload: dict[str, Any]) -> None:
    data = json.dumps(payload, ensure_ascii=False).encode("utf-8", "surrogatepass")
    stream.write(len(data).to_bytes(4, "little") + data)
    stream.flush()


# --------------------------------------------------------------------------------------------------


class Tokenizer:
    """Wraps a Hugging Face `tokenizer.json` (via `tokenizers`) plus `tokenizer_config.json`.

    Build it with `Tokenizer.from_dir(path)`. `encode`, `decode` and `apply_chat_template` give
    what `transformers.AutoTokenizer` gives for the same directory.
    """

    def __init__(
        self,
        backend: _BackendTokenizer,
        config: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> None:
        config = dict(config or {})
        self._tok = backend
        self.config = config

        self.special_tokens: dict[str, str] = {}
        for name in _NAMED_SPECIAL_TOKENS:
            content = _token_content(config.get(name))
            if content is not None:
                self.special_tokens[name] = content
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        if isinstance(extra, dict):
            extra = list(extra.values())
        self.extra_special_tokens: list[str] = [
            c for c in (_token_content(t) for t in extra) if c is not None
        ]
        self._register_added_tokens(config)

        # transformers rebuilds the post-processor only when the config says add_bos/add_eos_token.
        if "add_bos_token" in config or "add_eos_token" in config:
            self._set_post_processor(
                bool(config.get("add_bos_token", False)), bool(config.get("add_eos_token", False))
            )

        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")
        self.pad_token: str | None = self.special_tokens.get("pad_token")
        self.unk_token: str | None = self.special_tokens.get("unk_token")
        self.bos_token_id: int | None = self._id_or_none(self.bos_token)
        self.eos_token_id: int | None = self._id_or_none(self.eos_token)
        self.pad_token_id: int | None = self._id_or_none(self.pad_token)

        self.eos_token_ids: set[int] = set()
        if self.eos_token_id is not None:
            self.eos_token_ids.add(self.eos_token_id)
        gen_eos = (generation_config or {}).get("eos_token_id")
        if isinstance(gen_eos, int):
            self.eos_token_ids.add(gen_eos)
        elif isinstance(gen_eos, (list, tuple)):
            self.eos_token_ids.update(int(t) for t in gen_eos if t is not None)

        self.chat_template: str | None = chat_template
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        # what skip_special_tokens drops: the added tokens marked special
        self.special_ids: frozenset[int] = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

        # transformers v5 ignores clean_up_tokenization_spaces for BPE models (it corrupts them).
        self.clean_up_tokenization_spaces: bool = bool(
            config.get("clean_up_tokenization_spaces", False)
        ) and (
            type(self._tok.model).__name__ != "BPE"
            or bool(
                config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
            )
        )

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Read `tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`,
        `chat_template.jinja` and `generation_config.json` from a model directory."""
        root = Path(path)
        if root.is_file() and root.name == "tokenizer.json":
            root = root.parent
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {str(root)!r}: infer_lab needs a Hugging Face 'fast' "
                "tokenizer file (save one with transformers' tokenizer.save_pretrained(dir))"
            )
        backend = _BackendTokenizer.from_file(str(tokenizer_file))
        # Older checkpoints keep special tokens in special_tokens_map.json; the config wins.
        config = {
            **_read_json(root / "special_tokens_map.json"),
            **_read_json(root / "tokenizer_config.json"),
        }
        generation_config = _read_json(root / "generation_config.json")

        # transformers >= 4.43 saves the template beside the config; the file wins if both exist.
        template_file = root / "chat_template.jinja"
        if template_file.is_file():
            chat_template: str | None = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _pick_chat_template(config.get("chat_template"))
            if chat_template is None and (root / "chat_template.json").is_file():
                chat_template = _pick_chat_template(
                    _read_json(root / "chat_template.json").get("chat_template")
                )
        return cls(backend, config, generation_config, chat_template)

    # ---------------------------------------------------------------------------------- set-up

    def _register_added_tokens(self, config: dict[str, Any]) -> None:
        """Make the backend know every token the config declares, as transformers does on load.

        Named special tokens (bos, eos, ...) become *special* added tokens even when tokenizer.json
        does not mark them, so that `skip_special_tokens` drops them in both implementations.
        """
        present = {t.content: t for t in self._tok.get_added_tokens_decoder().values()}
        declared = config.get("added_tokens_decoder") or {}
        missing = []
        for _, spec in sorted(declared.items(), key=lambda kv: int(kv[0])):
            if isinstance(spec, dict) and spec.get("content") not in present:
                missing.append(
                    AddedToken(
                        spec["content"],
                        single_word=bool(spec.get("single_word", False)),
                        lstrip=bool(spec.get("lstrip", False)),
                        rstrip=bool(spec.get("rstrip", False)),
                        normalized=bool(spec.get("normalized", not spec.get("special", False))),
                        special=bool(spec.get("special", False)),
                    )
                )
        if missing:
            self._tok.add_tokens(missing)
        specials = [*self.special_tokens.values(), *self.extra_special_tokens]
        to_mark = [
            AddedToken(c, special=True, normalized=False)
            for c in dict.fromkeys(specials)
            if c not in present or not present[c].special
        ]
        if to_mark:
            self._tok.add_special_tokens(to_mark)

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        """transformers' `update_post_processor`: a bos/eos template built from the config flags."""
        bos = self.special_tokens.get("bos_token")
        eos = self.special_tokens.get("eos_token")
        add_bos = add_bos and bos is not None
        add_eos = add_eos and eos is not None
        single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
        pair = (
            f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1"
            f"{(' ' + eos + ':1') if add_eos else ''}"
        )
        special = []
        if add_bos:
            special.append((bos, self._tok.token_to_id(bos)))
        if add_eos:
            special.append((eos, self._tok.token_to_id(eos)))
        self._tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=special
        )

    def _id_or_none(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    # ----------------------------------------------------------------------------- the API

    @property
    def backend(self) -> _BackendTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids; with `add_special_tokens` the post-processor adds bos/eos as configured."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Many texts -> ids, as `encode` gives them. The `tokenizers` library releases the GIL
        here (not in `encode`), so a server thread can tokenize a long prompt while the event
        loop keeps streaming."""
        return [e.ids for e in self._tok.encode_batch(list(texts),
                                                      add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True,
               keep: Collection[int] = ()) -> str:
        """Ids -> text, as `transformers`' `decode` (with its space clean-up where it applies).
        `keep`: special tokens whose text stays although `skip_special_tokens` drops the others
        (a tool-call marker that is one special token, which the parser must see)."""
        ids = _as_int_list(ids)
        if skip_special_tokens and keep:
            text = self._raw_decode(self.skipping(ids, keep), False)
        else:
            text = self._raw_decode(ids, skip_special_tokens)
        return _clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def skipping(self, ids: list[int], keep: Collection[int]) -> list[int]:
        """`ids` less the special tokens not in `keep`: decoding them with the special tokens
        kept is decoding `ids` with them skipped, `keep` excepted (`tokenizers` drops skipped
        tokens before its decoder runs, so the rest decodes alike)."""
        return [t for t in ids if t in keep or t not in self.special_ids]

    def _raw_decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        *,
        chat_template: str | None = None,
        max_bytes: int | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render OpenAI-style messages into the prompt text the model was trained on.

        Renders like `transformers`: the sandboxed jinja environment with `raise_exception`,
        `strftime_now` and a JSON `tojson`; the variables `messages`, `add_generation_prompt`,
        `tools`, `documents`, the special tokens (`bos_token`, `eos_token`, ...) and `**kwargs`.
        `tokenize=True` encodes the text *without* adding special tokens, because the template
        already wrote them. `chat_template` overrides the model's template for this call;
        `max_bytes` bounds the rendered text (:class:`TemplateLimitError` beyond it).
        """
        source = chat_template if chat_template is not None else self.chat_template
        if source is None:
            raise ValueError(
                "this model has no chat template (no chat_template in tokenizer_config.json and no "
                "chat_template.jinja): use a plain text prompt, or pass chat_template=..."
            )
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        # Like transformers: drop keys whose value is None (OpenAI clients send content=None), which
        # templates handle as missing but would otherwise render as the text "None".
        chat = []
        for message in messages:
            if not isinstance(message, dict):
                raise TypeError(f"chat messages must be dicts, got {message!r}")
            chat.append({k: v for k, v in message.items() if v is not None})
        variables = self.template_variables(**kwargs)
        text = render_chat_template(source, chat, add_generation_prompt, variables, max_bytes)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def template_variables(self, **kwargs: Any) -> dict[str, Any]:
        """What a chat template sees besides the messages: the special tokens, ``tools`` and
        ``documents`` (None unless given) and ``kwargs``."""
        variables: dict[str, Any] = {**self.special_tokens, **kwargs}
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        return variables

    def detokenizer(
        self, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True,
        keep: Collection[int] = (),
    ) -> IncrementalDetokenizer:
        """A fresh streaming detokenizer; give it the prompt so the first token's text is right
        (`keep`: special tokens whose text stays, as in `decode`)."""
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens, keep)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
            f"eos={self.eos_token!r}, chat_template={'yes' if self.chat_template else 'no'})"
        )


def _as_int_list(ids: Sequence[int]) -> list[int]:
    tolist = getattr(ids, "tolist", None)  # torch tensors and numpy arrays
    if tolist is not None:
        ids = tolist()
    return [int(t) for t in ids]


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text pieces, never emitting half a character.

    Decoding one token at a time is wrong in two ways: a byte-level token can be half of a UTF-8
    character (🙂 is 4 bytes, often 2-4 tokens), and SentencePiece decoders drop the leading space
    of whatever they decode first, so `decode([t])` of a mid-sentence "▁word" loses its space.
    Re-decoding everything at each step is right but O(n) per token. So (the prefix-offset method
    of TGI and vLLM) we decode a small *window*: the tokens of the last emitted piece
    (`ids[prefix:read]`) plus the new ones. The window's first token gets the same treatment in
    both decodes, so the text past the old piece is exactly the new text; it is emitted unless it
    ends in U+FFFD (an incomplete character), in which case we wait for more tokens. The window is
    a few tokens long for valid UTF-8; it only grows across a run of bytes that never form a
    character, and `flush` emits those as U+FFFD, as `decode` does.

    Invariant (tested): `"".join(add(t) for t in ids) + flush() == tokenizer.decode(ids)` (with
    the same `skip_special_tokens` and `keep`).
    One exception: in a ByteFallback tokenizer, an invalid `<0x..>` byte token turns the *whole*
    preceding run of byte tokens into U+FFFD in `decode`, even the characters already streamed;
    for valid UTF-8 output the two always agree.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
        keep: Collection[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._keep = frozenset(keep) if skip_special_tokens else frozenset()
        self._ids: list[int] = _as_int_list(prompt_ids) if prompt_ids is not None else []
        self._read = len(self._ids)  # ids before this have been emitted (or are the prompt)
        self._prefix = max(0, self._read - _PROMPT_CONTEXT_TOKENS)  # window start
        # Never start the window inside a character (a UTF-8 character is at most 4 byte tokens):
        # a ByteFallback decoder turns a whole run of byte tokens into U+FFFD if its start is cut.
        earliest = max(0, self._read - _PROMPT_CONTEXT_TOKENS - 3)
        while self._prefix > earliest and self._decode(self._prefix, self._read).startswith(
            REPLACEMENT_CHAR
        ):
            self._prefix -= 1
        self._prefix_len = len(self._decode(self._prefix, self._read))  # its text, already out
        # transformers' space clean-up needs a little lookahead: see `_release`.
        self._cleanup = tokenizer.clean_up_tokenization_spaces
        self._held = ""  # raw text decoded but held back for the clean-up
        self._tail = self._decode(self._prefix, self._read)[-3:]  # last raw chars released
        self.text = ""
        self.token_ids: list[int] = []

    def _decode(self, start: int, stop: int | None = None) -> str:
        if self._keep:
            ids = self._tokenizer.skipping(self._ids[start:stop], self._keep)
            return self._tokenizer._raw_decode(ids, False)
        return self._tokenizer._raw_decode(self._ids[start:stop], self._skip)

    def add(self, token_id: int) -> str:
        """Feed one token; return the newly completed text (often "", never half a character)."""
        token_id = int(token_id)
        self._ids.append(token_id)
        self.token_ids.append(token_id)
        window = self._decode(self._prefix)
        if len(window) <= self._prefix_len or window.endswith(REPLACEMENT_CHAR):
            return ""
        piece = window[self._prefix_len :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_len = len(self._decode(self._prefix, self._read))
        return self._release(piece)

    def flush(self) -> str:
        """End of stream: emit what is pending (U+FFFD where bytes never formed a character)."""
        window = self._decode(self._prefix)
        piece = window[self._prefix_len :] if len(window) > self._prefix_len else ""
        self._prefix = self._read = len(self._ids)
        self._prefix_len = 0
        out = self._held + piece
        self._held = ""
        if self._cleanup:
            out = _clean_up_tokenization(out)
        self.text += out
        return out

    def _release(self, raw: str) -> str:
        """Emit `raw`, applying transformers' clean-up so that streaming matches `decode`.

        The clean-up patterns start with a space and are at most 4 characters long, so cleaning
        two pieces separately equals cleaning their concatenation whenever the first ends in 3
        characters without a space. We emit up to the last such cut and hold back the rest.
        """
        if not self._cleanup:
            self.text += raw
            return raw
        s = self._tail + self._held + raw
        start = len(self._tail)
        cut = len(s)
        while cut > start and " " in s[max(0, cut - 3) : cut]:
            cut -= 1
        out = _clean_up_tokenization(s[start:cut])
        self._held = s[cut:]
        self._tail = s[:cut][-3:]
        self.text += out
        return out
