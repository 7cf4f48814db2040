"""Run chapter notebooks as Colab runs them: a stand-in for Colab, on this machine.

What a reader's Colab has before their first cell: Python with torch, numpy, matplotlib and a
Jupyter kernel, and no infer_lab. This script builds exactly that in a virtualenv of its own
(``build/colab-venv``; the packages only, so it is reused between runs), puts a ``google.colab``
stand-in on the kernel's path and imports it at kernel start-up as Colab does (the setup cells
test for it), clones this repository's HEAD and sets ``INFER_LAB_REPO=git+file://<clone>`` (and
``INFER_LAB_RESULTS`` to the clone's committed benchmark results, which Colab reads from GitHub),
then executes each chapter's committed ``.ipynb`` top to bottom, setup cell included, in an
empty working directory (Colab runs in ``/content``, not in a checkout). A chapter passes if no
cell raises.

Usage: ``python scripts/colab_check.py [--torch torch==2.13.0] [--pip pip==23.2.1]
[02_kv_cache 06_serving ...]`` (default: every chapter, the newest pip; an older pip is how a
reader with an older Python installation meets the setup cell). It needs only python3 and git
(``--from-md`` needs jupytext: run it with the project's venv); commit first (the clone is HEAD).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / "build" / "colab-venv"
COLAB_PACKAGES = ["numpy", "matplotlib", "ipykernel", "nbclient", "nbformat"]
STAND_IN = '''"""A stand-in for Colab's module: the chapters' setup cells test that it exists."""
IN_STAND_IN = True
'''

RUNNER = r'''
import sys, time, nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
path, cwd, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3])
nb = nbformat.read(path, as_version=4)
client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                        resources={"metadata": {"path": cwd}})
start = time.time()
try:
    client.execute()
except CellExecutionError as e:
    print(str(e)[-4000:])
    sys.exit(1)
# A committed result the prose quotes must reach Colab too (infer_lab.measure.results says
# "is not here" when it does not): that is a failure here, not a quiet "n/a" in the text.
printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
missing = [line for line in printed.splitlines() if "is not here (set INFER_LAB_RESULTS" in line]
if missing:
    print("committed results the chapter could not find:", *missing, sep="\n  ")
    sys.exit(1)
quoted = sorted({line.split(":")[0] for line in printed.splitlines() if ", commit " in line})
print(f"{len(nb.cells)} cells in {time.time() - start:.0f} s; committed results read: "
      f"{', '.join(quoted) or 'none'}")
'''


def run(cmd: list[str], **kw) -> None:
    subprocess.run(cmd, check=True, **kw)


def make_venv(torch_spec: str, pip_spec: str = "pip") -> Path:
    """The Colab-like environment; rebuilt when the torch or pip spec changes."""
    py = VENV / "bin" / "python"
    stamp = VENV / ".colab-stamp"
    want = f"{torch_spec}|{pip_spec}|{' '.join(COLAB_PACKAGES)}"
    if not (py.exists() and stamp.exists() and stamp.read_text() == want):
        run([sys.executable, "-m", "venv", "--clear", str(VENV)])
        run([str(py), "-m", "pip", "install", "-q", "--upgrade", pip_spec])
        if torch_spec:
            run([str(py), "-m", "pip", "install", "-q", torch_spec])
        run([str(py), "-m", "pip", "install", "-q", *COLAB_PACKAGES])
        run([str(py), "-m", "ipykernel", "install", "--sys-prefix", "--name", "python3"],
            stdout=subprocess.DEVNULL)
        stamp.write_text(want)
    # Whatever an earlier run's setup cells installed goes: each run starts as Colab does.
    subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "infer_lab"],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    probe = subprocess.run([str(py), "-c", "import infer_lab"], capture_output=True, cwd="/")
    if probe.returncode == 0:
        raise SystemExit(f"{VENV}: infer_lab is importable before the setup cell; remove it")
    return py


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chapters", nargs="*", help="chapter stems, e.g. 02_kv_cache")
    parser.add_argument("--torch", default="torch==2.13.0", help="pip spec of Colab's torch")
    parser.add_argument("--pip", default="pip", dest="pip_spec",
                        help="pip spec of the reader's pip (default: the newest), e.g. "
                             "pip==23.2.1 for a reader whose pip predates 24.1")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    parser.add_argument("--from-md", action="store_true",
                        help="run what scripts/sync_notebooks.py makes of each .md now, not the "
                             "committed .ipynb (for chapters whose notebook is out of date)")
    args = parser.parse_args(argv)
    stems = args.chapters or sorted(p.stem for p in (ROOT / "chapters").glob("*.ipynb"))
    notebooks = [ROOT / "chapters" / f"{s.removesuffix('.ipynb')}.ipynb" for s in stems]
    missing = [str(n) for n in notebooks if not n.exists()]
    if missing:
        raise SystemExit(f"no such notebooks: {missing}")
    py = make_venv(args.torch, args.pip_spec)
    pip_version = subprocess.run([str(py), "-m", "pip", "--version"], capture_output=True,
                                 text=True).stdout.split()[1]
    print(f"colab-check: pip {pip_version}, {args.torch or 'the torch pip picks'}")
    results = []
    with tempfile.TemporaryDirectory(prefix="colab-check-") as tmp:
        clone = Path(tmp) / "clone"
        run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(clone)])
        stub = Path(tmp) / "stand-in"
        (stub / "google" / "colab").mkdir(parents=True)  # "google" stays a namespace package
        (stub / "google" / "colab" / "__init__.py").write_text(STAND_IN)
        # Colab's kernel has imported google.colab before the first cell; so does this one.
        startup = Path(tmp) / "ipython" / "profile_default" / "startup"
        startup.mkdir(parents=True)
        (startup / "00-colab.py").write_text("import google.colab  # noqa: F401\n")
        # The clone stands in for GitHub twice: pip installs from it, and the committed results
        # the prose quotes are read from it as Colab reads them from raw.githubusercontent.com.
        env = {**os.environ, "INFER_LAB_REPO": f"git+file://{clone}", "PYTHONPATH": str(stub),
               "INFER_LAB_RESULTS": f"file://{clone}/benchmarks/results",
               "IPYTHONDIR": str(Path(tmp) / "ipython"), "MPLBACKEND": "agg",
               "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        env.pop("VIRTUAL_ENV", None)
        for nb in notebooks:
            content = Path(tmp) / "content" / nb.stem  # an empty working directory
            content.mkdir(parents=True)
            if args.from_md:
                sys.path.insert(0, str(ROOT / "scripts"))
                import jupytext
                import sync_notebooks

                fresh = Path(tmp) / nb.name
                fresh.write_text(jupytext.writes(sync_notebooks.notebook_for(
                    nb.with_suffix(".md"), sync_notebooks.load_bib(ROOT / "references.bib"),
                    sync_notebooks.repository_url()), fmt="ipynb"))
                nb = fresh
            start = time.time()
            proc = subprocess.run([str(py), "-c", RUNNER, str(nb), str(content),
                                   str(args.timeout)], env=env, capture_output=True, text=True,
                                  cwd=content)
            ok = proc.returncode == 0
            results.append((nb.stem, ok, time.time() - start))
            last = proc.stdout.strip().splitlines()[-1:] if ok else []
            print(f"colab-check {nb.stem}: {'ok' if ok else 'FAILED'} "
                  f"({time.time() - start:.0f} s{'; ' + last[0] if last else ''})", flush=True)
            if not ok:
                print((proc.stdout + proc.stderr)[-4000:], flush=True)
            subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "infer_lab"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    failed = [s for s, ok, _ in results if not ok]
    print(f"colab-check: {len(results) - len(failed)}/{len(results)} chapters ok"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
