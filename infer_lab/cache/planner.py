"""How much KV cache fits on a GPU: what is left after the weights, in tokens.

Serving capacity is set by this subtraction. The weights are a fixed cost; what remains (less a
reserve for activations, the CUDA context and fragmentation, as vLLM's ``gpu_memory_utilization``
leaves) is the KV budget, and every token of every running sequence spends
``kv_bytes_per_token`` of it. So batch × context is fixed: more of one means less of the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from infer_lab.cache.sizing import kv_bytes_per_token
from infer_lab.model.config import ModelConfig


@dataclass(frozen=True)
class MemoryPlan:
    """The split of one GPU's memory between weights, reserve and KV cache."""

    gpu_memory_bytes: int
    reserve_bytes: int
    weight_bytes: int
    kv_budget_bytes: int
    kv_bytes_per_token: int

    @property
    def max_tokens(self) -> int:
        """Tokens (summed over all sequences) whose K and V fit in the budget."""
        return self.kv_budget_bytes // self.kv_bytes_per_token

    def max_batch(self, context_len: int) -> int:
        """Sequences of ``context_len`` tokens that fit at once."""
        _positive("context_len", context_len)
        return self.max_tokens // context_len

    def max_context(self, batch: int) -> int:
        """Longest context each of ``batch`` sequences can have (memory only: the model's own
        context limit is a separate cap)."""
        _positive("batch", batch)
        return self.max_tokens // batch

    def num_blocks(self, block_size: int = 16) -> int:
        """Paged-cache blocks of ``block_size`` tokens that fit in the budget."""
        _positive("block_size", block_size)
        return self.max_tokens // block_size


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")


def plan_memory(
    gpu_memory_bytes: int,
    cfg: ModelConfig,
    weight_dtype_bytes: float = 2,
    kv_dtype_bytes: int = 2,
    reserve_fraction: float = 0.1,
    reserve_bytes: int | None = None,
) -> MemoryPlan:
    """Split ``gpu_memory_bytes`` into weights, a reserve and the KV budget.

    The reserve is ``reserve_bytes`` when given, else ``reserve_fraction`` of the GPU.
    ``weight_dtype_bytes`` may be fractional (0.5 for 4-bit weights). Raises ``ValueError`` when
    the weights and the reserve alone do not fit.
    """
    _positive("gpu_memory_bytes", gpu_memory_bytes)
    _positive("weight_dtype_bytes", weight_dtype_bytes)
    _positive("kv_dtype_bytes", kv_dtype_bytes)
    if reserve_bytes is None:
        if not 0 <= reserve_fraction < 1:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {reserve_fraction}")
        reserve_bytes = int(gpu_memory_bytes * reserve_fraction)
    elif reserve_bytes < 0:
        raise ValueError(f"reserve_bytes must be >= 0, got {reserve_bytes}")
    weight_bytes = int(cfg.num_parameters() * weight_dtype_bytes)
    budget = gpu_memory_bytes - reserve_bytes - weight_bytes
    if budget <= 0:
        raise ValueError(
            f"the weights ({weight_bytes / 2**30:.1f} GiB) and the reserve "
            f"({reserve_bytes / 2**30:.1f} GiB) do not fit in {gpu_memory_bytes / 2**30:.1f} GiB; "
            "no room is left for the KV cache"
        )
    return MemoryPlan(
        gpu_memory_bytes=int(gpu_memory_bytes), reserve_bytes=int(reserve_bytes),
        weight_bytes=weight_bytes, kv_budget_bytes=budget,
        kv_bytes_per_token=kv_bytes_per_token(cfg, kv_dtype_bytes),
    )
