"""How a ``bench`` result names its conditions: the one-line description, load labels, strict JSON.

Both the table (:mod:`infer_lab.measure.bench`) and the plots (:mod:`infer_lab.measure.plots`)
state what was measured in the same words; this module is what they share, so neither has to
import the other.
"""

from __future__ import annotations

import math
from typing import Any

from infer_lab.measure.workloads import LONG_TAIL


def describe(meta: dict[str, Any]) -> str:
    """One line that says what was measured: mode, N, lengths, seed, repeats (for every output)."""
    if meta["dataset"] == "long-tail":
        lengths = str(LONG_TAIL)
    elif meta["dataset"] == "file":
        lengths = (f"prompts of {meta.get('dataset_path')} / output as each line says "
                   f"(else {meta['output_len']}) tokens")
    else:
        rr = f" ±{meta['range_ratio']:.0%}" if meta["range_ratio"] else ""
        lengths = f"input {meta['input_len']}{rr} / output {meta['output_len']}{rr} tokens"
    eos = ", ignore_eos" if meta["ignore_eos"] else ""
    if meta["mode"] == "closed":
        mode = "closed loop"
    else:
        b = meta["burstiness"]
        arrivals = "Poisson" if b == 1 else f"gamma (burstiness {b:g})"
        cap = f", max {meta['max_concurrency']} in flight" if meta["max_concurrency"] else ""
        mode = f"open loop, {arrivals} arrivals{cap}"
    reps = f", {meta['repeats']} repeats" if meta["repeats"] > 1 else ""
    warm = meta["num_warmups"]
    warm = ("max(C, 4)" if meta["mode"] == "closed" else "4") if warm is None else warm
    return (f"{mode}; N={meta['num_requests']} per run (+{warm} warm-up); "
            f"{lengths}{eos}; seed {meta['seed']}{reps}")


def load_label(point: dict[str, Any]) -> str:
    """``C=8`` or ``8 req/s`` (``inf req/s`` for everything at t = 0)."""
    load = float(point["load"])  # JSON keeps inf as "inf"
    return f"C={load:g}" if point["mode"] == "closed" else f"{load:g} req/s"


def jsonable(x: Any) -> Any:
    """Strict JSON: NaN becomes null and an infinite rate the string "inf"."""
    if isinstance(x, float):
        return None if math.isnan(x) else ("inf" if math.isinf(x) else x)
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x
