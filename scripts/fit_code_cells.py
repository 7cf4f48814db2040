"""Reformat the code cells of MyST chapters that have lines over 88 characters, with ruff format.

The book's column shows about 88 characters of code; ``tests/test_book_conventions.py`` fails
on longer lines. Cells that already fit, the Colab setup cell and cells with IPython magics are
left alone. ``ruff format`` cannot split long strings or comments: the lines it leaves are
printed, to be shortened by hand. Then regenerate the notebooks (``make sync-notebooks``).

Usage: ``python scripts/fit_code_cells.py chapters/03_paged_kv_cache.md [...]``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

COLUMN = 88
CELL = re.compile(r"(^```\{code-cell\}[^\n]*\n)(.*?)(^```\s*$)", re.S | re.M)


def _ruff() -> str:
    here = Path(sys.executable).parent / "ruff"
    return str(here) if here.exists() else (shutil.which("ruff") or "ruff")


def fit(match: re.Match) -> str:
    head, body, tail = match.groups()
    lines = body.splitlines()
    options = []
    while lines and lines[0].startswith(":"):  # cell options (:tags: ...) stay on top
        options.append(lines.pop(0))
    if ('"google.colab" in sys.modules' in body or all(len(x) <= COLUMN for x in lines)
            or any(x.lstrip().startswith(("%", "!")) for x in lines)):
        return match.group(0)
    proc = subprocess.run(
        [_ruff(), "format", "--line-length", str(COLUMN), "--stdin-filename", "cell.py", "-"],
        input="\n".join(lines) + "\n", capture_output=True, text=True)
    if proc.returncode:
        print(f"left alone (ruff: {proc.stderr.strip()[:200]})", file=sys.stderr)
        return match.group(0)
    return head + "".join(f"{x}\n" for x in options) + proc.stdout + tail


def main(paths: list[str]) -> int:
    left = 0
    for path in map(Path, paths):
        text = CELL.sub(fit, path.read_text(encoding="utf-8"))
        path.write_text(text, encoding="utf-8")
        for m in CELL.finditer(text):
            for line in m.group(2).splitlines():
                if len(line) > COLUMN and '"google.colab"' not in m.group(2):
                    left += 1
                    print(f"{path.name}: still {len(line)} characters: {line.strip()[:70]}")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
