"""The sampler: a batch whose rows have different settings, sampled in one call."""

from __future__ import annotations

import pytest
import torch

from infer_lab.engine import Sampler, SamplingParams


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(5, 50, generator=gen(0))
    params = [SamplingParams(temperature=0)] * 5
    assert Sampler()(logits, params, [None] * 5) == logits.argmax(-1).tolist()


def test_mixed_batch_respects_each_rows_settings():
    torch.manual_seed(0)
    logits = torch.randn(4, 100) * 3
    logits[3] /= 3  # a flat row: unrestricted sampling visits many tokens
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=3),
              SamplingParams(temperature=1.0, top_p=0.3), SamplingParams(temperature=1.0)]
    top3 = set(logits[1].topk(3).indices.tolist())
    probs = torch.softmax(logits[2], -1)
    sorted_p, order = probs.sort(descending=True)
    nucleus = set(order[: int((sorted_p.cumsum(0) < 0.3).sum()) + 1].tolist())
    sampler = Sampler(gen(1))
    seen = [set() for _ in range(4)]
    for _ in range(300):
        for i, t in enumerate(sampler(logits, params, [None] * 4)):
            seen[i].add(t)
    assert seen[0] == {int(logits[0].argmax())}
    assert seen[1] <= top3 and len(seen[1]) > 1
    assert seen[2] <= nucleus
    assert len(seen[3]) > 10


def test_seeded_row_does_not_depend_on_its_neighbours():
    torch.manual_seed(0)
    row = torch.randn(1, 64)
    p = SamplingParams(temperature=1.0, top_k=20, seed=3)

    def draws(batch_logits, params, gens, index):
        g = gen(3)
        gens = list(gens)
        gens[index] = g
        sampler = Sampler(gen(99))
        return [sampler(batch_logits, params, gens)[index] for _ in range(20)]

    alone = draws(row, [p], [None], 0)
    others = torch.randn(5, 64)
    batch = torch.cat([others[:2], row, others[2:]])
    mixed = [SamplingParams(temperature=0.5, top_p=0.5), SamplingParams(temperature=0),
             p, SamplingParams(temperature=2.0), SamplingParams(temperature=1.0, top_k=2),
             SamplingParams(temperature=1.0)]
    assert draws(batch, mixed, [None, gen(5), None, None, gen(6), None], 2) == alone


def test_sampled_frequencies_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(gen(0))
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[sampler(logits, [SamplingParams(temperature=1.0)], [None])[0]] += 1
    assert torch.allclose(counts / 4000, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)


def test_temperature_sharpens():
    logits = torch.log(torch.tensor([[0.6, 0.4]]))
    sampler = Sampler(gen(0))
    cold = sum(sampler(logits, [SamplingParams(temperature=0.2)], [None])[0] == 0
               for _ in range(1000))
    assert cold > 850  # 0.6^5 / (0.6^5 + 0.4^5) = 0.88


def test_rows_and_params_must_match():
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(2, 5), [SamplingParams()], [None])
