"""torch's ``F.linear`` against oneDNN's inner product (``kernels.linear``) on a CPU.

For float32 on a CPU, ``F.linear`` is MKL's ``sgemm`` and the inner product is
``kernels.linear``, the engine's route. For bf16 ``F.linear`` already goes to oneDNN (through
``aten::mm``), so the bf16 rows compare two ways into one library; they are why
``kernels.linear`` leaves bf16 to ``F.linear`` (the inner product was the slower), so here the
bf16 inner product is the op called directly (:func:`inner_product`). The committed result
(commit d95cdc7) predates that: its bf16 rows went through ``kernels.linear``, then still
routing bf16 to the inner product, its dtype check included. For each of
SmolLM2-135M's matrix kinds this runs the product over all 30 layers' matrices of that kind in
turn (30 matrices of 4-33 MB in fp32, so that most reads miss the caches, as in a real step; not
checked with counters) at 1, 2, 3, 4, 8, 16, 64 and 256 rows (a decode step, a speculative
verification, a batch of decodes, a prefill chunk), in fp32 (the exact path) and bf16, by both
routes, passes of the two alternating, and reports per matrix the median time over
``--repeats`` passes, the weight's size over that time (GB/s; not measured traffic), and the
speedup. The JSON keeps each median's fastest and slowest pass. Beside it, a read-only ``sum``
of a 256 MiB buffer at the same thread count. The provenance adds the processor's model and
torch's BLAS.

    python -m benchmarks.cpu_linear [--threads 1] [--repeats 9] [--rows 1 3 ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import infer_lab as il
from benchmarks._common import cpu_model, print_table, provenance, write_results
from infer_lab.kernels.linear import linear, onednn_takes

ROWS = (1, 2, 3, 4, 8, 16, 64, 256)


def inner_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's inner product, called directly: the bf16 comparison, which ``kernels.linear``
    no longer makes (it sends bf16 to ``F.linear``)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def onednn_route(dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """What the oneDNN column times: the package's route for float32, the op for bf16."""
    return linear if dtype == torch.float32 else inner_product


def pass_seconds(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Sorted pass times of each function, their passes alternating (drift hits both)."""
    out: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            out[name].append(time.perf_counter() - start)
    return {name: sorted(v) for name, v in out.items()}


def matrices_by_kind(model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """SmolLM2's weight matrices, each kind with its 30 layers' matrices, and the tied head."""
    kinds = {name: [layer.get_submodule(name).weight for layer in model.layers]
             for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                          "mlp.down_proj")}
    kinds["lm_head (tied embedding)"] = [model.embed_tokens.weight]
    return kinds


def blas() -> str:
    """torch's BLAS, as its build configuration names it."""
    m = re.search(r"BLAS_INFO=([^,\s]+)", torch.__config__.show())
    return m.group(1) if m else "unknown"


def cpu_id() -> str:
    """The processor's model name with its family and model numbers (Linux)."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    return (f"{fields.get('model name', cpu_model())} (family {fields.get('cpu family', '?')}, "
            f"model {fields.get('model', '?')})")


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = il.load("smollm2-135m-instruct", device="cpu", dtype=torch.float32)
    kinds = matrices_by_kind(model)
    load_before = os.getloadavg()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        dnn = onednn_route(dtype)
        for name, weights in kinds.items():
            ws = [w.to(dtype) for w in weights]
            nbytes = sum(w.numel() * w.element_size() for w in ws)
            for m in args.rows:
                x = torch.randn(m, ws[0].shape[1], dtype=dtype)
                if dtype == torch.float32:
                    assert onednn_takes(x, ws[0], None), "oneDNN's inner product is not available"
                got = pass_seconds({lib: lambda f=f, x=x, ws=ws: [f(x, w) for w in ws]
                                    for lib, f in (("F.linear", F.linear),
                                                   ("onednn", dnn))}, args.repeats)
                med = {lib: v[len(v) // 2] / len(ws) for lib, v in got.items()}
                rows.append({
                    "dtype": str(dtype).removeprefix("torch."), "matrix": name,
                    "shape": list(ws[0].shape), "rows": m,
                    "F.linear_us": round(med["F.linear"] * 1e6, 1),
                    "onednn_us": round(med["onednn"] * 1e6, 1),
                    "F.linear_GBps": round(nbytes / len(ws) / med["F.linear"] / 1e9, 2),
                    "onednn_GBps": round(nbytes / len(ws) / med["onednn"] / 1e9, 2),
                    "speedup": round(med["F.linear"] / med["onednn"], 2),
                    "passes_us": {lib: [round(v[0] / len(ws) * 1e6, 1),
                                        round(v[-1] / len(ws) * 1e6, 1)]
                                  for lib, v in got.items()},
                })
                print_table(rows[-1:], ["dtype", "matrix", "rows", "F.linear_us", "onednn_us",
                                        "F.linear_GBps", "onednn_GBps", "speedup"])
    src = torch.randn(2**26)
    read_s = pass_seconds({"sum": src.sum}, args.repeats)["sum"][args.repeats // 2]
    read = src.numel() * 4 / read_s / 1e9
    print(f"memory, one 256 MiB buffer: sum (read only) {read:.2f} GB/s")
    prov = provenance("cpu")
    prov.update(load_average=[load_before[0], os.getloadavg()[0]], cpu_model=cpu_id(),
                blas=blas())
    write_results("cpu_linear", {
        "benchmark": "cpu_linear", "provenance": prov, "model": "smollm2-135m-instruct",
        "threads": args.threads, "repeats": args.repeats, "read_GBps": round(read, 2),
        "rows": rows, "command": "python -m benchmarks.cpu_linear "
        f"--threads {args.threads} --repeats {args.repeats} --rows "
        + " ".join(map(str, args.rows)),
        "note": "time per matrix = median pass over all 30 layers' matrices of a kind / 30 "
                "(the LM head: one matrix); passes of F.linear and oneDNN alternate; "
                "passes_us: the fastest and slowest pass, per matrix; GB/s: weight bytes / "
                "time per matrix; F.linear is MKL's sgemm for float32 and oneDNN (aten::mm) "
                "for bf16; onednn is kernels.linear for float32 and the inner product op "
                "called directly for bf16 (kernels.linear sends bf16 to F.linear)"}, args.out)


if __name__ == "__main__":
    main()
