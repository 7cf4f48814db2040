"""Every Triton kernel compiled for a real GPU, in bf16 and fp16 at model-sized shapes.

The interpreter checks the arithmetic but none of a GPU's limits (``tl.dot`` tile minimums, shared
memory, register pressure): these tests catch what only compilation can. Run with ``pytest -m gpu``
(CI deselects them; without CUDA they skip).
"""

from __future__ import annotations

import pytest
import torch

from infer_lab import kernels
from infer_lab.cache import build_paged_batch, paged_attention_ref
from infer_lab.kernels.reference import rms_norm_ref, rope_ref, silu_and_mul_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not kernels.triton_available(), reason="Triton is not installed"),
]
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                                 ids=["bf16", "fp16", "fp32"])
DEV = "cuda"


def check(out, ref, dtype, what):
    assert out.dtype == dtype and out.shape == ref.shape
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e} > {TOL[dtype]:.0e}"


@DTYPES
def test_small_ops_on_gpu(dtype):
    torch.manual_seed(0)
    x, r = (torch.randn(37, 4096, device=DEV, dtype=dtype) for _ in range(2))
    w = torch.randn(4096, device=DEV, dtype=dtype)
    out, total = kernels.rms_norm(x, w, 1e-5, r, backend="triton")
    ref, ref_total = rms_norm_ref(x.double(), w.double(), 1e-5, r.double())
    check(out, ref, dtype, "rms_norm")
    check(total, ref_total, dtype, "x + r")
    g = torch.randn(37, 2 * 14336, device=DEV, dtype=dtype)
    check(kernels.silu_and_mul(g, backend="triton"), silu_and_mul_ref(g.double()), dtype, "silu")
    qkv = torch.randn(37, (32 + 16) * 128, device=DEV, dtype=dtype)
    q, k, _ = qkv.split([32 * 128, 8 * 128, 8 * 128], -1)
    q, k = q.unflatten(-1, (32, 128)), k.unflatten(-1, (8, 128))
    pos = torch.randint(0, 8192, (37,), device=DEV)
    inv_freq = 1.0 / 500000 ** (torch.arange(0, 128, 2, device=DEV) / 128)
    ref_q, ref_k = rope_ref(q.double(), k.double(), pos, inv_freq)
    out_q, out_k = kernels.apply_rope(q, k, pos, inv_freq, backend="triton")
    check(out_q, ref_q, dtype, "rope q")
    check(out_k, ref_k, dtype, "rope k")


def paged(chunks, dtype, hq=32, hkv=8, d=128, block_size=16):
    blocks = sum(-(-n // block_size) for n, _ in chunks) + 4
    kc = torch.randn(blocks, block_size, hkv, d, device=DEV, dtype=dtype)
    vc = torch.randn_like(kc)
    free = torch.randperm(blocks).tolist()
    spec = [([0] * q, n - q, [free.pop() for _ in range(-(-n // block_size))]) for n, q in chunks]
    batch = build_paged_batch(spec, block_size, blocks, DEV)
    q = torch.randn(batch.num_tokens, hq, d, device=DEV, dtype=dtype)
    ref = paged_attention_ref(q.double(), kc.double(), vc.double(), batch.block_tables,
                              batch.context_lens, batch.cu_seqlens_q)
    return q, kc, vc, batch, ref


@DTYPES
@pytest.mark.parametrize("splits", [1, 8, None], ids=["one-pass", "split-8", "auto"])
def test_decode_attention_on_gpu(dtype, splits):
    torch.manual_seed(1)
    mod = kernels.triton_module("triton_attention")
    q, kc, vc, batch, ref = paged([(n, 1) for n in (1, 17, 300, 2049, 4000)], dtype)
    out = mod.paged_decode_attention_triton(q, kc, vc, batch.block_tables, batch.context_lens,
                                            num_splits=splits)
    check(out, ref, dtype, "decode")


@DTYPES
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_attention_on_gpu(dtype, group):
    torch.manual_seed(2)
    q, kc, vc, batch, ref = paged([(300, 300), (1, 1), (700, 129), (65, 1)], dtype,
                                  hq=8 * group if group < 8 else 32, hkv=8 if group < 8 else 4)
    out = kernels.paged_attention_triton(q, kc, vc, batch.block_tables, batch.context_lens,
                                         batch.cu_seqlens_q)
    check(out, ref, dtype, "prefill")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_store_kv_on_gpu(dtype):
    k = torch.randn(50, 8, 128, device=DEV, dtype=dtype)
    v = torch.randn_like(k)
    slots = torch.randperm(64 * 16, device=DEV)[:50]
    caches = [torch.zeros(64, 16, 8, 128, device=DEV, dtype=dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    kernels.reference.store_kv_ref(k, v, *expected, slots)
    kernels.store_kv(k, v, *caches, slots, backend="triton")
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_auto_backend_is_triton_on_cuda():
    assert kernels.resolve_backend("auto", torch.ones(1, device=DEV)) == "triton"


def test_greedy_generation_on_gpu_triton_equals_torch(tmp_path):
    """fp32 on the GPU, so that exact token equality is a fair demand."""
    import infer_lab as il
    from infer_lab.cache import generate_paged
    from tests.helpers import assert_greedy_equal, make_checkpoint

    make_checkpoint(tmp_path, "llama3")
    model, tok = il.load(tmp_path, device=DEV, dtype=torch.float32)
    prompts = ["In the beginning", "Prefill is compute-bound; decode is memory-bandwidth-bound."]
    runs = {}
    for backend in ("torch", "triton"):
        with kernels.use_backend(backend):
            runs[backend] = generate_paged(model, tok, prompts, max_tokens=8, ignore_eos=True)

    def logits_at(prompt_ids, generated):
        with torch.inference_mode(), kernels.use_backend("torch"):
            return model(torch.tensor([list(prompt_ids) + generated], device=DEV))[0, -1]

    for ours, ref in zip(runs["triton"], runs["torch"], strict=True):
        assert_greedy_equal(ours.token_ids, ref.token_ids,
                            lambda gen, p=ref.prompt_token_ids: logits_at(p, gen))
