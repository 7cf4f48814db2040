"""Every chapter follows the book's conventions, and the repository URL is one setting."""

from __future__ import annotations

import re
from pathlib import Path

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
