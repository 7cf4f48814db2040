"""Plain-torch versions of the small ops with the reference's arithmetic in fewer ops.

A decode step of a small model on a CPU is made of a few thousand tiny ops, each costing a few
microseconds of dispatch whatever its size, so an op saved per layer is worth as much as a
faster matmul. These functions compute exactly what :mod:`infer_lab.kernels.reference` computes
(the same values, bit for bit in every dtype; the tests compare them) with fewer ops per step.
"""

from __future__ import annotations

import threading

import torch

from infer_lab.kernels.reference import rope_cos_sin

_last = threading.local()  # the engine thread's last (positions copy, inv_freq, dtype, tables)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``[-sin, sin]`` (halves) of ``positions``, ``[..., 1, D]``: every layer of a
    step rotates by the same positions, so on a CPU all but the first layer reuse the tables.

    The reuse is decided by the positions' *values* (a kept copy compared with ``torch.equal``,
    one op), never by identity: a positions buffer written in place, or a new tensor at a
    recycled address, gets fresh tables. Off the CPU that comparison would be a device sync per
    layer, so there the tables are simply recomputed.
    """
    hit = getattr(_last, "entry", None)
    if (positions.device.type == "cpu" and hit is not None and hit[1] is inv_freq
            and hit[2] == dtype and hit[0].shape == positions.shape
            and torch.equal(hit[0], positions)):
        return hit[3], hit[4]
    cos, sin = rope_cos_sin(positions, inv_freq, dtype)
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    cos, signed = cos.unsqueeze(-2), signed.unsqueeze(-2)
    if positions.device.type == "cpu":
        _last.entry = (positions.clone(), inv_freq, dtype, cos, signed)
    return cos, signed


def rope_torch(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~infer_lab.kernels.reference.rope_ref` in 6 ops a layer instead of about 25.

    ``rotate_half(x) * sin`` is ``cat(-x2, x1) * sin``, which equals ``roll(x, D/2) * [-sin,
    sin]`` term by term (negation is exact), so the halves are swapped by one ``roll`` and the
    sign rides on the cached table.
    """
    cos, signed = rope_tables(positions, inv_freq, q.dtype)
    half = q.shape[-1] // 2
    return (q * cos + q.roll(half, -1) * signed, k * cos + k.roll(half, -1) * signed)
