"""``import infer_lab`` stays light: a GPU box with only torch and triton runs chapters 1-5."""

from __future__ import annotations

import subprocess
import sys


def test_import_does_not_pull_in_the_server_stack():
    code = ("import sys, infer_lab; "
            "print(' '.join(m for m in ('fastapi', 'uvicorn', 'openai', 'starlette', "
            "'prometheus_client', 'httpx', 'transformers') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout.split()
    assert loaded == []
