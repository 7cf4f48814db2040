"""The architecture of book/architecture.md, as checks on the source.

"Imports run in one direction only: serve -> engine -> {cache, model} -> kernels". Each layer
knows as little as it can: the kernels see tensors and nothing of the model; the model does not
know that a scheduler exists; the engine does not know about HTTP. ``measure`` stands apart: its
load generator speaks only HTTP and its quality tools take a model object, so it imports nothing
of the engine or the server. And no module reaches into another one's ``_private`` names.

Every module is parsed with ``ast``, function-level imports included, and so are the name
tables of the lazy package roots (``lazy_exports``), which import on first use.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "infer_lab"

# The layers, lowest first; a module may import its own package and any lower layer.
LAYERS = {"kernels": 0, "cache": 1, "model": 1, "engine": 2, "serve": 3}
# Modules of the package root that every layer may use; they import no layer themselves.
HELPERS = {"infer_lab", "infer_lab.settings", "infer_lab.lazy", "infer_lab.device",
           "infer_lab.utils", "infer_lab.triton_hook", "infer_lab.notebook"}
# cache and model are one layer, but not equals in all things. The cache sizes and masks by the
# model's description: it reads the config and the attention mask, nothing else of the model.
# The model knows nothing of the cache, except the generation loops of Chapters 2-3
# (model/baselines.py), which drive a cache the way generate_naive drives none; the cache root
# re-exports them for the chapters that import them from there.
CACHE_READS_OF_THE_MODEL = {"infer_lab.model.config", "infer_lab.model.attention",
                            "infer_lab.model.baselines"}
CACHE_IMPORTERS_IN_THE_MODEL = {"infer_lab.model.baselines"}
CACHE_RE_EXPORTERS = {"infer_lab.cache"}  # the only importer of model.baselines in cache/
# What measure may read: the shapes and sizes it counts FLOPs, bytes and capacity from.
MEASURE_READS = {"infer_lab.model.config", "infer_lab.cache.sizing"}

# Imports that break a rule today, in packages their owners are refactoring (issue 23). Each
# entry is (importer, imported, why); the owners empty this list. Nothing else may be added.
KNOWN_VIOLATIONS: list[tuple[str, str, str]] = [
]


def module_name(file: Path) -> str:
    parts = file.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(f): f for f in sorted(PACKAGE.rglob("*.py"))}


def resolve(importer: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if MODULES[importer].name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def lazy_table(importer: str, call: ast.Call) -> list[str]:
    """The modules a ``lazy_exports(__name__, {...})`` table imports on first use."""
    if len(call.args) < 2 or not isinstance(call.args[1], ast.Dict):
        return []
    keys = [k.value for k in call.args[1].keys if isinstance(k, ast.Constant)]
    return [importer + k if k.startswith(".") else k for k in keys]


def imports_of(name: str) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None, line) of every import in module ``name``."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    found: list[tuple[str, str | None, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = resolve(name, node)
            for a in node.names:
                sub = f"{module}.{a.name}"
                found.append((sub, None, node.lineno) if sub in MODULES
                             else (module, a.name, node.lineno))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "lazy_exports"):
            found += [(m, None, node.lineno) for m in lazy_table(name, node)]
    return [f for f in found if f[0].split(".")[0] == "infer_lab"]


EDGES = sorted({(src, dst) for src in MODULES for dst, _, _ in imports_of(src) if dst != src})


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in {*LAYERS, "measure"} else module


def why_not(src: str, dst: str) -> str | None:
    """The rule that ``src`` importing ``dst`` breaks, or None."""
    a, b = layer(src), layer(dst)
    if dst in HELPERS:
        return None
    if src in HELPERS and src not in ("infer_lab", "infer_lab.triton_hook"):
        return f"the helper {src} imports the layer {b}"
    if a == b or src in ("infer_lab", "infer_lab.cli"):  # the root and the command line: the top
        return None
    if a == "measure":
        return None if dst in MEASURE_READS else f"measure reads only {sorted(MEASURE_READS)}"
    if b == "measure":
        return "measure stands apart: only the command line imports it"
    if {a, b} == {"cache", "model"}:
        allowed = (dst in CACHE_READS_OF_THE_MODEL and (src in CACHE_RE_EXPORTERS or dst !=
                   "infer_lab.model.baselines")) if a == "cache" else (
            src in CACHE_IMPORTERS_IN_THE_MODEL)
        return None if allowed else f"{a} may not import {dst}"
    if a in LAYERS and b in LAYERS and LAYERS[b] < LAYERS[a]:
        return None
    return f"{a} may not import {b} (imports run serve -> engine -> {{cache, model}} -> kernels)"


def test_every_module_is_seen_and_the_parse_finds_function_level_imports():
    assert {"infer_lab.model.loader", "infer_lab.cache.block_pool", "infer_lab.serve.routes",
            "infer_lab.engine.engine", "infer_lab.kernels.dispatch"} <= set(MODULES)
    loader_imports = {m for m, _, _ in imports_of("infer_lab.model.loader")}
    assert "infer_lab.model.random" in loader_imports  # imported inside random_named_model
    assert "infer_lab.model.baselines" in {m for m, _, _ in imports_of("infer_lab.cache")}


def test_imports_run_one_way():
    broken = {(s, d): why for s, d in EDGES if (why := why_not(s, d))}
    known = {(s, d) for s, d, _ in KNOWN_VIOLATIONS}
    new = {k: v for k, v in broken.items() if k not in known}
    assert new == {}, "\n".join(f"{s} -> {d}: {why}" for (s, d), why in sorted(new.items()))
    fixed = known - set(broken)
    assert not fixed, f"fixed, remove from KNOWN_VIOLATIONS: {sorted(fixed)}"


@pytest.mark.parametrize(("src", "dst", "rule"), [
    ("infer_lab.kernels.ops", "infer_lab.model.config", "kernels may not import model"),
    ("infer_lab.model.transformer", "infer_lab.cache.paged", "model may not import"),
    ("infer_lab.cache.paged", "infer_lab.engine.sequence", "cache may not import engine"),
    ("infer_lab.engine.engine", "infer_lab.serve.protocol", "engine may not import serve"),
    ("infer_lab.measure.bench", "infer_lab.engine.llm", "measure reads only"),
    ("infer_lab.engine.engine", "infer_lab.measure.stats", "measure stands apart"),
    ("infer_lab.cache.sizing", "infer_lab.model.baselines", "cache may not import"),
    ("infer_lab.utils", "infer_lab.cache.sizing", "the helper infer_lab.utils imports"),
])
def test_the_rules_catch_a_wrong_import(src, dst, rule):
    assert rule in (why_not(src, dst) or "")


def test_the_layers_may_use_what_is_below_them():
    for src, dst in [("infer_lab.serve.routes", "infer_lab.engine.engine"),
                     ("infer_lab.engine.engine", "infer_lab.cache.planner"),
                     ("infer_lab.engine.llm", "infer_lab.model.loader"),
                     ("infer_lab.model.transformer", "infer_lab.kernels"),
                     ("infer_lab.cache.paged", "infer_lab.model.attention"),
                     ("infer_lab.measure.flops", "infer_lab.cache.sizing"),
                     ("infer_lab.kernels.dispatch", "infer_lab.settings")]:
        assert why_not(src, dst) is None, (src, dst)


def test_there_are_no_import_cycles():
    graph: dict[str, set[str]] = {}
    for src, dst in EDGES:
        graph.setdefault(src, set()).add(dst)
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as a list of nodes, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def private_uses(name: str) -> list[str]:
    """``from m import _x`` and ``m._x`` where m is another infer_lab module."""
    tree = ast.parse(MODULES[name].read_text())
    aliases: dict[str, str] = {}  # local name -> infer_lab module
    found = []
    for module, imported, line in imports_of(name):
        if imported and imported.startswith("_") and not imported.startswith("__"):
            found.append(f"{name}:{line} imports {module}.{imported}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("infer_lab"):
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom):
            module = resolve(name, node)
            for a in node.names:
                if f"{module}.{a.name}" in MODULES:
                    aliases[a.asname or a.name] = f"{module}.{a.name}"
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            owner = ast.unparse(node.value)
            if owner in aliases and aliases[owner] != name:
                found.append(f"{name}:{node.lineno} uses {aliases[owner]}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    found = [use for name in MODULES for use in private_uses(name)]
    assert found == []


def test_the_private_name_check_sees_both_forms(tmp_path, monkeypatch):
    source = ("from infer_lab.model import gguf\nfrom infer_lab.model.gguf import _Cursor\n"
              "x = gguf._PLAIN_TYPES\n")
    monkeypatch.setitem(MODULES, "infer_lab.model.zz_probe", tmp_path / "zz_probe.py")
    (tmp_path / "zz_probe.py").write_text(source)
    assert private_uses("infer_lab.model.zz_probe") == [
        "infer_lab.model.zz_probe:2 imports infer_lab.model.gguf._Cursor",
        "infer_lab.model.zz_probe:3 uses infer_lab.model.gguf._PLAIN_TYPES",
    ]
