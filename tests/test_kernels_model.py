"""The whole model on the Triton kernels (interpreted on CPU) generates the same greedy tokens as
on the torch references, through the paged cache: prefill, then decode steps."""

from __future__ import annotations

import pytest
import torch

import infer_lab as il
from infer_lab import kernels
from infer_lab.cache import generate_paged
from tests.helpers import assert_greedy_equal, make_checkpoint

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="Triton is not installed")

PROMPTS = ["In the beginning", "Prefill is compute-bound; decode is memory-bandwidth-bound."]


# llama3: RoPE scaling and tied embeddings; mistral: a sliding window shorter than the prompt;
# qwen3: q/k norms on heads split out of the qkv projection.
@pytest.mark.parametrize("family", ["llama3", "mistral_window", "qwen3"])
def test_greedy_generation_triton_equals_torch(tmp_path, family):
    make_checkpoint(tmp_path, family)
    model, tok = il.load(tmp_path, device="cpu", dtype=torch.float32)
    runs = {}
    for backend in ("torch", "triton"):
        with kernels.use_backend(backend):
            runs[backend] = generate_paged(model, tok, PROMPTS, max_tokens=4, block_size=4,
                                           ignore_eos=True)

    def logits_at(prompt_ids, generated):
        ids = torch.tensor([list(prompt_ids) + generated])
        with torch.inference_mode(), kernels.use_backend("torch"):
            return model(ids)[0, -1]

    for ours, ref in zip(runs["triton"], runs["torch"], strict=True):
        assert len(ours.token_ids) == 4
        assert_greedy_equal(ours.token_ids, ref.token_ids,
                            lambda gen, p=ref.prompt_token_ids: logits_at(p, gen))
