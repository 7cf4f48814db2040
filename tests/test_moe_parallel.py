"""Expert parallelism and tensor-parallel experts across real processes (torchrun, gloo on CPU):
greedy outputs equal one process's, and the bytes the all-to-alls carried add up."""

from __future__ import annotations

import pytest

import infer_lab as il
from infer_lab.model.baselines import generate_cached
from infer_lab.model.config import ModelConfig
from infer_lab.model.expert_parallel import (
    ExpertParallelError,
    check_parallel_size,
    experts_of_rank,
    run_parallel,
    valid_sizes,
)
from infer_lab.model.tensor_parallel import TensorParallelError, check_tp_size
from tests.engine_fixtures import logits_after
from tests.helpers import assert_greedy_equal
from tests.moe_helpers import make_moe_checkpoint

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46], [100, 101], [7] * 9]


def qwen2_moe_config(**changes):
    raw = dict(model_type="qwen2_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=48)
    return ModelConfig.from_dict({**raw, **changes})


def test_sizes_that_do_not_divide_are_refused_with_the_reason():
    cfg = qwen2_moe_config()
    assert valid_sizes(cfg, "ep") == [1, 2, 4, 8]
    with pytest.raises(ExpertParallelError, match=r"expert_parallel_size=3 .*8 experts do not "
                                                  r"divide into 3 ranks.*\[1, 2, 4, 8\]"):
        check_parallel_size(cfg, 3, "ep")
    assert [list(experts_of_rank(cfg, r, 4)) for r in range(4)] == [[0, 1], [2, 3], [4, 5],
                                                                  [6, 7]]
    odd = qwen2_moe_config(moe_intermediate_size=30)
    with pytest.raises(ExpertParallelError, match="30 hidden units do not divide into 4"):
        check_parallel_size(odd, 4, "tp")
    with pytest.raises(TensorParallelError, match="30 hidden units do not divide into 4"):
        check_tp_size(odd, 4)  # the engine's tensor parallelism asks the same question
    dense = ModelConfig.from_dict(dict(model_type="llama", vocab_size=64, hidden_size=32,
                                       intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4))
    with pytest.raises(ExpertParallelError, match="no experts"):
        check_parallel_size(dense, 2, "ep")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ep-qwen2-moe")
    make_moe_checkpoint(path, "qwen2_moe", max_position_embeddings=256)
    return path


def test_bad_run_is_refused_before_any_process_starts(moe_dir):
    with pytest.raises(ExpertParallelError, match="4 experts do not divide into 3"):
        run_parallel(moe_dir, PROMPTS, 3, "ep")
    with pytest.raises(ValueError, match="at least 4 prompts"):
        run_parallel(moe_dir, PROMPTS[:2], 4, "ep")


def test_two_ranks_equal_one_process(moe_dir):
    """Both splits in one launch of two processes (they run one after the other)."""
    model, tok = il.load(moe_dir, device="cpu", dtype="float32")
    ref = [o.token_ids for o in generate_cached(model, tok, PROMPTS, 12, ignore_eos=True)]
    runs = run_parallel(moe_dir, PROMPTS, 2, ("ep", "tp"), max_tokens=12)
    cfg, h = model.config, model.config.hidden_size
    for mode, out in runs.items():
        for p, ours, theirs in zip(PROMPTS, out["tokens"], ref, strict=True):
            assert len(ours) == 12
            assert_greedy_equal(ours, theirs, logits_after(model, p))
        for r in out["ranks"]:
            s = r["stats"]
            assert s["calls"] > 0 and s["tokens"] > 0
            if mode == "ep":  # every (token, expert) pair stayed home or went there and back
                assert (s["rows_local"] + s["rows_remote"] // 2
                        == cfg.num_experts_per_tok * s["tokens"])
                assert s["payload_bytes"] == s["rows_remote"] * h * 4
                assert s["rows_remote"] > 0
            else:  # one all-reduce of the layer's output: 2 (n-1)/n of it per rank
                assert s["payload_bytes"] == s["tokens"] * h * 4


def test_engine_tensor_parallel_splits_the_experts(moe_dir):
    """``LLM(..., tensor_parallel_size=2)`` on an MoE model: the engine's workers split every
    expert and the shared expert by hidden units, with one all-reduce per sparse layer."""
    single = il.LLM(moe_dir, device="cpu", dtype="float32", num_kv_blocks=24, block_size=8)
    params = il.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in single.generate(PROMPTS, params, use_tqdm=False)]
    with il.LLM(moe_dir, device="cpu", dtype="float32", tensor_parallel_size=2,
                num_kv_blocks=24, block_size=8) as llm:
        block = llm.engine.model.layers[1].mlp
        assert type(block).__name__ == "TensorParallelMoeBlock"
        assert block.experts.w13_weight.shape[1] == 2 * 32 // 2  # half of each expert
        ours = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    for p, a, b in zip(PROMPTS, ours, ref, strict=True):
        assert_greedy_equal(a, b, logits_after(single.model, p))
