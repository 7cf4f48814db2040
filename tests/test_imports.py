"""``import infer_lab`` stays light: a GPU box with only torch and triton runs chapters 1-5."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


def test_import_does_not_pull_in_the_server_stack():
    code = ("import sys, infer_lab; "
            "print(' '.join(m for m in ('fastapi', 'uvicorn', 'openai', 'starlette', "
            "'prometheus_client', 'httpx', 'transformers') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout.split()
    assert loaded == []


# --------------------------------------------------------------------- lazy package roots
PACKAGES = ("infer_lab", "infer_lab.cache", "infer_lab.engine", "infer_lab.kernels",
            "infer_lab.measure", "infer_lab.model", "infer_lab.serve")
ROOT = Path(__file__).resolve().parent.parent


def loaded_by(statement: str) -> tuple[set[str], set[str]]:
    """(infer_lab modules, heavy libraries) in ``sys.modules`` after ``statement``, fresh."""
    code = (f"import sys; {statement}; print(' '.join(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('infer_lab', 'torch', 'numpy', 'jinja2', 'tokenizers', "
            "'safetensors', 'gguf', 'triton') and '.' not in m.removeprefix('infer_lab.') "
            "or m.startswith('infer_lab.'))))")
    names = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               check=True).stdout.split())
    ours = {m for m in names if m.split(".")[0] == "infer_lab"}
    return ours, names - ours


def test_import_infer_lab_loads_only_its_root():
    ours, heavy = loaded_by("import infer_lab")
    assert ours == {"infer_lab", "infer_lab.lazy", "infer_lab.triton_hook"}
    assert heavy == set()  # no torch, no tokenizer, no jinja2 until a name is used


def test_the_block_pool_loads_the_allocator_and_nothing_of_torch_or_the_model():
    ours, heavy = loaded_by("import infer_lab.cache.block_pool")
    assert ours == {"infer_lab", "infer_lab.lazy", "infer_lab.triton_hook", "infer_lab.cache",
                    "infer_lab.cache.block_pool", "infer_lab.utils"}
    assert heavy == {"numpy"}


def test_a_name_loads_what_it_needs():
    ours, heavy = loaded_by("import infer_lab as il; il.SamplingParams")
    assert "infer_lab.engine.sampling_params" in ours and "infer_lab.engine.engine" not in ours
    assert "jinja2" not in heavy


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_resolves_and_dir_lists_it(package):
    mod = importlib.import_module(package)
    assert mod.__all__ and len(set(mod.__all__)) == len(mod.__all__)
    for name in mod.__all__:
        assert getattr(mod, name) is not None
        assert name in dir(mod)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        mod.no_such_name  # noqa: B018


def test_subpackages_and_submodules_are_attributes_as_before():
    import infer_lab as il

    assert il.engine.LLMEngine is importlib.import_module("infer_lab.engine.engine").LLMEngine
    assert il.model.loader.load is il.load
    assert il.cache.generate_paged.__module__ == "infer_lab.model.baselines"


def used_names() -> set[tuple[str, str]]:
    """(module, name) of every ``from infer_lab... import name`` and ``il.name`` in the tests,
    benchmarks, scripts and the chapters' code cells."""
    files = [p for d in ("tests", "benchmarks", "scripts") for p in (ROOT / d).rglob("*.py")]
    sources = [p.read_text() for p in files]
    for chapter in (ROOT / "chapters").glob("*.md"):
        sources += re.findall(r"```\{code-cell\}[^\n]*\n(.*?)```", chapter.read_text(), re.S)
    used = set()
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:  # a cell with IPython magics
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("infer_lab"):
                used |= {(node.module, a.name) for a in node.names}
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id == "il"):
                used.add(("infer_lab", node.attr))
    return used


def test_every_name_the_book_and_tests_import_is_still_there():
    used = used_names()
    assert ("infer_lab", "load") in used and ("infer_lab.cache", "BlockManager") in used
    missing = []
    for module, name in sorted(used):
        mod = importlib.import_module(module)
        if not hasattr(mod, name) and importlib.util.find_spec(f"{module}.{name}") is None:
            missing.append(f"{module}.{name}")
    assert missing == []


def test_triton_comes_up_interpreted_when_imported_after_infer_lab():
    """The root no longer imports the kernels, yet the promise of book/how_to_run.md holds."""
    pytest.importorskip("triton")
    code = ("import os, infer_lab, torch; assert 'TRITON_INTERPRET' not in os.environ; "
            "import triton; print(os.environ.get('TRITON_INTERPRET'), torch.cuda.is_available())")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout.split()
    assert out == (["None", "True"] if out[-1] == "True" else ["1", "False"])
