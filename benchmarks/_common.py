"""What every benchmark script shares: provenance for its JSON, and a plain table."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
# A benchmark imports this module as it starts: its run began about now. With the host, this
# lets a reader tell whether two committed runs shared a machine at the same time.
STARTED = dt.datetime.now(dt.timezone.utc)


def git_state(cwd: Path) -> tuple[str, bool | None]:
    """The short commit of ``cwd``'s checkout, and whether its tracked files other than results
    (``benchmarks/results/``, which the runs themselves write) differ from it: a run with
    uncommitted changes is not exactly that commit's code. "unknown"/None outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=cwd).stdout.strip()
    try:
        changed = git("diff", "--name-only", "HEAD").splitlines()  # staged or not
        code = [path for path in changed if not path.startswith("benchmarks/results/")]
        return git("rev-parse", "--short", "HEAD"), bool(code)
    except (OSError, subprocess.CalledProcessError):
        return "unknown", None


def provenance(device: str) -> dict[str, Any]:
    """Where and when a number was taken: device, host, commit (and whether tracked files had
    uncommitted changes), start and end (``date``) of the run, library versions."""
    commit, dirty = git_state(Path(__file__).parent)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else cpu_model()
    return {
        "device": device,
        "device_name": name or platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "host": platform.node(),
        "cpu_threads": torch.get_num_threads(),
        "commit": commit,
        "uncommitted_changes": dirty,
        "started": STARTED.isoformat(timespec="seconds"),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), '' where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def write_results(name: str, payload: dict[str, Any], out_dir: Path | None = None) -> Path:
    out_dir = Path(out_dir or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    widths = [max(len(c), *(len(fmt(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(fmt(r[c]).rjust(w) for c, w in zip(columns, widths)))


def quartiles(xs: list[float]) -> list[float]:
    """[25th, 75th] percentile: the spread to quote beside a median."""
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return [q[0], q[2]]
