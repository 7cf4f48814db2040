"""``infer-lab generate`` streams the same tokens as the reference generator."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import infer_lab as il
from infer_lab.cli import main
from tests.helpers import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli")
    make_checkpoint(path, "qwen2")
    return path


def test_generate_streams_the_greedy_continuation(ckpt, capsys):
    prompt = "In the beginning"
    assert main(["generate", prompt, "--model", str(ckpt), "--max-tokens", "12"]) == 0
    printed = capsys.readouterr().out
    model, tok = il.load(ckpt)
    ref = il.generate_naive(model, tok, prompt, max_tokens=12)
    assert printed == prompt + ref.text + "\n"


def test_sampling_is_reproducible_with_a_seed(ckpt, capsys):
    args = ["generate", "The quick", "--model", str(ckpt), "--max-tokens", "10",
            "--temperature", "1.5", "--seed", "7"]
    main(args)
    first = capsys.readouterr().out
    main(args)
    assert capsys.readouterr().out == first
    main([*args[:-1], "8"])
    assert capsys.readouterr().out != first  # another seed, another sample (10 tokens)


@pytest.mark.parametrize(
    ("extra", "code", "message"),
    [
        (["--temperature", "-1"], 2, "temperature"),
        (["--max-tokens", "0"], 2, "max-tokens"),
        (["--model", "/nonexistent/model"], 1, "is not a directory, a .gguf file or a named"),
    ],
)
def test_bad_arguments_give_clear_errors(ckpt, capsys, extra, code, message):
    argv = ["generate", "hi", "--model", str(ckpt), *extra]
    assert main(argv) == code
    assert message in capsys.readouterr().err


def test_console_script_is_installed(ckpt):
    exe = os.path.join(os.path.dirname(sys.executable), "infer-lab")
    done = subprocess.run(
        [exe, "generate", "Prefill", "--model", str(ckpt), "--max-tokens", "3"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Prefill")


def test_the_serve_choices_are_the_package_lists():
    """The command line spells its choices out (``infer-lab -h`` must not import torch); they
    must be the lists the engine checks against."""
    from infer_lab.cache.kv_quant import KV_CACHE_DTYPES
    from infer_lab.cli import build_parser
    from infer_lab.engine.config import POLICIES
    from infer_lab.model.quantize import QUANTIZATIONS
    from infer_lab.serve.tool_formats import TOOL_CALL_PARSERS

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    choices = {a.dest: tuple(a.choices) for a in serve._actions if a.choices}
    assert choices["policy"] == POLICIES
    assert choices["quantization"] == (*QUANTIZATIONS, "none")
    assert choices["kv_cache_dtype"] == KV_CACHE_DTYPES
    assert choices["tool_call_parser"] == TOOL_CALL_PARSERS


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{% for m in messages %}{{ m.content }}", "--chat-template: the chat template does not "
         "parse: line 1"),
        ("/nonexistent/template.jinja", "looks like a file, but it cannot be read"),
        ("  \n", "the template is empty"),
    ],
)
def test_a_bad_chat_template_is_a_startup_error(capsys, value, message):
    """Refused before the model loads (a model that does not exist is never looked at)."""
    argv = ["serve", "--model", "/nonexistent/model", "--chat-template", value]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "is not a directory" not in err


def test_chat_template_is_a_file_or_the_template_itself(tmp_path):
    from infer_lab.serve.template import load_chat_template

    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(inline + "\n", encoding="utf-8")
    assert load_chat_template(str(path)) == inline + "\n"
    assert load_chat_template(inline) == inline
