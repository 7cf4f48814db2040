"""The plain-torch fast paths compute the reference's values bit for bit, with fewer ops."""

from __future__ import annotations

import pytest
import torch

from infer_lab.kernels import torch_path
from infer_lab.kernels.reference import rope_ref
from infer_lab.measure.ops import CountOps
from infer_lab.model.config import RopeConfig
from infer_lab.model.rope import rope_inv_freq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7,), (2, 5)])
def test_rope_torch_equals_reference_bit_for_bit(dtype, shape):
    g = torch.Generator().manual_seed(len(shape) + int(dtype.itemsize))
    inv = rope_inv_freq(RopeConfig(theta=10000.0), 64, 2048)
    q = torch.randn(*shape, 9, 64, generator=g).to(dtype)
    k = torch.randn(*shape, 3, 64, generator=g).to(dtype)
    pos = torch.randint(0, 2048, shape, generator=g)
    for got, want in zip(torch_path.rope_torch(q, k, pos, inv), rope_ref(q, k, pos, inv),
                         strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_rope_tables_are_reused_within_a_step_and_never_stale():
    inv = rope_inv_freq(RopeConfig(theta=10000.0), 64, 2048)
    q, k = torch.randn(4, 9, 64), torch.randn(4, 3, 64)
    pos = torch.tensor([3, 4, 5, 6])
    torch_path.rope_torch(q, k, pos, inv)  # the first layer builds the tables
    with CountOps() as later:
        torch_path.rope_torch(q, k, pos, inv)
    with CountOps() as first:
        torch_path.rope_torch(q, k, pos.clone(), inv)
    assert later.n < first.n  # a later layer of the same step skips the tables
    pos.add_(100)  # a positions buffer reused in place: the next step must see new angles
    got = torch_path.rope_torch(q, k, pos, inv)
    for a, b in zip(got, rope_ref(q, k, pos, inv), strict=True):
        assert torch.equal(a, b)
