"""The ``ctx`` seam: a flattened ragged batch gives the same logits as separate plain forwards."""

from __future__ import annotations

import pytest
import torch

import infer_lab as il
from infer_lab.model.attention import AttentionContext, causal_attention
from tests.helpers import make_checkpoint


class RaggedNoCache:
    """The simplest backend: sequences laid end to end, each attending causally to itself."""

    def __init__(self, lens: list[int]) -> None:
        self.bounds = torch.tensor([0, *lens]).cumsum(0).tolist()
        self.logits_indices = torch.tensor(self.bounds[1:]) - 1

    def attend(self, layer, q, k, v, window):
        outs = [
            causal_attention(q[None, a:b], k[None, a:b], v[None, a:b], window)[0]
            for a, b in zip(self.bounds, self.bounds[1:], strict=False)
        ]
        return torch.cat(outs)


@pytest.mark.parametrize("family", ["llama3", "mistral_window", "qwen3"])
def test_flattened_batch_matches_separate_forwards(tmp_path, family):
    make_checkpoint(tmp_path, family)
    model, _ = il.load(tmp_path)
    lens = [5, 1, 17, 12]
    seqs = [torch.randint(3, 384, (n,)) for n in lens]
    ctx = RaggedNoCache(lens)
    assert isinstance(ctx, AttentionContext)
    ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(n) for n in lens])
    logits = model(ids, positions, ctx)
    assert logits.shape == (len(lens), 384)  # only the last token of each sequence
    for row, seq in zip(logits, seqs, strict=True):
        torch.testing.assert_close(row, model(seq[None])[0, -1], atol=1e-5, rtol=1e-5)


def test_ctx_without_positions_is_an_error(tmp_path):
    make_checkpoint(tmp_path, "llama3")
    model, _ = il.load(tmp_path)
    with pytest.raises(ValueError, match="positions"):
        model(torch.tensor([5, 6]), None, RaggedNoCache([2]))
