"""Mixtral, Qwen2-MoE and Qwen3-MoE against transformers on random-weight checkpoints, and the
errors a checkpoint whose experts disagree with its config gets (Chapter 12)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import infer_lab as il
from infer_lab.kernels.moe import select_experts
from infer_lab.model.config import ModelConfig
from infer_lab.model.moe import SparseMoeBlock, moe_blocks
from infer_lab.model.moe_config import MoEConfigError
from tests.helpers import VOCAB, assert_greedy_equal
from tests.moe_helpers import MOE_FAMILIES, make_moe_checkpoint


@pytest.fixture(scope="module", params=sorted(MOE_FAMILIES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_moe_checkpoint(path, request.param)
    return request.param, path, hf


def test_logits_match_transformers(checkpoint):
    family, path, hf = checkpoint
    model, _ = il.load(path, device="cpu")
    assert model.dtype == torch.float32
    # the same layers are sparse as in transformers (decoder_sparse_step, mlp_only_layers)
    ours = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers]
    theirs = ["SparseMoe" in type(layer.mlp).__name__ for layer in hf.model.layers]
    assert ours == theirs and any(ours)
    assert model.config.num_parameters() == sum(p.numel() for p in hf.parameters())
    ids = torch.randint(3, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        got = model(ids)
    assert got.shape == (3, 40, VOCAB)
    assert ref.abs().max() > 1.0, "logits too flat to be a meaningful comparison"
    diff = (got - ref).abs().max().item()
    assert diff <= 1e-4, f"{family}: max |logit difference| {diff:.2e}"


def test_greedy_matches_transformers_generate(checkpoint):
    family, path, hf = checkpoint
    model, tok = il.load(path, device="cpu")
    out = il.generate_naive(model, tok, "In the beginning was the word", max_tokens=30,
                            ignore_eos=True)
    assert len(out.token_ids) == 30
    ids = torch.tensor([out.prompt_token_ids])
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=0)
    ref = ref[0, ids.shape[1]:].tolist()

    def logits_at(prefix: list[int]) -> torch.Tensor:
        return model(torch.tensor([out.prompt_token_ids + prefix]), last_only=True)[0, -1]

    assert_greedy_equal(out.token_ids, ref, logits_at)


def test_routing_matches_transformers_router(checkpoint):
    """Same experts and weights as transformers' router for the same hidden states."""
    family, path, hf = checkpoint
    model, _ = il.load(path, device="cpu")
    ours = moe_blocks(model)[0]
    theirs = hf.model.layers[ours.layer].mlp.gate
    x = torch.randn(50, 64)
    with torch.no_grad():
        _, ref_w, ref_ids = theirs(x)
    w, ids = select_experts(ours.gate(x), ours.top_k, ours.renormalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w.float(), rtol=0, atol=1e-6)
    if family == "qwen2_moe":  # norm_topk_prob false: the chosen weights do not sum to one
        assert (w.sum(-1) < 0.999).any()
    else:
        torch.testing.assert_close(w.sum(-1), torch.ones(50))


def test_transformers5_fused_expert_layout_loads(checkpoint, tmp_path):
    """The same weights stored as transformers 5 keeps them in memory (experts.gate_up_proj
    [E, 2I, H], experts.down_proj [E, H, I]) load to the same logits."""
    family, path, hf = checkpoint
    shutil.copytree(path, tmp_path / "fused")
    file = tmp_path / "fused" / "model.safetensors"
    state = load_file(file)
    fused: dict[str, torch.Tensor] = {}
    per_expert: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        parts = name.split(".")
        if "experts" in parts and "shared_expert" not in parts:
            i = parts.index("experts")
            prefix, e, proj = ".".join(parts[:i + 1]), int(parts[i + 1]), parts[i + 2]
            per_expert.setdefault((prefix, proj), {})[e] = t
        else:
            fused[name] = t
    names = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up",
             "down_proj": "down"}
    by_role: dict[str, dict[str, torch.Tensor]] = {}
    for (prefix, proj), experts in per_expert.items():
        stacked = torch.stack([experts[e] for e in sorted(experts)])
        by_role.setdefault(prefix, {})[names[proj]] = stacked
    for prefix, roles in by_role.items():
        fused[f"{prefix}.gate_up_proj"] = torch.cat([roles["gate"], roles["up"]], dim=1)
        fused[f"{prefix}.down_proj"] = roles["down"]
    save_file(fused, file, metadata={"format": "pt"})
    model, _ = il.load(tmp_path / "fused", device="cpu")
    ids = torch.randint(3, VOCAB, (2, 30))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() <= 1e-4


def test_bf16_load_runs(tmp_path):
    make_moe_checkpoint(tmp_path, "qwen2_moe")
    model, _ = il.load(tmp_path, device="cpu", dtype="bf16")
    logits = model(torch.randint(3, VOCAB, (2, 9)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


# ----------------------------------------------------------------------------- configs
def moe_config(**changes):
    raw = dict(model_type="mixtral", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               num_local_experts=4, num_experts_per_tok=2)
    raw.update(changes)
    return {k: v for k, v in raw.items() if v is not None}


def test_sparse_layers_follow_transformers_rules():
    from transformers import AutoConfig, AutoModelForCausalLM

    for changes in (dict(decoder_sparse_step=2), dict(decoder_sparse_step=3),
                    dict(mlp_only_layers=[0, 2]), dict(decoder_sparse_step=2,
                                                       mlp_only_layers=[3])):
        raw = dict(model_type="qwen2_moe", vocab_size=32, hidden_size=16, intermediate_size=32,
                   num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=2,
                   num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                   shared_expert_intermediate_size=8, **changes)
        cfg = ModelConfig.from_dict(raw)
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw))
        theirs = tuple(i for i, layer in enumerate(hf.model.layers)
                       if "SparseMoe" in type(layer.mlp).__name__)
        assert cfg.moe_layers == theirs, changes


@pytest.mark.parametrize("name, total, active", [
    ("Mixtral-8x7B", 46.7, 12.9), ("Mixtral-8x22B", 141, 39), ("Qwen1.5-MoE-A2.7B", 14.3, 2.7),
    ("Qwen3-30B-A3B", 30.5, 3.3), ("Qwen3-235B-A22B", 235, 22)])
def test_published_parameter_counts(name, total, active):
    """The model cards' figures (billions), from each config.json's fields."""
    from infer_lab.measure.moe import PUBLISHED_MOE

    cfg = PUBLISHED_MOE[name]
    assert cfg.num_parameters() / 1e9 == pytest.approx(total, rel=0.005)
    assert cfg.num_active_parameters() / 1e9 == pytest.approx(active, rel=0.02)


@pytest.mark.parametrize("changes, field", [
    (dict(num_experts_per_tok=5), "num_experts_per_tok=5"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok=0"),
    (dict(num_experts_per_tok=None), "num_experts_per_tok"),
    (dict(num_local_experts=None), "num_local_experts"),
    (dict(num_local_experts=0), "num_local_experts=0"),
    (dict(num_experts_per_tok="2"), "num_experts_per_tok"),
    (dict(model_type="qwen2_moe", num_experts=4, num_local_experts=None,
          moe_intermediate_size=32, decoder_sparse_step=0), "decoder_sparse_step"),
    (dict(model_type="qwen3_moe", num_experts=4, num_local_experts=None,
          moe_intermediate_size=32, mlp_only_layers=[2]), "mlp_only_layers"),
    (dict(model_type="qwen3_moe", num_experts=4, num_local_experts=None), "moe_intermediate_size"),
])
def test_bad_expert_configs_are_refused_naming_the_field(changes, field):
    with pytest.raises(MoEConfigError, match=field):
        ModelConfig.from_dict(moe_config(**changes))


# ----------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral-bad")
    make_moe_checkpoint(path, "mixtral")
    return path


def with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw.update(changes)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("changes, field", [
    (dict(num_local_experts=8), "num_local_experts=8"),  # the router has 4 rows
    (dict(num_local_experts=3), "num_local_experts=3"),  # the checkpoint has expert 3
    (dict(intermediate_size=64), "intermediate_size=64"),  # the experts are 128 wide
])
def test_checkpoint_disagreeing_with_its_config_names_the_field(mixtral_dir, tmp_path, changes,
                                                                field):
    path = with_config(mixtral_dir, tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=field):
        il.load(path, device="cpu")


def test_experts_in_a_layer_the_config_calls_dense(tmp_path):
    make_moe_checkpoint(tmp_path / "ok", "qwen3_moe")  # layer 1 dense, layer 0 sparse
    path = with_config(tmp_path / "ok", tmp_path / "bad", mlp_only_layers=[0, 1])
    with pytest.raises(ValueError, match="mlp_only_layers"):
        il.load(path, device="cpu")


def test_a_missing_expert_is_reported(mixtral_dir, tmp_path):
    shutil.copytree(mixtral_dir, tmp_path / "gap")
    file = tmp_path / "gap" / "model.safetensors"
    state = {k: v for k, v in load_file(file).items() if ".experts.2." not in k}
    save_file(state, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing weights.*experts"):
        il.load(tmp_path / "gap", device="cpu")


# ----------------------------------------------------------------------------- out of scope
def test_quantized_experts_are_refused(mixtral_dir):
    from infer_lab.model.quantize import QuantizationError

    with pytest.raises(QuantizationError, match="mixture-of-experts.*not supported"):
        il.load(mixtral_dir, device="cpu", quantization="int8")


def test_moe_gguf_files_are_refused(tmp_path):
    """llama.cpp writes Mixtral as architecture "llama" with an expert count: refused by name
    before any tensor is read, not loaded as a dense Llama."""
    import gguf

    path = tmp_path / "mixtral.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 2), ("embedding_length", 64), ("feed_forward_length", 128),
                       ("attention.head_count", 4), ("expert_count", 8),
                       ("expert_used_count", 2)):
        w.add_uint32(f"llama.{key}", value)
    w.add_tokenizer_model("gpt2")  # a valid byte-level BPE, so the experts are what fails
    w.add_token_list(["a", "b", "ab"])
    w.add_token_merges(["a b"])
    w.add_tensor("token_embd.weight", torch.zeros(3, 64).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(il.UnsupportedModelError, match="mixture-of-experts GGUF.*8 experts"):
        il.load(path, device="cpu")
