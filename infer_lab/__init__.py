"""infer_lab: a small, tested LLM inference engine, built one chapter at a time.

``import infer_lab as il`` gives the public face that the chapters use. It never imports the
server stack (FastAPI, uvicorn): a GPU box with only torch and triton runs chapters 1-5.
"""

from infer_lab.cache import kv_cache_bytes, model_kv_cache_bytes
from infer_lab.engine import LLM, EngineConfig, RequestOutput, SamplingParams
from infer_lab.model import (
    CheckpointError,
    GenerationOutput,
    ModelConfig,
    Tokenizer,
    Transformer,
    UnsupportedModelError,
    generate_naive,
    load,
    load_model,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "EngineConfig",
    "GenerationOutput",
    "LLM",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "Tokenizer",
    "Transformer",
    "UnsupportedModelError",
    "__version__",
    "generate_naive",
    "kv_cache_bytes",
    "load",
    "load_model",
    "model_kv_cache_bytes",
]
