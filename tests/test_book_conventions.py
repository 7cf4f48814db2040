"""Every chapter follows the book's conventions, and the repository URL is one setting."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("*.md"))
REPO = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"].rstrip("/")


def _toc_files(node) -> list[str]:  # noqa: ANN001
    """Every ``file:`` entry of _toc.yml (comments are not entries)."""
    if isinstance(node, dict):
        found = [node["file"]] if "file" in node else []
        return found + [f for v in node.values() for f in _toc_files(v)]
    if isinstance(node, list):
        return [f for v in node for f in _toc_files(v)]
    return []


TOC = set(_toc_files(yaml.safe_load((ROOT / "_toc.yml").read_text())))


def test_there_are_chapters():
    assert CHAPTERS


def test_every_copy_of_the_repository_url_is_the_configured_one():
    files = [*CHAPTERS, *(ROOT / "book").glob("*.md"), ROOT / "CITATION.cff", ROOT / "README.md"]
    for f in files:
        for url in re.findall(r"https://github\.com/[\w.-]+/[\w.-]+", f.read_text()):
            assert url == REPO, f"{f.name} names {url}, _config.yml says {REPO}"


def test_chapter_bones():
    for md in CHAPTERS:
        text = md.read_text()
        name = md.stem
        assert (md.with_suffix(".ipynb")).is_file(), f"{name}: no paired .ipynb"
        assert "formats: ipynb,md:myst" in text, f"{name}: not paired by jupytext"
        colab = f"https://colab.research.google.com/github/{REPO.removeprefix('https://github.com/')}"
        assert f"{colab}/blob/main/chapters/{name}.ipynb" in text, f"{name}: no Colab badge"
        assert '"google.colab" in sys.modules' in text, f"{name}: no Colab setup cell"
        assert "assert " in text, f"{name}: checks nothing against infer_lab"
        for heading in ("## Summary", "## Exercises", "## References"):
            assert heading in text, f"{name}: no '{heading}'"
        assert f"chapters/{name}" in TOC, f"{name}: not in _toc.yml"


def test_toc_lists_only_files_that_exist():
    for entry in TOC:
        assert (ROOT / f"{entry}.md").is_file(), f"_toc.yml lists {entry}, which does not exist"


def test_notebooks_are_committed_without_outputs():
    import json

    for md in CHAPTERS:
        nb = json.loads(md.with_suffix(".ipynb").read_text())
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                assert not cell["outputs"] and cell["execution_count"] is None, md.stem


# ----------------------------------------------------------------------------- what Colab sees
MYST_ROLE = re.compile(r"\{[a-z][a-z:-]*\}`")
MYST_FENCE = re.compile(r"^\s*(`{3,}|:{3,})\{[a-z-]+\}", re.MULTILINE)
MYST_TARGET = re.compile(r"^\([A-Za-z0-9_.:-]+\)=\s*$", re.MULTILINE)
NOTEBOOKS = [md.with_suffix(".ipynb") for md in CHAPTERS]


def _cells(ipynb: Path, kind: str) -> list[str]:
    import json

    nb = json.loads(ipynb.read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == kind]


@pytest.mark.parametrize("ipynb", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebooks_read_as_plain_markdown(ipynb):
    """Colab does not render MyST: no role, directive or target may reach a committed .ipynb
    (``python scripts/sync_notebooks.py`` converts them; the .md keeps them for the book)."""
    found = []
    for source in _cells(ipynb, "markdown"):
        for pattern in (MYST_ROLE, MYST_FENCE, MYST_TARGET):
            found += [m.group(0) for m in pattern.finditer(source)]
    assert not found, f"{ipynb.name}: MyST left in markdown cells: {sorted(set(found))[:8]}"


@pytest.mark.parametrize("ipynb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_setup_cell_is_generated_from_the_configured_url(ipynb):
    setup = [s for s in _cells(ipynb, "code") if '"google.colab" in sys.modules' in s]
    assert setup, f"{ipynb.name}: no Colab setup cell"
    assert f'REPO = "git+{REPO}"' in setup[0], f"{ipynb.name}: setup cell not from _config.yml"
    assert "INFER_LAB_REPO" in setup[0] and "SystemExit" in setup[0], ipynb.name


def test_sync_converts_myst_to_plain_markdown():
    sys.path.insert(0, str(ROOT / "scripts"))
    import sync_notebooks as sn

    bib = {"kwon2023vllm": {"authors": ["Kwon, Woosuk", "Li, Zhuohan", "Zhuang, Siyuan"],
                            "year": "2023", "title": "PagedAttention"},
           "shazeer2019mqa": {"authors": ["Shazeer, Noam"], "year": "2019", "title": "MQA"}}
    cites = sn.Citations(bib, "ch9-")
    md = ("(sec-x)=\n## Title\n\nAs {cite:p}`ch9-kwon2023vllm` showed, {cite:t}`shazeer2019mqa`"
          " argued; it took {glue:text}`ch9_ms` ms ({numref}`fig-x`).\n\n"
          "```{admonition} Try it\nChange `n`.\n```\n\n:::{note}\nA note.\n:::")
    out = sn.plain_markdown(md, cites)
    assert "(Kwon et al., 2023)" in out and "Shazeer (2019)" in out
    assert "`ch9_ms` ms" in out and "(sec-x)=" not in out
    assert "> **Try it**" in out and "> Change `n`." in out and "> **Note**" in out
    assert not MYST_ROLE.search(out) and not MYST_FENCE.search(out)
    assert sn.plain_markdown(out, cites) == out  # nothing left to convert: idempotent
    assert cites.bibliography().splitlines() == ["- Woosuk Kwon, Zhuohan Li, Siyuan Zhuang "
                                                 "(2023). PagedAttention.", "- Noam Shazeer "
                                                 "(2019). MQA."]
    assert sn.repository_url() == REPO


def test_setup_cell_keeps_extras_and_packages():
    sys.path.insert(0, str(ROOT / "scripts"))
    import sync_notebooks as sn

    src = ('if "google.colab" in sys.modules:\n    subprocess.run([sys.executable, "-m", "pip",'
           ' "install", "-q", f"infer_lab[serve] @ git+{REPO}", "openai"], check=True)')
    cell = sn.setup_cell(src, "https://example.org/me/infer_lab")
    assert 'REPO = "git+https://example.org/me/infer_lab"' in cell
    assert 'f"infer_lab[serve] @ {spec}"' in cell and 'req, "openai"]' in cell
    compile(cell, "setup", "exec")  # valid Python
    assert sn.setup_cell(cell, "https://example.org/me/infer_lab") == cell  # idempotent
    plain = 'if "google.colab" in sys.modules:\n    pass'
    assert "infer_lab[serve] @" in sn.setup_cell(plain, "https://x.org/a/b", serves=True)
    assert 'f"infer_lab @ {spec}"' in sn.setup_cell(plain, "https://x.org/a/b")


def _run_setup_cell(cell: str, monkeypatch, repo: str | None) -> list[str]:  # noqa: ANN001
    """Execute a generated setup cell as on Colab (a stand-in google.colab module) with pip
    replaced by a recorder; returns the pip command it would have run."""
    import subprocess
    import types

    calls = []
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd) or
                        types.SimpleNamespace(returncode=0))
    if repo is None:
        monkeypatch.delenv("INFER_LAB_REPO", raising=False)
    else:
        monkeypatch.setenv("INFER_LAB_REPO", repo)
    monkeypatch.delenv("INFER_LAB_RESULTS", raising=False)
    exec(compile(cell, "setup", "exec"), {})
    return calls[0]


def test_setup_cell_commands_work_with_old_pip(monkeypatch):
    """pip before 24.1 rejects ``infer_lab @ git+file:///path`` (an empty URL host), which is
    how_to_run's own example of INFER_LAB_REPO: the cell names the host (localhost), a form
    that pip 23.2 and 26 both install (``python scripts/colab_check.py --pip pip==23.2.1``)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import sync_notebooks as sn

    cell = sn.setup_cell("", "https://github.com/me/infer_lab", serves=True)
    assert _run_setup_cell(cell, monkeypatch, None)[-1] == (
        "infer_lab[serve] @ git+https://github.com/me/infer_lab")
    assert _run_setup_cell(cell, monkeypatch, "git+file:///tmp/clone")[-1] == (
        "infer_lab[serve] @ git+file://localhost/tmp/clone")
    assert _run_setup_cell(cell, monkeypatch, "/tmp/clone")[-1] == "/tmp/clone"
    import os

    assert os.environ["INFER_LAB_RESULTS"] == (
        "https://raw.githubusercontent.com/me/infer_lab/main/benchmarks/results")


@pytest.mark.parametrize("md", CHAPTERS, ids=lambda p: p.stem)
def test_the_md_shows_the_setup_cell_the_notebook_runs(md):
    """The book renders the .md, Colab runs the .ipynb: their setup cells are one text, the
    generated one (``python scripts/sync_notebooks.py`` writes both)."""
    import jupytext

    sys.path.insert(0, str(ROOT / "scripts"))
    import sync_notebooks as sn

    shown = [c.source for c in jupytext.read(md).cells
             if c.cell_type == "code" and sn.SETUP_MARK in c.source]
    runs = [s for s in _cells(md.with_suffix(".ipynb"), "code") if sn.SETUP_MARK in s]
    assert shown and runs and shown[0] == runs[0], (
        f"{md.name}: the .md's setup cell is not what the notebook runs "
        "(python scripts/sync_notebooks.py rewrites both)")
    text = md.read_text()
    assert sn.with_setup_cell(text, sn.repository_url(), sn.repository_branch()) == text, (
        f"{md.name}: setup cell is not the generated one")


# ----------------------------------------------------------------------------- the rendered page
REMOTE_IMAGE = re.compile(r"!\[[^\]]*\]\((https?://[^)\s]+)")


@pytest.mark.parametrize("md", CHAPTERS, ids=lambda p: p.stem)
def test_the_book_shows_only_images_it_ships(md):
    """The Colab badge (and any other image) of a chapter page comes with the book: a page that
    fetches images from elsewhere shows broken ones offline. The notebook keeps Colab's badge."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import sync_notebooks as sn

    text = md.read_text()
    assert not REMOTE_IMAGE.findall(text), f"{md.name}: remote images {REMOTE_IMAGE.findall(text)}"
    assert f"[![Open In Colab]({sn.BADGE_IMAGE})]" in text, f"{md.name}: no shipped Colab badge"
    assert (md.parent / sn.BADGE_IMAGE).resolve().is_file()
    assert f"]({sn.COLAB_BADGE_IMAGE})]" in md.with_suffix(".ipynb").read_text()


def test_the_book_css_is_configured_and_widens_the_code_column():
    """_static/infer_lab.css reaches every page (html_static_path, html_css_files) and keeps the
    rules that let 88 columns of code show at a 1280-pixel window (scripts/check_page_width.py
    measures that in a headless browser)."""
    sphinx = yaml.safe_load((ROOT / "_config.yml").read_text())["sphinx"]["config"]
    assert "_static" in sphinx["html_static_path"]
    assert "infer_lab.css" in sphinx["html_css_files"]
    css = (ROOT / "_static" / "infer_lab.css").read_text()
    for rule in ("--pst-sidebar-secondary", ".bd-sidebar-primary", ".bd-article-container",
                 "div.highlight pre"):
        assert rule in css, f"_static/infer_lab.css lost its {rule} rule"
    assert re.search(r"div\.highlight pre[^{]*\{[^}]*font-size:\s*0\.8\d*rem", css)


# ----------------------------------------------------------------------------- code cells
COLUMN = 88  # characters of code the rendered page shows without scrolling
# Calls that return None (glue too: see test_glue_returns_nothing), so end a cell quietly.
QUIET_CALLS = {"print", "display", "show", "savefig", "tight_layout", "legend", "close", "glue"}


def test_glue_returns_nothing_and_prints_outside_a_book_build(capsys, monkeypatch):
    from infer_lab.notebook import glue

    monkeypatch.setitem(sys.modules, "myst_nb", None)  # as on Colab: no myst-nb
    assert glue("ch0_speedup", 4.256, ".1f") is None
    assert glue("ch0_n", 12) is None
    assert glue("ch0_commit", "abc1234") is None
    assert capsys.readouterr().out.splitlines() == ["ch0_speedup = 4.3", "ch0_n = 12",
                                                    "ch0_commit = abc1234"]


def test_glued_strings_reach_the_book_without_quotes(monkeypatch):
    """myst-nb shows a glued value's text/plain, its repr: a str would read 'abc1234'."""
    import types

    from infer_lab.notebook import glue

    got: list[str] = []
    fake = types.SimpleNamespace(glue=lambda name, value, display: got.append(repr(value)))
    monkeypatch.setitem(sys.modules, "myst_nb", fake)
    glue("ch0_commit", "abc1234")
    glue("ch0_n", 12)
    glue("ch0_x", 0.25, ".2f")
    assert got == ["abc1234", "12", "0.25"]


def _stray_value(source: str) -> str | None:
    """The last statement of a cell, if it is an expression whose value Jupyter would print
    under the cell without the author meaning it (a bare name or ``;`` is meant)."""
    lines = source.splitlines()
    code = "\n".join(line for line in lines if not line.lstrip().startswith(("%", "!")))
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return None
    last = tree.body[-1]
    if code.rstrip().endswith(";") or isinstance(last.value, (ast.Name, ast.Constant)):
        return None
    func = last.value.func if isinstance(last.value, ast.Call) else None
    name = getattr(func, "attr", None) or getattr(func, "id", None)
    if name in QUIET_CALLS:
        return None
    return ast.get_source_segment(code, last) or "?"


@pytest.mark.parametrize("md", CHAPTERS, ids=lambda p: p.stem)
def test_code_fits_the_column_and_no_cell_ends_in_a_stray_value(md):
    import jupytext

    nb = jupytext.read(md)
    long, stray = [], []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        long += [f"cell {i}: {line}" for line in cell.source.splitlines() if len(line) > COLUMN]
        value = _stray_value(cell.source)
        if value:
            stray.append(f"cell {i}: {value.splitlines()[0]}")
    assert not long, f"{md.name}: code lines over {COLUMN} characters:\n" + "\n".join(long)
    assert not stray, f"{md.name}: cells that end in a value:\n" + "\n".join(stray)
