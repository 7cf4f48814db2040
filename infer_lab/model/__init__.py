"""The model: config, the transformer, the safetensors and GGUF loaders, named models, the
tokenizer, naive generation. Every name is imported on first use (:mod:`infer_lab.lazy`)."""

from infer_lab.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    ".config": ("ModelConfig", "UnsupportedModelError"),
    ".generate": ("GenerationOutput", "generate_naive"),
    ".gguf": ("GGUFError",),
    ".loader": ("BUNDLED_MODEL_DIR", "CheckpointError", "load", "load_model"),
    ".tokenizer": ("IncrementalDetokenizer", "Tokenizer"),
    ".transformer": ("Transformer",),
})
