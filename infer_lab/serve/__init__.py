"""The OpenAI-compatible HTTP server. Imported only when serving: it needs FastAPI and uvicorn,
which a GPU box running chapters 1-5 does not."""

from infer_lab.serve.app import build_app
from infer_lab.serve.async_engine import AsyncEngine
from infer_lab.serve.server import make_app, make_server, serve

__all__ = ["AsyncEngine", "build_app", "make_app", "make_server", "serve"]
