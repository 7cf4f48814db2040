"""GPTQ and AWQ (Chapter 8b): constructed cases with known answers, then a tiny calibration end
to end on the bundled model, judged by KL divergence against round-to-nearest at equal bits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import infer_lab as il
from infer_lab.measure.kl import kl_divergence_many
from infer_lab.model.quant import FormatError
from infer_lab.model.quant.awq import ALPHAS, awq_int4, fold_input_scales, scales_fold
from infer_lab.model.quant.calibrate import collect_stats, fake_quantize, layer_linears
from infer_lab.model.quant.formats import WEIGHT_FORMATS
from infer_lab.model.quant.gptq import Int4Groups, gptq_int4, rtn_int4
from infer_lab.model.random import llama_config, random_model

GEN = torch.Generator().manual_seed(0)
HELDOUT = Path(il.__file__).parent / "assets" / "tiny-moe" / "heldout.txt"


def correlated_inputs(t: int, k: int) -> torch.Tensor:
    """Inputs with correlated channels and a few large ones (what real activations look like)."""
    mix = torch.randn(k, k, generator=GEN) / k**0.5 + torch.eye(k)
    x = torch.randn(t, k, generator=GEN) @ mix
    x[:, :4] *= 20
    return x


def test_rtn_grid_and_bits():
    w = torch.randn(8, 100, generator=GEN)
    t = rtn_int4(w, 32)  # 100 = 3 * 32 + 4: a short last group
    assert t.g_idx.tolist() == [i // 32 for i in range(100)] and t.scales.shape == (8, 4)
    assert t.qweight.max() <= 15
    step = t.scales.float()[:, t.g_idx]
    err = (t.dequantize() - w).abs()
    # half a step inside the range; the integer zero shifts the grid by up to half a step,
    # so the group's extremes can be off by up to one
    assert (err <= step + 1e-6).all() and (err <= step / 2 + 1e-6).float().mean() > 0.9
    assert t.bits_per_weight == pytest.approx(4 + 4 * 20 / 100)


def test_gptq_with_a_diagonal_hessian_is_rtn():
    w = torch.randn(16, 64, generator=GEN)
    g = gptq_int4(w, torch.eye(64) * 3, group_size=32, act_order=False)
    r = rtn_int4(w, 32)
    assert torch.equal(g.qweight, r.qweight) and torch.equal(g.scales, r.scales)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_lowers_the_output_error_of_rtn(act_order):
    w = torch.randn(32, 128, generator=GEN)
    x = correlated_inputs(2048, 128)
    h = 2 * x.double().t() @ x.double() / x.shape[0]
    g = gptq_int4(w, h, group_size=32, act_order=act_order)
    r = rtn_int4(w, 32)
    err = {n: float((x @ (t.dequantize() - w).t()).pow(2).mean()) for n, t in
           (("gptq", g), ("rtn", r))}
    assert err["gptq"] < 0.8 * err["rtn"], err
    if act_order:  # groups follow the activation order: g_idx is a permutation of the groups
        assert not g.sorted_groups
        assert sorted(g.g_idx.tolist()) == [i // 32 for i in range(128)]
        assert g.bits_per_weight > r.bits_per_weight  # the g_idx column costs 32 bits


def test_awq_protects_the_salient_channels():
    w = torch.randn(32, 128, generator=GEN)
    x = correlated_inputs(1024, 128)
    a = awq_int4(w, x.abs().mean(0), x, group_size=32)
    r = rtn_int4(w, 32)
    out = {n: float((x @ (d - w).t()).pow(2).mean())
           for n, d in (("awq", a.dequantize()), ("rtn", r.dequantize()))}
    assert a.alpha > 0 and out["awq"] < out["rtn"], (a.alpha, out)
    # the large-activation channels get scaled up: finer steps relative to their weights
    assert a.scales[:4].min() > a.scales[4:].max()


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_awq_scales_fold_into_the_op_before_except_o_proj_under_gqa(kv_heads):
    """What "nothing is added at run time" rests on: every layer linear's input scale folds
    into the op before it with the logits unchanged, except o_proj's when KV heads are shared."""
    cfg = llama_config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=kv_heads)
    model = random_model(cfg, device="cpu", dtype=torch.float32, std=0.1)
    ids = torch.randint(0, 64, (1, 12), generator=GEN)
    with torch.no_grad():
        ref = model(ids)
    before = {n: m.weight.clone() for n, m in layer_linears(model)}
    layer = model.layers[0]
    for name, mod in layer_linears(model):
        s = torch.rand(mod.in_features, generator=GEN) * 4 + 0.25
        if kv_heads < 4 and name.endswith("o_proj"):
            assert not scales_fold(name, cfg)
            with pytest.raises(FormatError, match="grouped-query"):
                fold_input_scales(layer, name, s, cfg)
            continue
        assert scales_fold(name, cfg)
        fold_input_scales(layer, name, s, cfg)
        assert not torch.equal(mod.weight, before[name])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref, rtol=1e-4, atol=1e-5)


def test_bad_g_idx_and_hessian_are_refused_with_the_name():
    t = rtn_int4(torch.randn(4, 64, generator=GEN), 32)
    bad = Int4Groups(t.qweight, t.scales, t.zeros, torch.full((64,), 5))
    with pytest.raises(FormatError, match=r"layers\.1\.o_proj: g_idx"):
        bad.dequantize("layers.1.o_proj")
    with pytest.raises(FormatError, match="Hessian"):
        gptq_int4(torch.randn(4, 64), torch.eye(32), name="w")
    with pytest.raises(FormatError, match=r"q_proj.*NaN"):
        gptq_int4(torch.full((4, 64), float("nan")), torch.eye(64), name="q_proj")


def test_tiny_calibration_end_to_end_beats_rtn_in_kl():
    """g128 (ragged on 704-wide rows): at g32 AWQ ties RTN on this model (measured), at g128
    both calibrated methods are ahead."""
    model, tok = il.load()
    ids = torch.tensor(tok.encode(HELDOUT.read_text()))
    calib = [ids[i: i + 64] for i in range(0, 64 * 16, 64)]  # 16 sequences of 64 tokens
    held = ids[4096: 4096 + 512]  # disjoint from the calibration text
    stats = collect_stats(model, calib)
    assert set(stats) == {n for n, _ in layer_linears(model)}
    assert all(s.rows == 16 * 64 for s in stats.values())

    def gptq(name, w):
        t = gptq_int4(w, stats[name].hessian, group_size=128)
        return t.dequantize(name), t.bits_per_weight

    def awq(name, w):  # o_proj unscaled under GQA (4 heads, 2 KV heads), as the benchmark
        alphas = ALPHAS if scales_fold(name, model.config) else (0.0,)
        t = awq_int4(w, stats[name].mean_abs, stats[name].sample, group_size=128,
                     alphas=alphas)
        return t.dequantize(name), t.bits_per_weight

    models = {n: fake_quantize(model, fn) for n, fn in
              (("rtn", WEIGHT_FORMATS["int4 g128 RTN"]), ("gptq", gptq), ("awq", awq))}
    res = kl_divergence_many(model, {n: m for n, (m, _) in models.items()}, held, window=128)
    assert res["gptq"].kl_mean < res["rtn"].kl_mean, res
    assert res["awq"].kl_mean < res["rtn"].kl_mean, res
    assert 4 + 20 / 128 < models["rtn"][1] < 4 + 20 / 64  # ragged last groups cost more


def test_sequential_calibration_feeds_each_block_the_quantized_blocks_outputs():
    """Block by block only (``true_sequential=False``): block 0 sees what the one pass sees;
    block 1 sees what the model with block 0 already quantized gives it, and not the
    unquantized inputs; with an identity "format" nothing is quantized and every block's
    statistics are the one pass's, and the copy is the model."""
    from infer_lab.model.quant.calibrate import blocks_of, quantize_sequential

    model, tok = il.load()
    ids = torch.tensor(tok.encode(HELDOUT.read_text()))
    calib = [ids[i: i + 32] for i in range(0, 32 * 4, 32)]
    one_pass = collect_stats(model, calib)
    seen: list[dict] = []

    def rtn_for(stats):
        seen.append(stats)
        return WEIGHT_FORMATS["int4 g32 RTN"]

    q, bits = quantize_sequential(model, calib, rtn_for, true_sequential=False)
    blocks = list(blocks_of(model))
    assert len(seen) == len(blocks) and 4 < bits < 5
    assert [set(st) for st in seen] == [{n for n, _ in blocks_of(model)[b]} for b in blocks]
    first, second = seen[0], seen[1]
    for name, st in first.items():  # nothing before block 0: the same inputs
        assert torch.equal(st.xtx, one_pass[name].xtx) and st.rows == one_pass[name].rows
    name = next(iter(second))
    assert not torch.allclose(second[name].xtx, one_pass[name].xtx)
    # ... and exactly what a model whose block 0 alone is quantized gives block 1
    only0 = {n for n, _ in blocks_of(model)[blocks[0]]}
    half, _ = fake_quantize(model, lambda n, w: WEIGHT_FORMATS["int4 g32 RTN"](n, w)
                            if n in only0 else (w, 32.0))
    expect = collect_stats(half, calib, only=set(second))
    torch.testing.assert_close(second[name].xtx, expect[name].xtx, rtol=1e-6, atol=1e-6)
    # every weight quantized, the hooks gone, the original untouched
    for (n, m), (_, m0) in zip(layer_linears(q), layer_linears(model), strict=True):
        assert not torch.equal(m.weight, m0.weight), n
        assert not m._forward_pre_hooks and not m._forward_hooks
    seen.clear()
    same, _ = quantize_sequential(model, calib, lambda st: (seen.append(st) or
                                                            (lambda n, w: (w, 32.0))),
                                  true_sequential=False)
    assert len(seen) == len(blocks)
    for st in seen:
        for n, v in st.items():
            assert torch.equal(v.xtx, one_pass[n].xtx), n
    with torch.no_grad():
        assert torch.equal(same(ids[None, :40]), model(ids[None, :40]))


class _ToyBlock(torch.nn.Module):
    """Separate q/k/v and gate/up (the bundled model fuses them); ``mode`` breaks the grouping:
    "inplace" scales the input in place between k and v, "twice" runs o twice."""

    def __init__(self, d: int, mode: str = "") -> None:
        super().__init__()
        lin = torch.nn.Linear
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (lin(d, d) for _ in range(4))
        self.gate_proj, self.up_proj, self.down_proj = lin(d, 2 * d), lin(d, 2 * d), lin(2 * d, d)
        self.mode = mode

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.normalize(h, dim=-1)
        q, k = self.q_proj(x), self.k_proj(x)
        if self.mode == "inplace":
            x.mul_(2)
        v = self.v_proj(x)
        a = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
        h = h + self.o_proj(a)
        if self.mode == "twice":
            h = h + self.o_proj(a)
        x = torch.nn.functional.normalize(h, dim=-1)
        return h + self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Toy(torch.nn.Module):
    def __init__(self, mode: str = "") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(32, 16)
        self.layers = torch.nn.ModuleList([_ToyBlock(16, mode), _ToyBlock(16, mode)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return h


@pytest.mark.parametrize("mode", ["", "inplace", "twice"])
def test_linear_stages_group_the_linears_that_read_one_input_in_the_order_they_run(mode):
    from infer_lab.model.quant.calibrate import blocks_of, linear_stages

    toy = _Toy(mode)
    linears = blocks_of(toy)["layers.1"]
    stages, grouped = linear_stages(toy, toy.layers[1], linears, torch.arange(8))
    short = [[n.rsplit(".", 1)[-1].removesuffix("_proj") for n in st] for st in stages]
    if mode == "twice":  # o runs twice: no safe grouping, one linear a stage in module order
        assert not grouped and short == [[n] for n in ("q", "k", "v", "o", "gate", "up", "down")]
    elif mode == "inplace":  # v reads x after it changed: not k's input any more
        assert grouped and short == [["q", "k"], ["v"], ["o"], ["gate", "up"], ["down"]]
    else:
        assert grouped and short == [["q", "k", "v"], ["o"], ["gate", "up"], ["down"]]
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in toy.modules())


def test_true_sequential_calibrates_each_stage_after_the_earlier_stages_of_its_block():
    """GPTQ's default order inside a block: each stage of block 0 (qkv, o_proj, gate_up,
    down_proj) is calibrated on exactly what a model with only the earlier stages of block 0
    quantized gives it; every block's first stage sees what the block-only order gives it; an
    identity "format" changes no statistic and not the model; no hook is left behind."""
    from infer_lab.model.quant.calibrate import blocks_of, linear_stages, quantize_sequential

    model, tok = il.load()
    ids = torch.tensor(tok.encode(HELDOUT.read_text()))
    calib = [ids[i: i + 32] for i in range(0, 32 * 4, 32)]
    rtn = WEIGHT_FORMATS["int4 g32 RTN"]  # ignores the statistics: both orders round alike
    one_pass = collect_stats(model, calib)
    blocks = blocks_of(model)
    stages = [linear_stages(model, model.get_submodule(b), lins, calib[0]) for b, lins in
              blocks.items()]
    assert all(grouped and len(st) == 4 for st, grouped in stages)
    seen: list[dict] = []
    q, bits = quantize_sequential(model, calib, lambda st: seen.append(st) or rtn)
    assert [list(st) for st in seen] == [s for st, _ in stages for s in st] and 4 < bits < 5
    block_only: list[dict] = []
    q_block, _ = quantize_sequential(model, calib, lambda st: block_only.append(st) or rtn,
                                     true_sequential=False)
    for i, per_block in enumerate(block_only):  # the first stage: as without true_sequential
        for name, st in seen[4 * i].items():
            assert torch.equal(st.xtx, per_block[name].xtx), name
            assert torch.equal(st.abs_sum, per_block[name].abs_sum) and st.rows == 4 * 32
    first = stages[0][0]
    for k, stage in enumerate(first):
        done = {n for s in first[:k] for n in s}
        part, _ = fake_quantize(model, lambda n, w, done=done: rtn(n, w) if n in done
                                else (w, 32.0))
        expect = collect_stats(part, calib, only=set(stage))
        for name in stage:
            got = seen[k][name]
            assert torch.equal(got.xtx, expect[name].xtx), name
            assert torch.equal(got.abs_sum, expect[name].abs_sum) and got.rows == 4 * 32
            if k:  # ... and not what the unquantized block (the block-only order) gives
                assert not torch.allclose(got.xtx, one_pass[name].xtx), name
    with torch.no_grad():  # the two orders' models differ only through GPTQ, not under RTN
        assert torch.equal(q(ids[None, :40]), q_block(ids[None, :40]))
    seen.clear()
    same, _ = quantize_sequential(model, calib, lambda st: seen.append(st) or
                                  (lambda n, w: (w, 32.0)))
    assert len(seen) == 16 and set().union(*seen) == set(one_pass)
    for st in seen:  # the sample differs: the pass draws its rows for fewer linears at a time
        for n, v in st.items():
            assert torch.equal(v.xtx, one_pass[n].xtx) and v.rows == one_pass[n].rows, n
            assert torch.equal(v.abs_sum, one_pass[n].abs_sum), n
    with torch.no_grad():
        assert torch.equal(same(ids[None, :40]), model(ids[None, :40]))
    for m in (*q.modules(), *same.modules(), *model.modules()):
        assert not m._forward_pre_hooks and not m._forward_hooks


# ------------------------------------------------------------------ GPTQ checkpoint layout
def autogptq_dequantize(qweight, qzeros, scales, g_idx):
    """AutoGPTQ's QuantLinear (v1) dequantization, written from its forward: the reference."""
    wf = torch.arange(0, 32, 4, dtype=torch.int32)
    zeros = torch.bitwise_right_shift(qzeros.unsqueeze(2).expand(-1, -1, 8), wf[None, None])
    zeros = (torch.bitwise_and(zeros, 15) + 1).reshape(scales.shape)
    weight = torch.bitwise_right_shift(qweight.unsqueeze(1).expand(-1, 8, -1), wf[None, :, None])
    weight = torch.bitwise_and(weight, 15).reshape(-1, qweight.shape[1])
    return (scales[g_idx.long()].float() * (weight - zeros[g_idx.long()]).float()).t()


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_checkpoint_layout_round_trips_and_matches_autogptq(act_order):
    from infer_lab.model.quant.gptq_checkpoint import pack_gptq, unpack_gptq

    w = torch.randn(32, 128, generator=GEN) - 0.3  # groups straddle 0: no zero point of 0
    x = correlated_inputs(512, 128)
    t = gptq_int4(w, 2 * x.t() @ x / 512, group_size=32, act_order=act_order)
    ckpt = pack_gptq(t)
    assert ckpt["qweight"].shape == (16, 32) and ckpt["qweight"].dtype == torch.int32
    assert ckpt["qzeros"].shape == (4, 4) and ckpt["scales"].shape == (4, 32)
    assert torch.equal(autogptq_dequantize(**ckpt), t.dequantize())
    back = unpack_gptq(ckpt)
    for field in ("qweight", "scales", "zeros", "g_idx"):
        assert torch.equal(getattr(back, field), getattr(t, field)), field


def test_gptq_checkpoint_into_the_engine_int4_kernels():
    from infer_lab.model.quant.gptq_checkpoint import (
        pack_gptq,
        to_quantized_linear,
        unpack_gptq,
    )

    w = torch.randn(64, 128, generator=GEN) - 0.3
    x = correlated_inputs(256, 128)
    t = unpack_gptq(pack_gptq(gptq_int4(w, 2 * x.t() @ x / 256, 32, act_order=False)))
    layer = to_quantized_linear(t, name="layers.0.mlp.down_proj")
    dense = t.dequantize()
    # the engine stores minimum = -zero * scale in fp32, where it is exact: the same weights
    assert torch.equal(layer.dequantize(), dense)
    out = layer(x[:4])  # the engine's int4 kernel path on this machine (bf16 activations)
    ref = x[:4] @ layer.dequantize().t()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2
    # act-order: the columns sorted by group, the activation's gathered the same way
    ordered = gptq_int4(w, 2 * x.t() @ x / 256, 32, act_order=True)
    layer = to_quantized_linear(ordered, name="down_proj")
    assert layer.input_perm is not None
    assert torch.equal(layer.dequantize(), ordered.dequantize())
    ref = x[:4] @ ordered.dequantize().t()
    assert ((layer(x[:4]) - ref).norm() / ref.norm()).item() < 1e-2
    uneven = Int4Groups(ordered.qweight, ordered.scales, ordered.zeros,
                        torch.arange(128) * 4 // 129)  # groups of 33, 32, 32, 31
    with pytest.raises(FormatError, match=r"down_proj\.g_idx: its groups hold \[33, 32, 32, 31\]"):
        to_quantized_linear(uneven, name="down_proj")


def test_gptq_checkpoint_bad_tensors_are_named():
    from infer_lab.model.quant.gptq_checkpoint import pack_gptq, unpack_gptq

    t = rtn_int4(torch.randn(16, 64, generator=GEN) - 0.3, 32)
    ckpt = pack_gptq(t)
    with pytest.raises(FormatError, match=r"o_proj: g_idx holds groups 0\.\.7 but .* 2 groups"):
        unpack_gptq({**ckpt, "g_idx": torch.arange(64) // 8}, "o_proj")
    with pytest.raises(FormatError, match=r"o_proj: GPTQ shapes"):
        unpack_gptq({**ckpt, "g_idx": torch.zeros(32, dtype=torch.int32)}, "o_proj")
    with pytest.raises(FormatError, match="missing"):
        unpack_gptq({"qweight": ckpt["qweight"]}, "o_proj")
    zero = rtn_int4(torch.rand(16, 64, generator=GEN), 32)  # all positive: zero point 0
    with pytest.raises(FormatError, match="zero point of 0"):
        pack_gptq(zero, "q_proj")
