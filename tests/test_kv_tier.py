"""Chapter 13's second KV tier: the byte store's bounds and checks, and the engine reloading an
evicted prefix instead of recomputing it, with outputs unchanged."""

from __future__ import annotations

import errno
import random

import pytest

from infer_lab.cache.block_pool import block_key
from infer_lab.cache.kv_tier import _HEADER, KVByteStore, block_nbytes
from infer_lab.engine import LLMEngine, SamplingParams
from infer_lab.engine.kv_connector import attach_kv_tier
from tests.engine_fixtures import assert_no_leak, tiny_model

NS = bytes(range(32))


def key(i: int) -> bytes:
    return block_key(None, [i])


def test_store_round_trips_and_is_bounded_in_bytes_lru(tmp_path):
    store = KVByteStore(tmp_path, capacity_bytes=3 * (_HEADER.size + 200), namespace=NS)
    for i in range(3):
        assert store.put(key(i), bytes([i]) * 200)
    assert store.get(key(0)) == bytes([0]) * 200  # 0 is now the most recent
    assert store.put(key(3), b"x" * 200)  # over the bound: the least recent (1) goes
    assert key(1) not in store and key(0) in store and key(3) in store
    assert store.bytes_used <= store.capacity_bytes and store.stats.evictions == 1
    assert store.get(key(1)) is None
    assert not store.put(key(9), b"y" * 10_000)  # larger than the whole store: refused


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "namespace", "delete"])
def test_a_damaged_file_is_a_miss_never_wrong_bytes(tmp_path, damage):
    store = KVByteStore(tmp_path, 1 << 20, NS)
    payload = bytes(random.Random(0).randrange(256) for _ in range(512))
    store.put(key(1), payload)
    path = store.path(key(1))
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-7] ^= 0x40
    elif damage == "truncate":
        data = data[:-100]
    elif damage == "empty":
        data = bytearray()
    elif damage == "namespace":
        data[8] ^= 1
    if damage == "delete":
        path.unlink()
    else:
        path.write_bytes(bytes(data))
    assert store.get(key(1)) is None
    assert key(1) not in store and store.stats.corrupt == 1
    assert store.bytes_used == 0


def test_a_failed_write_is_a_miss(tmp_path, monkeypatch):
    store = KVByteStore(tmp_path, 1 << 20, NS)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("builtins.open", full)
    assert not store.put(key(1), b"z" * 64)
    monkeypatch.undo()
    assert store.stats.write_errors == 1 and store.get(key(1)) is None
    assert not list(store.dir.iterdir())  # no temporary file left behind


def test_a_restarted_store_finds_its_files_and_only_its_namespace(tmp_path):
    store = KVByteStore(tmp_path, 1 << 20, NS)
    store.put(key(1), b"a" * 64)
    again = KVByteStore(tmp_path, 1 << 20, NS)
    assert again.get(key(1)) == b"a" * 64
    other = KVByteStore(tmp_path, 1 << 20, bytes(32))  # another model: another folder
    assert other.get(key(1)) is None


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return tiny_model(tmp_path_factory)


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 6) -> list[list[int]]:
    """Each prompt alone, in order (so that a returning prompt finds what the earlier left)."""
    outs = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{engine.num_steps}-{i}", prompt, SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs.append(out.outputs[0].token_ids)
    return outs


def workload(seed: int = 0) -> list[list[int]]:
    """A long conversation prefix, enough other prompts to evict it from a small pool, and the
    conversation returning with a new turn."""
    rng = random.Random(seed)
    convo = [rng.randrange(3, 384) for _ in range(80)]
    others = [[rng.randrange(3, 384) for _ in range(60)] for _ in range(4)]
    return [convo] + others + [convo + [rng.randrange(3, 384) for _ in range(7)]]


@pytest.mark.parametrize("block_size", [8, 16])
def test_reloaded_prefix_gives_identical_greedy_outputs(loaded, tmp_path, block_size):
    model, tok = loaded
    prompts = workload()
    kw = dict(num_kv_blocks=96 // block_size * 2, block_size=block_size, max_num_seqs=2)
    plain = LLMEngine(model, tok, **kw)
    expected = run(plain, prompts)
    assert plain.kv.prefix_hits == 0  # the small pool forgot the conversation

    engine = LLMEngine(model, tok, **kw)
    tier = attach_kv_tier(engine, tmp_path, capacity_bytes=64 << 20)
    assert run(engine, prompts) == expected
    assert tier.reloaded_blocks == 80 // block_size  # the whole returning prefix came back
    assert engine.kv.prefix_hits == tier.reloaded_blocks * block_size
    assert tier.store.stats.corrupt == 0
    assert_no_leak(engine)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3_scaled"])
def test_an_8bit_cache_reloads_its_codes_and_their_scales(loaded, tmp_path, kv_cache_dtype):
    """An 8-bit cache keeps a scale per token and head beside the codes: a block's bytes are
    both, and a reloaded block gives the same greedy tokens as the block never evicted."""
    model, tok = loaded
    prompts = workload(2)
    kw = dict(num_kv_blocks=12, block_size=16, max_num_seqs=2, kv_cache_dtype=kv_cache_dtype)
    plain = LLMEngine(model, tok, **kw)
    expected = run(plain, prompts)
    assert plain.kv.prefix_hits == 0  # the small pool forgot the conversation
    engine = LLMEngine(model, tok, **kw)
    cache = engine.runner.cache
    codes = cache.kv[:, :, 0].numel() * cache.kv.element_size()
    scales = cache.scales[:, :, 0].numel() * cache.scales.element_size()
    assert block_nbytes(cache) == codes + scales  # the scales travel with the codes
    tier = attach_kv_tier(engine, tmp_path, capacity_bytes=64 << 20)
    assert run(engine, prompts) == expected
    assert tier.reloaded_blocks == 80 // 16 and engine.kv.prefix_hits == 80
    assert_no_leak(engine)
    # another cache format is another namespace: the int8 files are not read as fp32 K/V
    other = LLMEngine(model, tok, num_kv_blocks=12, block_size=16, max_num_seqs=2)
    assert attach_kv_tier(other, tmp_path, 64 << 20).store.dir != tier.store.dir


def test_corrupted_tier_files_are_recomputed_not_read(loaded, tmp_path):
    model, tok = loaded
    prompts = workload(1)
    kw = dict(num_kv_blocks=12, block_size=16, max_num_seqs=2)
    expected = run(LLMEngine(model, tok, **kw), prompts)
    engine = LLMEngine(model, tok, **kw)
    tier = attach_kv_tier(engine, tmp_path, capacity_bytes=64 << 20)
    run(engine, prompts[:-1])
    for path in tier.store.dir.glob("*.kv"):  # every stored block damaged, same length
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    assert run(engine, prompts[-1:]) == expected[-1:]
    assert tier.reloaded_blocks == 0 and tier.store.stats.corrupt == 1  # the first, then stop
    assert_no_leak(engine)


def test_a_tier_needs_prefix_caching(loaded, tmp_path):
    model, tok = loaded
    engine = LLMEngine(model, tok, num_kv_blocks=8, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefix caching"):
        attach_kv_tier(engine, tmp_path, 1 << 20)
