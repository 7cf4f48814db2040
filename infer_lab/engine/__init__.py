"""The engine of Chapter 5: sampling, scheduling (static and continuous), the model runner,
the step loop and the offline ``LLM`` API. It knows nothing of HTTP (Chapter 6 wraps it)."""

from infer_lab.engine.config import EngineConfig
from infer_lab.engine.engine import EngineStats, LLMEngine, StepRecord
from infer_lab.engine.kv_cache_manager import KVCacheManager
from infer_lab.engine.llm import LLM
from infer_lab.engine.model_runner import ModelRunner
from infer_lab.engine.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
)
from infer_lab.engine.sampler import Sampler
from infer_lab.engine.sampling_params import SamplingParams
from infer_lab.engine.scheduler import (
    ContinuousScheduler,
    Scheduler,
    SchedulerOutput,
    StaticScheduler,
    make_scheduler,
)
from infer_lab.engine.sequence import Request, Sequence, SequenceStatus

__all__ = [
    "LLM",
    "CompletionOutput",
    "ContinuousScheduler",
    "EngineConfig",
    "EngineStats",
    "KVCacheManager",
    "LLMEngine",
    "ModelRunner",
    "Request",
    "RequestMetrics",
    "RequestOutput",
    "Sampler",
    "SamplingParams",
    "Scheduler",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
    "StaticScheduler",
    "StepRecord",
    "TokenLogprobs",
    "make_scheduler",
]
