"""The OpenAI-compatible HTTP server. Imported only when serving: it needs FastAPI and uvicorn,
which a GPU box running chapters 1-5 does not. Every name is imported on first use
(:mod:`infer_lab.lazy`), so ``infer_lab.serve.protocol`` does not start the app."""

from infer_lab.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    ".app": ("build_app",),
    ".async_engine": ("AsyncEngine",),
    ".server": ("make_app", "make_server", "serve"),
})
