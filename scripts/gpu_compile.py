"""Compile every Triton kernel of ``infer_lab.kernels`` for real GPUs, on a machine without one.

The interpreter that runs the kernels on CPU in CI accepts code that the GPU compiler refuses
(a plain global inside a kernel, for one), and it says nothing about shared memory or registers.
This script runs Triton's own compiler, its bundled ``ptxas`` included, for each target GPU
generation (``GPUTarget("cuda", capability, 32)``: no driver, nothing launched) at every launch
configuration the dispatch can choose, and fails on:

- a compile error;
- shared memory above the target's per-block limit (64 KB on sm_75, 163 KB on sm_80,
  227 KB on sm_90);
- register spills above ``--max-spill`` bytes (stores + loads, from ``ptxas -v``). The default,
  64 B, is the noise that CUDA 13's ptxas shows for sm_90a even in 64-register kernels (16 B in
  RoPE); register pressure shows as hundreds to tens of thousands of bytes (the T4 prefill tile
  before its fix: 47 KB), and costs local-memory traffic on every tile.

The configurations come from the dispatch itself (``choose_tiles`` in ``triton_attention``, the
block-size rules of the wrappers), so a change there is compiled here. Only what the dispatch
can select is compiled: no bf16 below sm_80 (Triton has no bf16 ``tl.dot`` there, and
``infer_lab.kernels`` routes bf16 to torch on such GPUs).

Usage: ``python scripts/gpu_compile.py [--targets 75,80,90] [--jobs N] [--max-spill BYTES]``.
It needs Triton, not torch on a GPU; it runs with the Triton that CI installs and, through
``make gpu-compile``, with Triton 3.6 (the GPU machine's version) in a separate virtualenv.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels, whatever the machine has
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # Triton prints `ptxas -v`: registers and spills
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without a warning
# A fresh cache: a cached kernel would skip ptxas, and with it the log read here.
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="infer-lab-gpu-compile-")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHARED_LIMIT = {75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}
HEAD_DIMS = (64, 80, 96, 128)
MAX_SPILL = 64  # bytes; see the module docstring


@dataclass(frozen=True)
class Job:
    """One compilation: a kernel, its argument types and constexprs, for one target."""

    module: str
    kernel: str
    label: str
    types: tuple[tuple[str, str], ...]  # argument name -> Triton type, for non-default args
    consts: tuple[tuple[str, object], ...]
    num_warps: int
    num_stages: int
    capability: int
    aligned: tuple[str, ...] = field(default=())  # int arguments that are multiples of 16
    max_spill: int | None = None  # this kernel's own spill allowance, said where it is set


@dataclass
class Result:
    job: Job
    ok: bool
    registers: int = 0
    spill_bytes: int = 0
    shared: int = 0
    error: str = ""
    seconds: float = 0.0


def _dtypes(capability: int) -> list[str]:
    """What the dispatch can run on this GPU: bf16 needs sm_80 (see infer_lab.kernels)."""
    return [d for d in DTYPES if d != "bf16" or capability >= 80]


def _p2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def jobs(capability: int) -> Iterator[Job]:
    """Every launch configuration the dispatch can choose on ``capability`` (e.g. 90)."""
    from infer_lab.kernels.triton_attention import MAX_DECODE_GROUP, choose_tiles, precision_for

    cap = (capability // 10, capability % 10)
    strides = ("q_stride_t", "q_stride_h", "c_stride_blk", "c_stride_slot", "c_stride_h",
               "o_stride_t", "o_stride_h", "k_stride_t", "k_stride_h", "v_stride_t", "v_stride_h")
    for dt in _dtypes(capability):
        size = DTYPES[dt]
        prec = precision_for(dt)
        for block_d in sorted({max(16, _p2(d)) for d in HEAD_DIMS}):
            dims = [d for d in HEAD_DIMS if max(16, _p2(d)) == block_d]
            hd = "/".join(map(str, dims))
            io = (("q_ptr", f"*{dt}"), ("kc_ptr", f"*{dt}"), ("vc_ptr", f"*{dt}"),
                  ("out_ptr", f"*{dt}"), ("table_ptr", "*i32"), ("ctx_ptr", "*i32"),
                  ("cu_ptr", "*i32"), ("part_acc_ptr", "*fp32"), ("part_ml_ptr", "*fp32"),
                  ("scale_log2", "fp32"))
            # The page size and the window are runtime arguments of the attention kernels: one
            # compile covers pages 16/32 and windows on/off (both multiples of 16 at run time).
            for split in (False, True):
                t = choose_tiles("decode", size, block_d, cap)
                yield Job("triton_attention", "_decode_kernel",
                          f"decode {dt} hd={hd} split={int(split)}", io,
                          (("BLOCK_H", max(16, MAX_DECODE_GROUP)), ("BLOCK_N", t.block_n),
                           ("BLOCK_D", block_d), ("SPLIT", split), ("UPCAST", False),
                           ("PRECISION", prec)),
                          t.num_warps, t.num_stages, capability, (*strides, "page", "window"))
            t = choose_tiles("prefill", size, block_d, cap)
            for tree in (False, True):  # EAGLE's draft trees: a mask row per query (uint8)
                yield Job("triton_attention", "_prefill_kernel",
                          f"prefill {dt} hd={hd}" + (" tree" if tree else ""),
                          (*io, ("tree_ptr", "*u8")),
                          (("BLOCK_M", t.block_m), ("BLOCK_N", t.block_n), ("BLOCK_D", block_d),
                           ("UPCAST", False), ("PRECISION", prec), ("TREE", tree)),
                          t.num_warps, t.num_stages, capability, (*strides, "page", "window"),
                          # the tree path's extra mask tile spills on sm_80 at head_dim 128
                          # with the plain path's tiles (132 B with Triton 3.9, 248 B with
                          # 3.6): allowed until a GPU run times it and picks its own tiles
                          max_spill=256 if tree else None)
            for parts in (2, 4, 8, 16, 32, 64):  # auto_splits never exceeds 64 partitions
                yield Job("triton_attention", "_reduce_kernel",
                          f"reduce {dt} hd={hd} parts<={parts}",
                          (("part_acc_ptr", "*fp32"), ("part_ml_ptr", "*fp32"),
                           ("out_ptr", f"*{dt}")),
                          (("BLOCK_P", parts), ("BLOCK_D", block_d)), 4, 3, capability,
                          ("o_stride_t", "o_stride_h"))
            for heads in (1, 2, 4, 8):
                yield Job("triton_attention", "_store_kv_kernel",
                          f"store_kv {dt} hd={hd} kv_heads<={heads}",
                          (("k_ptr", f"*{dt}"), ("v_ptr", f"*{dt}"), ("kc_ptr", f"*{dt}"),
                           ("vc_ptr", f"*{dt}"), ("slot_ptr", "*i32")),
                          (("BLOCK_H", heads), ("BLOCK_D", block_d)), 4, 3, capability, strides)
            half = block_d // 2
            yield Job("triton_rope", "_rope_kernel", f"rope {dt} hd={hd}",
                      (("q_ptr", f"*{dt}"), ("k_ptr", f"*{dt}"), ("pos_ptr", "*i64"),
                       ("inv_freq_ptr", "*fp32")),
                      (("BLOCK_HQ", 32), ("BLOCK_HK", 8), ("BLOCK_HALF", half)), 4, 3,
                      capability, ("q_tok_stride", "q_head_stride", "k_tok_stride",
                                   "k_head_stride"))
        for hidden in (576, 2048, 4096, 8192):
            block = _p2(hidden)
            for residual in (False, True):
                yield Job("triton_norm", "_rms_norm_kernel",
                          f"rms_norm {dt} hidden={hidden} residual={int(residual)}",
                          (("x_ptr", f"*{dt}"), ("res_ptr", f"*{dt}"), ("w_ptr", f"*{dt}"),
                           ("out_ptr", f"*{dt}"), ("sum_ptr", f"*{dt}"), ("eps", "fp32")),
                          (("HAS_RESIDUAL", residual), ("BLOCK", block)),
                          min(16, max(1, block // 256)), 3, capability,
                          ("x_stride", "res_stride", "out_stride", "sum_stride"))
        yield Job("triton_act", "_silu_and_mul_kernel", f"silu_and_mul {dt}",
                  (("x_ptr", f"*{dt}"), ("out_ptr", f"*{dt}")), (("BLOCK", 1024),), 4, 3,
                  capability, ("x_stride", "out_stride"))
        yield from moe_jobs(dt, capability)


def moe_jobs(dt: str, capability: int) -> Iterator[Job]:
    """Chapter 12's fused MoE kernel: each tile configuration its dispatch picks, as the
    gate/up launch (SwiGLU, rows gathered through top-k; k only changes an integer division, so
    one value stands for all) and the down launch."""
    import torch

    from infer_lab.kernels.moe_triton import tile_configs

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt]
    io = (("a_ptr", f"*{dt}"), ("b_ptr", f"*{dt}"), ("c_ptr", f"*{dt}"), ("w_ptr", "*fp32"),
          ("sorted_ptr", "*i32"), ("expert_ptr", "*i32"), ("used_ptr", "*i32"))
    for t in tile_configs(torch_dtype, (capability // 10, capability % 10)):
        for top_k, swiglu in ((2, True), (1, False)):
            what = "gate_up" if swiglu else "down"
            yield Job("moe_triton", "_fused_moe_kernel", f"fused_moe {dt} bm={t.block_m} {what}",
                      io, (("TOP_K", top_k), ("SWIGLU", swiglu), ("MUL_WEIGHT", not swiglu),
                           ("BLOCK_M", t.block_m), ("BLOCK_N", t.block_n),
                           ("BLOCK_K", t.block_k), ("IEEE", dt == "fp32")),
                      t.num_warps, t.num_stages, capability,
                      ("stride_am", "stride_be", "stride_bn", "stride_cm", "N", "K"))


def _ptxas(capability: int) -> str:
    """The ptxas Triton itself uses for this target (it bundles one per CUDA generation)."""
    import triton

    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(capability).path
    except (ImportError, AttributeError, TypeError):
        return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas")


def _arch(capability: int) -> str:
    return f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"


def compile_job(job: Job) -> Result:
    """Compile one job; registers and spills from ``ptxas -v`` on the PTX Triton produced."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    start = time.perf_counter()
    fn = getattr(importlib.import_module(f"infer_lab.kernels.{job.module}"), job.kernel)
    consts = dict(job.consts)
    types = dict(job.types)
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        signature[name] = types.get(name, "i32")
        if signature[name].startswith("*") or name in job.aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
    missing = set(consts) - set(fn.arg_names)
    if missing:
        return Result(job, False, error=f"no constexpr parameters {sorted(missing)}")
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(
                ASTSource(fn, signature, consts, attrs),
                target=GPUTarget("cuda", job.capability, 32),
                options={"num_warps": job.num_warps, "num_stages": job.num_stages},
            )
    except Exception as e:  # noqa: BLE001 - the compiler raises many kinds; report them all
        return Result(job, False, error=f"{type(e).__name__}: {e}"[-2000:],
                      seconds=time.perf_counter() - start)
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    if regs is None:  # no log (an older Triton?): run the same ptxas on the PTX ourselves
        text = _ptxas_log(kernel.asm["ptx"], job.capability)
        regs = re.search(r"Used (\d+) registers", text)
    if regs is None:
        return Result(job, False, error=f"no register count from ptxas: {text[-800:]}")
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", text)
    return Result(job, True, int(regs.group(1)), sum(map(int, spills)),
                  int(kernel.metadata.shared), seconds=time.perf_counter() - start)


def _ptxas_log(ptx: str, capability: int) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([_ptxas(capability), "-v", f"--gpu-name={_arch(capability)}",
                               str(src), "-o", str(Path(tmp) / "k.cubin")],
                              capture_output=True, text=True)
    return proc.stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="75,80,90", help="compute capabilities, e.g. 80,90")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-spill", type=int, default=MAX_SPILL,
                        help="bytes of register spill (stores + loads) allowed per kernel")
    parser.add_argument("--only", default="", help="compile only labels containing this text")
    args = parser.parse_args(argv)
    import triton

    caps = [int(c) for c in args.targets.split(",") if c.strip()]
    todo = [j for c in caps for j in jobs(c) if args.only in j.label]
    print(f"gpu-compile: Triton {triton.__version__}, {len(todo)} kernels for "
          f"{', '.join(_arch(c) for c in caps)}; limits: shared per target, spills "
          f"<= {args.max_spill} B")
    start = time.perf_counter()
    failures, results = 0, []
    print(f"{'target':8} {'kernel':52} {'regs':>4} {'spill B':>7} {'shared':>7} {'s':>4}  verdict",
          flush=True)
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        for r in pool.map(compile_job, todo):  # printed as they come: a timeout keeps the rows
            results.append(r)
            j = r.job
            limit = SHARED_LIMIT.get(j.capability, 48 * 1024)
            problems = []
            if not r.ok:
                problems.append("COMPILE ERROR")
            else:
                if r.shared > limit:
                    problems.append(f"SHARED {r.shared} > {limit}")
                if r.spill_bytes > (args.max_spill if j.max_spill is None else j.max_spill):
                    problems.append(f"SPILLS {r.spill_bytes} B")
            failures += bool(problems)
            print(f"{_arch(j.capability):8} {j.label:52} {r.registers:4} {r.spill_bytes:7} "
                  f"{r.shared:7} {r.seconds:4.1f}  {'; '.join(problems) or 'ok'}", flush=True)
            if r.error:
                print("    " + r.error.strip().replace("\n", "\n    "), flush=True)
    print(f"gpu-compile: {len(results) - failures}/{len(results)} ok with Triton "
          f"{triton.__version__} in {time.perf_counter() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
