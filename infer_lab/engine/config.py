"""One engine configuration, built once and passed down (vLLM's ``EngineArgs`` -> config).

``LLMEngine``, ``LLM``, ``infer-lab serve`` and ``infer-lab generate`` all build an
:class:`EngineConfig` and hand it on, so that each limit is stored in one place: the scheduler,
the KV-cache manager and the model runner read their values from it instead of keeping copies.
The names are vLLM's, so a reader can carry them over.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from infer_lab.cache.kv_quant import KV_CACHE_DTYPES  # the one list; the cache defines it
from infer_lab.utils import check_positive_int

Policy = Literal["continuous", "static"]
POLICIES: tuple[str, ...] = get_args(Policy)  # the one list of policies


@dataclass(frozen=True)
class EngineConfig:
    """Every knob of the engine, validated when built.

    - ``max_num_seqs``: most sequences running at once (the batch size of a decode step).
    - ``max_num_batched_tokens``: token budget of one step (prefill chunks plus decodes).
    - ``max_model_len``: longest prompt + output (None: the model's context length).
    - ``block_size``: tokens per KV block; ``num_kv_blocks`` fixes the pool size, otherwise
      ``gpu_memory_utilization`` of the GPU (or a fixed budget on CPU) decides it.
    - ``policy``: ``"continuous"`` (admit and retire at token granularity) or ``"static"``
      (a batch is held until its longest request finishes; the baseline of Chapter 5).
    - ``enable_prefix_caching``, ``enable_chunked_prefill``: as in vLLM.
    - ``use_cuda_graphs``: None means "on CUDA, yes".
    - ``seed``: the engine's random stream for requests without a seed of their own.
    - ``log_steps``: keep a :class:`~infer_lab.engine.engine.StepRecord` per step.
    - ``quantization``, ``kv_cache_dtype``, ``speculative_config``, ``tensor_parallel_size``:
      room for the techniques of the later chapters (weight quantization, an 8-bit KV cache,
      speculative decoding, tensor parallelism); each is validated by the part that reads it.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    policy: Policy = "continuous"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    use_cuda_graphs: bool | None = None
    seed: int = 0
    log_steps: bool = False
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    speculative_config: dict[str, Any] | None = field(default=None, hash=False)
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                     "tensor_parallel_size"):
            check_positive_int(name, getattr(self, name))
        for name in ("max_model_len", "num_kv_blocks"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an integer, got {self.seed!r}")
        if self.speculative_config is not None:
            from infer_lab.engine.speculative import SpeculativeConfig

            SpeculativeConfig.parse(self.speculative_config)  # clear errors before any load
            if self.policy != "continuous":
                raise ValueError("speculative decoding needs policy='continuous'")

    @classmethod
    def from_kwargs(cls, config: EngineConfig | None = None, **kwargs: Any) -> EngineConfig:
        """``config`` with ``kwargs`` replacing its fields (a clear error for unknown names)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; the options are {sorted(names)}")
        return dataclasses.replace(config or cls(), **kwargs)

    def replace(self, **kwargs: Any) -> EngineConfig:
        return self.from_kwargs(self, **kwargs)
