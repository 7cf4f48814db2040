"""The model: config, the transformer, the safetensors and GGUF loaders, named models, the
tokenizer, naive generation."""

from infer_lab.model.config import ModelConfig, UnsupportedModelError
from infer_lab.model.generate import GenerationOutput, generate_naive
from infer_lab.model.gguf import GGUFError
from infer_lab.model.loader import BUNDLED_MODEL_DIR, CheckpointError, load, load_model
from infer_lab.model.tokenizer import IncrementalDetokenizer, Tokenizer
from infer_lab.model.transformer import Transformer

__all__ = [
    "BUNDLED_MODEL_DIR",
    "CheckpointError",
    "GGUFError",
    "GenerationOutput",
    "IncrementalDetokenizer",
    "ModelConfig",
    "Tokenizer",
    "Transformer",
    "UnsupportedModelError",
    "generate_naive",
    "load",
    "load_model",
]
