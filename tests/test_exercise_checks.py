"""Every exercise's check cell must fail on a wrong answer (and pass on the worked solution).

The check code is taken from the chapter's ``.md`` itself (the source of the notebook), so a
check that drifts into accepting anything fails here. Each chapter's tests are functions named
``test_chNN_*``; the helpers at the top are shared.
"""

from __future__ import annotations

import ast
import asyncio
import queue
import threading
from pathlib import Path
from typing import Any

import pytest

import infer_lab as il

CHAPTERS = Path(__file__).resolve().parent.parent / "chapters"


def code_cells(chapter: str) -> list[str]:
    """The sources of the code cells of ``chapters/<chapter>.md``, in order."""
    import jupytext

    nb = jupytext.read(CHAPTERS / f"{chapter}.md")
    return [c.source for c in nb.cells if c.cell_type == "code"]


def cell_with(chapter: str, marker: str) -> str:
    """The one code cell containing ``marker``."""
    found = [c for c in code_cells(chapter) if marker in c]
    assert len(found) == 1, f"{chapter}: {len(found)} cells contain {marker!r}"
    return found[0]


def definitions(source: str) -> str:
    """Only the imports, functions and classes of a cell (not its top-level ``await`` calls)."""
    keep = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    tree = ast.parse(source)
    tree.body = [node for node in tree.body if isinstance(node, keep)]
    return ast.unparse(tree)


def run_cells(namespace: dict[str, Any], *sources: str) -> dict[str, Any]:
    for source in sources:
        exec(compile(source, "<chapter cell>", "exec"), namespace)  # noqa: S102
    return namespace


# -------------------------------------------------------------------------------- chapter 6
CH6 = "06_serving"


@pytest.fixture(scope="module")
def ch6() -> dict[str, Any]:
    """The chapter's miniature engine and its check functions, over the bundled model."""
    model, tok = il.load(device="cpu")
    namespace: dict[str, Any] = {
        "asyncio": asyncio, "queue": queue, "threading": threading, "il": il,
        "LLMEngine": il.engine.LLMEngine, "model": model, "tok": tok,
        "PROMPTS": ["And God said,", "In the beginning", "Blessed are the"],
    }
    return run_cells(namespace, cell_with(CH6, "class MiniAsyncEngine"),
                     cell_with(CH6, "def check_1"))


def test_ch06_checks_accept_an_unanswered_exercise(ch6, capsys):
    asyncio.run(ch6["check_1"](None))
    ch6["check_2"](None)
    ch6["check_3"](None)
    assert capsys.readouterr().out.count("replace None") == 3


def test_ch06_exercise_1_check_fails_on_wrong_answers(ch6):
    mini = ch6["MiniAsyncEngine"]

    class ForgetsTheEngine(mini):
        def abort_all(self) -> None:
            self.outputs.clear()  # the engine thread keeps generating for nobody

    class ForgetsTheQueues(mini):
        def abort_all(self) -> None:
            for request_id in list(self.outputs):
                self.submit(lambda r=request_id: self.engine.abort(r))

    for wrong in (ForgetsTheEngine, ForgetsTheQueues):
        with pytest.raises(AssertionError):
            asyncio.run(ch6["check_1"](wrong))
    solution = run_cells(dict(ch6), definitions(cell_with(CH6, "# Solution 1.")))
    asyncio.run(ch6["check_1"](solution["DrainingMini"]))


def test_ch06_exercise_2_check_fails_on_wrong_answers(ch6):
    for wrong in ([401, 200, 200], [200, 401, 200], [401, 401, 401], [401, 401]):
        with pytest.raises(AssertionError):
            ch6["check_2"](wrong)
    solution = run_cells({"httpx": __import__("httpx")},
                         definitions(cell_with(CH6, "# Solution 2.")))
    measured = asyncio.run(solution["statuses_with_key"]())
    ch6["check_2"](measured)  # the solution measures what the check expects


def test_ch06_exercise_3_check_fails_on_wrong_answers(ch6):
    right = 2 * 32 * 8 * 128 * 16 * 2
    for wrong in (right // 2, right * 2, right // 16, 2 * 32 * 32 * 128 * 16 * 2):
        with pytest.raises(AssertionError):
            ch6["check_3"](wrong)
    ch6["check_3"](right)

