"""infer_lab: a small, tested LLM inference engine, built one chapter at a time.

``import infer_lab as il`` gives the public face that the chapters use. It imports nothing until
a name is used (``il.load`` imports the loader, ``il.LLM`` the engine: :mod:`infer_lab.lazy`), and
never the server stack (FastAPI, uvicorn): a GPU box with only torch and triton runs chapters 1-5.
"""

from infer_lab import triton_hook
from infer_lab.lazy import lazy_exports

__version__ = "0.1.0"

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    ".cache": ("kv_cache_bytes", "model_kv_cache_bytes"),
    ".engine": ("LLM", "EngineConfig", "RequestOutput", "SamplingParams"),
    ".model": (
        "CheckpointError", "GenerationOutput", "ModelConfig", "Tokenizer", "Transformer",
        "UnsupportedModelError", "generate_naive", "load", "load_model",
    ),
})
__all__ += ["__version__"]

triton_hook.install()
