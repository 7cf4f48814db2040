"""Chat templates rendered in child processes, with a deadline and a memory limit.

A chat template is jinja code shipped in a model file. Rendered in the server's own threads, a
hostile one (``{{ 'a' * 200000000 }}``, nested loops over ``range(100000)``) takes the memory or
the time of the whole server, and a thread cannot be stopped from outside. A child process can:
each render gets ``timeout`` seconds, after which the child is killed (and replaced on the next
render), and the child's address space is limited, so that a runaway string is a
``MemoryError`` in the child, not in the server. Its output is capped at the prompt's byte limit.

The child loads ``infer_lab/model/tokenizer.py`` by its path and runs
:func:`~infer_lab.model.tokenizer.template_worker`: the same renderer as in-process, without
importing ``infer_lab`` (and torch), so that it starts in a fraction of a second. POSIX only (the
deadline uses ``select`` on the pipe); elsewhere templates render in-process with the byte cap.

The template is the model's, or the one ``infer-lab serve --chat-template`` gives for every
request (:func:`load_chat_template`: a file or the template itself, checked at startup). Whether
it has a tools section (reads the variable ``tools``) decides how a request's tools are described
to the model (:mod:`infer_lab.serve.tools`).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import select
import subprocess
import sys
import time
import weakref
from typing import Any

from infer_lab.model import tokenizer as tokenizer_module
from infer_lab.model.tokenizer import (
    ChatTemplateError,
    TemplateLimitError,
    Tokenizer,
    check_chat_template,
    template_reads,
)

_BOOT = ("import importlib.util, sys\n"
         "spec = importlib.util.spec_from_file_location('infer_lab_template_worker', sys.argv[1])\n"
         "module = importlib.util.module_from_spec(spec)\n"
         "sys.modules[spec.name] = module\n"
         "spec.loader.exec_module(module)\n"
         "module.template_worker(int(sys.argv[2]))\n")
START_TIMEOUT = 60.0  # a child's start (imports) is not charged to the render's deadline
MIN_MEMORY = 1 << 30


class _Worker:
    """One child process, started on first use and after a kill."""

    def __init__(self, memory_bytes: int) -> None:
        self.memory_bytes = memory_bytes
        self.proc: subprocess.Popen | None = None

    def call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        data = json.dumps(request, ensure_ascii=False).encode("utf-8", "surrogatepass")
        try:
            self.proc.stdin.write(len(data).to_bytes(4, "little") + data)
            self.proc.stdin.flush()
            return self._read(time.monotonic() + timeout)
        except TimeoutError:
            self.kill()
            raise TemplateLimitError(f"the chat template did not finish within {timeout:g} s "
                                     "for this conversation", "template_timeout") from None
        except (OSError, EOFError, ValueError):
            self.kill()
            raise TemplateLimitError("the chat template's renderer failed on this conversation",
                                     "template_output") from None

    def _start(self) -> None:
        path = os.path.abspath(tokenizer_module.__file__)
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _BOOT, path, str(self.memory_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            if not self._read(time.monotonic() + START_TIMEOUT).get("ready"):
                raise OSError("no ready frame")
        except (TimeoutError, OSError, EOFError, ValueError) as e:
            self.kill()
            raise ChatTemplateError(f"the chat template renderer did not start: {e}") from None

    def _read(self, deadline: float) -> dict[str, Any]:
        head = self._read_exactly(4, deadline)
        return json.loads(self._read_exactly(int.from_bytes(head, "little"), deadline))

    def _read_exactly(self, n: int, deadline: float) -> bytes:
        fd, parts, got = self.proc.stdout.fileno(), [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            part = os.read(fd, min(n - got, 1 << 20))
            if not part:
                raise EOFError("the renderer exited")
            parts.append(part)
            got += len(part)
        return b"".join(parts)

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout) if proc is not None else ():
            with contextlib.suppress(OSError):
                stream.close()


def load_chat_template(value: str) -> str:
    """``--chat-template``'s value as a template: the text of the file it names, else the value
    itself when it looks like jinja (it has ``{``, ``}`` or a newline; vLLM's rule), taken as is.
    A ``ValueError`` for a path that cannot be read or a template that does not parse."""
    try:
        with open(value, encoding="utf-8") as f:
            source = f.read()
    except (OSError, ValueError) as e:
        if not any(c in value for c in "{}\n"):
            why = getattr(e, "strerror", None) or e
            raise ValueError(f"--chat-template {value!r} looks like a file, but it cannot be "
                             f"read ({why}); give a file or the template itself") from None
        source = value
    if not source.strip():
        raise ValueError(f"--chat-template {value!r}: the template is empty")
    try:
        check_chat_template(source)
    except ValueError as e:
        raise ValueError(f"--chat-template: {e}") from None
    return source


class TemplateRenderer:
    """Render a chat template (``chat_template``, else the tokenizer's), ``workers``
    conversations at a time, each within ``timeout`` seconds and ``max_bytes`` of output;
    thread-safe (call it from worker threads). ``reads_tools``: whether the template has a
    tools section.

    Raises :class:`~infer_lab.model.tokenizer.TemplateLimitError` past a limit and
    :class:`~infer_lab.model.tokenizer.ChatTemplateError` when the template refuses the
    conversation (``raise_exception``) or fails on it; ``ValueError`` if there is no template."""

    def __init__(self, tokenizer: Tokenizer, *, timeout: float, max_bytes: int,
                 workers: int = 2, memory_bytes: int | None = None,
                 chat_template: str | None = None) -> None:
        self.tokenizer, self.timeout, self.max_bytes = tokenizer, timeout, max_bytes
        if chat_template is not None:
            check_chat_template(chat_template)
        self.override = chat_template
        self.isolated = os.name == "posix"
        memory = memory_bytes or max(MIN_MEMORY, 8 * max_bytes)
        self._workers = [_Worker(memory) for _ in range(workers)]
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        for worker in self._workers:
            self._idle.put(worker)
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)

    @property
    def chat_template(self) -> str | None:
        """The override, else the tokenizer's template as it is now."""
        return self.override if self.override is not None else self.tokenizer.chat_template

    @property
    def reads_tools(self) -> bool:
        """Whether the template has a tools section (parsed once per template, not run)."""
        source = self.chat_template
        return bool(source) and template_reads(source, "tools")

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        """The prompt for ``messages``, the template given ``tools`` (OpenAI's shape, as
        ``transformers`` passes them) as its variable ``tools``."""
        tok, source = self.tokenizer, self.chat_template
        if source is None or not self.isolated:
            return tok.apply_chat_template(  # type: ignore[return-value]
                messages, add_generation_prompt, chat_template=source,
                max_bytes=self.max_bytes, tools=tools)
        request = {"source": source, "add_generation_prompt": add_generation_prompt,
                   "messages": [{k: v for k, v in m.items() if v is not None} for m in messages],
                   "variables": tok.template_variables(tools=tools),
                   "max_bytes": self.max_bytes}
        worker = self._idle.get()
        try:
            reply = worker.call(request, self.timeout)
        finally:
            self._idle.put(worker)
        if "text" in reply:
            return reply["text"]
        if reply.get("reason"):
            raise TemplateLimitError(reply["error"], reply["reason"])
        raise ChatTemplateError(reply["error"])

    def close(self) -> None:
        """Stop the child processes (also done when the renderer is collected)."""
        self._finalizer()


def _kill_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.kill()
