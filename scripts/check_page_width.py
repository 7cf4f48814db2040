"""Check the rendered book at a given browser width: how many columns of code each page shows.

The chapters' code cells are written to 88 columns (``tests/test_book_conventions.py``), and
``_static/infer_lab.css`` widens the content column so that 88 columns show at a 1280-pixel
window. This script checks the built HTML in a real browser engine, headless Chromium (Debian's
``chromium`` package): for every chapter page it saves a screenshot at that window size and
measures, in the page itself, the columns each code block shows (its width over the width of one
character of its font) against the longest line it holds. A code cell whose lines are cut behind
a scrollbar is a failure; a long line of *output* (a table a cell printed) is only reported.

Build the book first, without executing it (the Makefile's ``book-check`` does; the widths do not
depend on the outputs)::

    jupyter-book build . -W -n --keep-going --config _build/_config_noexec.yml
    python scripts/check_page_width.py                # every chapter, 1280 x 900
    python scripts/check_page_width.py --width 1024 chapters/04_gpu_kernels

Screenshots go to ``_build/screenshots/<page>_<width>.png`` (the top of each page, where the
Colab badge and the setup cell are). Exit status 1 if a code cell is cut. Not run in CI: CI has
no browser; a unit test checks that the CSS is configured.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COLUMN = 88
# Runs inside the page: for each code block, the columns it shows and its longest line.
PROBE = """
<script>
window.addEventListener("load", () => document.fonts.ready.then(() => {
  const rows = [];
  for (const pre of document.querySelectorAll("div.highlight pre, div.cell_output pre")) {
    const probe = document.createElement("span");
    probe.textContent = "0".repeat(100);
    probe.style.visibility = "hidden";
    pre.appendChild(probe);
    const char = probe.getBoundingClientRect().width / 100;
    probe.remove();
    const style = getComputedStyle(pre);
    const inner = pre.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
    const lines = pre.textContent.split("\\n");
    const longest = Math.max(...lines.map(l => l.length));
    rows.push({input: pre.closest("div.cell_output") === null, shows: Math.floor(inner / char),
               longest: longest, cut: pre.scrollWidth > pre.clientWidth + 1,
               line: lines.find(l => l.length === longest).slice(0, 100)});
  }
  const out = document.createElement("pre");
  out.id = "infer-lab-width-report";
  out.textContent = JSON.stringify({window: window.innerWidth, rows: rows});
  document.body.appendChild(out);
}));
</script>
"""


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return name
    raise SystemExit("no headless browser: apt-get install -y chromium")


def browse(page: Path, width: int, height: int, *args: str) -> str:
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu",
           "--disable-background-networking", f"--window-size={width},{height}",
           "--virtual-time-budget=10000", *args, page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout


def measure(page: Path, width: int, height: int) -> dict:
    """The page's report, from a copy of it (beside it, so that its assets load) with PROBE."""
    text = page.read_text(encoding="utf-8")
    with tempfile.NamedTemporaryFile("w", suffix=".html", dir=page.parent, delete=False,
                                     encoding="utf-8") as f:
        f.write(text.replace("</body>", PROBE + "</body>", 1))
        probe_page = Path(f.name)
    try:
        dom = browse(probe_page, width, height, "--dump-dom")
    finally:
        probe_page.unlink()
    m = re.search(r'<pre id="infer-lab-width-report"[^>]*>(.*?)</pre>', dom, re.S)
    if not m:
        raise SystemExit(f"{page}: the browser returned no measurement")
    return json.loads(html.unescape(m.group(1)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", help="e.g. chapters/04_gpu_kernels (default: all)")
    parser.add_argument("--html", type=Path, default=ROOT / "_build" / "html")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=900)
    parser.add_argument("--out", type=Path, default=ROOT / "_build" / "screenshots")
    args = parser.parse_args(argv)
    pages = ([args.html / f"{p.removesuffix('.html')}.html" for p in args.pages] or
             sorted((args.html / "chapters").glob("*.html")))
    if not pages:
        raise SystemExit(f"no pages under {args.html}: build the book first (see --help)")
    args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    for page in pages:
        shot = args.out / f"{page.stem}_{args.width}.png"
        browse(page, args.width, args.height, f"--screenshot={shot}")
        report = measure(page, args.width, args.height)
        inputs = [r for r in report["rows"] if r["input"]]
        outputs = [r for r in report["rows"] if not r["input"]]
        shows = min((r["shows"] for r in inputs), default=0)
        cut = [r for r in inputs if r["cut"]]
        wide = [r for r in outputs if r["cut"]]
        print(f"{page.stem}: {len(inputs)} code cells show {shows} columns at "
              f"{report['window']} px; {len(cut)} cut, {len(wide)} wide outputs; {shot.name}")
        for r in cut:
            print(f"  cut ({r['longest']} > {r['shows']} columns): {r['line']}")
        if cut or shows < COLUMN:
            failed.append(page.stem)
    print(f"check_page_width: {len(pages) - len(failed)}/{len(pages)} pages show every code "
          f"line whole at {args.width} px" + (f"; not: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
