"""Every ``INFER_LAB_*`` variable is read in :mod:`infer_lab.settings` and nowhere else."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from infer_lab import settings

PACKAGE = Path(__file__).resolve().parent.parent / "infer_lab"
ENV_READS = ("get", "setdefault", "pop", "__getitem__", "__contains__")


def environ_keys(tree: ast.AST) -> list[tuple[int, ast.expr | None]]:
    """(line, key) of every read of the environment: ``os.environ[k]``, ``os.environ.get(k)``,
    ``k in os.environ``, ``os.getenv(k)``; key None when there is no single key expression."""

    def is_environ(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
            isinstance(node, ast.Name) and node.id == "environ")

    found: list[tuple[int, ast.expr | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and is_environ(node.value):
            found.append((node.lineno, node.slice))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner, attr = node.func.value, node.func.attr
            if (is_environ(owner) and attr in ENV_READS) or attr == "getenv":
                found.append((node.lineno, node.args[0] if node.args else None))
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            found.append((node.lineno, node.left))
    return found


def test_no_module_but_settings_reads_an_infer_lab_variable():
    offenders = []
    for file in sorted(PACKAGE.rglob("*.py")):
        if file.name == "settings.py" and file.parent == PACKAGE:
            continue
        for line, key in environ_keys(ast.parse(file.read_text(), str(file))):
            where = f"{file.relative_to(PACKAGE.parent)}:{line}"
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                offenders.append(f"{where} reads the environment with a computed key")
            elif key.value.startswith("INFER_LAB_"):
                offenders.append(f"{where} reads {key.value}")
    assert offenders == [], "ask infer_lab.settings instead:\n" + "\n".join(offenders)


def test_the_checker_sees_each_kind_of_read():
    code = """
import os
from os import environ
a = os.environ["INFER_LAB_A"]
b = os.environ.get("INFER_LAB_B")
c = "INFER_LAB_C" in os.environ
d = os.getenv("INFER_LAB_D")
e = environ.get(NAME)
"""
    keys = [getattr(k, "value", None) for _, k in environ_keys(ast.parse(code))]
    assert keys == ["INFER_LAB_A", "INFER_LAB_B", "INFER_LAB_C", "INFER_LAB_D", None]


def test_every_variable_the_package_names_is_a_declared_setting():
    declared = {s.name for s in settings.ALL}
    named = set()
    for file in PACKAGE.rglob("*.py"):
        named |= set(re.findall(r"INFER_LAB_[A-Z0-9_]*[A-Z0-9]", file.read_text()))
    named.discard("INFER_LAB_REPO")  # read by the Colab set-up cell, before the package exists
    assert named == declared


def test_settings_are_documented_and_typed():
    doc = settings.__doc__ or ""
    for s in settings.ALL:
        assert s.name in doc and s.doc and s.type
        assert f"``{s.name}``" in doc
    table = settings.describe()
    assert all(s.name in table for s in settings.ALL)


@pytest.mark.parametrize(("setting", "text", "value"), [
    (settings.DTYPE, " BF16 ", "bf16"),
    (settings.KERNELS, "Torch", "torch"),
    (settings.CACHE, "~/models", Path.home() / "models"),
    (settings.SMOLLM2, "random", "random"),
    (settings.RESULTS, "https://x.org/r", "https://x.org/r"),
    (settings.API_KEY, "sk-1", "sk-1"),
    (settings.TP_BACKEND, "gloo", "gloo"),
    (settings.TP_AUTHKEY, "00ff", b"\x00\xff"),
])
def test_each_setting_parses_its_type_and_defaults_when_unset(monkeypatch, setting, text, value):
    monkeypatch.setenv(setting.name, text)
    assert setting.get() == value
    monkeypatch.setenv(setting.name, "  ")
    assert setting.get() == setting.default  # empty counts as unset
    monkeypatch.delenv(setting.name)
    assert setting.get() == setting.default


@pytest.mark.parametrize(("setting", "text"), [
    (settings.DTYPE, "float8"), (settings.KERNELS, "cuda"), (settings.SMOLLM2, "yes"),
    (settings.TP_BACKEND, "mpi"), (settings.TP_AUTHKEY, "xyz"),
])
def test_a_bad_value_names_the_variable(monkeypatch, setting, text):
    monkeypatch.setenv(setting.name, text)
    with pytest.raises(ValueError, match=f"^{setting.name}='{text}': "):
        setting.get()


def test_child_env_carries_the_value():
    env = settings.TP_AUTHKEY.child_env("abcd")
    assert env["INFER_LAB_TP_AUTHKEY"] == "abcd" and "PATH" in env


def test_module_prints_its_table():
    out = subprocess.run([sys.executable, "-m", "infer_lab.settings"], capture_output=True,
                         text=True, check=True).stdout
    assert out.splitlines()[0].split()[:3] == ["variable", "type", "default"]
    assert len(out.splitlines()) == 1 + len(settings.ALL)
