"""FLOP and byte counts against what torch actually does; the named workloads; capacity and cost
against examples worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from infer_lab.cache.sizing import kv_bytes_per_token
from infer_lab.measure import (
    LONG_TAIL,
    RequestSpec,
    long_tail_mix,
    nano_vllm_offline,
    step_bytes,
    step_flops,
)
from infer_lab.measure.capacity import (
    PRICES,
    PRICES_DATE,
    capacity,
    cost_per_million_tokens,
    goodput_tokens,
    meets,
    roofline_rate,
    steady_step_s,
)
from infer_lab.measure.flops import arithmetic_intensity, attended_pairs
from infer_lab.measure.hardware import GPUS
from infer_lab.measure.stats import beyond
from infer_lab.measure.workloads import arrival_times
from infer_lab.model.random import llama_config, random_model

CFG = llama_config(hidden_size=128, intermediate_size=352, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)


def counted_flops(batch: int, seq: int) -> int:
    model = random_model(CFG, "cpu")
    ids = torch.randint(0, CFG.vocab_size, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(ids, last_only=True)
    return counter.get_total_flops()


@pytest.mark.parametrize(("batch", "seq"), [(1, 1), (3, 1), (1, 33), (2, 64)])
def test_step_flops_match_torch_flop_counter(batch, seq):
    # torch's counter sees the projections and the LM head (exactly); on CPU it does not count
    # the fused attention kernel, so that term (causal pairs) is taken out of ours to compare.
    attn_per_pair = 4 * CFG.num_hidden_layers * CFG.num_attention_heads * CFG.head_dim * batch
    causal = attn_per_pair * attended_pairs(seq, 0)
    assert counted_flops(batch, seq) == step_flops(CFG, batch, seq, 0) - causal


def test_attended_pairs_is_a_causal_count():
    for new, ctx in [(1, 0), (1, 100), (7, 0), (7, 5)]:
        mask = torch.ones(new, ctx + new).tril(ctx)
        assert attended_pairs(new, ctx) == int(mask.sum())


def test_step_bytes_count_every_weight_once():
    model = random_model(CFG, "cpu")
    table = CFG.vocab_size * CFG.hidden_size * 4  # untied: the embedding table is not read whole
    weights = sum(p.numel() for p in model.parameters()) * 4 - table
    assert step_bytes(CFG, 1, 1, 0, dtype_bytes=4) == (
        weights + CFG.hidden_size * 4 + kv_bytes_per_token(CFG, 4)
    )
    # a decode step over a long context reads the whole cache
    extra = step_bytes(CFG, 8, 1, 1000, 4) - step_bytes(CFG, 8, 1, 0, 4)
    assert extra == 8 * 1000 * kv_bytes_per_token(CFG, 4)


def test_intensity_separates_decode_from_prefill():
    decode = arithmetic_intensity(CFG, 1, 1, 0, dtype_bytes=2)
    prefill = arithmetic_intensity(CFG, 1, 512, 0, dtype_bytes=2)
    assert 0.5 < decode < 2 < 100 < prefill
    for gpu in GPUS.values():  # decode at batch 1 is memory-bound on every GPU
        assert decode < gpu.ridge_point


def test_long_tail_mix_is_fixed_and_in_range():
    a, b = long_tail_mix(), long_tail_mix()
    assert a == b and len(a) == 128
    prompts = np.array([r.prompt_len for r in a])
    outputs = np.array([r.output_len for r in a])
    assert prompts.min() >= 8 and prompts.max() <= 512
    assert outputs.min() >= 12 and outputs.max() <= 256
    assert np.median(outputs) < outputs.mean()  # a long tail: the mean sits above the median
    assert all(r.arrival == 0 for r in a)
    assert long_tail_mix(seed=1) != a


def test_arrivals_have_the_stated_rate():
    t = arrival_times(20000, rate=4.0, rng=np.random.default_rng(0))
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    assert abs(len(t) / t[-1] - 4.0) < 0.1
    bursty = arrival_times(20000, rate=4.0, burstiness=0.25, rng=np.random.default_rng(0))
    assert np.diff(bursty).std() > 1.5 * np.diff(t).std()
    with pytest.raises(ValueError):
        arrival_times(10, rate=0)


def test_nano_vllm_offline_lengths():
    reqs = nano_vllm_offline(n=256)
    assert len(reqs) == 256
    assert all(100 <= r.prompt_len <= 1024 and 100 <= r.output_len <= 1024 for r in reqs)


def test_long_tail_constants_live_in_one_place():
    assert (LONG_TAIL.prompt.alpha, LONG_TAIL.prompt.scale, LONG_TAIL.prompt.cap) == (1.5, 8, 512)
    assert (LONG_TAIL.output.alpha, LONG_TAIL.output.scale, LONG_TAIL.output.cap) == (1.2, 12, 256)
    assert LONG_TAIL.max_len == 768
    assert str(LONG_TAIL) == ("long-tail mix (prompt ⌊8·Pareto(1.5)⌋≤512, "
                              "output ⌊12·Pareto(1.2)⌋≤256)")
    # the same draw as the formula, first all prompts then all outputs from one seeded stream
    rng = np.random.default_rng(5)
    want_p = np.minimum(np.floor(8 * (1 + rng.pareto(1.5, 20))), 512).astype(int)
    want_o = np.minimum(np.floor(12 * (1 + rng.pareto(1.2, 20))), 256).astype(int)
    got = long_tail_mix(20, seed=5)
    assert [r.prompt_len for r in got] == want_p.tolist()
    assert [r.output_len for r in got] == want_o.tolist()


def test_one_request_type_for_workloads_and_the_load_generator():
    from infer_lab.measure import loadgen

    assert loadgen.RequestSpec is RequestSpec
    r = long_tail_mix(1)[0]
    assert isinstance(r, RequestSpec) and r.prompt is None
    assert RequestSpec(3, 4) == RequestSpec(prompt_len=3, output_len=4, arrival=0.0)
    for bad in ((-1, 4), (3, 0)):
        with pytest.raises(ValueError):
            RequestSpec(*bad)


# --- capacity and cost ---------------------------------------------------------------------


def point(load, rps, ttft_p99, ttft_hi, tpot_p99=0.01, tpot_hi=0.012, failed=0, out_tps=None,
          goodput=None):
    """A sweep point as ``infer-lab bench`` writes it (seconds), with p99 intervals."""
    metrics = {"request_throughput": rps, "output_throughput": out_tps or 16 * rps,
               "ttft.p99": ttft_p99, "tpot.p99": tpot_p99, "failed": failed}
    if goodput is not None:
        metrics["goodput"] = goodput
    ci = {"ttft.p99": [ttft_p99 * 0.8, ttft_hi], "tpot.p99": [tpot_p99 * 0.8, tpot_hi]}
    return {"load": load, "metrics": metrics, "ci": ci, "ci_block": ci}


SLO = {"ttft": 0.250, "tpot": 0.025}


def test_the_upper_bound_decides_not_the_point_estimate():
    p = point(8, 30.0, ttft_p99=0.240, ttft_hi=0.262)  # the estimate passes, its interval not
    assert meets(p, SLO, "point") and not meets(p, SLO, "upper")
    assert not meets(point(8, 30.0, 0.1, 0.2, failed=1), SLO)  # failures never meet an SLO
    with pytest.raises(ValueError):
        meets(p, SLO, "median")
    with pytest.raises(ValueError):
        meets({"load": 1, "metrics": {"ttft.p99": 0.1}}, SLO)  # no interval stored
    with pytest.raises(ValueError):
        meets(p, SLO, interval="bayes")


def test_the_time_block_interval_judges_by_default():
    # over requests the p99 looks tight (one stall's ten requests read as ten observations);
    # over stretches of the timeline it is as wide as one event makes it
    p = point(32, 30.0, ttft_p99=0.240, ttft_hi=0.241)
    p["ci_block"] = {"ttft.p99": [0.15, 0.31], "tpot.p99": [0.008, 0.012]}
    assert meets(p, SLO, interval="requests") and not meets(p, SLO)
    old = {k: v for k, v in p.items() if k != "ci_block"}  # a result from before the block CI
    with pytest.raises(ValueError, match="reanalyse"):
        meets(old, SLO)
    assert meets(old, SLO, interval="requests")


def test_replicas_from_the_heaviest_trusted_passing_load():
    pts = [point(1, 6.0, 0.02, 0.03), point(4, 20.0, 0.08, 0.10), point(16, 40.0, 0.20, 0.24),
           point(64, 45.0, 0.60, 0.80)]
    cap = capacity(pts, SLO, target_rps=100)
    assert cap.passing == (True, True, True, False) and cap.monotone
    # 40 req/s per replica at C=16: ceil(100 / 40) = 3
    assert (cap.load, cap.rate, cap.replicas) == (16, 40.0, 3)
    assert capacity(pts, SLO, target_rps=80).replicas == 2  # exactly 2 x 40: no extra replica
    # a stricter SLO: C=4's estimate (80 ms) passes 90 ms, its upper bound (100 ms) does not
    strict = capacity(pts, {"ttft": 0.09}, target_rps=100)
    assert (strict.load, strict.replicas) == (1, 17)  # 0.10 > 0.09 at C=4: ceil(100 / 6)
    assert capacity(pts, {"ttft": 0.09}, 100, bound="point").replicas == 5  # ceil(100 / 20)


def test_a_pass_above_a_failure_is_not_trusted():
    pts = [point(8, 30.0, 0.20, 0.24), point(16, 36.0, 0.25, 0.30), point(32, 44.0, 0.21, 0.24)]
    cap = capacity(pts, SLO, target_rps=100)
    assert cap.passing == (True, False, True) and not cap.monotone
    assert (cap.load, cap.replicas) == (8, 4)  # C=32 passed again, but after C=16 failed
    none = capacity([point(1, 5.0, 0.3, 0.4)], SLO, 100)
    assert none.replicas is None and none.rate is None
    with pytest.raises(ValueError):
        capacity(pts, SLO, target_rps=0)


def test_cost_per_million_tokens_by_hand():
    # $3.60 an hour at 1000 tokens/s: 3.6 million tokens an hour -> $1.00 per million
    assert cost_per_million_tokens(3.60, 1000) == pytest.approx(1.00)
    # $0.07 an hour at 250 tokens/s: 0.07 / 900 000 * 1e6 = $0.0778
    assert cost_per_million_tokens(0.07, 250) == pytest.approx(0.07 / 0.9)
    assert cost_per_million_tokens(1.0, 0) == float("inf")
    with pytest.raises(ValueError):
        cost_per_million_tokens(-1.0, 10)
    assert set(PRICES) >= {"cpu-2vcpu", *GPUS} and PRICES_DATE.startswith("20")


def test_goodput_tokens_from_a_point():
    # 20 req/s of which 15 met the SLO, 320 output tokens/s: 240 good tokens/s
    assert goodput_tokens(point(4, 20.0, 0.1, 0.1, out_tps=320.0, goodput=15.0)) == 240.0
    p = point(4, 20.0, 0.1, 0.1, out_tps=320.0, goodput=15.0)
    p["metrics"]["goodput_tokens"] = 200.0  # measured directly, when the bench stored it
    assert goodput_tokens(p) == 200.0


def test_roofline_rate_by_hand():
    # A made-up device where everything is round: 100 GB/s, 1 TFLOP/s, 1 GiB.
    from infer_lab.measure.hardware import Hardware

    gpu = Hardware("toy", 1, 100, 1, 1)
    weights = CFG.num_parameters() * 2
    per_seq = (8 + 4) * kv_bytes_per_token(CFG, 2)
    r = roofline_rate(CFG, gpu, prompt_len=8, output_len=4, tpot_bound=1.0, max_batch=4)
    assert r.fits and r.batch == 4 and r.limit == "max_batch"
    # steady state: 4 decodes at context 8 + 4 // 2 = 10, and 4 / 4 = 1 prefill of 8 tokens in
    # the same step (chunked): its FLOPs, and its K/V and embedding rows, on top
    prompt_bytes = 8 * (kv_bytes_per_token(CFG, 2) + CFG.hidden_size * 2)
    step = max((step_bytes(CFG, 4, 1, 10) + prompt_bytes) / 100e9,
               (step_flops(CFG, 4, 1, 10) + step_flops(CFG, 1, 8, 0)) / 1e12)
    assert r.step_s == pytest.approx(step) and r.prefill_tokens_per_step == 8
    assert r.tokens_per_s == pytest.approx(4 / step)  # 4 tokens a step, one per sequence
    assert r.requests_per_s == pytest.approx(1 / step)
    # without chunking the prefill is a step of its own that everyone waits for
    apart = roofline_rate(CFG, gpu, 8, 4, 1.0, max_batch=4, chunked_prefill=False)
    assert apart.step_s == pytest.approx(
        max(step_bytes(CFG, 4, 1, 10) / 100e9, step_flops(CFG, 4, 1, 10) / 1e12)
        + max(step_bytes(CFG, 1, 8, 0) / 100e9, step_flops(CFG, 1, 8, 0) / 1e12))
    # memory: at most (0.9 GiB - weights) / per_seq sequences
    mem = int((0.9 * 2**30 - weights) // per_seq)
    big = roofline_rate(CFG, gpu, 8, 4, tpot_bound=1.0, max_batch=10 * mem)
    assert big.batch == mem and big.limit == "memory"
    bound = steady_step_s(CFG, gpu, 2, 8, 4) * 1.0001
    tight = roofline_rate(CFG, gpu, 8, 4, tpot_bound=bound)
    assert tight.limit == "tpot" and tight.batch == 2


def test_the_issues_example_meets_its_bound_once_prefills_are_counted():
    """Llama-3-8B, A100, 512 in / 128 out, TPOT <= 25 ms (issue 26).

    Sizing the batch on a decode step alone gave 475 sequences; every step then also carries
    475 / 128 prefills of 512 tokens, and a sequence's tokens come ~110 ms apart."""
    from infer_lab.cache import PUBLISHED

    cfg, gpu, bound = PUBLISHED["Llama-3-8B"].config, GPUS["A100-80GB"], 0.025
    peak, bw = gpu.tflops_16bit * 1e12, gpu.bandwidth_gbs * 1e9

    def decode_only(b):
        return max(step_bytes(cfg, b, 1, 576) / bw, step_flops(cfg, b, 1, 576) / peak)

    old = max(b for b in range(1, 1025) if decode_only(b) <= bound)
    prefill = step_flops(cfg, 1, 512, 0) / peak
    old_gap = decode_only(old) + old / 128 * prefill  # each step's share of prefills, counted
    assert old == 475 and 0.105 < old_gap < 0.115
    r = roofline_rate(cfg, gpu, 512, 128, bound)
    assert r.limit == "tpot" and r.batch < old
    assert r.batch / r.tokens_per_s == pytest.approx(r.step_s) and r.step_s <= bound
    assert steady_step_s(cfg, gpu, r.batch + 1, 512, 128) > bound  # the largest such batch


@pytest.mark.parametrize("chunked", [True, False])
def test_every_operating_point_meets_its_bound_with_prefills_counted(chunked):
    """A property over the package's GPU table, models and request shapes: the time between a
    sequence's tokens, recomputed here from the FLOP and byte counts with the steady state's
    prefills in every step, is within the bound, and one more sequence would break it."""
    from infer_lab.cache import PUBLISHED

    models = [PUBLISHED[name].config for name in ("Llama-3-8B", "Mistral-7B-v0.1", "Qwen2.5-7B",
                                                  "Llama-3-70B")] + [CFG]
    checked = 0
    for gpu in GPUS.values():
        peak, bw = gpu.tflops_16bit * 1e12, gpu.bandwidth_gbs * 1e9
        for cfg in models:
            for prompt, out in ((64, 16), (512, 128), (2048, 256), (128, 1024)):
                for bound in (0.01, 0.025, 0.1):
                    r = roofline_rate(cfg, gpu, prompt, out, bound, chunked_prefill=chunked)
                    if not r.batch:
                        continue
                    b, ctx = r.batch, prompt + out // 2
                    flops = step_flops(cfg, b, 1, ctx) + b / out * step_flops(cfg, 1, prompt, 0)
                    gap = b / r.tokens_per_s  # a sequence gets one token per step
                    assert gap <= bound * (1 + 1e-9), (gpu.name, prompt, out, bound, b, gap)
                    assert gap >= flops / peak * (1 - 1e-9)  # never faster than the arithmetic
                    assert gap >= step_bytes(cfg, b, 1, ctx) / bw * (1 - 1e-9)
                    assert r.requests_per_s * out == pytest.approx(r.tokens_per_s)
                    if r.limit == "tpot":
                        assert steady_step_s(cfg, gpu, b + 1, prompt, out,
                                             chunked_prefill=chunked) > bound
                    checked += 1
    assert checked > 50


def test_chunked_prefill_never_slows_the_steady_step():
    # one step doing both works costs at most the two done apart (max(a+b, c+d) <= max(a, c) +
    # max(b, d)), and less where a bandwidth-bound decode has compute to spare
    from infer_lab.cache import PUBLISHED

    cfg = PUBLISHED["Llama-3-8B"].config
    for gpu in GPUS.values():
        for b in (1, 16, 128):
            both = steady_step_s(cfg, gpu, b, 512, 128)
            apart = steady_step_s(cfg, gpu, b, 512, 128, chunked_prefill=False)
            assert both <= apart * (1 + 1e-12)


def test_roofline_knows_what_does_not_fit():
    llama3_8b = llama_config(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    t4 = roofline_rate(llama3_8b, GPUS["T4"], 64, 16, tpot_bound=0.05)
    assert not t4.fits and t4.tokens_per_s == 0  # 16 GB of bf16 weights in a 16 GiB card
    h100 = roofline_rate(llama3_8b, GPUS["H100-SXM"], 64, 16, tpot_bound=0.05)
    assert h100.fits and h100.tokens_per_s > 1000
    with pytest.raises(ValueError):
        roofline_rate(llama3_8b, GPUS["H100-SXM"], 0, 16, 0.05)


# --- Chapter 7's exercise checks fail on a wrong answer and pass on the worked solution ----------


def chapter7_checks() -> dict:
    """Run the chapter's cell that defines ``check_1`` ... ``check_6`` and return its namespace."""
    import math
    import re
    from pathlib import Path

    from infer_lab.measure import stats
    from infer_lab.measure.loadgen import RequestResult

    text = (Path(__file__).parents[1] / "chapters" / "07_measurement.md").read_text()
    cells = re.findall(r"```\{code-cell\} ipython3\n(.*?)```", text, flags=re.S)
    (source,) = [c for c in cells if "def check_1(" in c]
    ns = {"math": math, "np": np, "stats": stats, "RequestResult": RequestResult,
          "capacity": capacity}
    exec(source, ns)  # noqa: S102 - the chapter's own code, read from the repository
    return ns


def committed_sweep() -> dict:
    import json
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "results" / "serve_sweep.json"
    return json.loads(path.read_text())["sweep"]


def test_chapter7_checks_reject_wrong_answers_and_accept_the_solutions(capsys):
    ns = chapter7_checks()
    sweep = committed_sweep()
    p16 = next(p for p in sweep["points"] if p["load"] == 16)
    little = 16 / p16["metrics"]["request_throughput"]
    strict = capacity(sweep["points"], {"ttft": 0.250, "tpot": 0.100}, 100).replicas or 0
    n_999 = next(n for n in range(9000, 11000) if beyond(n, 99.9) >= 10)
    from infer_lab.measure import stats

    p8 = next(p for p in sweep["points"] if p["load"] == 8)
    sent8 = stats.closed_loop_send_times(np.array(p8["per_request_ms"]["e2el"]) / 1e3, 8)
    ttft8 = np.array(p8["per_request_ms"]["ttft"]) / 1e3
    events = stats.stall_events(ttft8, sent8)
    assert events < beyond(len(ttft8), 99)  # the answer is not the sample count
    cases = [
        ("check_1", (0.075,), (0.70 / 5,)),  # E2EL / tokens is not TPOT
        ("check_2", ("inter_token_latency_ms",), ("time_per_output_token_ms",)),
        ("check_3", (little, sweep), (little * 1.5, sweep)),
        ("check_4", (strict, sweep), (strict + 1, sweep)),
        ("check_5", (n_999,), (n_999 + 1,)),  # enough, but not the least
        ("check_6", (2.50 / 7.2,), (2.50 / 2000,)),
        ("check_7", (events, sweep), (beyond(len(ttft8), 99), sweep)),  # samples, not events
    ]
    for name, right, wrong in cases:
        ns[name](*right)
        with pytest.raises(AssertionError):
            ns[name](*wrong)
    ns["check_1"](None)  # not answered: a reminder, not a failure
    assert "not answered yet" in capsys.readouterr().out


def test_the_guidellm_appendix_quotes_the_committed_result():
    """book/guidellm.md is plain Markdown (it is not executed): every figure in its tables must
    be what benchmarks/results/guidellm_compare.json holds, rounded as printed."""
    import json
    import re
    from pathlib import Path

    root = Path(__file__).parents[1]
    data = json.loads((root / "benchmarks" / "results" / "guidellm_compare.json").read_text())
    page = (root / "book" / "guidellm.md").read_text()
    assert f"guidellm {data['guidellm_version'].split()[-1]}" in page
    assert f"commit {data['commit']}, {data['date'][:10]}" in page
    names = {"TTFT": 0, "TPOT": 1, "E2EL": 2}
    rows = re.findall(r"^\| (\d+) \| (TTFT|TPOT|E2EL) \| [^|]+ \| ([\d.]+) \| ([\d.]+) \| "
                      r"([+-]\d+)% \|$", page, flags=re.M)
    assert len(rows) == 3 * len(data["points"])
    for c, metric, ours, theirs, diff in rows:
        pt = next(p for p in data["points"] if p["concurrency"] == int(c))
        r = pt["rows"][names[metric]]
        assert (ours, theirs) == (f"{r['ours_p50']:.1f}", f"{r['guidellm_p50']:.1f}")
        assert int(diff) == round(100 * r["diff_p50"])
    seen = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \|$", page, flags=re.M)
    assert len(seen) == len(data["points"])
    for c, ours, theirs in seen:
        pt = next(p for p in data["points"] if p["concurrency"] == int(c))
        assert ours == f"{pt['server_mean_ms']['infer_lab']['itl']:.1f}"
        assert theirs == f"{pt['server_mean_ms']['guidellm']['itl']:.1f}"
    n = min(p["guidellm"]["num_requests"] for p in data["points"])
    assert data["workload"]["num_requests"] == 160 and beyond(160, 99) <= 2 and n >= 150
    for pt in data["points"]:  # the counts and the CPU figures the prose quotes
        assert f"{pt['guidellm']['num_requests']} (C = {pt['concurrency']})" in page
    c8 = next(p for p in data["points"] if p["concurrency"] == 8)
    g8 = c8["guidellm"]
    assert (f"{g8['cpu_s']:.1f} s of CPU time in an {g8['wall_s']:.1f} s\ninvocation whose "
            f"measured part lasted {g8['duration_s']:.1f} s") in page
    assert f"averaged {c8['infer_lab']['client_cpu']} of a core" in page
    # the server's own means at C = 8 and the rates the TTFT paragraph reads
    srv = c8["server_mean_ms"]
    gap_rise = srv["guidellm"]["itl"] / srv["infer_lab"]["itl"] - 1
    assert f"mean gap rose by {round(100 * gap_rise)}%" in page
    assert (f"({srv['guidellm']['ttft']:.1f} ms while guidellm ran against "
            f"{srv['infer_lab']['ttft']:.1f} ms while ours did)") in page
    assert srv["guidellm"]["ttft"] < srv["infer_lab"]["ttft"]
    rates = (g8["request_throughput"], c8["infer_lab"]["metrics"]["request_throughput"])
    assert f"completed {rates[0]:.1f} requests/s at a mean gap of " in page
    assert f"ours {rates[1]:.1f} at {srv['infer_lab']['itl']:.1f} ms" in page
    per_step = [r * g / 1e3 for r, g in zip(rates, (srv["guidellm"]["itl"],
                                                  srv["infer_lab"]["itl"]))]
    assert all(f"{x:.2f}" == "0.12" for x in per_step) and "0.12 new prompts" in page
