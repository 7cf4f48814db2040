"""The executor: where the model runs, and how much KV cache it can have.

The engine hands each step's :class:`~infer_lab.engine.scheduler.SchedulerOutput` to
:meth:`Executor.execute_model` and gets logits back; it does not know whether one process runs
the forward or several. With ``tensor_parallel_size > 1`` the executor starts the worker
processes (:mod:`~infer_lab.engine.tensor_parallel`), mirrors every forward and every block copy
on them, and stops them when it goes away — with the engine, not only at interpreter exit.

Before the first step it settles what the configuration left open (vLLM's executor measures the
memory the same way): ``max_model_len`` (the model's context) and ``num_kv_blocks`` (what fits in
``gpu_memory_utilization`` of the GPU beside the weights, or a fixed budget on the CPU).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from infer_lab.cache.kv_quant import kv_storage_bytes
from infer_lab.cache.planner import plan_memory
from infer_lab.engine.config import EngineConfig
from infer_lab.engine.model_runner import ModelRunner
from infer_lab.engine.scheduler import SchedulerOutput
from infer_lab.engine.sequence import Sequence
from infer_lab.model.quantize import check_model_quantization, model_weight_bytes
from infer_lab.model.transformer import Transformer
from infer_lab.utils import cdiv

CPU_KV_BYTES = 1 << 30  # default KV pool on CPU: 1 GiB (or less, if that already fits everything)


class Executor:
    """Runs the model for the engine: in this process, or mirrored on tensor-parallel ranks."""

    def __init__(self, model: Transformer, config: EngineConfig) -> None:
        check_model_quantization(model, config.quantization)
        self.workers: Any = None
        if config.tensor_parallel_size > 1:
            # Rank 0 keeps its slice and starts the other ranks; from here on the model is the
            # driver that mirrors every forward on them (CUDA graphs would not capture that).
            from infer_lab.engine.tensor_parallel import TensorParallelWorkers

            model = TensorParallelWorkers.start(model, config.tensor_parallel_size)
            self.workers = model.tp_workers
            config = config.replace(use_cuda_graphs=False)
        self._stop = weakref.finalize(self, _stop_workers, self.workers)
        self.model = model
        self.config = resolve_config(model, config)
        self.runner = ModelRunner(model, self.config)

    @property
    def is_tensor_parallel(self) -> bool:
        return self.workers is not None

    def execute_model(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        """One forward: the step's block copies first (on every rank), then the model."""
        if out.block_copies:
            self.runner.copy_blocks(out.block_copies)
            if self.workers is not None:
                self.workers.copy_blocks(self.runner.cache, out.block_copies)
        return self.runner.execute(out)

    def shutdown(self) -> None:
        """Stop the worker processes, if any (also done when the executor is collected)."""
        self._stop()


def _stop_workers(workers: Any) -> None:
    if workers is not None:
        workers.shutdown()


def resolve_config(model: Transformer, config: EngineConfig) -> EngineConfig:
    """``config`` with ``max_model_len`` and ``num_kv_blocks`` made concrete for ``model``."""
    context = model.config.max_position_embeddings
    max_model_len = min(config.max_model_len or context, context)
    num_blocks = config.num_kv_blocks
    if num_blocks is None:
        num_blocks = default_num_blocks(model, config, max_model_len)
    return config.replace(max_model_len=max_model_len, num_kv_blocks=num_blocks)


def default_num_blocks(model: Transformer, config: EngineConfig, max_model_len: int) -> int:
    """The KV blocks that fit: on a GPU, ``gpu_memory_utilization`` of it beside the weights;
    on the CPU, ``CPU_KV_BYTES`` or what every sequence at full length needs, if less."""
    cfg, dtype_bytes = model.config, model.dtype.itemsize
    # Chapter 8: quantized weights leave more room, an 8-bit KV cache costs less per token
    per_block = int(kv_storage_bytes(cfg, config.kv_cache_dtype, dtype_bytes)) * config.block_size
    weight_bytes: float = dtype_bytes
    if getattr(model, "quantization", None):
        weight_bytes = model_weight_bytes(model) / cfg.num_parameters()
    if model.device.type == "cuda":
        util = config.gpu_memory_utilization
        total = torch.cuda.get_device_properties(model.device).total_memory
        plan = plan_memory(int(total * util), cfg, weight_dtype_bytes=weight_bytes,
                           kv_dtype_bytes=dtype_bytes, reserve_bytes=0)
        free_now = torch.cuda.mem_get_info(model.device)[0]
        return max(1, min(plan.kv_budget_bytes // per_block, int(free_now * util) // per_block))
    everything = config.max_num_seqs * cdiv(max_model_len, config.block_size)
    return max(1, min(everything, CPU_KV_BYTES // per_block))
