"""What every benchmark script shares: provenance for its JSON, and a plain table."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
# A benchmark imports this module as it starts: its run began about now. With the host, this
# lets a reader tell whether two committed runs shared a machine at the same time.
STARTED = dt.datetime.now(dt.timezone.utc)


def provenance(device: str) -> dict[str, Any]:
    """Where and when a number was taken: device, host, commit, start and end (``date``) of
    the run, library versions."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    name = torch.cuda.get_device_name() if device.startswith("cuda") else cpu_model()
    return {
        "device": device,
        "device_name": name or platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "host": platform.node(),
        "cpu_threads": torch.get_num_threads(),
        "commit": commit,
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
