"""Every ``INFER_LAB_*`` environment variable the package reads, in one place, typed.

A module that needs one asks its :class:`Setting` here (``settings.DTYPE.get()``) and never
reads ``os.environ`` itself (``tests/test_settings.py`` checks that), so this list is complete:

=========================  ===============  ===========  =========================================
variable                   type             default      what it changes
=========================  ===============  ===========  =========================================
``INFER_LAB_DTYPE``        dtype name       ``auto``     the default dtype of ``il.load``,
                                                         ``il.LLM`` and random models
``INFER_LAB_KERNELS``      auto|triton|     ``auto``     which kernels run (read once, when
                           torch                         ``infer_lab.kernels`` is imported)
``INFER_LAB_MOE``          auto|naive|      ``auto``     how an MoE layer computes (Chapter 12;
                           grouped|                      read once, when ``kernels.moe`` is
                           grouped_mm|                   imported)
                           triton
``INFER_LAB_CACHE``        path             ``~/.cache/  where named models are fetched to
                                            infer_lab``
``INFER_LAB_SMOLLM2``      real|random      ``real``     random weights of SmolLM2's shape in
                                                         place of the real file
``INFER_LAB_RESULTS``      folder or URL    (none)       where chapters find committed benchmark
                                                         results
``INFER_LAB_API_KEY``      string           (none)       the key ``infer-lab serve`` requires
``INFER_LAB_KV_TOKEN``     string           (none)       the token KV-moving workers share
                                                         (``--kv-role``, Chapter 13)
``INFER_LAB_TP_BACKEND``   gloo|nccl        (by device)  the tensor-parallel collective backend
``INFER_LAB_TP_AUTHKEY``   hex bytes        (none)       set by the engine for its worker
                                                         processes; never set it yourself
=========================  ===============  ===========  =========================================

An empty value counts as unset. A value that cannot be parsed raises ``ValueError`` naming the
variable, when the setting is read. Each setting is read when it is asked for, not at import, so
a test or a notebook may change the environment in between. (``INFER_LAB_REPO``, the pip
requirement the Colab set-up cell installs from, is read by that cell before the package exists.)

``python -m infer_lab.settings`` prints the table with the values in force.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")

# dtype spellings accepted by INFER_LAB_DTYPE and by dtype= arguments -> the torch dtype's name
DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32", "float32": "float32", "float": "float32",
    "fp16": "float16", "float16": "float16", "half": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
}
KERNEL_BACKENDS = ("auto", "triton", "torch")
MOE_IMPLS = ("auto", "naive", "grouped", "grouped_mm", "triton")
TP_BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable: its name, its type (``parse``), its default and its meaning."""

    name: str
    default: T
    parse: Callable[[str], T]
    type: str
    doc: str

    def get(self) -> T:
        """The value in force: the parsed variable, or the default when it is unset or empty."""
        raw = self.raw()
        if raw is None:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"{self.name}={raw!r}: {e}") from None

    def raw(self) -> str | None:
        """The variable's text, stripped; None when unset or empty."""
        value = os.environ.get(self.name, "").strip()
        return value or None

    def child_env(self, value: str) -> dict[str, str]:
        """This process's environment with the variable set to ``value``, for a child process."""
        return {**os.environ, self.name: value}


def _choice(options: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.lower()
        if value not in options:
            raise ValueError(f"use one of {options}")
        return value

    return parse


def _dtype_name(text: str) -> str:
    value = text.lower()
    if value != "auto" and value not in DTYPE_ALIASES:
        raise ValueError(f"unknown dtype {text!r}; use one of {sorted(DTYPE_ALIASES)} or 'auto'")
    return value


def _weights(text: str) -> str:
    value = text.lower()
    if value not in ("random", "real"):
        raise ValueError("use 'random' (or unset it for the real file)")
    return value


def _path(text: str) -> Path:
    return Path(text).expanduser()


def _text(text: str) -> str:
    return text


def _hex_bytes(text: str) -> bytes:
    return bytes.fromhex(text)


DTYPE: Setting[str] = Setting(
    "INFER_LAB_DTYPE", "auto", _dtype_name, "dtype name",
    "The default dtype everywhere (float32, bfloat16, float16 or a short name; auto: fp32 on "
    "CPU, bf16 on Ampere or newer, fp16 on older GPUs). CI runs the chapters in bf16 with it.")
KERNELS: Setting[str] = Setting(
    "INFER_LAB_KERNELS", "auto", _choice(KERNEL_BACKENDS), "auto|triton|torch",
    "Which kernels run: Triton on CUDA and the torch references elsewhere (auto), or either one "
    "forced. Read once, when infer_lab.kernels is first imported.")
MOE: Setting[str] = Setting(
    "INFER_LAB_MOE", "auto", _choice(MOE_IMPLS), "|".join(MOE_IMPLS),
    "How a mixture-of-experts layer computes (Chapter 12): the Triton kernel on CUDA and the "
    "fastest CPU path elsewhere (auto), or one path forced. Read once, when "
    "infer_lab.kernels.moe is first imported.")
CACHE: Setting[Path | None] = Setting(
    "INFER_LAB_CACHE", None, _path, "path",
    "The folder named models are fetched into and loaded from (unset: ~/.cache/infer_lab).")
SMOLLM2: Setting[str] = Setting(
    "INFER_LAB_SMOLLM2", "real", _weights, "real|random",
    "random: smollm2-135m-instruct loads random weights of its shape with the bundled tokenizer "
    "(announced on stderr), for a machine that cannot receive the file.")
RESULTS: Setting[str] = Setting(
    "INFER_LAB_RESULTS", "", _text, "folder or URL",
    "Where a chapter looks first for committed benchmark results (the Colab set-up cell points "
    "it at the repository's raw files).")
API_KEY: Setting[str | None] = Setting(
    "INFER_LAB_API_KEY", None, _text, "string",
    "The key `infer-lab serve` requires as 'Authorization: Bearer KEY' when --api-key is not "
    "given.")
TP_BACKEND: Setting[str | None] = Setting(
    "INFER_LAB_TP_BACKEND", None, _choice(TP_BACKENDS), "gloo|nccl",
    "The torch.distributed backend of tensor parallelism (default: nccl with a GPU per rank, "
    "else gloo).")
KV_TOKEN: Setting[str] = Setting(
    "INFER_LAB_KV_TOKEN", "", _text, "string",
    "The shared token prefill and decode workers prove themselves with when they move KV blocks "
    "(`infer-lab serve --kv-role`, Chapter 13); kept out of the command line.")
TP_AUTHKEY: Setting[bytes | None] = Setting(
    "INFER_LAB_TP_AUTHKEY", None, _hex_bytes, "hex bytes",
    "The key a tensor-parallel worker proves itself with; the engine sets it for the workers it "
    "starts.")

ALL: tuple[Setting, ...] = (
    DTYPE, KERNELS, MOE, CACHE, SMOLLM2, RESULTS, API_KEY, KV_TOKEN, TP_BACKEND, TP_AUTHKEY,
)


def describe() -> str:
    """A table of every setting: name, type, default, value in force."""
    rows = [("variable", "type", "default", "now")]
    for s in ALL:
        secret = s in (TP_AUTHKEY, KV_TOKEN, API_KEY)
        shown = "(set)" if secret and s.raw() else (s.raw() or "")
        rows.append((s.name, s.type, "" if s.default is None else str(s.default), shown))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


if __name__ == "__main__":
    print(describe())
