"""Wiring: load a model, build an engine and its app, run uvicorn."""

from __future__ import annotations

import os
from typing import Any

import uvicorn
from fastapi import FastAPI

from infer_lab.engine import LLMEngine
from infer_lab.model.loader import load, resolve_model_path
from infer_lab.serve.app import build_app
from infer_lab.serve.async_engine import AsyncEngine
from infer_lab.serve.metrics import ServerMetrics


def make_app(
    model: str | os.PathLike | None = None,
    *,
    served_model_name: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = 1 << 20,
    **engine_args: Any,
) -> FastAPI:
    """An app serving ``model`` (the bundled one by default); ``engine_args`` go to LLMEngine."""
    path = resolve_model_path(model)
    name = served_model_name or (str(model) if model is not None else path.name)
    llm_model, tokenizer = load(path, device=device, dtype=dtype)
    engine = AsyncEngine(LLMEngine(llm_model, tokenizer, **engine_args), ServerMetrics(name))
    return build_app(engine, name, api_key=api_key, max_body_bytes=max_body_bytes)


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000) -> uvicorn.Server:
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve until interrupted."""
    make_server(app, host, port).run()
