"""Every exercise's check cell must fail on a wrong answer (and pass on the worked solution).

The check code is taken from the chapter's ``.md`` itself (the source of the notebook), so a
check that drifts into accepting anything fails here. Each chapter's tests are functions named
``test_chNN_*``; the helpers at the top are shared.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import queue
import struct
import threading
from pathlib import Path
from typing import Any

import pytest

import infer_lab as il

CHAPTERS = Path(__file__).resolve().parent.parent / "chapters"


def code_cells(chapter: str) -> list[str]:
    """The sources of the code cells of ``chapters/<chapter>.md``, in order."""
    import jupytext

    nb = jupytext.read(CHAPTERS / f"{chapter}.md")
    return [c.source for c in nb.cells if c.cell_type == "code"]


def cell_with(chapter: str, marker: str) -> str:
    """The one code cell containing ``marker``."""
    found = [c for c in code_cells(chapter) if marker in c]
    assert len(found) == 1, f"{chapter}: {len(found)} cells contain {marker!r}"
    return found[0]


def definitions(source: str) -> str:
    """Only the imports, functions and classes of a cell (not its top-level ``await`` calls)."""
    keep = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    tree = ast.parse(source)
    tree.body = [node for node in tree.body if isinstance(node, keep)]
    return ast.unparse(tree)


def assert_checks(namespace: dict[str, Any], cases: list[tuple[str, Any, list[Any]]],
                  unpack: bool = False) -> None:
    """Each check passes its right answer and raises AssertionError on every wrong one
    (``unpack``: the answers are argument tuples)."""
    def args(answer: Any) -> tuple:
        return tuple(answer) if unpack else (answer,)

    for name, right, wrongs in cases:
        namespace[name](*args(right))
        for wrong in wrongs:
            with pytest.raises(AssertionError):
                namespace[name](*args(wrong))


def run_cells(namespace: dict[str, Any], *sources: str) -> dict[str, Any]:
    for source in sources:
        exec(compile(source, "<chapter cell>", "exec"), namespace)  # noqa: S102
    return namespace


# -------------------------------------------------------------------------------- chapter 6
CH6 = "06_serving"


@pytest.fixture(scope="module")
def ch6() -> dict[str, Any]:
    """The chapter's miniature engine and its check functions, over the bundled model."""
    model, tok = il.load(device="cpu")
    namespace: dict[str, Any] = {
        "asyncio": asyncio, "queue": queue, "threading": threading, "il": il,
        "LLMEngine": il.engine.LLMEngine, "model": model, "tok": tok,
        "PROMPTS": ["And God said,", "In the beginning", "Blessed are the"],
    }
    return run_cells(namespace, cell_with(CH6, "class MiniAsyncEngine"),
                     cell_with(CH6, "def check_1"))


def test_ch06_checks_accept_an_unanswered_exercise(ch6, capsys):
    asyncio.run(ch6["check_1"](None))
    ch6["check_2"](None)
    ch6["check_3"](None)
    assert capsys.readouterr().out.count("replace None") == 3


def test_ch06_exercise_1_check_fails_on_wrong_answers(ch6):
    mini = ch6["MiniAsyncEngine"]

    class ForgetsTheEngine(mini):
        def abort_all(self) -> None:
            self.outputs.clear()  # the engine thread keeps generating for nobody

    class ForgetsTheQueues(mini):
        def abort_all(self) -> None:
            for request_id in list(self.outputs):
                self.submit(lambda r=request_id: self.engine.abort(r))

    for wrong in (ForgetsTheEngine, ForgetsTheQueues):
        with pytest.raises(AssertionError):
            asyncio.run(ch6["check_1"](wrong))
    solution = run_cells(dict(ch6), definitions(cell_with(CH6, "# Solution 1.")))
    asyncio.run(ch6["check_1"](solution["DrainingMini"]))


def test_ch06_exercise_2_check_fails_on_wrong_answers(ch6):
    for wrong in ([401, 200, 200], [200, 401, 200], [401, 401, 401], [401, 401]):
        with pytest.raises(AssertionError):
            ch6["check_2"](wrong)
    solution = run_cells({"httpx": __import__("httpx")},
                         definitions(cell_with(CH6, "# Solution 2.")))
    measured = asyncio.run(solution["statuses_with_key"]())
    ch6["check_2"](measured)  # the solution measures what the check expects


def test_ch06_exercise_3_check_fails_on_wrong_answers(ch6):
    right = 2 * 32 * 8 * 128 * 16 * 2
    for wrong in (right // 2, right * 2, right // 16, 2 * 32 * 32 * 128 * 16 * 2):
        with pytest.raises(AssertionError):
            ch6["check_3"](wrong)
    ch6["check_3"](right)


# -------------------------------------------------------------------------------- chapter 3
CH3 = "03_paged_kv_cache"


@pytest.fixture(scope="module")
def ch3() -> dict[str, Any]:
    """The chapter's check functions, over the long-tail mix and a fresh BlockManager."""
    from infer_lab.cache import BlockManager
    from infer_lab.measure import long_tail_mix
    from infer_lab.utils import cdiv

    namespace: dict[str, Any] = {"BlockManager": BlockManager, "cdiv": cdiv,
                                 "requests": long_tail_mix()}
    return run_cells(namespace, cell_with(CH3, "def check_1"))


def test_ch03_checks_accept_an_unanswered_exercise(ch3, capsys):
    ch3["check_1"](None)
    ch3["check_2"](None)
    ch3["check_3"](None, None)
    ch3["check_4"](None)
    assert capsys.readouterr().out.count("replace None") == 4


def test_ch03_checks_fail_on_wrong_answers_and_pass_the_solutions(ch3):
    from infer_lab.utils import cdiv

    reqs = ch3["requests"]
    peak = sum(cdiv(r.prompt_len + r.output_len - 1, 16) for r in reqs)
    with_last = sum(cdiv(r.prompt_len + r.output_len, 16) for r in reqs)  # counts a token more
    rounded_once = cdiv(sum(r.prompt_len + r.output_len - 1 for r in reqs), 16)
    assert peak not in (with_last, rounded_once)
    cases = [
        ("check_1", (149,), [(9 * 16 + 37,), (2 * 16 + 5,)]),
        ("check_2", (peak,), [(with_last,), (rounded_once,)]),
        ("check_3", (256, 70), [(240, 70), (256, 39), (256, 256)]),  # 39: a partial block shared
        ("check_4", (3,), [(6,), (4,), (0,)]),
    ]
    assert_checks(ch3, cases, unpack=True)


# -------------------------------------------------------------------------------- chapter 5
CH5 = "05_continuous_batching"
CH5B = "05b_prefix_caching_and_cuda_graphs"
CH5_LAUNCHES = 300  # a stand-in for the launches the chapter counts in one decode step


@pytest.fixture(scope="module")
def ch5() -> dict[str, Any]:
    """The chapter's inline schedulers and check functions, without the model."""
    from collections import deque
    from dataclasses import dataclass

    from infer_lab.measure.workloads import long_tail_mix
    from infer_lab.utils import cdiv

    reqs = long_tail_mix(24)[:16]  # the chapter's squeezed run (CPU): 16 of 24 drawn
    namespace: dict[str, Any] = {
        "il": il, "deque": deque, "dataclass": dataclass, "cdiv": cdiv,
        "BATCH": 8, "BUDGET": 64, "LONG": 768,
        "lengths": [(r.prompt_len, r.output_len) for r in reqs],
    }
    return run_cells(namespace, *(definitions(cell_with(CH5, marker)) for marker in (
        "def static_steps", "def mini_schedule", "def check_1")))


@pytest.fixture(scope="module")
def ch5b() -> dict[str, Any]:
    """The second part's block keys, hand-built sequences and check functions, no model."""
    from infer_lab.engine import EngineConfig, KVCacheManager
    from infer_lab.engine.sequence import Request, Sequence

    namespace: dict[str, Any] = {
        "il": il, "Request": Request, "Sequence": Sequence, "KVCacheManager": KVCacheManager,
        "EngineConfig": EngineConfig, "launches": CH5_LAUNCHES,
        "hashlib": hashlib, "struct": struct,
    }
    return run_cells(namespace, *(definitions(cell_with(CH5B, marker)) for marker in (
        "def block_keys", "def sequence(", "def check_1")))


def scheduler_log(lengths: list[tuple[int, int]], budget: int, blocks: int,
                  max_seqs: int) -> list[tuple[list[tuple[int, int]], list[int]]]:
    """The package's ContinuousScheduler driven on ``lengths``, with a stand-in for the forward:
    each step's [(request, tokens)] and the requests it preempted, as the miniature logs them."""
    from infer_lab.engine import EngineConfig, KVCacheManager
    from infer_lab.engine.scheduler import make_scheduler
    from infer_lab.engine.sequence import Request, Sequence, SequenceStatus

    config = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                          num_kv_blocks=blocks, block_size=16, max_model_len=4096,
                          enable_prefix_caching=False)
    kv = KVCacheManager(config)
    scheduler = make_scheduler(config, kv)
    for i, (p, o) in enumerate(lengths):
        params = il.SamplingParams(max_tokens=o, ignore_eos=True)
        request = Request(str(i), None, [3] * p, params, 0.0, frozenset(), forked=True)
        seq = Sequence(i, request, 0, [3] * p, p)
        request.seqs.append(seq)
        scheduler.add(seq)
    log = []
    for _ in range(100_000):
        out = scheduler.schedule()
        if out.is_empty and not out.preempted:
            break
        finished = []
        for seq, n in zip(out.seqs, out.num_new):
            seq.num_computed += n
            if seq.num_computed == seq.num_tokens:
                seq.token_ids.append(4)
                if seq.num_output_tokens >= seq.request.params.max_tokens:
                    seq.status = SequenceStatus.FINISHED
                    finished.append(seq)
        scheduler.finish(finished)
        log.append(([(s.seq_id, n) for s, n in zip(out.seqs, out.num_new)],
                    [s.seq_id for s in out.preempted]))
    return log


@pytest.mark.parametrize(("budget", "blocks"), [(64, 40), (128, 48), (2048, 40), (32, 200)])
def test_ch05_mini_scheduler_decides_what_the_package_scheduler_decides(ch5, budget, blocks):
    lengths = ch5["lengths"]
    mine = ch5["mini_schedule"](lengths, budget, blocks, max_seqs=8)
    theirs = scheduler_log(lengths, budget, blocks, max_seqs=8)
    assert mine == theirs
    if (budget, blocks) == (64, 40):  # the chapter's squeezed run: both mechanisms happen
        assert any(p for _, p in mine)
        assert any(n > 1 for work, _ in mine[5:] for _, n in work)


def test_ch05b_block_keys_are_the_kv_managers_keys(ch5b):
    seq = ch5b["sequence"](0, list(range(37)))
    kv = ch5b["KVCacheManager"](ch5b["EngineConfig"](num_kv_blocks=8, block_size=8))
    kv.allocate_slots(seq, 37)
    seq.num_computed = 37
    kv.cache_blocks(seq)
    assert ch5b["block_keys"](list(range(37)), 8) == seq.block_keys
    assert len(seq.block_keys) == 4
    other = ch5b["block_keys"]([99] * 8 + list(range(8, 16)), 8)  # block 2's tokens, new start
    assert other[1] != seq.block_keys[1]
    assert len(set(other + seq.block_keys)) == 6  # no key repeats across the two prompts


def test_ch05_exercise_2_answer_is_the_package_schedulers_too(ch5):
    """Exercise 2 is answered with the miniature: at its answer (no preemption) and 8 blocks
    fewer (some), the package's scheduler must decide the same, step for step."""
    lengths, blocks = ch5["lengths"], 8
    while ch5["mini_preemptions"](blocks) > 0:
        blocks += 8
    for pool in (blocks, blocks - 8):
        mine = ch5["mini_schedule"](lengths, 64, pool, max_seqs=8)
        assert mine == scheduler_log(lengths, 64, pool, max_seqs=8), pool
        assert any(p for _, p in mine) == (pool < blocks)


def test_ch05_checks_accept_an_unanswered_exercise(ch5, ch5b, capsys):
    for k in range(1, 4):
        ch5[f"check_{k}"](None)
    for k in range(1, 3):
        ch5b[f"check_{k}"](None)
    assert capsys.readouterr().out.count("replace None") == 5


def test_ch05_checks_fail_on_wrong_answers_and_pass_the_solutions(ch5):
    right_blocks = 8
    while ch5["mini_preemptions"](right_blocks) > 0:
        right_blocks += 8
    cases = [
        ("check_1", [30] * 16, ([30] + [1] * 7) * 2),
        ("check_1", [5] * 8 + [9] * 8, [30] + [1] * 15),
        ("check_2", right_blocks, right_blocks + 8),  # no preemption, but not the least
        ("check_2", right_blocks, right_blocks - 8),
        ("check_3", 7, 6),  # ceil(768 / 124), not 768 / 128
    ]
    for name, right, wrong in cases:
        ch5[name](right)
        with pytest.raises(AssertionError):
            ch5[name](wrong)


def test_ch05b_checks_fail_on_wrong_answers_and_pass_the_solutions(ch5b):
    cases = [
        ("check_1", 2, [3, 0]),  # the last token is always computed
        ("check_2", CH5_LAUNCHES * 4e-3, [CH5_LAUNCHES * 4e-6]),  # in ms, not s
    ]
    assert_checks(ch5b, cases)
    run_cells(dict(ch5b), *(cell_with(CH5B, f"# Solution {k}.") for k in (1, 2)))


# -------------------------------------------------------------------------------- chapter 1
CH1 = "01_where_the_time_goes"


def assignment(source: str, name: str) -> str:
    """Only the top-level statement of a cell that assigns ``name``."""
    tree = ast.parse(source)
    tree.body = [node for node in tree.body if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)]
    assert len(tree.body) == 1, f"{len(tree.body)} assignments to {name}"
    return ast.unparse(tree)


@pytest.fixture(scope="module")
def ch1() -> dict[str, Any]:
    """The chapter's checks, with its Llama-3-8B config and SmolLM2's (read from the file's
    metadata: the checks count, they never run the model)."""
    from infer_lab.measure import GPUS, step_bytes, step_flops
    from infer_lab.model.gguf import read_gguf_config
    from infer_lab.model.registry import fetch

    namespace: dict[str, Any] = {
        "il": il, "GPUS": GPUS, "step_flops": step_flops, "step_bytes": step_bytes,
        "big_cfg": read_gguf_config(fetch("smollm2-135m-instruct")),
    }
    run_cells(namespace, assignment(cell_with(CH1, "llama3_8b = il.ModelConfig"), "llama3_8b"))
    return run_cells(namespace, cell_with(CH1, "def check_1"))


def test_ch01_checks_accept_an_unanswered_exercise(ch1, capsys):
    for k in (1, 2, 3):
        ch1[f"check_{k}"](None)
    assert capsys.readouterr().out.count("replace None") == 3


def test_ch01_checks_fail_on_wrong_answers_and_pass_the_solutions(ch1, capsys):
    from infer_lab.measure import GPUS

    solutions = run_cells(dict(ch1), *(definitions(cell_with(CH1, f"# Solution {k}."))
                                       for k in (1, 2, 3)))
    batch = solutions["saturating_batch"](ch1["llama3_8b"], GPUS["H100-SXM"])
    intensity = solutions["decode_intensity_16bit"](ch1["big_cfg"])
    kv = solutions["kv_read_bytes"](ch1["llama3_8b"], 32, 8192)
    assert 250 < batch < 350  # near the H100's ridge point (~295 FLOP/byte)
    assert 0.9 < intensity < 1.1  # about one FLOP per 16-bit byte
    assert kv == 32 * 2**30  # 32 GiB of cache for 32 sequences of 8192 tokens
    cases = [
        ("check_1", batch, [1, batch // 2, batch * 2]),  # batch // 2: 4 bytes per weight
        ("check_2", intensity, [intensity / 2, 2 * intensity]),  # fp32, 1 byte per weight
        ("check_3", kv, [kv // 2, kv // 32, kv * 2]),  # K only, one sequence, fp32
    ]
    assert_checks(ch1, cases)
    assert capsys.readouterr().out.count("right") == 3


# -------------------------------------------------------------------------------- chapter 8
CH8 = "08_quantization"


@pytest.fixture(scope="module")
def ch8() -> dict[str, Any]:
    """The chapter's checks, with the bundled model in fp32 (exercise 2 measures its weight)."""
    import torch

    from infer_lab.cache import PUBLISHED
    from infer_lab.model.quantize import dequantize_int4, quantize_int4

    tiny, _ = il.load(device="cpu", dtype=torch.float32)
    namespace: dict[str, Any] = {
        "torch": torch, "tiny": tiny, "PUBLISHED": PUBLISHED,
        "quantize_int4": quantize_int4, "dequantize_int4": dequantize_int4,
    }
    return run_cells(namespace, cell_with(CH8, "def check_1"))


def test_ch08_checks_accept_an_unanswered_exercise(ch8, capsys):
    for k in (1, 2, 3):
        ch8[f"check_{k}"](None)
    assert capsys.readouterr().out.count("replace None") == 3


def test_ch08_checks_fail_on_wrong_answers_and_pass_the_solutions(ch8, capsys):
    solutions = run_cells(dict(ch8), *(cell_with(CH8, f"# Solution {k}.") for k in (1, 2, 3)))
    assert capsys.readouterr().out.count("right") == 3  # each solution cell runs its check
    ratio = solutions["symmetric_over_asymmetric"](ch8["tiny"].layers[0].mlp.down_proj.weight)
    kv = solutions["int4_kv_bytes_per_token"](solutions["PUBLISHED"]["Llama-3-8B"].config)
    assert 1.05 < ratio < 2  # asymmetric int4 errs less: 16 levels on [min, max], not 15 on ±max
    assert kv == 2 * 32 * 8 * (128 / 2 + 2)  # Llama-3-8B: 32 layers, 8 KV heads, head_dim 128
    cases = [  # the wrong answers: codes only, one fp16 per group, groups of 32 ...
        ("check_1", 4.5, [4, 4.25, 4 + 32 / 32]),
        ("check_2", ratio, [1.0, 1 / ratio, ratio**2]),  # ... equal, inverted, the MSE ratio
        ("check_3", kv, [kv / 2, 2 * 32 * 8 * 64, 2 * 32 * 8 * (128 + 2)]),  # K only, no scale,
    ]  # int8 codes
    assert_checks(ch8, cases)
    assert capsys.readouterr().out.count("right") == 3


# -------------------------------------------------------------------------------- chapter 8b
CH8B = "08b_quantization_formats"


@pytest.fixture(scope="module")
def ch8b() -> dict[str, Any]:
    """Chapter 8b's checks: they need only the standard library."""
    import math

    import torch

    return run_cells({"math": math, "torch": torch}, cell_with(CH8B, "def check_1"))


def test_ch08b_checks_accept_an_unanswered_exercise(ch8b, capsys):
    for k in (1, 2, 3):
        ch8b[f"check_{k}"](None)
    assert capsys.readouterr().out.count("replace None") == 3


def test_ch08b_checks_fail_on_wrong_answers_and_pass_the_solutions(ch8b, capsys):
    import torch

    solutions = run_cells(dict(ch8b), *(cell_with(CH8B, f"# Solution {k}.") for k in (1, 2, 3)))
    assert capsys.readouterr().out.count("right") == 3  # each solution cell runs its check
    code = solutions["mx_scale_code"](0.3)
    nbytes = solutions["nvfp4_bytes"](4096, 14336)
    # independent statements of the answers: torch's E4M3 and E8M0, the layout's arithmetic
    value = torch.tensor([0x5A], dtype=torch.uint8).view(torch.float8_e4m3fn).item()
    assert value == 20.0
    assert torch.tensor([code], dtype=torch.uint8).view(torch.float8_e8m0fnu).item() == 2.0**-4
    assert nbytes == 4096 * 14336 * 4.5 / 8 + 4
    cases = [  # wrong answers: the exponent alone, the bits read as an integer, ...
        ("check_1", value, [16.0, 90.0, 10.0, 2.5]),
        ("check_2", code, [-4, 125, 124, 127]),  # ... the exponent not the code, emax forgotten,
        ("check_3", nbytes, [4096 * 14336 // 2, nbytes - 4, 4096 * 14336 // 2 + 4096 * 448 + 4]),
    ]  # rounded up, 2^0; codes only, no tensor scale, MX blocks of 32
    assert_checks(ch8b, cases)
    assert capsys.readouterr().out.count("right") == 3



# -------------------------------------------------------------------------------- chapter 2
CH2 = "02_kv_cache"


@pytest.fixture(scope="module")
def ch2() -> dict[str, Any]:
    """The chapter's SimpleKVCache, its cached loop and the check functions."""
    import torch
    import torch.nn.functional as F

    from infer_lab.cache import PUBLISHED, kv_bytes_per_token, model_kv_cache_bytes, plan_memory
    from infer_lab.measure import GPUS
    from infer_lab.model.generate import stream_naive

    namespace: dict[str, Any] = {
        "torch": torch, "F": F, "PUBLISHED": PUBLISHED, "GPUS": GPUS,
        "kv_bytes_per_token": kv_bytes_per_token, "model_kv_cache_bytes": model_kv_cache_bytes,
        "plan_memory": plan_memory, "stream_naive": stream_naive,
    }
    return run_cells(namespace, cell_with(CH2, "class SimpleKVCache"),
                     cell_with(CH2, "def stream_cached"), cell_with(CH2, "def check_1"))


def test_ch02_checks_accept_an_unanswered_exercise(ch2, capsys):
    for n in (1, 2, 3, 4):
        ch2[f"check_{n}"](None)
    assert capsys.readouterr().out.count("replace None") == 4


def test_ch02_checks_fail_on_wrong_answers_and_pass_the_solutions(ch2):
    from infer_lab.cache import PUBLISHED, kv_bytes_per_token, plan_memory
    from infer_lab.measure import GPUS

    gib = 2 * 28 * 4 * 128 * 32768 * 8 * 2 / 2**30
    c = PUBLISHED["Llama-2-7B"].config
    tokens = c.num_parameters() * 2 / kv_bytes_per_token(c, 2)
    h200 = PUBLISHED["Llama-3-70B"].config
    batch = plan_memory(int(GPUS["H200-SXM"].memory_gb * 2**30), h200, 0.5, 1).max_batch(8192)
    decimal = plan_memory(int(GPUS["H200-SXM"].memory_gb * 1e9), h200, 0.5, 1).max_batch(8192)
    assert decimal != batch  # GB read as 10^9 bytes gives a different (wrong) answer
    cases = [
        ("check_1", gib, [gib / 2, gib * 2, gib * 1e9 / 2**30]),  # one K/V, fp32, decimal GB
        ("check_2", tokens, [tokens / 2, tokens * 2]),
        ("check_3", batch, [decimal, batch * 2, batch + 1]),
    ]
    assert_checks(ch2, cases)
    for marker in ("# Solution 1.", "# Solution 2.", "# Solution 3."):
        run_cells(dict(ch2), cell_with(CH2, marker))  # each solution passes its check


def test_ch02_exercise_4_check_fails_on_a_cache_that_ignores_the_window(ch2):
    with pytest.raises(AssertionError):
        ch2["check_4"](ch2["SimpleKVCache"])  # full attention: the window of 8 is ignored

    solution = run_cells(dict(ch2), cell_with(CH2, "# Solution 4."))  # runs check_4 itself

    class OffByOne(solution["WindowedKVCache"]):
        def attend(self, layer, q, k, v, window):
            return super().attend(layer, q, k, v, None if window is None else window + 1)

    with pytest.raises(AssertionError):
        ch2["check_4"](OffByOne)


# -------------------------------------------------------------------------------- chapter 4
CH4 = "04_gpu_kernels"


@pytest.fixture(scope="module")
def ch4() -> dict[str, Any]:
    """The chapter's check functions (pure torch: no kernel runs)."""
    import math

    import torch

    return run_cells({"math": math, "torch": torch}, cell_with(CH4, "def check_1"))


def test_ch04_checks_accept_an_unanswered_exercise(ch4, capsys):
    for n in (1, 2, 3):
        ch4[f"check_{n}"](None)
    assert capsys.readouterr().out.count("replace None") == 3


def test_ch04_checks_fail_on_wrong_answers_and_pass_the_solutions(ch4, capsys):
    import torch

    assert_checks(ch4, [
        ("check_1", 5 / 3, [2.0, 1.5, 7 / 3]),  # 2: fused reads x twice; 7/3: eager reads 2n twice
        ("check_3", 33, [32, 66, 64, 17]),  # 32 leaves programs short; 66, 64: auto_splits' aim
    ])

    def no_rescale(a, b):  # adds the parts as if they shared a maximum
        return torch.maximum(a[0], b[0]), a[1] + b[1], a[2] + b[2]

    def first_max(a, b):  # rescales, but keeps the first part's maximum
        wb = torch.exp(b[0] - a[0])
        return a[0], a[1] + b[1] * wb, a[2] + b[2] * wb

    for wrong in (no_rescale, first_max):
        with pytest.raises(AssertionError):
            ch4["check_2"](wrong)
    capsys.readouterr()
    for marker in ("# Solution 1.", "# Solution 2.", "# Solution 3."):
        run_cells(dict(ch4), cell_with(CH4, marker))
    assert capsys.readouterr().out.count("right") == 3  # each solution passes its check


# -------------------------------------------------------------------------------- chapter 9
CH9 = "09_speculative_decoding"


@pytest.fixture(scope="module")
def ch9() -> dict[str, Any]:
    """The chapter's checks, its ``expected_tokens`` and ``prompt_lookup`` (no model needed)."""
    import torch

    namespace: dict[str, Any] = {"torch": torch}
    run_cells(namespace, definitions(cell_with(CH9, "def expected_tokens")))
    run_cells(namespace, definitions(cell_with(CH9, "def prompt_lookup")))
    return run_cells(namespace, cell_with(CH9, "def check_1"))


def test_ch09_checks_accept_an_unanswered_exercise(ch9, capsys):
    for k in (1, 2, 3):
        ch9[f"check_{k}"](None)
    assert capsys.readouterr().out.count("replace None") == 3


def test_ch09_checks_fail_on_wrong_answers_and_pass_the_solutions(ch9, capsys):
    run_cells(dict(ch9), *(cell_with(CH9, f"# Solution {k}.") for k in (1, 2, 3)))
    assert capsys.readouterr().out.count("right") == 3  # each solution cell runs its check
    cases = [  # wrong: guesses only (no own token), k + 1 tokens, alpha * k + 1 ...
        ("check_1", (1 - 0.6**5) / 0.4, [0.6 * (1 - 0.6**4) / 0.4, 5, 0.6 * 4 + 1]),
        # ... the first occurrence's tail, the lookup with n = 1, the tail itself
        ("check_2", [1, 5, 9], [[5, 9, 2], [1, 5, 9, 2], [1, 4]]),
        # ... sum of max(p, q), the product of the kept mass, sum of p * q
        ("check_3", 0.6, [1.4, 0.2 * 0.3 * 0.1, 0.6 * 0.2 + 0.3 * 0.5 + 0.1 * 0.3]),
    ]
    assert_checks(ch9, cases)
    assert capsys.readouterr().out.count("right") == 3


# -------------------------------------------------------------------------------- chapter 9b
CH9B = "09b_eagle_and_draft_trees"


@pytest.fixture(scope="module")
def ch9b() -> dict[str, Any]:
    """The chapter's checks (no model needed: the solutions use the package's tree and head)."""
    import numpy as np
    import torch

    from infer_lab.engine.draft_tree import DraftTree
    from infer_lab.model.eagle_head import EagleHead

    namespace: dict[str, Any] = {"torch": torch, "np": np, "il": il, "DraftTree": DraftTree,
                                 "EagleHead": EagleHead}
    return run_cells(namespace, cell_with(CH9B, "def check_1"))


def test_ch09b_checks_accept_an_unanswered_exercise(ch9b, capsys):
    for k in (1, 2, 3):
        ch9b[f"check_{k}"](None)
    assert capsys.readouterr().out.count("replace None") == 3


def test_ch09b_checks_fail_on_wrong_answers_and_pass_the_solutions(ch9b, capsys):
    run_cells(dict(ch9b), *(cell_with(CH9B, f"# Solution {k}.") for k in (1, 2, 3)))
    assert capsys.readouterr().out.count("right") == 3  # each solution cell runs its check
    h, kv, mlp = 576, 192, 1536
    head = (2 * h * h + h) + (2 * h * h + 2 * h * kv) + 3 * h * mlp + 2 * h
    speedup = (1 - 0.7**5) / (0.3 * 1.4)
    cases = [  # wrong: the sibling's branch, without itself, every node up to it ...
        ("check_1", [0, 2, 4], [[1, 3, 4], [0, 2], [0, 1, 2, 3, 4]]),
        # ... the tokens alone (no cost), the cost forgotten for the bonus token, k c alone
        ("check_2", speedup, [speedup * 1.4, (1 - 0.7**4) / 0.3 / 1.4, speedup * 1.4 / 0.4]),
        # ... without fc's bias, k and v as wide as q, without the MLP's third matrix
        ("check_3", head, [head - h, head + 2 * h * (h - kv), head - h * mlp]),
    ]
    assert_checks(ch9b, cases)
    assert capsys.readouterr().out.count("right") == 3


# -------------------------------------------------------------------------------- chapter 11
CH11 = "11_structured_output"


@pytest.fixture(scope="module")
def ch11() -> dict[str, Any]:
    """The chapter's checks and its ``run``, over the bundled model (exercises 2 and 3
    constrain it with the reader's schema and regex)."""
    import json
    import re

    import jsonschema

    from infer_lab.engine import LLMEngine, SamplingParams
    from infer_lab.engine.structured import StructuredOutputsParams

    small, small_tok = il.load(device="cpu")
    namespace: dict[str, Any] = {
        "il": il, "json": json, "re": re, "jsonschema": jsonschema, "LLMEngine": LLMEngine,
        "SamplingParams": SamplingParams, "StructuredOutputsParams": StructuredOutputsParams,
        "small": small, "small_tok": small_tok, "V": 49152,  # SmolLM2's vocabulary
    }
    run_cells(namespace, definitions(cell_with(CH11, "def run(")))
    return run_cells(namespace, cell_with(CH11, "def check_1"))


def test_ch11_checks_accept_an_unanswered_exercise(ch11, capsys):
    for k in (1, 2, 3):
        ch11[f"check_{k}"](None)
    assert capsys.readouterr().out.count("replace None") == 3


def test_ch11_checks_fail_on_wrong_answers_and_pass_the_solutions(ch11, capsys):
    solutions = run_cells(dict(ch11), *(cell_with(CH11, f"# Solution {k}.") for k in (1, 2, 3)))
    assert capsys.readouterr().out.count("right") == 3  # each solution cell runs its check
    schema = solutions["verdict_schema"]
    props = schema["properties"]
    open_schema = {k: v for k, v in schema.items() if k != "additionalProperties"}
    cases = [  # wrong: a byte (a bool) per token, words not bytes, a float per token
        ("check_1", 6144, [49152, 1536, 49152 * 4]),
        ("check_2", schema, [
            open_schema,  # a "fine" field gets through
            {**schema, "required": ["verdict"]},  # years optional
            {**schema, "properties": {**props, "years": {"type": "integer", "minimum": 0}}},
            {**schema, "properties": {**props, "years": {"type": "number", "minimum": 0,
                                                         "maximum": 99}}},  # 2.5 years
            {**schema, "properties": {**props, "verdict": {"type": "string"}}},  # "maybe"
        ]),
        ("check_3", r"([01][0-9]|2[0-3]):[0-5][0-9]", [
            r"\d\d:\d\d",  # 24:00
            r"[0-2][0-9]:[0-5][0-9]",  # 29:00
            r"([01]?[0-9]|2[0-3]):[0-5][0-9]",  # 9:05
            r"([01][0-9]|2[0-3]):[0-5][0-9]+",  # 12:300
        ]),
    ]
    assert_checks(ch11, cases)
    assert capsys.readouterr().out.count("right") == 3


# -------------------------------------------------------------------------------- chapter 12
CH12 = "12_mixture_of_experts"


@pytest.fixture(scope="module")
def ch12() -> dict[str, Any]:
    """The chapter's checks and its inline router, expert loop and grouped computation."""
    import torch
    import torch.nn.functional as F

    from infer_lab.measure import moe as mm

    namespace: dict[str, Any] = {"torch": torch, "F": F, "mm": mm}
    for marker in ("def route(", "def moe_loop(", "def moe_grouped("):
        run_cells(namespace, definitions(cell_with(CH12, marker)))
    return run_cells(namespace, cell_with(CH12, "def check_1"))


def test_ch12_inline_moe_equals_the_package(ch12):
    import torch

    from infer_lab.kernels.moe import moe_naive, select_experts

    gen = torch.Generator().manual_seed(12)
    x, router = torch.randn(37, 24, generator=gen), torch.randn(6, 24, generator=gen)
    w13, w2 = torch.randn(6, 32, 24, generator=gen), torch.randn(6, 24, 16, generator=gen)
    for renormalize in (True, False):
        w, e = ch12["route"](x, router, 2, renormalize)
        w_pkg, e_pkg = select_experts(x @ router.T, 2, renormalize)
        assert torch.equal(e, e_pkg) and torch.allclose(w, w_pkg)
    ref = moe_naive(x, w13, w2, w, e)
    torch.testing.assert_close(ch12["moe_loop"](x, w13, w2, w, e), ref)
    torch.testing.assert_close(ch12["moe_grouped"](x, w13, w2, w, e), ref)


def test_ch12_checks_accept_an_unanswered_exercise(ch12, capsys):
    for k in (1, 2, 3):
        ch12[f"check_{k}"](None)
    assert capsys.readouterr().out.count("replace None") == 3


def test_ch12_checks_fail_on_wrong_answers_and_pass_the_solutions(ch12, capsys):
    run_cells(dict(ch12), *(cell_with(CH12, f"# Solution {k}.") for k in (1, 2, 3)))
    assert capsys.readouterr().out.count("right") == 3  # each solution cell runs its check
    per_expert = 3 * 2048 * 768
    cases = [  # wrong: one layer only, every expert, two matrices per expert
        ("check_1", 48 * 8 * per_expert, [8 * per_expert, 48 * 128 * per_expert,
                                          48 * 8 * 2 * 2048 * 768]),
        # ... B k picks as if all distinct, k (batch 1), every expert
        ("check_2", 256 * (1 - (1 - 8 / 256) ** 32), [8 * 32, 8, 256]),
        # ... every pair remote, one way only, fp32
        ("check_3", 2 * 8 * 4096 * 2 * 7 / 8, [2 * 8 * 4096 * 2, 8 * 4096 * 2 * 7 / 8,
                                               2 * 8 * 4096 * 4 * 7 / 8]),
    ]
    assert_checks(ch12, cases)
    assert capsys.readouterr().out.count("right") == 3


# -------------------------------------------------------------------------------- chapter 13
CH13 = "13_moving_the_kv_cache"


@pytest.fixture(scope="module")
def ch13() -> dict[str, Any]:
    """The chapter's checks and its inline tier."""
    import hashlib

    from infer_lab.cache.kv_tier import read_block

    namespace: dict[str, Any] = {"hashlib": hashlib, "read_block": read_block}
    run_cells(namespace, definitions(cell_with(CH13, "class DictTier")))
    return run_cells(namespace, cell_with(CH13, "def check_1"))


def test_ch13_inline_tier_holds_what_the_package_tier_writes(ch13, tmp_path):
    from infer_lab.engine import LLMEngine, SamplingParams
    from infer_lab.engine.kv_connector import attach_kv_tier, prompt_keys

    model, tok = il.load(device="cpu")
    engine = LLMEngine(model, tok, num_kv_blocks=6, block_size=16)
    mine = ch13["DictTier"](engine.runner.cache)
    tier = attach_kv_tier(engine, tmp_path, 1 << 24)
    offload = tier.offload
    engine.kv.pool.on_evict = lambda b, k: (mine.offload(b, k), offload(b, k))
    prompts = [list(range(5 + i, 53 + i)) for i in range(4)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=2, temperature=0.0))
        while engine.has_unfinished_requests():
            engine.step()
    keys = prompt_keys(engine, prompts[0])
    assert keys and all(mine.get(k) == tier.store.get(k) is not None for k in keys)
    key = keys[0]
    mine.blobs[key] = mine.blobs[key][:-1] + bytes([mine.blobs[key][-1] ^ 1])
    assert mine.get(key) is None  # a flipped bit is a miss


def test_ch13_checks_accept_an_unanswered_exercise(ch13, capsys):
    for k in (1, 2, 3):
        ch13[f"check_{k}"](None)
    assert capsys.readouterr().out.count("replace None") == 3


def test_ch13_checks_fail_on_wrong_answers_and_pass_the_solutions(ch13, capsys):
    run_cells(dict(ch13), *(cell_with(CH13, f"# Solution {k}.") for k in (1, 2, 3)))
    assert capsys.readouterr().out.count("right") == 3
    per_token = 2 * 30 * 3 * 64 * 4
    cases = [  # wrong: K only, bf16, query heads (9) instead of KV heads
        ("check_1", per_token, [per_token // 2, per_token // 2, 2 * 30 * 9 * 64 * 4]),
        # ... full blocks only, the tokens' bytes without the partial block's empty slots,
        # the last token's K/V sent too (the same 7 blocks here: its bytes, not its block)
        ("check_2", 7 * 16 * per_token, [6 * 16 * per_token, 99 * per_token,
                                         100 * per_token]),
        # ... forgot the fixed cost, one token's bytes, the read time itself
        ("check_3", 1000 - (20 + 16 * per_token / 2e9 * 1e6),
         [1000 - 16 * per_token / 2e9 * 1e6, 1000 - (20 + per_token / 2e9 * 1e6),
          20 + 16 * per_token / 2e9 * 1e6]),
    ]
    assert_checks(ch13, cases)
    assert capsys.readouterr().out.count("right") == 3
