"""The sampler: a batch whose rows have different settings, sampled in one call."""

from __future__ import annotations

import pytest
import torch

from infer_lab.engine import Sampler, SamplingParams
from infer_lab.engine.sampler import apply_penalties


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


def test_penalties_match_a_hand_computed_reference():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5, 0.9],
                           [2.0, -1.0, 0.5, 3.0, -0.5, 0.9]])
    pen = SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5,
                         presence_penalty=0.25)
    plain = SamplingParams(temperature=0)
    prompts, outputs = [[0, 4], [0, 4]], [[3, 3, 1], [3, 3, 1]]
    # Seen (prompt or output): 0, 1, 3, 4. Repetition: positive / 2, negative * 2. Then the
    # output counts: token 3 twice (-2 * 0.5 - 0.25), token 1 once (-0.5 - 0.25).
    expected = torch.tensor([2.0 / 2, -1.0 * 2 - 0.5 - 0.25, 0.5, 3.0 / 2 - 1.0 - 0.25,
                             -0.5 * 2, 0.9])
    got = apply_penalties(logits, [pen, plain], prompts, outputs)
    torch.testing.assert_close(got[0], expected)
    assert torch.equal(got[1], logits[1]) and torch.equal(logits[0, :2], torch.tensor([2.0, -1.0]))
    assert Sampler()(logits, [pen, plain], [None, None], prompts, outputs) == [0, 3]
    with pytest.raises(ValueError, match="penalties"):
        Sampler()(logits, [pen, plain], [None, None])


def test_penalties_apply_before_temperature_and_top_k():
    logits = torch.tensor([[4.0, 3.9, -5.0]])
    p = SamplingParams(temperature=0.7, top_k=1, frequency_penalty=2.0, seed=0)
    g = torch.Generator().manual_seed(0)
    # token 0 was generated once: 4.0 - 2.0 = 2.0 < 3.9, so top-1 is token 1
    assert Sampler()(logits, [p], [g], [[2]], [[0]]) == [1]
