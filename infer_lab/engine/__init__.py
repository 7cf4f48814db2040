"""The engine of Chapter 5: sampling, scheduling (static and continuous), the model runner,
the step loop and the offline ``LLM`` API. It knows nothing of HTTP (Chapter 6 wraps it).

Every name is imported on first use (:mod:`infer_lab.lazy`)."""

from infer_lab.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    ".config": ("EngineConfig",),
    ".engine": ("EngineStats", "LLMEngine", "StepRecord"),
    ".kv_cache_manager": ("KVCacheManager",),
    ".llm": ("LLM",),
    ".model_runner": ("ModelRunner",),
    ".outputs": ("CompletionOutput", "RequestMetrics", "RequestOutput", "TokenLogprobs"),
    ".sampler": ("Sampler",),
    ".sampling_params": ("SamplingParams",),
    ".scheduler": (
        "ContinuousScheduler", "Scheduler", "SchedulerOutput", "StaticScheduler", "make_scheduler",
    ),
    ".sequence": ("Request", "Sequence", "SequenceStatus"),
})
