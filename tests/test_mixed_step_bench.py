"""The mixed-step benchmark's two paths (benchmarks/mixed_step.py): its ``padded`` stand-in for
the previous torch path computes what the package's unpadded path does and really pads, so the
before/after figures compare the same outputs."""

from __future__ import annotations

import torch

import infer_lab as il
from benchmarks.mixed_step import measure


def test_both_paths_agree_and_only_the_padded_one_pads():
    torch.manual_seed(0)
    model, _ = il.load(device="cpu", dtype=torch.float32)
    out = measure(model, chunk=40, contexts=[20, 35, 9], rounds=2)
    assert max(out["max_logit_difference"].values()) < 1e-4
    rows = {(r["step"], r["path"]): r for r in out["rows"]}
    assert rows["mixed", "varlen"]["sdpa_query_rows_per_layer"] == 43  # the step's tokens
    assert rows["mixed", "padded"]["sdpa_query_rows_per_layer"] == 4 * 40
    assert rows["mixed", "varlen"]["sdpa_calls_per_layer"] == 2  # the decodes, the chunk
    for step in ("prefill", "decodes"):  # nothing to pad: the same rows both ways
        assert rows[step, "varlen"]["sdpa_query_rows_per_layer"] == \
            rows[step, "padded"]["sdpa_query_rows_per_layer"]
    assert all(len(r["samples_ms"]) == 2 for r in out["rows"])
