"""The committed benchmark results a chapter quotes, found wherever the chapter runs.

A benchmark writes ``benchmarks/results/NAME.json`` in the repository, and the chapters quote
those files. A reader is not always in the repository: Colab installs the package from git into
an empty ``/content``, where ``../benchmarks/results`` does not exist. So a result is looked up,
in order:

1. ``$INFER_LAB_RESULTS``: a folder, or a URL prefix (the Colab setup cell sets it to the
   repository's raw files on GitHub, unless it is set already: a fork or a mirror overrides it);
2. ``benchmarks/results`` under the working directory and under its parent (a chapter runs in
   ``chapters/``);
3. the checkout the package was installed from (an editable install).

A result that is nowhere is ``None``, and the chapter says how to produce it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from infer_lab import settings

RESULTS_ENV = settings.RESULTS.name
_CACHE: dict[str, dict[str, Any] | None] = {}


def _folders() -> list[Path]:
    here = Path.cwd()
    checkout = Path(__file__).resolve().parents[2]
    return [here / "benchmarks" / "results", here.parent / "benchmarks" / "results",
            checkout / "benchmarks" / "results"]


def _fetch(url: str, timeout: float) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (http/s only)
            return json.loads(response.read().decode("utf-8"))
    except (urllib.error.URLError, TimeoutError, OSError, ValueError):
        return None


def find_result(name: str, timeout: float = 10.0) -> dict[str, Any] | None:
    """The committed result ``name`` (e.g. ``"routing"`` or ``"gpu/kernels"``), or None.

    Raises ValueError on a name that leaves the results folder (``..``, an absolute path).
    """
    if not name or name.startswith("/") or ".." in Path(name).parts:
        raise ValueError(f"result names are relative, like 'routing' or 'gpu/kernels': {name!r}")
    file = name if name.endswith(".json") else f"{name}.json"
    where = settings.RESULTS.get()
    key = f"{where}|{Path.cwd()}|{file}"
    if key in _CACHE:  # a URL is fetched once per session
        return _CACHE[key]
    found: dict[str, Any] | None = None
    if where.startswith(("http://", "https://", "file://")):
        found = _fetch(f"{where.rstrip('/')}/{file}", timeout)
    else:
        for folder in ([Path(where)] if where else []) + _folders():
            path = folder / file
            if path.is_file():
                found = json.loads(path.read_text(encoding="utf-8"))
                break
    if found is not None:  # a miss is not remembered: the benchmark may run in between
        _CACHE[key] = found
    return found


def load_result(name: str, timeout: float = 10.0) -> dict[str, Any] | None:
    """:func:`find_result`, printing where and when the figures were taken (a result names its
    machine, commit and date: quote them as "the machine that took it", never "this machine"),
    or how to produce them when they are not here."""
    data = find_result(name, timeout)
    if data is None:
        module = name.split("/")[-1].removesuffix(".json")
        print(f"benchmarks/results/{name}.json is not here (set {RESULTS_ENV} to a folder or URL "
              f"that has it, or run `python -m benchmarks.{module}` in the repository)")
        return None
    prov = data.get("provenance")  # one run's dict, or a list of runs' dicts
    if prov is None and isinstance(data.get("runs"), dict):  # runs by name, each with its own
        prov = [run["provenance"] for run in data["runs"].values()
                if isinstance(run, dict) and isinstance(run.get("provenance"), dict)] or None
    runs = prov if isinstance(prov, list) else [prov if isinstance(prov, dict) else data]
    for meta in runs:  # a result taken in several runs names each one
        machine = meta.get("device_name") or meta.get("device") or "?"
        if meta.get("cpu_threads"):
            machine += f", {meta['cpu_threads']} threads"
        print(f"{name}: {meta.get('device', '?')} ({machine}), commit {meta.get('commit', '?')}, "
              f"{meta.get('date', '?')}"
              + (f", load average {meta['load_average']}" if "load_average" in meta else ""))
    if data.get("conditions"):
        print("  " + str(data["conditions"]))
    load = data.get("load_average")
    if isinstance(load, dict):
        print(f"  load average (1, 5, 15 min) before: {load.get('before')}, "
              f"after: {load.get('after')}")
    return data
