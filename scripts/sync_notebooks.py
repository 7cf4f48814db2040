"""Make each chapter's ``.ipynb`` from its ``.md``: what Colab opens, in plain Markdown.

The ``.md`` (MyST) is the source and the book is built from it unchanged. Colab and plain
Jupyter do not render MyST, so on the way to ``.ipynb`` (jupytext does the conversion) the
markdown cells are rewritten:

- ``{cite:p}`key``` becomes "(Author et al., Year)", ``{cite:t}`` "Author et al. (Year)",
  from ``references.bib`` (and the chapter's ``keyprefix``); the ``{bibliography}`` directive
  becomes a list of the works the chapter cites;
- ``{glue:text}`name``` becomes ```name``` : outside a book build
  :func:`infer_lab.notebook.glue` prints ``name = value`` under the cell that computes it;
- admonitions (``{note}``, ``{admonition} Title``, ...) become blockquotes;
- ``(label)=`` targets are dropped and ``{numref}``/``{ref}``/``{doc}``/``{eq}`` roles keep
  their text;
- the Colab setup cell (the first code cell that tests ``"google.colab" in sys.modules``) is
  generated from ``repository.url`` in ``_config.yml``, keeping the chapter's extras and extra
  packages (and adding ``[serve]`` to a chapter that uses the server): ``INFER_LAB_REPO``
  overrides the URL, and a failed install says what to do.

Cell ids are derived from the chapter and the cell's position, so the output depends on the
``.md`` alone: running the script twice changes nothing (``make pairing`` relies on it).

Usage: ``python scripts/sync_notebooks.py [chapters/NN_x.md ...]`` (default: every chapter);
``--check`` writes nothing and exits 1 if a notebook would change.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

import jupytext
import nbformat

ROOT = Path(__file__).resolve().parent.parent
ROLE = re.compile(r"\{([a-z][a-z:-]*)\}`([^`]*)`")
FENCE = re.compile(r"^(`{3,}|:{3,})\{([a-z-]+)\}[ \t]*(.*)$")
TARGET = re.compile(r"^\(([A-Za-z0-9_.:-]+)\)=[ \t]*$")
ADMONITIONS = {"note": "Note", "tip": "Tip", "warning": "Warning", "important": "Important",
               "seealso": "See also", "caution": "Caution", "hint": "Hint",
               "attention": "Attention", "danger": "Danger", "error": "Error"}
SETUP_MARK = '"google.colab" in sys.modules'


# ----------------------------------------------------------------------------- references
def _bib_field(body: str, name: str) -> str:
    m = re.search(rf"\b{name}\s*=\s*", body, re.IGNORECASE)
    if not m:
        return ""
    i, depth, out = m.end(), 0, []
    if body[i] == '"':
        j = body.index('"', i + 1)
        return body[i + 1 : j]
    if body[i] != "{":
        return re.match(r"[^,\n]*", body[i:]).group(0).strip()
    for ch in body[i:]:
        depth += ch == "{"
        depth -= ch == "}"
        out.append(ch)
        if depth == 0:
            break
    return "".join(out)[1:-1]


def _plain(tex: str) -> str:
    """BibTeX text as plain text: accents and braces away (enough for author names, titles)."""
    accents = {r"\L": "Ł", r"\l": "ł", r"\'o": "ó", r"\'e": "é", r"\"o": "ö", r"\"u": "ü",
               r"\"a": "ä", r"\'a": "á", r"\`e": "è", r"\c{c}": "ç", r"\o": "ø", r"\ss": "ß",
               r"\'i": "í", r"\~n": "ñ", r"\&": "&"}
    for k, v in accents.items():
        tex = tex.replace("{" + k + "}", v).replace(k, v)
    return re.sub(r"\s+", " ", tex.replace("{", "").replace("}", "")).strip()


def load_bib(path: Path) -> dict[str, dict[str, str]]:
    """``key -> {"authors": [...], "year", "title"}`` from a .bib file."""
    text = path.read_text(encoding="utf-8")
    entries: dict[str, dict[str, str]] = {}
    for m in re.finditer(r"^@\w+\{([^,\s]+),", text, re.MULTILINE):
        end = text.find("\n@", m.end())
        body = text[m.end() : end if end > 0 else len(text)]
        authors = [_plain(a) for a in re.split(r"\s+and\s+", _bib_field(body, "author")) if a]
        entries[m.group(1)] = {"authors": authors, "year": _plain(_bib_field(body, "year")),
                               "title": _plain(_bib_field(body, "title"))}
    return entries


def _surname(author: str) -> str:
    return author.split(",")[0].strip() if "," in author else author.split()[-1]


def _forename_first(author: str) -> str:
    if author == "others":
        return "et al."
    last, _, first = author.partition(",")
    return f"{first.strip()} {last.strip()}" if first else author


def _who(entry: dict) -> str:
    names = [_surname(a) for a in entry["authors"]] or ["Anonymous"]
    if len(names) == 1:
        return names[0]
    if len(names) == 2:
        return f"{names[0]} and {names[1]}"
    return f"{names[0]} et al."


class Citations:
    def __init__(self, bib: dict[str, dict[str, str]], prefix: str) -> None:
        self.bib, self.prefix, self.cited = bib, prefix, []

    def entry(self, key: str) -> dict:
        for k in (key, key.removeprefix(self.prefix)):
            if k in self.bib:
                if k not in self.cited:
                    self.cited.append(k)
                return self.bib[k]
        raise KeyError(f"citation {key!r} is not in references.bib")

    def cite(self, role: str, keys: str) -> str:
        entries = [self.entry(k.strip()) for k in keys.split(",") if k.strip()]
        if role == "cite:t":
            return "; ".join(f"{_who(e)} ({e['year']})" for e in entries)
        return "(" + "; ".join(f"{_who(e)}, {e['year']}" for e in entries) + ")"

    def bibliography(self) -> str:
        lines = []
        for k in self.cited:
            e = self.bib[k]
            lines.append(f"- {', '.join(map(_forename_first, e['authors']))} ({e['year']}). "
                         f"{e['title']}.")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- markdown
def _role(m: re.Match, cites: Citations) -> str:
    role, text = m.group(1), m.group(2)
    if role in ("cite:p", "cite:t", "cite", "cite:ps", "cite:ts"):
        return cites.cite("cite:t" if role.startswith("cite:t") else "cite:p", text)
    if role.startswith("glue"):
        return f"`{text.split(':')[0]}`"  # printed by the cell that computed it
    if role in ("math",):
        return f"${text}$"
    shown = re.match(r"(.*?)\s*<[^>]*>$", text)  # {ref}`the text <label>`
    if shown and shown.group(1):
        return shown.group(1)
    return f"`{text}`" if role in ("numref", "ref", "doc", "eq", "term") else text


def plain_markdown(source: str, cites: Citations) -> str:
    """One markdown cell's MyST as plain Markdown (see the module docstring)."""
    out: list[str] = []
    lines = source.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if TARGET.match(line):
            i += 1
            continue
        fence = FENCE.match(line)
        if fence:
            marker, name, arg = fence.groups()
            body: list[str] = []
            i += 1
            while i < len(lines) and lines[i].strip() != marker:
                body.append(lines[i])
                i += 1
            i += 1  # the closing fence
            options = [b for b in body if re.match(r"^:[a-z-]+:", b)]
            body = [b for b in body if b not in options]
            while body and body[0].strip() in ("---", ""):
                body.pop(0)
            if name == "bibliography":
                out.append("@@BIBLIOGRAPHY@@")
                continue
            title = arg.strip() if name == "admonition" else ADMONITIONS.get(name, name.title())
            inner = plain_markdown("\n".join(body), cites).split("\n")
            out.append(f"> **{title or 'Note'}**")
            out.append(">")
            out.extend(f"> {b}".rstrip() for b in inner)
            continue
        out.append(ROLE.sub(lambda m: _role(m, cites), line))
        i += 1
    return "\n".join(out)


# ----------------------------------------------------------------------------- setup cell
def repository_url(config: Path = ROOT / "_config.yml") -> str:
    """``repository.url`` from the book's configuration: the one place it is written."""
    m = re.search(r"^repository:\s*\n(?:[ \t]+.*\n)*?[ \t]+url:\s*(\S+)", config.read_text(),
                  re.MULTILINE)
    if not m:
        raise ValueError(f"{config}: no repository.url")
    return m.group(1)


SERVES = re.compile(r"infer_lab\.serve|infer-lab serve|\bimport openai\b|from openai import")


def repository_branch(config: Path = ROOT / "_config.yml") -> str:
    """``repository.branch`` from the book's configuration (``main`` if it names none)."""
    m = re.search(r"^repository:\s*\n(?:[ \t]+.*\n)*?[ \t]+branch:\s*(\S+)",
                  config.read_text(), re.MULTILINE)
    return m.group(1) if m else "main"


def results_url(url: str, branch: str = "main") -> str | None:
    """Where a GitHub repository serves its committed ``benchmarks/results`` as raw files, so a
    chapter opened in Colab (no checkout) still quotes them; None for other hosts."""
    m = re.fullmatch(r"https://github\.com/([^/]+)/([^/]+?)(?:\.git)?/?", url)
    if not m:
        return None
    owner, name = m.groups()
    return f"https://raw.githubusercontent.com/{owner}/{name}/{branch}/benchmarks/results"


def setup_cell(source: str, url: str, serves: bool = False, branch: str = "main") -> str:
    """The Colab install cell, generated; keeps the chapter's extras and extra packages, and
    adds the ``serve`` extra when the chapter uses the server (``serves``)."""
    extras = re.search(r"infer_lab(\[[a-z,\-]+\])", source)
    extra = extras.group(1) if extras else ("[serve]" if serves else "")
    skip = {"-m", "pip", "install", "-q", "-U", "--upgrade"}
    packages = [p for p in re.findall(r'"([A-Za-z0-9_.\-]+(?:[=<>!~]=?[A-Za-z0-9_.*]+)?)"',
                                      source.split("subprocess.run", 1)[-1])
                if p not in skip and not p.startswith("infer_lab")]
    what = f"infer_lab{extra}" + (f" and {', '.join(packages)}" if packages else "")
    pkgs = "".join(f', "{p}"' for p in packages)
    raw = results_url(url, branch)
    results = ("\n    # where infer_lab.measure.results finds the figures the prose quotes"
               f'\n    RAW = "{raw.removesuffix("/benchmarks/results")}"'
               '\n    os.environ.setdefault("INFER_LAB_RESULTS", RAW + "/benchmarks/results")'
               ) if raw else ""
    return f'''# On Colab, install {what} from the repository (elsewhere it is installed).
# INFER_LAB_REPO overrides where from: any pip requirement, e.g. git+file:///path/to/clone.
import os
import subprocess
import sys

if "google.colab" in sys.modules:
    REPO = "git+{url}"  # from _config.yml
    spec = os.environ.get("INFER_LAB_REPO", REPO)
    req = f"infer_lab{extra} @ {{spec}}" if "://" in spec else spec
    pip = [sys.executable, "-m", "pip", "install", "-q", req{pkgs}]
    if subprocess.run(pip).returncode:
        raise SystemExit(
            f"Could not install {{req!r}} (pip's message is above). Check that the runtime is "
            "online, or point INFER_LAB_REPO at a reachable copy: os.environ['INFER_LAB_REPO'] "
            "= 'git+https://github.com/<you>/infer_lab', then run this cell again."){results}'''


# ----------------------------------------------------------------------------- notebooks
def notebook_for(md: Path, bib: dict, url: str) -> nbformat.NotebookNode:
    text = md.read_text(encoding="utf-8")
    prefix = ""
    m = re.search(r"^:keyprefix:\s*(\S+)", text, re.MULTILINE)
    if m:
        prefix = m.group(1)
    nb = jupytext.reads(text, fmt="md:myst")
    cites = Citations(bib, prefix)
    setup_done = False
    for i, cell in enumerate(nb.cells):
        cell["id"] = hashlib.sha1(f"{md.stem}:{i}".encode()).hexdigest()[:8]
        if cell.cell_type == "markdown":
            cell.source = plain_markdown(cell.source, cites)
        elif cell.cell_type == "code" and not setup_done and SETUP_MARK in cell.source:
            cell.source = setup_cell(cell.source, url, bool(SERVES.search(text)),
                                     repository_branch())
            setup_done = True
    for cell in nb.cells:
        if cell.cell_type == "markdown" and "@@BIBLIOGRAPHY@@" in cell.source:
            cell.source = cell.source.replace("@@BIBLIOGRAPHY@@", cites.bibliography())
    return nb


def sync(md: Path, *, check: bool = False, bib: dict | None = None, url: str | None = None
         ) -> bool:
    """Write ``md``'s notebook; True if it changed (with ``check``: would change)."""
    bib = load_bib(ROOT / "references.bib") if bib is None else bib
    url = repository_url() if url is None else url
    text = jupytext.writes(notebook_for(md, bib, url), fmt="ipynb")
    if not text.endswith("\n"):
        text += "\n"
    target = md.with_suffix(".ipynb")
    old = target.read_text(encoding="utf-8") if target.exists() else None
    if old == text:
        return False
    if not check:
        target.write_text(text, encoding="utf-8")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chapters", nargs="*", type=Path)
    parser.add_argument("--check", action="store_true", help="write nothing; 1 if out of date")
    args = parser.parse_args(argv)
    chapters = args.chapters or sorted((ROOT / "chapters").glob("*.md"))
    bib, url = load_bib(ROOT / "references.bib"), repository_url()
    changed = [md for md in chapters if sync(md, check=args.check, bib=bib, url=url)]
    verb = "out of date" if args.check else "written"
    for md in changed:
        print(f"{md.with_suffix('.ipynb')}: {verb}")
    print(f"sync_notebooks: {len(chapters)} chapter(s), {len(changed)} {verb}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
