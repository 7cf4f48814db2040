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

One cell is generated rather than converted: the Colab setup cell (the first code cell that
tests ``"google.colab" in sys.modules``), from ``repository.url`` in ``_config.yml``, keeping
the chapter's extras and extra packages (and adding ``[serve]`` to a chapter that uses the
server). ``INFER_LAB_REPO`` overrides the URL, a ``git+file:///`` URL gets the host name that
pip before 24.1 requires, and a failed install says what to do. The generated cell is written
into the ``.md`` too, so the book shows exactly what the notebook runs, within 88 columns. So is
the "Open in Colab" badge line: in the ``.md`` it shows the image shipped with the book
(``book/images/colab-badge.svg``; a page fetches no image from elsewhere), in the ``.ipynb``
Colab's own.

Cell ids are derived from the chapter and the cell's position, so the output depends on the
``.md`` alone: running the script twice changes nothing (``make pairing`` relies on it).

Usage: ``python scripts/sync_notebooks.py [chapters/NN_x.md ...]`` (default: every chapter);
``--check`` writes nothing and exits 1 if a notebook (or a .md's setup cell) would change.
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


def _setup_packages(source: str) -> list[str]:
    """The extra packages a setup cell installs beside infer_lab: the quoted names in its
    ``[sys.executable, ...]`` list, old hand-written form or generated one."""
    m = re.search(r"\[sys\.executable,(.*?)\](?=\s*[,)\n])", source, re.DOTALL)
    skip = {"-m", "pip", "install", "-q", "-U", "--upgrade"}
    quoted = r'"([A-Za-z0-9_.\-]+(?:[=<>!~]=?[A-Za-z0-9_.*]+)?)"'
    names = re.findall(quoted, m.group(1) if m else "")
    return [p for p in names if p not in skip and not p.startswith("infer_lab")]


def setup_cell(source: str, url: str, serves: bool = False, branch: str = "main") -> str:
    """The Colab install cell, generated; keeps the chapter's extras and extra packages, and
    adds the ``serve`` extra when the chapter uses the server (``serves``). Every line fits
    the book's 88 columns, and the same text is written into the .md and the .ipynb."""
    extras = re.search(r"infer_lab(\[[a-z,\-]+\])", source)
    extra = extras.group(1) if extras else ("[serve]" if serves else "")
    packages = _setup_packages(source)
    what = ", ".join([f"infer_lab{extra}", *packages])
    pkgs = "".join(f', "{p}"' for p in packages)
    raw = results_url(url, branch)
    results = ("\n    # where infer_lab.measure.results finds the figures the prose quotes"
               f'\n    RAW = "{raw.removesuffix("/benchmarks/results")}"'
               '\n    os.environ.setdefault("INFER_LAB_RESULTS", RAW + "/benchmarks/results")'
               ) if raw else ""
    return f'''# On Colab, install {what} from the book's repository;
# anywhere else this cell does nothing (infer_lab is installed: see How to run).
# INFER_LAB_REPO, if set, says where from: git+https://..., git+file:///path/to/clone,
# or any other pip requirement.
import os
import subprocess
import sys

if "google.colab" in sys.modules:
    REPO = "git+{url}"  # from _config.yml
    spec = os.environ.get("INFER_LAB_REPO", REPO)
    # pip before 24.1 rejects "name @ file:///path" (an empty host): name the host
    spec = spec.replace("git+file:///", "git+file://localhost/")
    req = f"infer_lab{extra} @ {{spec}}" if "://" in spec else spec
    pip = [sys.executable, "-m", "pip", "install", "-q", req{pkgs}]
    if subprocess.run(pip).returncode:
        raise SystemExit(
            f"Could not install {{req!r}} (pip's message is above). Check that the "
            "runtime is online, or point INFER_LAB_REPO at a reachable copy: "
            "os.environ['INFER_LAB_REPO'] = 'git+https://github.com/<you>/infer_lab', "
            "then run this cell again."
        ){results}'''


# The "Open in Colab" badge: the book shows its own copy of the image (a page never fetches an
# image from elsewhere); the notebook, which is open in Colab or Jupyter anyway, keeps Colab's.
BADGE = re.compile(r"^\[!\[Open In Colab\]\([^)\s]*\)\]\(https://colab\.research\.google\.com/[^)\s]*\)"
                   r"[ \t]*$", re.MULTILINE)
BADGE_IMAGE = "../book/images/colab-badge.svg"  # relative to chapters/
COLAB_BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"


def colab_url(url: str, branch: str, stem: str) -> str:
    """Where Colab opens ``chapters/<stem>.ipynb`` of the repository ``url`` (GitHub only)."""
    m = re.fullmatch(r"https://github\.com/([^/]+/[^/]+?)(?:\.git)?/?", url)
    if not m:
        raise ValueError(f"Colab opens notebooks from GitHub; repository.url is {url}")
    return f"https://colab.research.google.com/github/{m.group(1)}/blob/{branch}/chapters/{stem}.ipynb"


def with_badge(text: str, url: str, branch: str, stem: str) -> str:
    """``text`` with its Colab badge line generated: the shipped image, this chapter's link."""
    badge = f"[![Open In Colab]({BADGE_IMAGE})]({colab_url(url, branch, stem)})"
    return BADGE.sub(lambda _: badge, text, count=1)


SETUP_BLOCK = re.compile(r"^(```\{code-cell\}[^\n]*\n)(.*?)(^```[ \t]*$)", re.MULTILINE | re.DOTALL)


def with_setup_cell(text: str, url: str, branch: str = "main") -> str:
    """``text`` (a chapter's .md) with its Colab setup cell replaced by the generated one, so
    that the .md shows exactly what the .ipynb runs; unchanged if it has no setup cell."""
    for m in SETUP_BLOCK.finditer(text):
        body = m.group(2)
        if SETUP_MARK not in body:
            continue
        lines = body.split("\n")
        keep = 0  # the cell's own options stay: ":tags: ..." lines, or a "---" YAML block
        if lines[0] == "---":
            keep = lines.index("---", 1) + 1
        while keep < len(lines) and lines[keep].startswith(":"):
            keep += 1
        options = lines[:keep]
        cell = setup_cell(body, url, bool(SERVES.search(text)), branch)
        new = "\n".join(options + [cell]) + "\n"
        return text[: m.start(2)] + new + text[m.end(2) :]
    return text


# ----------------------------------------------------------------------------- notebooks
def generated(text: str, url: str, stem: str) -> str:
    """A chapter's .md with its generated parts (the Colab badge, the setup cell) up to date."""
    branch = repository_branch()
    return with_setup_cell(with_badge(text, url, branch, stem), url, branch)


def notebook_for(md: Path, bib: dict, url: str) -> nbformat.NotebookNode:
    text = generated(md.read_text(encoding="utf-8"), url, md.stem)
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
            cell.source = plain_markdown(cell.source, cites).replace(
                f"]({BADGE_IMAGE})]", f"]({COLAB_BADGE_IMAGE})]")
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
    """Write ``md``'s generated setup cell into the .md and its notebook next to it; True if
    either changed (with ``check``: would change)."""
    bib = load_bib(ROOT / "references.bib") if bib is None else bib
    url = repository_url() if url is None else url
    source = md.read_text(encoding="utf-8")
    md_text = generated(source, url, md.stem)
    text = jupytext.writes(notebook_for(md, bib, url), fmt="ipynb")
    if not text.endswith("\n"):
        text += "\n"
    target = md.with_suffix(".ipynb")
    old = target.read_text(encoding="utf-8") if target.exists() else None
    if old == text and md_text == source:
        return False
    if not check:
        target.write_text(text, encoding="utf-8")
        md.write_text(md_text, encoding="utf-8")
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
